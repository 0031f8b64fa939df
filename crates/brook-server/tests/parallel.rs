//! Several conversations at once (issue #32): `--parallel` slots whose steps are batched.
//! Each request's tokens are the ones it gets alone; a request joins and leaves while others
//! decode; a cancelled one leaves the others running; a long prompt is read in chunks between
//! the others' tokens; beyond the slots and the queue, 429; `/metrics` parses as Prometheus
//! text and counts what ran.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{SseStream, chat_body, post_json};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

fn config(parallel: usize, queue: usize) -> brook_server::Config {
    let mut c = brook_server::Config::new("chat-model");
    c.parallel = parallel;
    c.queue = queue;
    c
}

fn body(user: &str, max_tokens: u64, stream: bool) -> Value {
    let mut b = chat_body(user, max_tokens);
    b["ignore_eos"] = json!(true);
    b["stream"] = json!(stream);
    // Each request its own client: no conversation reuse across them.
    b["user"] = json!(user);
    b
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string()
}

/// Reads a stream to its end: the content and how many chunks carried some.
fn read_stream(mut s: SseStream) -> (String, usize) {
    let (mut text, mut n) = (String::new(), 0);
    while let Some(d) = s.next_data() {
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&d).expect("chunk");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str()
            && v["choices"][0]["delta"]["role"].is_null()
        {
            text.push_str(c);
            n += 1;
        }
    }
    (text, n)
}

/// Waits for the next content chunk of a stream.
fn next_content(s: &mut SseStream) -> String {
    loop {
        let d = s.next_data().expect("stream ended early");
        let v: Value = serde_json::from_str(&d).expect("chunk");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str()
            && v["choices"][0]["delta"]["role"].is_null()
        {
            return c.to_string();
        }
    }
}

fn metrics(addr: std::net::SocketAddr) -> HashMap<String, f64> {
    let r = common::get(addr, "/metrics");
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap_or("")
            .starts_with("text/plain"),
        "{:?}",
        r.header("content-type")
    );
    let text = r.text();
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("Prometheus text");
    let mut out = HashMap::new();
    for s in scrape.samples {
        let mut key = s.metric.clone();
        let mut labels: Vec<_> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        if !labels.is_empty() {
            key = format!("{key}{{{}}}", labels.join(","));
        }
        let v = match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(h) => {
                for b in h {
                    out.insert(format!("{key}_bucket{{le={}}}", b.less_than), b.count);
                }
                continue;
            }
            prometheus_parse::Value::Summary(_) => continue,
        };
        out.insert(key, v);
    }
    out
}

const PROMPTS: [&str; 4] = [
    "Tell me about rivers.",
    "What is a prime number?",
    "Write a haiku about snow.",
    "List three colours.",
];

#[test]
fn parallel_requests_share_steps_and_answer_what_they_answer_alone() {
    let _g = common::exclusive();
    let server = common::start_with(common::llm_parallel(), config(4, 4));
    let alone: Vec<String> = PROMPTS
        .iter()
        .map(|p| content(&post_json(server.addr, CHAT, &body(p, 24, false)).json()))
        .collect();
    let before = metrics(server.addr);
    let t = std::time::Instant::now();
    let together: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = PROMPTS
            .iter()
            .map(|p| {
                let addr = server.addr;
                sc.spawn(move || read_stream(SseStream::open(addr, CHAT, &body(p, 24, true))).0)
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("client")).collect()
    });
    let wall = t.elapsed().as_secs_f64();
    assert_eq!(alone, together);
    let after = metrics(server.addr);
    let d = |k: &str| after[k] - before.get(k).copied().unwrap_or(0.0);
    // 4 × 24 tokens were generated; alone each takes a step, together they share.
    assert_eq!(d("brook_generation_tokens_total"), 96.0);
    let steps = d("brook_engine_steps_total");
    assert!(
        steps < 96.0 * 0.75,
        "{steps} steps for 96 tokens: too few shared"
    );
    // The engine was busy for part of the wall time, never more.
    let busy = d("brook_engine_busy_seconds_total");
    assert!(
        busy > 0.0 && busy <= wall,
        "engine busy {busy} s of {wall} s"
    );
    // Waiting for the streams' next tokens between steps is idle time, not busy time.
    let gather = d("brook_engine_gather_seconds_total");
    assert!(
        gather > 0.0 && busy + gather <= wall,
        "engine gathering {gather} s and busy {busy} s of {wall} s"
    );
    assert_eq!(d("brook_requests_total{finish_reason=length}"), 4.0);
    assert_eq!(after["brook_parallel_slots"], 4.0);
    assert_eq!(
        after["brook_time_to_first_token_seconds_bucket{le=inf}"],
        after["brook_requests_total{finish_reason=length}"]
    );
}

