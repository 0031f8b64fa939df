#!/usr/bin/env python3
"""Renders chat-template cases with transformers' apply_chat_template and records the output, for
crates/brook-core/tests/text_template.rs (which must reproduce every byte).

Reads the committed templates in tests/fixtures/templates/<name>/ (tokenizer_config.json, and
chat_template.jinja where the checkpoint ships one) and the committed tokenizer from
tests/fixtures/tokenizers/<name>/tokenizer.json.gz, loads them with AutoTokenizer exactly as a
checkpoint directory, and writes tests/fixtures/templates/<name>/cases.json:
  [{name, messages, tools, add_generation_prompt, kwargs, expected | error}]
`error` is the message of the jinja2 TemplateError that the template raised. Messages go through
vLLM's `_postprocess_messages` first (string tool-call arguments parsed into dicts), as brook does.

Run:  .venv-text/bin/python scripts/make_template_fixtures.py
"""

import copy
import gzip
import json
import shutil
import tempfile
from pathlib import Path

import jinja2
import transformers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
TOKENIZERS = ROOT / "tests" / "fixtures" / "tokenizers"

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather in a city. Température en °C — «exact».",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14, "default": 1},
        "threshold": {"type": "number", "default": 0.5, "exclusiveMinimum": 1e-05},
    }, "required": ["city"]},
}}
SEARCH = {"type": "function", "function": {
    "name": "search",
    "description": "Search the web.\nReturns a list of results.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"},
        "filters": {"type": "object", "properties": {"site": {"type": "string"}, "recent": {"type": "boolean"}}},
        "tags": {"type": "array", "items": {"type": "string"}},
    }, "required": ["query"]},
}}
TOOLS = [WEATHER, SEARCH]

SYS = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
U1 = {"role": "user", "content": "What's the weather in Paris?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 18, \"sky\": \"cloudy\"}"}
ANSWER = {"role": "assistant", "content": "It is 18 °C and cloudy in Paris."}


def common_cases():
    return [
        ("user_only_generation_prompt", [U1], None, True, {}),
        ("system_and_user", [SYS, U1], None, True, {}),
        ("thinking_disabled", [SYS, U1], None, True, {"enable_thinking": False}),
        ("thinking_enabled_explicitly", [U1], None, True, {"enable_thinking": True}),
        ("multi_turn_no_generation_prompt", [SYS, U1, ANSWER, {"role": "user", "content": "And tomorrow?"},
                                             {"role": "assistant", "content": "Probably rain."}], None, False, {}),
        ("multi_turn_generation_prompt", [U1, ANSWER, {"role": "user", "content": "Thanks! 🙏 谢谢"}], None, True, {}),
        ("tools_no_system", [U1], TOOLS, True, {}),
        ("tools_with_system", [SYS, U1], TOOLS, True, {}),
        ("tool_call_and_result", [SYS, U1, CALL, RESULT], TOOLS, True, {}),
        ("tool_call_result_and_answer", [U1, CALL, RESULT, ANSWER], TOOLS, False, {}),
        ("parallel_tool_calls", [U1, {"role": "assistant", "content": "Let me check both.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
            {"type": "function", "function": {"name": "search", "arguments": {
                "query": "Paris events", "filters": {"site": "paris.fr", "recent": True}, "tags": ["music", "art"]}}}]},
            {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "[\"jazz night\"]"}], TOOLS, True, {}),
        ("reasoning_content_current_turn", [U1, {"role": "assistant", "reasoning_content": "The user wants weather.\n",
                                                 "content": "I need a tool for that."}], None, False, {}),
        ("reasoning_content_in_history", [U1, {"role": "assistant", "reasoning_content": "Think think.",
                                               "content": "Cloudy."}, {"role": "user", "content": "Sure?"}], None, True, {}),
        ("inline_think_in_content", [U1, {"role": "assistant", "content": "<think>\nhidden steps\n</think>\n\nVisible answer."}],
         None, False, {}),
        ("content_parts", [{"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]}],
         None, True, {}),
        ("unicode_and_markup", [{"role": "user", "content": "<b>bold</b> & \"quotes\" 'single' — Привет 😀"}], None, True, {}),
    ]


def qwen36_cases():
    typed = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {
        "query": "x", "n": 3, "ratio": 0.25, "flag": False, "none": None, "filters": {"site": "a.b", "recent": True},
        "tags": ["é", "ü"]}}}]}
    return common_cases() + [
        ("typed_tool_arguments", [U1, typed, {"role": "tool", "content": "ok"}], TOOLS, True, {}),
        ("preserve_thinking", [U1, {"role": "assistant", "reasoning_content": "Old thoughts.", "content": "Old answer."},
                               {"role": "user", "content": "Next?"}], None, True, {"preserve_thinking": True}),
        ("error_system_not_first", [U1, SYS], None, True, {}),
        ("error_no_user_query", [SYS], None, True, {}),
        ("error_unexpected_role", [U1, {"role": "critic", "content": "hm"}], None, True, {}),
    ]


def qwen3_cases():
    return common_cases() + [
        ("system_not_first_is_allowed", [U1, SYS], None, True, {}),
        ("string_tool_arguments_parsed_like_vllm", [U1, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]}], TOOLS, False, {}),
    ]


def vllm_postprocess(messages):
    """vLLM's `_postprocess_messages`, which brook mirrors: tool-call arguments sent as a JSON
    string (the OpenAI wire form) are parsed into a dict before the template sees them."""
    messages = copy.deepcopy(messages)
    for m in messages:
        for call in m.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if not args:
                call["function"]["arguments"] = {}
            elif isinstance(args, str):
                call["function"]["arguments"] = json.loads(args)
    return messages


def render(tok, messages, tools, agp, kwargs):
    try:
        out = tok.apply_chat_template(vllm_postprocess(messages), tools=copy.deepcopy(tools), add_generation_prompt=agp,
                                      tokenize=False, **kwargs)
        return {"expected": out}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}


def load(name):
    tmp = Path(tempfile.mkdtemp())
    for f in (TEMPLATES / name).iterdir():
        if f.name != "cases.json" and f.name != "README.md":
            shutil.copy(f, tmp / f.name)
    with gzip.open(TOKENIZERS / name / "tokenizer.json.gz", "rb") as src:
        (tmp / "tokenizer.json").write_bytes(src.read())
    return AutoTokenizer.from_pretrained(str(tmp))


def main():
    for name, cases in (("qwen3", qwen3_cases()), ("qwen3.6", qwen36_cases())):
        tok = load(name)
        out = []
        for case_name, messages, tools, agp, kwargs in cases:
            row = {"name": case_name, "messages": messages, "tools": tools, "add_generation_prompt": agp, "kwargs": kwargs}
            row.update(render(tok, messages, tools, agp, kwargs))
            out.append(row)
        path = TEMPLATES / name / "cases.json"
        path.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
        errors = sum("error" in r for r in out)
        print(f"{name}: {len(out)} cases ({errors} raising) -> {path} [transformers {transformers.__version__}]")


if __name__ == "__main__":
    main()
