//! The server's limits against clients that hold on or reach too far: header, idle and body
//! timeouts, the connection cap, the Host check, the token cap and the request deadline, the
//! queue place taken before any prompt work, and per-client isolation of the kept state.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{Resp, raw};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

fn assert_error(what: &str, r: &Resp, status: u16, code: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["code"], code, "{what}: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty())
    );
}

/// Reads until the server closes the connection; how long that took.
fn time_to_close(mut s: TcpStream) -> (Duration, Vec<u8>) {
    let t = Instant::now();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    (t.elapsed(), out)
}

fn fast_limits(config: &mut brook_server::Config) {
    config.transport.header_timeout = Duration::from_secs(1);
    config.transport.body_timeout = Duration::from_secs(1);
}

#[test]
fn silent_slow_and_idle_connections_are_closed() {
    let _g = common::exclusive();
    let mut config = brook_server::Config::new("chat-model");
    fast_limits(&mut config);
    let server = common::start(config);

    // Opened and never written to.
    let (t, out) = time_to_close(common::connect(server.addr));
    assert!(
        out.is_empty() && t < Duration::from_secs(10),
        "silent: {t:?}"
    );

    // Headers trickled and never finished (slowloris).
    let mut s = common::connect(server.addr);
    s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: 1\r\n")
        .expect("io");
    let (t, _) = time_to_close(s);
    assert!(t < Duration::from_secs(10), "unfinished headers: {t:?}");

    // A body that never arrives whole: 408 as JSON.
    let mut s = common::connect(server.addr);
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\":",
    )
    .expect("io");
    let (t, out) = time_to_close(s);
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 408"), "slow body: {text}");
    assert!(text.contains("body_timeout"), "{text}");
    assert!(t < Duration::from_secs(10), "slow body: {t:?}");

    // A keep-alive connection left idle after its answer.
    let mut s = common::connect(server.addr);
    s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .expect("io");
    let (t, out) = time_to_close(s);
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200"));
    assert!(t < Duration::from_secs(10), "idle keep-alive: {t:?}");

    assert_eq!(common::get(server.addr, "/health").status, 200);
}

#[test]
fn the_connection_cap_closes_idle_sockets_first_and_refuses_only_when_all_are_busy() {
    let _g = common::exclusive();
    let mut config = brook_server::Config::new("chat-model");
    config.transport.max_connections = 4;
    config.transport.body_timeout = Duration::from_secs(3);
    let server = common::start(config);

    // Far more silent sockets than the cap: each newcomer closes the oldest, and a real
    // request still gets through.
    let silent: Vec<TcpStream> = (0..40).map(|_| common::connect(server.addr)).collect();
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    assert_eq!(common::get(server.addr, "/health").status, 200);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    drop(silent);

    // Four connections each in the middle of a request (a body still coming): a fifth is
    // answered 503 at once.
    let busy: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = common::connect(server.addr);
            s.write_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{",
            )
            .expect("io");
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let r = common::get(server.addr, "/health");
    assert_error("over the cap", &r, 503, "too_many_connections");
    assert!(r.header("retry-after").is_some());
    // Once their bodies time out, the server answers again.
    for s in busy {
        let (_, out) = time_to_close(s);
        assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 408"));
    }
    assert_eq!(common::get(server.addr, "/health").status, 200);
}

