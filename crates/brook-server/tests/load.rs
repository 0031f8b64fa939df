//! A load test on loopback, bounded in count and time: streaming chat clients beyond the
//! queue, a slowloris of over a thousand sockets, and a flood of oversized bodies, all at
//! once, while a prober asks `/health` every 100 ms. `/health` must answer within a second
//! throughout, every error must be OpenAI-shaped JSON, and memory must stay bounded.
//!
//! The short form runs in `cargo test`. `BROOK_LOAD_SCALE=N` multiplies the counts and the
//! duration for the long form recorded in docs/SERVER.md (run it with `--release`).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

fn scale() -> u64 {
    std::env::var("BROOK_LOAD_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// Raises this process's open-file limit to its hard limit; returns the limit.
fn open_files() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain getrlimit/setrlimit on a local struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
    }
    lim.rlim_cur
}

fn rss_kib() -> u64 {
    brook_core::experts::budget::rss().0 / 1024
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    busy: AtomicU64,
    too_large: AtomicU64,
    other: AtomicU64,
    bad_errors: Mutex<Vec<String>>,
}

impl Tally {
    fn record(&self, r: &common::Resp) {
        match r.status {
            200 => {
                self.ok.fetch_add(1, Ordering::Relaxed);
                return;
            }
            429 => self.busy.fetch_add(1, Ordering::Relaxed),
            413 => self.too_large.fetch_add(1, Ordering::Relaxed),
            _ => self.other.fetch_add(1, Ordering::Relaxed),
        };
        let shaped = serde_json::from_slice::<Value>(&r.body)
            .is_ok_and(|v| v["error"]["message"].is_string() && v["error"]["type"].is_string());
        if !shaped {
            let mut b = self.bad_errors.lock().unwrap_or_else(|p| p.into_inner());
            b.push(format!(
                "{} {}",
                r.status,
                r.text().chars().take(200).collect::<String>()
            ));
        }
    }
}

#[test]
fn health_answers_and_errors_stay_json_under_load() {
    let _g = common::exclusive();
    let k = scale();
    let fds = open_files();
    let mut config = brook_server::Config::new("chat-model");
    config.max_body = 1 << 20;
    config.queue = 4;
    let server = common::start(config);
    let addr = server.addr;
    let rss_before = rss_kib();
    let duration = Duration::from_secs(8 * k);
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let mut threads = Vec::new();

    // The prober.
    let worst = Arc::new(Mutex::new((Duration::ZERO, 0u64, 0u64)));
    let rss_max = Arc::new(AtomicU64::new(rss_before));
    {
        let (stop, worst, rss_max) = (stop.clone(), worst.clone(), rss_max.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                rss_max.fetch_max(rss_kib(), Ordering::Relaxed);
                let t = Instant::now();
                let r = common::get(addr, "/health");
                let took = t.elapsed();
                let mut w = worst.lock().unwrap_or_else(|p| p.into_inner());
                w.0 = w.0.max(took);
                w.1 += 1;
                if r.status != 200 {
                    w.2 += 1;
                }
                drop(w);
                std::thread::sleep(Duration::from_millis(100));
            }
        }));
    }

    // Streaming chat clients, more than the queue holds.
    let clients = 12 * k as usize;
    for c in 0..clients {
        let (stop, tally) = (stop.clone(), tally.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let body = json!({
                    "messages": [{"role": "user", "content": format!("client {c}: tell me about rivers")}],
                    "max_tokens": 24, "stream": true, "temperature": 0.7, "ignore_eos": true,
                });
                let r = common::post_json(addr, CHAT, &body);
                if r.status == 200 {
                    assert!(r.text().contains("data: [DONE]"), "{}", r.text());
                }
                tally.record(&r);
                if r.status == 429 {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }));
    }

    // Oversized bodies: declared (refused at once) and undeclared (cut at the limit).
    for f in 0..4 {
        let (stop, tally) = (stop.clone(), tally.clone());
        threads.push(std::thread::spawn(move || {
            let big = vec![b' '; 3 << 20];
            while !stop.load(Ordering::Relaxed) {
                let r = if f % 2 == 0 {
                    common::request(
                        addr,
                        "POST",
                        CHAT,
                        &[("Content-Type", "application/json")],
                        &big,
                    )
                } else {
                    let mut head = format!("POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").into_bytes();
                    for piece in big.chunks(64 << 10) {
                        head.extend(format!("{:x}\r\n", piece.len()).bytes());
                        head.extend_from_slice(piece);
                        head.extend(b"\r\n");
                    }
                    head.extend(b"0\r\n\r\n");
                    common::raw(addr, &head)
                };
                tally.record(&r);
            }
        }));
    }

    // Slowloris: sockets that send part of a request head and trickle a header now and then.
    let sockets = (1500 * k).min(fds.saturating_sub(512) / 2) as usize;
    let opened = Arc::new(AtomicU64::new(0));
    let closed_by_server = Arc::new(AtomicU64::new(0));
    {
        let (stop, opened, closed) = (stop.clone(), opened.clone(), closed_by_server.clone());
        threads.push(std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            for _ in 0..sockets {
                if let Ok(mut s) = TcpStream::connect(addr) {
                    let _ =
                        s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n");
                    let _ = s.set_nonblocking(true);
                    held.push(s);
                    opened.fetch_add(1, Ordering::Relaxed);
                }
            }
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(500));
                held.retain_mut(|s| {
                    let mut b = [0u8; 64];
                    let gone =
                        matches!(s.read(&mut b), Ok(0)) || s.write_all(b"X-Slow: 1\r\n").is_err();
                    if gone {
                        closed.fetch_add(1, Ordering::Relaxed);
                    }
                    !gone
                });
            }
        }));
    }

    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("load thread");
    }
    let (worst_health, probes, failed_probes) = *worst.lock().unwrap_or_else(|p| p.into_inner());
    let rss_growth_mib = rss_max.load(Ordering::Relaxed).saturating_sub(rss_before) / 1024;
    let bad = tally
        .bad_errors
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    eprintln!(
        "load x{k} for {:?}: /health {probes} probes, worst {:.0} ms, {failed_probes} failed; chat streams {} ok, {} answered 429; oversized bodies {} answered 413, other statuses {}; slowloris {} sockets opened, {} closed by the server; RSS (this process: server and clients) rose at most {rss_growth_mib} MiB",
        duration,
        worst_health.as_secs_f64() * 1e3,
        tally.ok.load(Ordering::Relaxed),
        tally.busy.load(Ordering::Relaxed),
        tally.too_large.load(Ordering::Relaxed),
        tally.other.load(Ordering::Relaxed),
        opened.load(Ordering::Relaxed),
        closed_by_server.load(Ordering::Relaxed),
    );
    assert!(
        bad.is_empty(),
        "errors that are not OpenAI-shaped JSON: {bad:?}"
    );
    assert_eq!(failed_probes, 0, "/health failed under load");
    assert!(
        worst_health < Duration::from_secs(1),
        "/health took {worst_health:?} under load"
    );
    assert!(
        tally.ok.load(Ordering::Relaxed) > 0,
        "no chat stream finished"
    );
    assert!(tally.too_large.load(Ordering::Relaxed) > 0);
    assert!(rss_growth_mib < 1024, "RSS rose {rss_growth_mib} MiB");
}
