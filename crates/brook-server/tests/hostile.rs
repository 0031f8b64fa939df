//! Malformed and hostile requests: each is answered with a 4xx OpenAI-style JSON error, the
//! server never panics or hangs, and a good request still succeeds afterwards.

mod common;

use common::{Resp, raw, request_bytes};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// A chat body with one field replaced or added.
fn chat_with(field: &str, value: Value) -> Vec<u8> {
    let mut b = common::chat_body("Hi", 1);
    b[field] = value;
    b.to_string().into_bytes()
}

fn completion_with(field: &str, value: Value) -> Vec<u8> {
    let mut b = json!({"model": "chat-model", "prompt": "Hello", "max_tokens": 1});
    b[field] = value;
    b.to_string().into_bytes()
}

fn messages(m: Value) -> Vec<u8> {
    chat_with("messages", m)
}

fn post(path: &str, body: &[u8]) -> Vec<u8> {
    request_bytes("POST", path, &[("Content-Type", "application/json")], body)
}

/// (what, raw request, expected status)
fn cases() -> Vec<(String, Vec<u8>, u16)> {
    let s = |x: &str| x.as_bytes().to_vec();
    let mut c: Vec<(String, Vec<u8>, u16)> = Vec::new();
    let mut chat = |what: &str, body: Vec<u8>, status: u16| {
        c.push((format!("chat: {what}"), post(CHAT, &body), status));
    };
    // Not JSON, or JSON of the wrong shape.
    chat(
        "truncated JSON",
        s("{\"messages\": [{\"role\": \"user\""),
        400,
    );
    chat("not JSON", s("hello there"), 400);
    chat(
        "a user message without content",
        s("{\"messages\": [{\"role\": \"user\"}]}"),
        400,
    );
    chat(
        "a system message with null content",
        s(
            "{\"messages\": [{\"role\": \"system\", \"content\": null}, {\"role\": \"user\", \"content\": \"hi\"}]}",
        ),
        400,
    );
    chat("empty body", Vec::new(), 400);
    chat("JSON array", s("[]"), 400);
    chat("JSON string", s("\"hi\""), 400);
    chat("JSON null", s("null"), 400);
    chat(
        "trailing garbage",
        [common::chat_body("Hi", 1).to_string().as_bytes(), b" }}"].concat(),
        400,
    );
    chat(
        "invalid UTF-8 in a string",
        b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}".to_vec(),
        400,
    );
    chat(
        "nesting 100000 deep",
        [b"{\"messages\":".as_slice(), &vec![b'['; 100_000]].concat(),
        400,
    );
    chat(
        "duplicate field",
        s(r#"{"messages":[{"role":"user","content":"a"}],"messages":[]}"#),
        400,
    );
    // Messages.
    chat("missing messages", s("{\"model\": \"chat-model\"}"), 400);
    chat("messages null", messages(Value::Null), 400);
    chat("messages a string", messages(json!("hi")), 400);
    chat("messages empty", messages(json!([])), 400);
    chat("message null", messages(json!([null])), 400);
    chat(
        "message without role",
        messages(json!([{"content": "hi"}])),
        400,
    );
    chat(
        "role a number",
        messages(json!([{"role": 5, "content": "hi"}])),
        400,
    );
    chat(
        "unknown role",
        messages(json!([{"role": "wizard", "content": "hi"}])),
        400,
    );
    chat(
        "content a number",
        messages(json!([{"role": "user", "content": 5}])),
        400,
    );
    chat(
        "content part type a number",
        messages(json!([{"role": "user", "content": [{"type": 5}]}])),
        400,
    );
    chat(
        "tool_calls a string",
        messages(json!([{"role": "assistant", "content": "", "tool_calls": "x"}])),
        400,
    );
    chat(
        "tool call without name",
        messages(
            json!([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]),
        ),
        400,
    );
    // Limits and sampling values.
    chat(
        "max_tokens a string",
        chat_with("max_tokens", json!("ten")),
        400,
    );
    chat(
        "max_tokens negative",
        chat_with("max_tokens", json!(-1)),
        400,
    );
    chat("max_tokens zero", chat_with("max_tokens", json!(0)), 400);
    chat(
        "max_tokens fractional",
        chat_with("max_tokens", json!(1.5)),
        400,
    );
    chat(
        "max_tokens 1e400",
        [s(
            r#"{"messages":[{"role":"user","content":"a"}],"max_tokens":1e400}"#,
        )]
        .concat(),
        400,
    );
    chat(
        "max_tokens beyond u64",
        s(
            r#"{"messages":[{"role":"user","content":"a"}],"max_tokens":99999999999999999999999999}"#,
        ),
        400,
    );
    chat(
        "max_completion_tokens negative",
        chat_with("max_completion_tokens", json!(-7)),
        400,
    );
    chat(
        "temperature a string",
        chat_with("temperature", json!("hot")),
        400,
    );
    chat(
        "temperature negative",
        chat_with("temperature", json!(-1)),
        400,
    );
    chat(
        "temperature 1e308",
        chat_with("temperature", json!(1e308)),
        400,
    );
    chat("temperature 3", chat_with("temperature", json!(3)), 400);
    chat("top_p zero", chat_with("top_p", json!(0)), 400);
    chat("top_p 1.5", chat_with("top_p", json!(1.5)), 400);
    chat("top_k -5", chat_with("top_k", json!(-5)), 400);
    chat("top_k a string", chat_with("top_k", json!("x")), 400);
    chat("min_p 2", chat_with("min_p", json!(2)), 400);
    chat(
        "presence_penalty 5",
        chat_with("presence_penalty", json!(5)),
        400,
    );
    chat(
        "frequency_penalty -3",
        chat_with("frequency_penalty", json!(-3)),
        400,
    );
    chat(
        "repetition_penalty 0",
        chat_with("repetition_penalty", json!(0)),
        400,
    );
    chat(
        "repetition_penalty negative",
        chat_with("repetition_penalty", json!(-1)),
        400,
    );
    chat("seed a string", chat_with("seed", json!("abc")), 400);
    chat("seed fractional", chat_with("seed", json!(1.5)), 400);
    chat("stop a number", chat_with("stop", json!(5)), 400);
    chat(
        "stop a list of numbers",
        chat_with("stop", json!([1, 2])),
        400,
    );
    chat(
        "stop with 20 strings",
        chat_with("stop", json!(vec!["x"; 20])),
        400,
    );
    // Streaming parameters.
    chat("stream a string", chat_with("stream", json!("yes")), 400);
    chat(
        "stream_options without stream",
        chat_with("stream_options", json!({"include_usage": true})),
        400,
    );
    chat(
        "stream_options a string",
        chat_with("stream_options", json!("x")),
        400,
    );
    let mut b = common::chat_body("Hi", 1);
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": "yes"});
    chat("include_usage a string", b.to_string().into_bytes(), 400);
    // Known but unsupported, or of the wrong type.
    chat("n = 2", chat_with("n", json!(2)), 400);
    chat("n a string", chat_with("n", json!("two")), 400);
    chat("logprobs", chat_with("logprobs", json!(true)), 400);
    chat(
        "logprobs a string",
        chat_with("logprobs", json!("yes")),
        400,
    );
    chat(
        "response_format json_schema",
        chat_with("response_format", json!({"type": "json_schema"})),
        400,
    );
    chat(
        "logit_bias",
        chat_with("logit_bias", json!({"1": 100})),
        400,
    );
    chat("user a number", chat_with("user", json!(5)), 400);
    chat("tools a string", chat_with("tools", json!("all")), 400);
    chat(
        "tool without function",
        chat_with("tools", json!([{"type": "function"}])),
        400,
    );
    chat(
        "tool of another type",
        chat_with(
            "tools",
            json!([{"type": "retrieval", "function": {"name": "x"}}]),
        ),
        400,
    );
    chat(
        "chat_template_kwargs a string",
        chat_with("chat_template_kwargs", json!("x")),
        400,
    );
    chat(
        "enable_thinking kwarg a string",
        chat_with("chat_template_kwargs", json!({"enable_thinking": "maybe"})),
        400,
    );
    chat(
        "template kwarg overriding messages",
        chat_with("chat_template_kwargs", json!({"messages": []})),
        400,
    );
    chat(
        "enable_thinking a string",
        chat_with("enable_thinking", json!("yes")),
        400,
    );
    chat("model a number", chat_with("model", json!(5)), 400);
    chat("unknown model", chat_with("model", json!("gpt-4")), 404);
    chat(
        "prompt longer than the context",
        messages(json!([{"role": "user", "content": "hello ".repeat(3 * common::CONTEXT)}])),
        400,
    );

    // Content type.
    c.push((
        "chat: no content type".into(),
        request_bytes(
            "POST",
            CHAT,
            &[],
            &common::chat_body("Hi", 1).to_string().into_bytes(),
        ),
        415,
    ));
    c.push((
        "chat: text/plain".into(),
        request_bytes(
            "POST",
            CHAT,
            &[("Content-Type", "text/plain")],
            &common::chat_body("Hi", 1).to_string().into_bytes(),
        ),
        415,
    ));
    c.push((
        "chat: form".into(),
        request_bytes(
            "POST",
            CHAT,
            &[("Content-Type", "application/x-www-form-urlencoded")],
            b"messages=hi",
        ),
        415,
    ));

    // Text completions.
    let mut comp = |what: &str, body: Vec<u8>, status: u16| {
        c.push((
            format!("completions: {what}"),
            post(COMPLETIONS, &body),
            status,
        ));
    };
    comp("missing prompt", s("{\"max_tokens\": 1}"), 400);
    comp("prompt a number", completion_with("prompt", json!(5)), 400);
    comp(
        "prompt empty list",
        completion_with("prompt", json!([])),
        400,
    );
    comp(
        "prompt empty string",
        completion_with("prompt", json!("")),
        400,
    );
    comp(
        "two prompts",
        completion_with("prompt", json!(["a", "b"])),
        400,
    );
    comp(
        "token id out of range",
        completion_with("prompt", json!([999_999_999])),
        400,
    );
    comp(
        "token id negative",
        completion_with("prompt", json!([-1])),
        400,
    );
    comp("echo a string", completion_with("echo", json!("x")), 400);
    comp("suffix", completion_with("suffix", json!("abc")), 400);
    comp("best_of 3", completion_with("best_of", json!(3)), 400);
    comp("logprobs 5", completion_with("logprobs", json!(5)), 400);
    comp(
        "max_tokens negative",
        completion_with("max_tokens", json!(-5)),
        400,
    );
    comp(
        "unknown model",
        completion_with("model", json!("davinci")),
        404,
    );

    // Paths and methods.
    let mut req = |what: &str, method: &str, path: &str, status: u16| {
        c.push((
            format!("{method} {path}: {what}"),
            request_bytes(method, path, &[], b""),
            status,
        ));
    };
    req("GET on a POST route", "GET", CHAT, 405);
    req("PUT on a GET route", "PUT", "/v1/models", 405);
    req("DELETE", "DELETE", COMPLETIONS, 405);
    req("OPTIONS on the page", "OPTIONS", "/", 405);
    req("path traversal", "GET", "/../../etc/passwd", 404);
    req(
        "encoded path traversal",
        "GET",
        "/%2e%2e/%2e%2e/etc/passwd",
        404,
    );
    req(
        "traversal under a static-looking path",
        "GET",
        "/static/..%2f..%2fCargo.toml",
        404,
    );
    req(
        "traversal in the model id",
        "GET",
        "/v1/models/../../etc/passwd",
        404,
    );
    req(
        "invalid UTF-8 in the model id",
        "GET",
        "/v1/models/%FF%FE",
        400,
    );
    req("unknown model", "GET", "/v1/models/gpt-4", 404);
    req("typo in the route", "POST", "/v1/chat/completion", 404);
    req("no such file", "GET", "/index.html", 404);
    c
}

