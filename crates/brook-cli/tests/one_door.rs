//! Regression tests for "one door to the forward pass": every face a user runs computes on
//! the engine `--backend` asked for, never on another. `generate`, `chat` (driven through
//! stdin) and `serve` (through HTTP) report the engine that ran and the steps each engine ran
//! over the model; the CPU backend must show CPU steps only.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

#[path = "../../brook-core/tests/common/chat_model.rs"]
mod chat_model;
use chat_model::chat_model;

fn brook(home: &std::path::Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_brook"));
    cmd.env("BROOK_HOME", home);
    cmd
}

/// Only `engine` ran steps over the model, and it ran some.
fn only(stats: &serde_json::Value, engine: &str) {
    assert_eq!(stats["engine"], engine, "{stats}");
    let steps = stats["model_steps"].as_array().expect("model_steps");
    assert_eq!(steps.len(), 1, "{stats}");
    assert_eq!(steps[0][0], engine, "{stats}");
    assert!(steps[0][1].as_u64().unwrap_or(0) > 0, "{stats}");
    assert!(stats["forward_calls"].as_u64().unwrap_or(0) > 0, "{stats}");
}

#[test]
fn generate_runs_the_backend_asked_for() {
    let dir = tempfile::tempdir().expect("tmp");
    let model = chat_model(dir.path());
    let mut tokens = Vec::new();
    for backend in ["cpu", "reference"] {
        let out = brook(dir.path())
            .args(["generate", "--model"])
            .arg(&model)
            .args([
                "--prompt",
                "Hello",
                "--max-tokens",
                "4",
                "--temperature",
                "0",
            ])
            .args(["--backend", backend, "--json"])
            .output()
            .expect("run");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        only(&v["engine"], backend);
        for key in ["decode_tok_s", "ttft_s", "peak_rss_bytes"] {
            assert!(v[key].as_f64().is_some(), "{key} missing: {v}");
        }
        tokens.push(v["tokens"].clone());
    }
    assert_eq!(tokens[0], tokens[1], "cpu and reference disagree");
}

#[test]
fn chat_through_stdin_runs_the_backend_asked_for() {
    let dir = tempfile::tempdir().expect("tmp");
    let model = chat_model(dir.path());
    for backend in ["cpu", "reference"] {
        let mut child = brook(dir.path())
            .args(["chat", "--model"])
            .arg(&model)
            .args([
                "--max-tokens",
                "3",
                "--temperature",
                "0",
                "--backend",
                backend,
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(b"Hello\n/stats\n").expect("write");
        drop(stdin);
        let out = child.wait_with_output().expect("wait");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains(&format!("the {backend} engine")), "{text}");
    }
}

fn http(addr: &str, request: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    s.write_all(request.as_bytes()).expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

fn body(response: &str) -> serde_json::Value {
    let body = response.split("\r\n\r\n").nth(1).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {response}"))
}

#[test]
fn serve_runs_the_cpu_engine() {
    let dir = tempfile::tempdir().expect("tmp");
    let model = chat_model(dir.path());
    let mut child = brook(dir.path())
        .args(["serve", "--port", "0", "--model"])
        .arg(&model)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("stdout");
    BufReader::new(stdout).read_line(&mut line).expect("line");
    let result = std::panic::catch_unwind(|| {
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .expect("address")
            .to_string();
        let req =
            r#"{"messages":[{"role":"user","content":"Hello"}],"max_tokens":3,"temperature":0}"#;
        let answer = http(
            &addr,
            &format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{req}",
                req.len()
            ),
        );
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let health = body(&http(
            &addr,
            "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        ));
        only(&health["engine"], "cpu");
    });
    child.kill().expect("kill");
    let _ = child.wait();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
