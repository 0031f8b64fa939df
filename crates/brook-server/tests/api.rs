//! The OpenAI API over plain HTTP: response shapes, streaming, usage, stop strings, seeds,
//! state reuse across requests, tool results fed back through the template, raw completions,
//! models, health and the page. Generations are a few tokens of a random model, so tests
//! compare the server with itself and with the library, never with expected words.

mod common;

use brook_core::session::GenOptions;
use brook_core::text::Message;
use common::{SseStream, chat_body, get, post_json};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

fn ok(r: common::Resp) -> Value {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[test]
fn models_health_and_page() {
    let server = common::start_default();
    let m = ok(get(server.addr, "/v1/models"));
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "chat-model");
    assert_eq!(m["data"][0]["object"], "model");
    assert_eq!(m["data"][0]["max_model_len"], common::CONTEXT);
    assert_eq!(
        ok(get(server.addr, "/v1/models/chat-model"))["id"],
        "chat-model"
    );
    let h = ok(get(server.addr, "/health"));
    assert_eq!(h["status"], "ok");

    let page = get(server.addr, "/");
    assert_eq!(page.status, 200);
    assert!(
        page.header("content-type")
            .is_some_and(|c| c.starts_with("text/html"))
    );
    let csp = page.header("content-security-policy").expect("CSP");
    assert!(csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"));
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("script-src 'unsafe-inline'"),
        "{csp}"
    );
    let html = page.text();
    assert!(html.contains("<script src=\"/page.js\"></script>") && html.contains("id=\"stop\""));
    assert!(!html.contains("<script>"), "the page has inline script");
    let js = get(server.addr, "/page.js");
    assert_eq!(js.status, 200);
    assert!(
        js.header("content-type")
            .is_some_and(|c| c.starts_with("text/javascript"))
    );
    assert!(js.text().contains("function markdown"));
    for external in ["src=\"http", "href=\"http", "@import", "url(http", "<link "] {
        assert!(!html.contains(external), "the page loads {external}...");
    }
}

#[test]
fn chat_non_streaming_and_streaming_agree() {
    let server = common::start_default();
    let body = chat_body("Write one word.", 3);
    let v = ok(post_json(server.addr, CHAT, &body));
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().is_some_and(|i| i.starts_with("chatcmpl-")));
    assert_eq!(v["model"], "chat-model");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let text = choice["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    let u = &v["usage"];
    assert_eq!(u["completion_tokens"], 3);
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().expect("prompt") + 3)
    );
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());

    let mut s = body.clone();
    s["stream"] = json!(true);
    s["stream_options"] = json!({"include_usage": true});
    let mut stream = SseStream::open(server.addr, CHAT, &s);
    assert_eq!(stream.status, 200);
    let ctype = stream
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"));
    assert!(ctype.is_some_and(|(_, v)| v.starts_with("text/event-stream")));
    let events = stream.rest();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text, "greedy stream equals the whole answer");
    let n = chunks.len();
    assert_eq!(chunks[n - 2]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[n - 1]["choices"], json!([]));
    assert_eq!(chunks[n - 1]["usage"]["completion_tokens"], 3);
}