fn assert_json_error(what: &str, r: &Resp, status: u16) {
    assert_eq!(r.status, status, "{what}: status; body {}", r.text());
    let v: Value = serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{what}: body is not JSON ({e}): {}", r.text()));
    let err = &v["error"];
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {v}"
    );
    assert!(err["type"].is_string(), "{what}: {v}");
    let o = err.as_object().expect("error object");
    assert!(
        o.contains_key("param") && o.contains_key("code"),
        "{what}: {v}"
    );
}

#[test]
fn hostile_requests_get_json_errors_and_the_server_still_answers() {
    let _g = common::exclusive();
    let mut config = brook_server::Config::new("chat-model");
    config.max_body = 1 << 20;
    let server = common::start(config);
    let cases = cases();
    assert!(cases.len() >= 50, "only {} cases", cases.len());
    for (what, bytes, status) in &cases {
        let r = raw(server.addr, bytes);
        assert_json_error(what, &r, *status);
    }
    // Over the body limit: refused with 413 whether or not the client declares its length.
    let big = vec![b' '; 2 << 20];
    let r = raw(server.addr, &post(CHAT, &big));
    assert_json_error("body over the limit", &r, 413);

    // The model still answers.
    let r = common::post_json(server.addr, CHAT, &common::chat_body("Hi", 2));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    let h = common::get(server.addr, "/health");
    assert_eq!(h.status, 200);
    eprintln!(
        "{} hostile requests answered with JSON errors",
        cases.len() + 1
    );
}

