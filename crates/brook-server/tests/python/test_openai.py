"""The official `openai` Python client against a running brook server.

Run by crates/brook-server/tests/clients.rs, which starts the server and sets BROOK_BASE_URL
(e.g. http://127.0.0.1:PORT/v1). The model has random weights: tests check shapes, fields
and behaviour, never words. Standard library `unittest` only, besides `openai` itself.
"""

import os
import time
import unittest

import openai

BASE_URL = os.environ["BROOK_BASE_URL"]
MODEL = os.environ.get("BROOK_MODEL", "chat-model")
client = openai.OpenAI(base_url=BASE_URL, api_key="not-needed", timeout=120, max_retries=0)
NO_THINKING = {"enable_thinking": False}


def chat(**kw):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                max_tokens=3, temperature=0, extra_body=NO_THINKING)
    args.update(kw)
    return client.chat.completions.create(**args)


class OpenAIClient(unittest.TestCase):
    def test_models(self):
        ids = [m.id for m in client.models.list().data]
        self.assertEqual(ids, [MODEL])
        self.assertEqual(client.models.retrieve(MODEL).id, MODEL)

    def test_chat(self):
        r = chat()
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertIsInstance(r.choices[0].message.content, str)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 3)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + 3)
        self.assertIsNotNone(r.usage.prompt_tokens_details.cached_tokens)

    def test_chat_stream_matches_non_streamed(self):
        whole = chat().choices[0].message.content
        chunks = list(chat(stream=True, stream_options={"include_usage": True}))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, whole)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        self.assertEqual(finishes[-1], "length")
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, 3)

    def test_sampling_parameters(self):
        # max_completion_tokens wins over max_tokens (3, from chat()).
        kw = dict(temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.1,
                  frequency_penalty=0.1, stop=["\u0001", "\u0002"], max_completion_tokens=2,
                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                              "enable_thinking": False})
        a = chat(**kw)
        b = chat(**kw)
        self.assertEqual(a.choices[0].message.content, b.choices[0].message.content)
        self.assertEqual(a.usage.completion_tokens, 2)

    def test_reasoning_content(self):
        r = chat(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        extra = r.choices[0].message.model_extra
        self.assertTrue(extra.get("reasoning_content"))
        self.assertEqual(extra.get("reasoning"), extra.get("reasoning_content"))

    def test_tool_round_trip(self):
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        messages = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp_c\": 21}"},
        ]
        r = chat(messages=messages, tools=tools, tool_choice="auto", max_tokens=2)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length", "tool_calls"))
        self.assertEqual(r.usage.completion_tokens, 2)
        # The tools and the result are in the prompt: it is longer than without them.
        bare = chat(messages=messages[:1], max_tokens=1)
        self.assertGreater(r.usage.prompt_tokens, bare.usage.prompt_tokens + 50)

    def test_completions(self):
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2,
                                      temperature=0)
        self.assertEqual(r.object, "text_completion")
        self.assertIsInstance(r.choices[0].text, str)
        self.assertEqual(r.usage.completion_tokens, 2)
        parts = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                               max_tokens=2, temperature=0, stream=True))
        self.assertEqual("".join(p.choices[0].text for p in parts if p.choices), r.choices[0].text)

    def test_errors_are_typed(self):
        with self.assertRaises(openai.NotFoundError):
            chat(model="gpt-4")
        with self.assertRaises(openai.BadRequestError) as e:
            chat(max_tokens=-1)
        self.assertEqual(e.exception.body["param"], "max_tokens")
        with self.assertRaises(openai.BadRequestError) as e:
            chat(messages=[{"role": "user", "content": "word " * 5000}])
        self.assertEqual(e.exception.code, "context_length_exceeded")

    def test_closing_a_stream_frees_the_model(self):
        stream = chat(max_tokens=1500, stream=True)
        seen = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                seen += 1
                if seen == 2:
                    break
        stream.close()
        t = time.monotonic()
        chat(max_tokens=1)
        # Without cancellation this would wait for ~1500 tokens (minutes).
        self.assertLess(time.monotonic() - t, 30)


if __name__ == "__main__":
    unittest.main(verbosity=2)
