//! The streaming detokenizer on the real Qwen3.6 and Qwen3 vocabularies: any split of the text
//! into ids (down to one byte per id, which cuts emoji and CJK characters apart) gives back the
//! exact text; stop strings spanning ids stop the stream; think blocks and tool calls of both
//! Qwen forms become typed events; malformed or unfinished tool calls come back as content.

use std::io::Read;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use brook_core::text::{
    StopReason, StreamEvent, StreamOptions, TextStream, Tokenizer, ToolCall, ToolSchemas,
    prompt_opens_reasoning,
};

fn load(name: &str) -> Arc<Tokenizer> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizers")
        .join(name)
        .join("tokenizer.json.gz");
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).expect("fixture"))
        .read_to_end(&mut json)
        .expect("gzip");
    Arc::new(Tokenizer::from_bytes(&json).expect("loads"))
}

fn qwen36() -> Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    Arc::clone(T.get_or_init(|| load("qwen3.6")))
}

fn qwen3() -> Arc<Tokenizer> {
    static T: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    Arc::clone(T.get_or_init(|| load("qwen3")))
}

/// Deterministic pseudo-random numbers for the splits (64-bit LCG, Knuth's constants).
struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

/// One id per byte: the byte-level token for each byte of `text`.
fn byte_ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
    let mut ids = Vec::new();
    for b in text.bytes() {
        let id = (0..256u32)
            .find(|&id| tok.token_bytes(id) == [b])
            .expect("every byte has a token");
        ids.push(id);
    }
    ids
}

/// `text` cut at random char boundaries, each piece encoded on its own.
fn random_split_ids(tok: &Tokenizer, text: &str, rng: &mut Lcg) -> Vec<u32> {
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect();
    let mut ids = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let next = bounds
            .iter()
            .copied()
            .filter(|&b| b > start)
            .nth(rng.below(6))
            .unwrap_or(text.len());
        ids.extend(tok.encode(&text[start..next], false).expect("encodes"));
        start = next;
    }
    ids
}

#[derive(Debug, Default, PartialEq)]
struct Out {
    content: String,
    reasoning: String,
    calls: Vec<ToolCall>,
    stopped: Option<StopReason>,
}

fn run(tok: Arc<Tokenizer>, opts: StreamOptions, ids: &[u32]) -> Out {
    let mut stream = TextStream::new(tok, opts);
    let mut events = Vec::new();
    for &id in ids {
        events.extend(stream.push(id));
    }
    events.extend(stream.finish());
    let mut out = Out::default();
    for e in events {
        assert!(out.stopped.is_none(), "event after Stopped: {e:?}");
        match e {
            StreamEvent::Content(s) => out.content.push_str(&s),
            StreamEvent::Reasoning(s) => out.reasoning.push_str(&s),
            StreamEvent::ToolCall(c) => out.calls.push(c),
            StreamEvent::Stopped(r) => out.stopped = Some(r),
        }
    }
    out
}

const MIXED: &str = "Plain ASCII, then emoji 😀👍🏽🇯🇵👩‍👩‍👧, CJK 漢字かなカナ한국어, Arabic مرحبا, Hindi नमस्ते,\ncode `fn main() {}` and   spaces\n\n";

#[test]
fn any_split_gives_back_the_exact_text() {
    let tok = qwen36();
    let opts = || StreamOptions {
        parse_reasoning: false,
        parse_tool_calls: false,
        ..Default::default()
    };
    let whole = run(
        tok.clone(),
        opts(),
        &tok.encode(MIXED, false).expect("encodes"),
    );
    assert_eq!(whole.content, MIXED);
    let bytes = run(tok.clone(), opts(), &byte_ids(&tok, MIXED));
    assert_eq!(bytes.content, MIXED);
    let mut rng = Lcg(99);
    for _ in 0..50 {
        let ids = random_split_ids(&tok, MIXED, &mut rng);
        assert_eq!(run(tok.clone(), opts(), &ids).content, MIXED);
    }
}

