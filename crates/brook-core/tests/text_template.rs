//! Chat templates render byte-identically to transformers' `apply_chat_template` for the real
//! Qwen3 and Qwen3.6 templates (cases recorded by scripts/make_template_fixtures.py), and a
//! template's `raise_exception` surfaces as a typed error carrying its message.

use std::io::Read;
use std::path::{Path, PathBuf};

use brook_core::text::{ChatTemplate, Message, TextError, Tokenizer};
use serde::Deserialize;
use serde_json::{Map, Value};

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    messages: Vec<Message>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    kwargs: Map<String, Value>,
    expected: Option<String>,
    error: Option<String>,
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn cases(name: &str) -> Vec<Case> {
    let path = fixtures().join("templates").join(name).join("cases.json");
    let text = std::fs::read_to_string(&path).expect("cases.json is committed");
    serde_json::from_str(&text).expect("cases.json parses")
}

fn template(name: &str) -> ChatTemplate {
    ChatTemplate::from_dir(fixtures().join("templates").join(name))
        .expect("template loads")
        .expect("fixture has a template")
}

fn tokenizer(name: &str) -> Tokenizer {
    let path = fixtures()
        .join("tokenizers")
        .join(name)
        .join("tokenizer.json.gz");
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).expect("fixture exists"))
        .read_to_end(&mut json)
        .expect("gzip decodes");
    Tokenizer::from_bytes(&json).expect("tokenizer loads")
}

fn check_all(name: &str) -> usize {
    let tmpl = template(name);
    let all = cases(name);
    assert!(all.len() >= 15, "{name}: only {} cases", all.len());
    for case in &all {
        let got = tmpl.render(
            &case.messages,
            case.tools.as_deref(),
            case.add_generation_prompt,
            &case.kwargs,
        );
        match (&case.expected, &case.error, got) {
            (Some(want), _, Ok(got)) => {
                assert_eq!(&got, want, "{name}/{}: rendered prompt differs", case.name)
            }
            (_, Some(want), Err(TextError::TemplateRaised { message })) => {
                assert_eq!(&message, want, "{name}/{}", case.name)
            }
            (_, _, other) => panic!("{name}/{}: unexpected result {other:?}", case.name),
        }
    }
    all.len()
}

#[test]
fn qwen3_template_matches_transformers_byte_for_byte() {
    assert!(check_all("qwen3") >= 15);
}

#[test]
fn qwen36_template_matches_transformers_byte_for_byte() {
    assert!(check_all("qwen3.6") >= 15);
}

#[test]
fn qwen36_system_message_not_first_is_a_typed_error() {
    let tmpl = template("qwen3.6");
    let msgs = [Message::new("user", "hi"), Message::new("system", "late")];
    match tmpl.render(&msgs, None, true, &Map::new()) {
        Err(TextError::TemplateRaised { message }) => {
            assert_eq!(message, "System message must be at the beginning.")
        }
        other => panic!("expected TemplateRaised, got {other:?}"),
    }
}

#[test]
fn special_tokens_come_from_tokenizer_config() {
    let tmpl = template("qwen3");
    assert_eq!(tmpl.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(tmpl.bos_token, None);
}

#[test]
fn string_tool_arguments_render_like_objects_on_qwen36() {
    // OpenAI clients send arguments as a JSON string; the Qwen3.6 template needs a mapping.
    let tmpl = template("qwen3.6");
    let as_string: Vec<Message> = serde_json::from_str(
        r#"[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{\"a\": 1, \"b\": \"x\"}"}}]}]"#,
    )
    .expect("messages parse");
    let mut as_object = as_string.clone();
    as_object[1].tool_calls[0].function.arguments = serde_json::json!({"a": 1, "b": "x"});
    let a = tmpl
        .render(&as_string, None, false, &Map::new())
        .expect("renders");
    let b = tmpl
        .render(&as_object, None, false, &Map::new())
        .expect("renders");
    assert_eq!(a, b);
    assert!(a.contains("<parameter=a>\n1\n</parameter>\n<parameter=b>\nx\n</parameter>"));
}

#[test]
fn tojson_honours_python_arguments() {
    let tmpl = ChatTemplate::new(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}|{{ x | tojson(ensure_ascii=true) }}|{{ x | tojson(sort_keys=true) }}",
    )
    .expect("compiles");
    let mut extra = Map::new();
    extra.insert("x".into(), serde_json::json!({"b": [1.5, "é"], "a": null}));
    let got = tmpl.render(&[], None, false, &extra).expect("renders");
    assert_eq!(
        got,
        "{\"b\": [1.5, \"é\"], \"a\": null}|{\n  \"b\": [\n    1.5,\n    \"é\"\n  ],\n  \"a\": null\n}|{\"b\":[1.5,\"é\"],\"a\":null}|{\"b\": [1.5, \"\\u00e9\"], \"a\": null}|{\"a\": null, \"b\": [1.5, \"é\"]}"
    );
}

