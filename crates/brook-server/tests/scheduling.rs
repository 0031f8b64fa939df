//! One model, one request at a time: a client that disconnects frees the model at once, and a
//! full queue is answered 429 with Retry-After.
//!
//! The times asserted are loose (the machine may be busy); what they separate is "cancelled"
//! (the next request runs in about the time of its own prefill and one token) from "not
//! cancelled" (it waits for hundreds of tokens of the abandoned one, minutes on this model).

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::{SseStream, chat_body, post_json};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

/// Tokens the abandoned generations ask for: far more than could finish during a test.
const LONG: u64 = 1500;

/// Reads chunks until `n` carry content.
fn wait_for_content(s: &mut SseStream, n: usize) {
    let mut seen = 0;
    while seen < n {
        let data = s.next_data().expect("stream ended early");
        let v: Value = serde_json::from_str(&data).expect("chunk");
        if v["choices"][0]["delta"]["content"].is_string()
            && v["choices"][0]["delta"]["role"].is_null()
        {
            seen += 1;
        }
    }
}

/// Time for a one-token request on an idle model.
fn one_token(addr: std::net::SocketAddr) -> Duration {
    let t = Instant::now();
    let r = post_json(addr, CHAT, &chat_body("Hi", 1));
    assert_eq!(r.status, 200, "{}", r.text());
    t.elapsed()
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_the_model_at_once() {
    let _g = common::exclusive();
    let server = common::start_default();
    let idle = one_token(server.addr);

    let mut body = chat_body("Tell me a very long story.", LONG);
    body["stream"] = json!(true);
    let mut s = SseStream::open(server.addr, CHAT, &body);
    assert_eq!(s.status, 200);
    wait_for_content(&mut s, 2);
    let gone = Instant::now();
    s.disconnect();
    let next = one_token(server.addr);
    let since = gone.elapsed();
    eprintln!(
        "one-token request: {:.2} s on an idle model, {:.2} s right after a disconnect",
        idle.as_secs_f64(),
        next.as_secs_f64()
    );
    assert!(
        since < idle * 4 + Duration::from_secs(10),
        "the next request took {since:?} after the disconnect (idle: {idle:?})"
    );
    let h = common::get(server.addr, "/health").json();
    assert_eq!(h["running"], 0, "{h}");
}

#[test]
fn a_client_that_disconnects_before_a_non_streamed_answer_cancels_it() {
    let _g = common::exclusive();
    let server = common::start_default();
    let idle = one_token(server.addr);
    let req = common::request_bytes(
        "POST",
        CHAT,
        &[("Content-Type", "application/json")],
        chat_body("Tell me a very long story.", LONG)
            .to_string()
            .as_bytes(),
    );
    let mut c = common::connect(server.addr);
    c.write_all(&req).expect("write");
    // Let it start generating, then leave.
    let t = Instant::now();
    while common::get(server.addr, "/health").json()["running"] != 1 {
        assert!(t.elapsed() < Duration::from_secs(60), "never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let gone = Instant::now();
    drop(c);
    one_token(server.addr);
    let since = gone.elapsed();
    eprintln!(
        "non-streamed: next request done {:.2} s after the disconnect",
        since.as_secs_f64()
    );
    assert!(
        since < idle * 4 + Duration::from_secs(10),
        "the next request took {since:?} after the disconnect (idle: {idle:?})"
    );
}

#[test]
fn a_full_queue_is_answered_429_with_retry_after() {
    let _g = common::exclusive();
    let mut config = brook_server::Config::new("chat-model");
    config.queue = 1;
    let server = common::start(config);
    let mut body = chat_body("Tell me a very long story.", LONG);
    body["stream"] = json!(true);

    let mut running = SseStream::open(server.addr, CHAT, &body);
    wait_for_content(&mut running, 1);
    let waiting = SseStream::open(server.addr, CHAT, &body);
    assert_eq!(waiting.status, 200, "one request may wait");
    let h = common::get(server.addr, "/health").json();
    assert_eq!(
        (h["running"].clone(), h["waiting"].clone()),
        (json!(1), json!(1)),
        "{h}"
    );

    for path in [CHAT, "/v1/completions"] {
        let b = if path == CHAT {
            chat_body("Hi", 1)
        } else {
            json!({"prompt": "Hi"})
        };
        let r = post_json(server.addr, path, &b);
        assert_eq!(r.status, 429, "{}", r.text());
        let retry: u64 = r
            .header("retry-after")
            .expect("Retry-After")
            .parse()
            .expect("seconds");
        assert!(retry >= 1);
        let v = r.json();
        assert_eq!(v["error"]["code"], "queue_full");
        assert!(v["error"]["message"].is_string());
    }

    // Both leave; the waiting one is dropped from the queue and the model is free again. The
    // server learns of a disconnect from the socket, so allow it a moment before retrying.
    waiting.disconnect();
    running.disconnect();
    let t = Instant::now();
    loop {
        let r = post_json(server.addr, CHAT, &chat_body("Hi", 1));
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 429, "{}", r.text());
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the queue never emptied"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "after both clients left: the next request was answered in {:.2} s",
        t.elapsed().as_secs_f64()
    );
}