#[test]
fn garbage_bytes_do_not_take_the_server_down() {
    let _g = common::exclusive();
    let server = common::start_default();
    for junk in [
        b"\x00\x01\x02\x03\r\n\r\n".as_slice(),
        b"GET / HTTP/9.9\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ] {
        let mut s = common::connect(server.addr);
        use std::io::{Read, Write};
        let _ = s.write_all(junk);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
    }
    assert_eq!(common::get(server.addr, "/health").status, 200);
}

#[test]
fn api_key_is_required_when_configured() {
    let _g = common::exclusive();
    let mut config = brook_server::Config::new("chat-model");
    config.api_key = Some("s3cret".into());
    let server = common::start(config);
    let body = common::chat_body("Hi", 1).to_string();
    let with = |auth: Option<&str>| {
        let mut h = vec![("Content-Type", "application/json")];
        if let Some(a) = auth {
            h.push(("Authorization", a));
        }
        raw(
            server.addr,
            &request_bytes("POST", CHAT, &h, body.as_bytes()),
        )
    };
    assert_json_error("no key", &with(None), 401);
    assert_json_error("wrong key", &with(Some("Bearer nope")), 401);
    assert_json_error("longer key", &with(Some("Bearer s3cret2")), 401);
    assert_json_error("basic auth", &with(Some("Basic czNjcmV0")), 401);
    let models = raw(server.addr, &request_bytes("GET", "/v1/models", &[], b""));
    assert_json_error("models without key", &models, 401);
    assert_eq!(with(Some("Bearer s3cret")).status, 200);
    // The page and health stay open (the page asks for the key itself).
    assert_eq!(common::get(server.addr, "/").status, 200);
    assert_eq!(common::get(server.addr, "/health").status, 200);
}