#[test]
fn requests_join_and_leave_while_others_decode_and_cancelling_one_spares_the_rest() {
    let _g = common::exclusive();
    let server = common::start_with(common::llm_parallel(), config(4, 4));
    let short_alone = content(&post_json(server.addr, CHAT, &body(PROMPTS[1], 8, false)).json());
    let mut a = SseStream::open(server.addr, CHAT, &body(PROMPTS[0], 100_000, true));
    let mut c = SseStream::open(server.addr, CHAT, &body(PROMPTS[2], 100_000, true));
    next_content(&mut a);
    next_content(&mut c);
    // A short request joins, finishes and leaves while both decode.
    let r = post_json(server.addr, CHAT, &body(PROMPTS[1], 8, false));
    assert_eq!(content(&r.json()), short_alone);
    for _ in 0..3 {
        next_content(&mut a);
        next_content(&mut c);
    }
    let h = common::get(server.addr, "/health").json();
    assert_eq!(
        (h["running"].clone(), h["waiting"].clone()),
        (json!(2), json!(0)),
        "{h}"
    );
    // C leaves; A goes on, and C's slot frees.
    c.disconnect();
    let t = Instant::now();
    loop {
        next_content(&mut a);
        if common::get(server.addr, "/health").json()["running"] == 1 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the cancelled request kept its slot"
        );
    }
    for _ in 0..5 {
        next_content(&mut a);
    }
    a.disconnect();
}

#[test]
fn a_long_prompt_is_read_between_the_tokens_of_others() {
    let _g = common::exclusive();
    let server = common::start_with(common::llm_parallel(), config(4, 4));
    let mut a = SseStream::open(server.addr, CHAT, &body(PROMPTS[0], 100_000, true));
    next_content(&mut a);
    // About 1500 prompt tokens: three chunks of 512.
    let long = "The river bends past seven hills and the town. ".repeat(150);
    let addr = server.addr;
    let reader = std::thread::spawn(move || {
        let t = Instant::now();
        let mut s = SseStream::open(addr, CHAT, &body(&long, 2, true));
        next_content(&mut s);
        (t, Instant::now(), read_stream(s))
    });
    // A keeps decoding while the long prompt is read: count its tokens until the long
    // request's first token.
    let mut gaps = Vec::new();
    let mut last = Instant::now();
    while !reader.is_finished() {
        next_content(&mut a);
        gaps.push(last.elapsed());
        last = Instant::now();
    }
    let (sent, first, _) = reader.join().expect("long request");
    let during = gaps.len();
    eprintln!(
        "long prompt: first token {:.2} s after sending; {during} tokens of the other request meanwhile, longest gap {:?}",
        (first - sent).as_secs_f64(),
        gaps.iter().max()
    );
    assert!(
        during >= 3,
        "the decoding request stalled while the prompt was read"
    );
    a.disconnect();
}

#[test]
fn beyond_the_slots_and_the_queue_requests_get_429_with_retry_after() {
    let _g = common::exclusive();
    let server = common::start_with(common::llm_parallel(), config(2, 1));
    let mut s1 = SseStream::open(server.addr, CHAT, &body(PROMPTS[0], 100_000, true));
    let mut s2 = SseStream::open(server.addr, CHAT, &body(PROMPTS[1], 100_000, true));
    next_content(&mut s1);
    next_content(&mut s2);
    let waiting = SseStream::open(server.addr, CHAT, &body(PROMPTS[2], 4, true));
    assert_eq!(waiting.status, 200);
    let h = common::get(server.addr, "/health").json();
    assert_eq!(
        (h["running"].clone(), h["waiting"].clone()),
        (json!(2), json!(1)),
        "{h}"
    );
    let m = metrics(server.addr);
    assert_eq!(
        (m["brook_requests_running"], m["brook_requests_waiting"]),
        (2.0, 1.0)
    );
    let r = post_json(server.addr, CHAT, &body(PROMPTS[3], 1, false));
    assert_eq!(r.status, 429, "{}", r.text());
    assert!(r.header("retry-after").is_some());
    assert_eq!(r.json()["error"]["code"], "queue_full");
    // A slot frees: the waiting request runs to its end.
    s1.disconnect();
    let (_, n) = read_stream(waiting);
    assert_eq!(n, 4);
    s2.disconnect();
}