#[test]
fn named_templates_pick_tool_use_when_tools_are_given() {
    let config = serde_json::json!({
        "chat_template": [
            {"name": "default", "template": "plain"},
            {"name": "tool_use", "template": "tools:{{ tools | length }}"}
        ],
        "eos_token": {"content": "</s>"}
    });
    let tmpl = ChatTemplate::from_tokenizer_config(&config, Path::new("tokenizer_config.json"))
        .expect("loads")
        .expect("has a template");
    let tool = serde_json::json!({"type": "function", "function": {"name": "f"}});
    let none = tmpl.render(&[], None, false, &Map::new()).expect("renders");
    let some = tmpl
        .render(&[], Some(&[tool]), false, &Map::new())
        .expect("renders");
    assert_eq!((none.as_str(), some.as_str()), ("plain", "tools:1"));
    assert_eq!(tmpl.eos_token.as_deref(), Some("</s>"));
}

#[test]
fn rendered_prompts_round_trip_through_the_tokenizer() {
    for name in ["qwen3", "qwen3.6"] {
        let tok = tokenizer(name);
        for case in cases(name) {
            let Some(prompt) = case.expected else {
                continue;
            };
            let ids = tok.encode(&prompt, false).expect("encodes");
            let back = tok.decode(&ids, false).expect("decodes");
            assert_eq!(back, prompt, "{name}/{}", case.name);
        }
    }
}

/// A template from a hostile checkpoint ends in a typed error, never a hang, a stack overflow
/// or an allocation without bound.
#[test]
fn hostile_templates_end_in_errors_within_their_budget() {
    let msgs = [Message::new("user", "hi")];
    let render = |src: &str| {
        let t = ChatTemplate::new(src).expect("compiles");
        let start = std::time::Instant::now();
        let r = t.render(&msgs, None, true, &Map::new());
        (r, start.elapsed())
    };
    for (what, src) in [
        (
            "a namespace holding itself, printed",
            "{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns }}",
        ),
        (
            "a namespace holding itself, as a string",
            "{% set ns = namespace(a=1) %}{% set ns.me = [ns] %}{{ ns.me|string }}",
        ),
        (
            "a namespace holding itself, as JSON",
            "{% set ns = namespace(a=1) %}{% set ns.me = {'x': ns} %}{{ ns|tojson }}",
        ),
        (
            "an endless loop",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        ),
        (
            "output without end",
            "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
        ),
        ("a huge indent", "{{ messages|tojson(indent=100000000) }}"),
        (
            "endless recursion",
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        ),
        ("a huge range", "{% for i in range(10**12) %}{% endfor %}"),
        // minijinja has no hook for these two; the render's child process ends instead.
        (
            "a namespace holding itself, joined",
            "{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ 'x' ~ ns }}",
        ),
        (
            "a string doubled without end",
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        ),
    ] {
        let (r, took) = render(src);
        let e = r.expect_err(what);
        assert!(
            matches!(e, TextError::TemplateRender { .. }),
            "{what}: {e:?}"
        );
        assert!(
            took < std::time::Duration::from_secs(30),
            "{what}: {took:?}"
        );
        eprintln!("{what}: {e} ({took:?})");
    }
    // Deep but finite values still print.
    let (r, _) = render("{{ [[[[1]]]] }} {{ {'a': {'b': [1, 2]}}|tojson(indent=2) }}");
    assert!(r.expect("renders").starts_with("[[[[1]]]]"));
}