#[test]
fn without_a_key_only_loopback_hosts_are_served() {
    let _g = common::exclusive();
    let mut config = brook_server::Config::new("chat-model");
    config.allowed_hosts = vec!["brook.lan".into()];
    let server = common::start(config);
    let with_host = |host: &str| {
        let r = format!("GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        raw(server.addr, r.as_bytes())
    };
    for ok in [
        "127.0.0.1",
        "127.0.0.1:8080",
        "localhost",
        "LOCALHOST:1",
        "app.localhost",
        "[::1]:8080",
        "brook.lan",
        "Brook.LAN:80",
    ] {
        assert_eq!(with_host(ok).status, 200, "{ok}");
    }
    for bad in [
        "evil.example",
        "evil.example:8080",
        "127.0.0.1.evil.example",
        "localhost.evil.example",
        "192.168.1.10",
        "brook.lan.evil.example",
    ] {
        assert_error(bad, &with_host(bad), 403, "host_not_allowed");
    }

    // With a key the key is the guard: any host, key required.
    let mut config = brook_server::Config::new("chat-model");
    config.api_key = Some("k".into());
    let keyed = common::start(config);
    let r = "GET /v1/models HTTP/1.1\r\nHost: models.example\r\nAuthorization: Bearer k\r\nConnection: close\r\n\r\n";
    assert_eq!(raw(keyed.addr, r.as_bytes()).status, 200);
}

#[test]
fn the_token_cap_and_the_deadline_hold() {
    let _g = common::exclusive();
    let mut config = brook_server::Config::new("chat-model");
    config.max_tokens = Some(3);
    let server = common::start(config);
    let mut body = common::chat_body("Hi", 50);
    body["ignore_eos"] = json!(true);
    let r = common::post_json(server.addr, CHAT, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);
    body.as_object_mut().expect("object").remove("max_tokens");
    let r = common::post_json(server.addr, CHAT, &body);
    assert_eq!(r.json()["usage"]["completion_tokens"], 3);

    // A deadline already past when the request reaches the model: 503 `timeout`, and the
    // server goes on.
    let mut config = brook_server::Config::new("chat-model");
    config.request_timeout = Some(Duration::from_nanos(1));
    let server = common::start(config);
    let r = common::post_json(server.addr, CHAT, &common::chat_body("Hi", 2));
    assert_error("past deadline", &r, 503, "timeout");
    assert_eq!(common::get(server.addr, "/health").status, 200);
}

#[test]
fn refused_prompts_give_their_queue_place_back() {
    let _g = common::exclusive();
    let mut config = brook_server::Config::new("chat-model");
    config.queue = 0;
    let server = common::start(config);
    // Each of these takes the only place, renders, and is refused: the place must come back.
    let long = "word ".repeat(3 * common::CONTEXT);
    for _ in 0..5 {
        let r = common::post_json(server.addr, CHAT, &common::chat_body(&long, 1));
        assert_error("too long", &r, 400, "context_length_exceeded");
        let r = common::post_json(
            server.addr,
            "/v1/completions",
            &json!({"prompt": [1, 2, 999_999_999], "max_tokens": 1}),
        );
        assert_eq!(r.status, 400, "{}", r.text());
    }
    let r = common::post_json(server.addr, CHAT, &common::chat_body("Hi", 1));
    assert_eq!(r.status, 200, "{}", r.text());
}

fn cached(v: &Value) -> Option<u64> {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64()
}

#[test]
fn kept_state_is_reused_only_for_the_same_client_and_timings_can_be_hidden() {
    let _g = common::exclusive();
    let server = common::start_default();
    let turn = |user: Option<&str>, text: &str| {
        let mut b = common::chat_body(text, 2);
        if let Some(u) = user {
            b["user"] = json!(u);
        }
        let r = common::post_json(server.addr, CHAT, &b);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let prompt = "Tell me a long story about rivers and the sea";
    turn(Some("alice"), prompt);
    // Bob sends the same prompt: nothing of Alice's is reused.
    assert_eq!(cached(&turn(Some("bob"), prompt)), Some(0));
    // Bob again: his own state is.
    assert!(cached(&turn(Some("bob"), prompt)).is_some_and(|n| n > 0));
    // Alice after Bob: fresh again.
    assert_eq!(cached(&turn(Some("alice"), prompt)), Some(0));

    let mut config = brook_server::Config::new("chat-model");
    config.hide_timings = true;
    let hidden = common::start(config);
    let r = common::post_json(hidden.addr, CHAT, &common::chat_body("Hi", 2)).json();
    let usage = r["usage"].as_object().expect("usage");
    assert!(usage.contains_key("prompt_tokens") && usage.contains_key("completion_tokens"));
    assert!(
        !usage.contains_key("timings") && !usage.contains_key("prompt_tokens_details"),
        "{r}"
    );
    let mut b = common::chat_body("Hi", 2);
    b["stream"] = json!(true);
    let mut s = common::SseStream::open(hidden.addr, CHAT, &b);
    let events = s.rest();
    assert!(!events.is_empty());
    assert!(events.iter().all(|e| !e.contains("timings")), "{events:?}");
}

#[test]
fn bodies_in_memory_are_bounded_whatever_the_connections() {
    let _g = common::exclusive();
    let mut config = brook_server::Config::new("chat-model");
    config.max_body = 64 << 10; // room for four such bodies at once
    config.transport.body_timeout = Duration::from_secs(4);
    let server = common::start(config);
    // Four uploads that declare the whole limit and stall take all the room.
    let stalled: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = common::connect(server.addr);
            s.write_all(
                format!("POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{", 64 << 10)
                    .as_bytes(),
            )
            .expect("io");
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // Requests without a body are not held up.
    let t = Instant::now();
    assert_eq!(common::get(server.addr, "/health").status, 200);
    assert!(t.elapsed() < Duration::from_secs(1));
    // A fifth body waits for room: it is read only once the stalled ones time out.
    let t = Instant::now();
    let r = common::request(
        server.addr,
        "POST",
        CHAT,
        &[("Content-Type", "application/json")],
        &vec![b' '; 64 << 10],
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        t.elapsed() > Duration::from_secs(2),
        "the fifth body was read at once ({:?}): the room is not bounded",
        t.elapsed()
    );
    for s in stalled {
        let (_, out) = time_to_close(s);
        assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 408"));
    }
}