#[test]
fn split_emoji_never_yields_a_broken_character() {
    let tok = qwen36();
    let text = "🦀🧑‍🚀";
    let mut stream = TextStream::new(tok.clone(), StreamOptions::default());
    let mut seen = String::new();
    for id in byte_ids(&tok, text) {
        for e in stream.push(id) {
            let StreamEvent::Content(s) = e else {
                panic!("{e:?}")
            };
            assert!(!s.contains('\u{fffd}'), "broken char in {s:?}");
            seen.push_str(&s);
        }
    }
    assert!(stream.finish().is_empty());
    assert_eq!(seen, text);
}

#[test]
fn truncated_character_at_the_end_becomes_a_replacement() {
    let tok = qwen36();
    let ids = byte_ids(&tok, "ok😀");
    let out = run(tok, StreamOptions::default(), &ids[..ids.len() - 1]);
    assert_eq!(out.content, "ok\u{fffd}");
}

#[test]
fn stop_string_spanning_ids_stops_the_stream() {
    let tok = qwen36();
    let text = "Answer: 42. ###END### trailing text";
    let opts = || StreamOptions {
        stop_strings: vec!["###END###".into(), "never".into()],
        ..Default::default()
    };
    for ids in [
        tok.encode(text, false).expect("encodes"),
        byte_ids(&tok, text),
    ] {
        let out = run(tok.clone(), opts(), &ids);
        assert_eq!(out.content, "Answer: 42. ");
        assert_eq!(
            out.stopped,
            Some(StopReason::StopString("###END###".into()))
        );
    }
}

#[test]
fn stop_string_prefix_is_released_when_ruled_out() {
    let tok = qwen36();
    let text = "#### ##E ###EN done ###";
    let opts = StreamOptions {
        stop_strings: vec!["###END###".into()],
        ..Default::default()
    };
    let out = run(tok.clone(), opts, &byte_ids(&tok, text));
    assert_eq!(out.content, text);
    assert_eq!(out.stopped, None);
}

#[test]
fn stop_ids_and_special_tokens() {
    let tok = qwen36();
    let mut ids = tok
        .encode("Hi there<|endoftext|>!", false)
        .expect("encodes");
    ids.push(248046); // <|im_end|>
    ids.extend(tok.encode("ignored", false).expect("encodes"));
    let opts = StreamOptions {
        stop_ids: vec![248046, 248044 + 100_000],
        ..Default::default()
    };
    let out = run(tok, opts, &ids);
    assert_eq!(out.content, "Hi there!");
    assert_eq!(out.stopped, Some(StopReason::StopToken(248046)));
}

#[test]
fn think_block_becomes_reasoning() {
    let tok = qwen3();
    let text = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! 你好";
    for ids in [
        tok.encode(text, false).expect("encodes"),
        byte_ids(&tok, text),
    ] {
        let out = run(tok.clone(), StreamOptions::default(), &ids);
        assert_eq!(out.reasoning, "The user greets me. I should greet back.");
        assert_eq!(out.content, "Hello! 你好");
    }
}

#[test]
fn generation_inside_an_opened_think_block() {
    let tok = qwen36();
    let prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n";
    let opts = StreamOptions {
        starts_in_reasoning: prompt_opens_reasoning(prompt),
        ..Default::default()
    };
    let text = "Short thought.\n</think>\n\nDone.";
    let out = run(
        tok.clone(),
        opts,
        &tok.encode(text, false).expect("encodes"),
    );
    assert_eq!(
        (out.reasoning.as_str(), out.content.as_str()),
        ("Short thought.", "Done.")
    );
    let mut rng = Lcg(5);
    for _ in 0..30 {
        let opts = StreamOptions {
            starts_in_reasoning: true,
            ..Default::default()
        };
        let out = run(tok.clone(), opts, &random_split_ids(&tok, text, &mut rng));
        assert_eq!(
            (out.reasoning.as_str(), out.content.as_str()),
            ("Short thought.", "Done.")
        );
    }
}

