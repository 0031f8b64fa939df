//! Qwen's tool-call output parsed into OpenAI `tool_calls`: model text in the Qwen3.6 XML form
//! (and the older Hermes JSON form) is tokenized with the real tokenizer, run through the
//! stream parser the session uses, and turned into the server's chunks and messages. A random
//! model never calls a tool by itself, so this is where the output side of a tool round trip
//! is checked; tests/api.rs checks the input side (calls and results rendered back in).

mod common;

use brook_core::session::{Completion, Event, FinishReason, GenOptions};
use brook_core::text::{Message, StreamEvent, StreamOptions, TextStream, ToolSchemas};
use brook_server::wire::{self, Chunker, Meta};
use serde_json::{Value, json};

fn tools() -> Vec<Value> {
    vec![json!({"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}})]
}

/// Runs `text` (as generated ids) through the stream parser, as the session does.
fn parse(text: &str) -> Vec<Event> {
    let llm = common::llm();
    let tok = llm.tokenizer().expect("tokenizer").clone();
    let ids = tok.encode(text, false).expect("encode");
    let mut s = TextStream::new(
        tok,
        StreamOptions {
            stop_ids: llm.stop_ids.clone(),
            tools: ToolSchemas::from_tools(&tools()),
            ..Default::default()
        },
    );
    let mut events: Vec<StreamEvent> = ids.iter().flat_map(|&id| s.push(id)).collect();
    events.extend(s.finish());
    events
        .into_iter()
        .filter_map(|e| match e {
            StreamEvent::Content(c) => Some(Event::Content(c)),
            StreamEvent::Reasoning(r) => Some(Event::Reasoning(r)),
            StreamEvent::ToolCall(c) => Some(Event::ToolCall(c)),
            StreamEvent::Stopped(_) => None,
        })
        .collect()
}

fn completion(events: &[Event]) -> Completion {
    let mut c = Completion::default();
    for e in events {
        match e {
            Event::Content(s) => c.content.push_str(s),
            Event::Reasoning(s) => c.reasoning.push_str(s),
            Event::ToolCall(t) => c.tool_calls.push(t.clone()),
            _ => {}
        }
    }
    c.finish = Some(if c.tool_calls.is_empty() {
        FinishReason::Stop
    } else {
        FinishReason::ToolCalls
    });
    c
}

fn meta() -> Meta {
    Meta {
        id: "chatcmpl-test".into(),
        created: 0,
        model: "chat-model".into(),
        hide_timings: false,
    }
}

fn args(call: &Value) -> Value {
    serde_json::from_str(
        call["function"]["arguments"]
            .as_str()
            .expect("arguments string"),
    )
    .expect("arguments JSON")
}

const XML_TWO_CALLS: &str = "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n02139\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|im_end|>";

#[test]
fn qwen_xml_tool_calls_become_openai_stream_deltas() {
    let events = parse(XML_TWO_CALLS);
    let mut chunker = Chunker::new(meta(), true, true);
    let chunks: Vec<Value> = events.iter().filter_map(|e| chunker.event(e)).collect();
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    assert_eq!(calls.len(), 2, "{chunks:#?}");
    for (i, call) in calls.iter().enumerate() {
        assert_eq!(call["index"], i);
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "get_weather");
        assert!(call["id"].as_str().is_some_and(|id| !id.is_empty()));
    }
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    // A string parameter stays a string even when it looks like a number.
    assert_eq!(
        args(calls[0]),
        json!({"city": "Paris", "days": 3, "zip": "02139"})
    );
    assert_eq!(args(calls[1]), json!({"city": "Oslo"}));
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content.trim(), "Let me check.");
    let end = chunker.end(&completion(&events));
    assert_eq!(end[0]["choices"][0]["finish_reason"], "tool_calls");
}

#[test]
fn qwen_xml_tool_calls_become_an_openai_message() {
    let c = completion(&parse(XML_TWO_CALLS));
    let v = wire::chat_completion(&meta(), &c);
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let m = &choice["message"];
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["content"].as_str().map(str::trim), Some("Let me check."));
    let calls = m["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 2);
    assert!(
        calls[0].get("index").is_none(),
        "index is for stream deltas only"
    );
    assert_eq!(args(&calls[1]), json!({"city": "Oslo"}));

    // Only a call: content is null, as OpenAI sends it.
    let only = completion(&parse(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call><|im_end|>",
    ));
    let m = wire::chat_message(&only);
    assert_eq!(m["content"], Value::Null);
    assert_eq!(args(&m["tool_calls"][0]), json!({"city": "Rome"}));
}

#[test]
fn hermes_json_tool_calls_are_parsed_too() {
    let c = completion(&parse(
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\", \"days\": 2}}\n</tool_call><|im_end|>",
    ));
    let m = wire::chat_message(&c);
    assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
    assert_eq!(
        args(&m["tool_calls"][0]),
        json!({"city": "Lima", "days": 2})
    );
}

#[test]
fn a_tool_call_rendered_by_the_template_parses_back_to_the_same_call() {
    let llm = common::llm();
    let call = json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_7",
        "type": "function", "function": {"name": "get_weather",
        "arguments": "{\"city\": \"Paris\", \"days\": 3, \"zip\": \"02139\"}"}}]});
    let messages: Vec<Message> = serde_json::from_value(json!([
        {"role": "user", "content": "Weather?"}, call,
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny"},
    ]))
    .expect("messages");
    let opts = GenOptions {
        tools: Some(tools()),
        enable_thinking: Some(false),
        ..Default::default()
    };
    let prompt = llm.render(&messages, &opts, true).expect("render");
    // The last call in the prompt is the assistant's (the system part shows an example one).
    let start = prompt.rfind("<tool_call>").expect("call rendered");
    let end = start + prompt[start..].find("</tool_call>").expect("call closed") + 12;
    let c = completion(&parse(&format!("{}<|im_end|>", &prompt[start..end])));
    let m = wire::chat_message(&c);
    assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
    assert_eq!(
        args(&m["tool_calls"][0]),
        json!({"city": "Paris", "days": 3, "zip": "02139"})
    );
}

#[test]
fn a_broken_tool_call_is_kept_as_content_not_dropped() {
    let c = completion(&parse(
        "<tool_call>\nnot a call at all\n</tool_call><|im_end|>",
    ));
    assert!(c.tool_calls.is_empty());
    assert!(c.content.contains("not a call at all"), "{:?}", c.content);
    assert_eq!(
        wire::chat_completion(&meta(), &c)["choices"][0]["finish_reason"],
        "stop"
    );
}