#[test]
fn reasoning_is_returned_as_reasoning_content_and_reasoning() {
    let server = common::start_default();
    let mut body = chat_body("Think about it.", 3);
    body["enable_thinking"] = json!(true);
    let v = ok(post_json(server.addr, CHAT, &body));
    let m = &v["choices"][0]["message"];
    // The Qwen3.6 prompt opens <think>, so a random model's first tokens are reasoning.
    let r = m["reasoning_content"].as_str().expect("reasoning_content");
    assert!(!r.is_empty());
    assert_eq!(m["reasoning"], m["reasoning_content"]);

    // The same switch through chat_template_kwargs, streamed.
    let mut body = chat_body("Think about it.", 3);
    body.as_object_mut().map(|o| o.remove("enable_thinking"));
    body["chat_template_kwargs"] = json!({"enable_thinking": true});
    body["stream"] = json!(true);
    let events = SseStream::open(server.addr, CHAT, &body).rest();
    let reasoning: String = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| {
            c["choices"][0]["delta"]["reasoning_content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(reasoning, r);
}

#[test]
fn stop_strings_end_the_answer_before_them() {
    let server = common::start_default();
    let v = ok(post_json(server.addr, CHAT, &chat_body("Count.", 4)));
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("text")
        .to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "need some text to cut: {text:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = &text[..text.find(&stop).expect("stop in text")];
    for s in [json!(stop), json!(["\u{1}never", stop])] {
        let mut body = chat_body("Count.", 4);
        body["stop"] = s;
        let v = ok(post_json(server.addr, CHAT, &body));
        assert_eq!(v["choices"][0]["message"]["content"], cut);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
}

#[test]
fn seed_makes_sampling_repeatable_and_every_sampling_field_is_accepted() {
    let server = common::start_default();
    let mut body = chat_body("Say something.", 3);
    body["temperature"] = json!(1.0);
    body["seed"] = json!(1234);
    body["top_p"] = json!(0.95);
    body["top_k"] = json!(50);
    body["min_p"] = json!(0.01);
    body["presence_penalty"] = json!(0.5);
    body["frequency_penalty"] = json!(0.5);
    body["repetition_penalty"] = json!(1.1);
    body["max_completion_tokens"] = json!(3);
    body["n"] = json!(1);
    body["response_format"] = json!({"type": "text"});
    body["user"] = json!("tester");
    body["some_future_field"] = json!({"ignored": true});
    let a = ok(post_json(server.addr, CHAT, &body));
    let b = ok(post_json(server.addr, CHAT, &body));
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    assert_eq!(a["usage"]["completion_tokens"], 3);
}

#[test]
fn a_conversation_that_extends_the_last_one_reuses_its_state() {
    let server = common::start_default();
    let v = ok(post_json(
        server.addr,
        CHAT,
        &chat_body("Hello! Who are you?", 3),
    ));
    let reply = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("reply")
        .to_string();
    let mut body = chat_body("", 2);
    body["messages"] = json!([
        {"role": "user", "content": "Hello! Who are you?"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Tell me more."},
    ]);
    let v = ok(post_json(server.addr, CHAT, &body));

    // Reused: the state up to the end of the first user message (the template rewrites the
    // previous reply, so that and the new message are prefilled), as the library computes it.
    let llm = common::llm();
    let opts = GenOptions {
        enable_thinking: Some(false),
        ..Default::default()
    };
    let kept = llm
        .render(&[Message::new("user", "Hello! Who are you?")], &opts, false)
        .expect("render");
    let kept = llm
        .tokenizer()
        .expect("tok")
        .encode(&kept, false)
        .expect("encode")
        .len();
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], kept, "{u}");
    assert!(u["prompt_tokens"].as_u64().expect("n") > kept as u64);
}

#[test]
fn tool_calls_and_tool_results_are_rendered_through_the_template() {
    let server = common::start_default();
    let tools = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let conversation = json!([
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp_c\": 21}"},
    ]);
    let mut body = chat_body("", 2);
    body["messages"] = conversation.clone();
    body["tools"] = tools.clone();
    body["tool_choice"] = json!("auto");
    let v = ok(post_json(server.addr, CHAT, &body));
    assert_eq!(v["usage"]["completion_tokens"], 2);

    // The server's prompt is the template's rendering with the call and its result in it.
    let llm = common::llm();
    let messages: Vec<Message> = serde_json::from_value(conversation).expect("messages");
    let opts = GenOptions {
        enable_thinking: Some(false),
        tools: tools.as_array().cloned(),
        ..Default::default()
    };
    let prompt = llm.render(&messages, &opts, true).expect("render");
    assert!(prompt.contains("<function=get_weather>") && prompt.contains("<tool_response>"));
    assert!(prompt.contains("{\"temp_c\": 21}") && prompt.contains("# Tools"));
    let n = llm
        .tokenizer()
        .expect("tok")
        .encode(&prompt, false)
        .expect("encode")
        .len();
    assert_eq!(v["usage"]["prompt_tokens"], n);
}

#[test]
fn text_completions_stream_and_not() {
    let server = common::start_default();
    let body = json!({"model": "chat-model", "prompt": "Once upon a time", "max_tokens": 3,
                      "temperature": 0});
    let v = ok(post_json(server.addr, "/v1/completions", &body));
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().is_some_and(|i| i.starts_with("cmpl-")));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let text = v["choices"][0]["text"].as_str().expect("text").to_string();

    let mut s = body.clone();
    s["stream"] = json!(true);
    s["echo"] = json!(true);
    let events = SseStream::open(server.addr, "/v1/completions", &s).rest();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).expect("chunk"))
        .filter_map(|c| c["choices"][0]["text"].as_str().map(String::from))
        .collect();
    assert_eq!(streamed, format!("Once upon a time{text}"));

    // Token ids work as a prompt too.
    let ids = common::llm()
        .tokenizer()
        .expect("tok")
        .encode("Once upon a time", true)
        .expect("ids");
    let mut b = body.clone();
    b["prompt"] = json!(ids);
    let v = ok(post_json(server.addr, "/v1/completions", &b));
    assert_eq!(v["choices"][0]["text"], text.as_str());
}

#[test]
fn a_prompt_longer_than_the_context_is_context_length_exceeded() {
    let server = common::start_default();
    let long = "word ".repeat(3 * common::CONTEXT);
    let r = post_json(server.addr, CHAT, &chat_body(&long, 1));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    let r = post_json(server.addr, "/v1/completions", &json!({"prompt": long}));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
}