#[test]
fn qwen3_json_tool_call_is_parsed() {
    let tok = qwen3();
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"météo\"}}\n</tool_call>";
    let mut rng = Lcg(17);
    for ids in [
        tok.encode(text, false).expect("encodes"),
        byte_ids(&tok, text),
        random_split_ids(&tok, text, &mut rng),
    ] {
        let out = run(tok.clone(), StreamOptions::default(), &ids);
        assert_eq!(out.content, "Let me check.");
        assert_eq!(
            out.calls,
            [
                ToolCall {
                    id: "call_0".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris","days":2}"#.into()
                },
                ToolCall {
                    id: "call_1".into(),
                    name: "search".into(),
                    arguments: r#"{"query":"météo"}"#.into()
                },
            ]
        );
    }
}

#[test]
fn qwen36_xml_tool_call_is_parsed_with_typed_values() {
    let tok = qwen36();
    // As the Qwen3.6 template renders a call (see templates/qwen3.6/cases.json).
    let text = "<think>\nNeed the weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n01310\n</parameter>\n<parameter=opts>\n{\"unit\": \"celsius\", \"alerts\": [true, null]}\n</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>";
    let tools: Vec<serde_json::Value> = serde_json::from_str(
        r#"[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"zip":{"type":"string"},"days":{"type":"integer"}}}}}]"#,
    )
    .expect("tools");
    let mut rng = Lcg(23);
    for ids in [
        tok.encode(text, false).expect("encodes"),
        byte_ids(&tok, text),
        random_split_ids(&tok, text, &mut rng),
    ] {
        let opts = StreamOptions {
            tools: ToolSchemas::from_tools(&tools),
            tool_call_id_prefix: "chatcmpl-1-".into(),
            ..Default::default()
        };
        let out = run(tok.clone(), opts, &ids);
        assert_eq!(out.reasoning, "Need the weather.");
        assert_eq!(out.content, "Checking.");
        assert_eq!(out.calls.len(), 1);
        assert_eq!(out.calls[0].id, "chatcmpl-1-0");
        assert_eq!(out.calls[0].name, "get_weather");
        assert_eq!(
            out.calls[0].arguments,
            r#"{"city":"São Paulo","days":3,"zip":"01310","opts":{"unit":"celsius","alerts":[true,null]},"note":"line one\nline two"}"#
        );
    }
}

#[test]
fn malformed_tool_call_is_kept_as_content() {
    let tok = qwen36();
    let text = "Before <tool_call>\nnot a call at all\n</tool_call> after";
    let out = run(tok.clone(), StreamOptions::default(), &byte_ids(&tok, text));
    assert!(out.calls.is_empty());
    assert_eq!(out.content, text, "nothing lost");
}

#[test]
fn unfinished_tool_call_is_held_then_given_back() {
    let tok = qwen36();
    let text = "<tool_call>\n<function=f>\n<parameter=a>\n1";
    let mut stream = TextStream::new(tok.clone(), StreamOptions::default());
    for id in tok.encode(text, false).expect("encodes") {
        assert!(
            stream.push(id).is_empty(),
            "text inside an open tool call leaked"
        );
    }
    assert_eq!(stream.finish(), [StreamEvent::Content(text.into())]);
}

#[test]
fn tags_are_plain_text_when_parsing_is_off() {
    let tok = qwen3();
    let text = "<think>x</think><tool_call>{}</tool_call>";
    let opts = StreamOptions {
        parse_reasoning: false,
        parse_tool_calls: false,
        ..Default::default()
    };
    assert_eq!(
        run(
            tok.clone(),
            opts,
            &tok.encode(text, false).expect("encodes")
        )
        .content,
        text
    );
}
