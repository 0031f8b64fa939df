//! `brook serve` as a process: it prints where it listens, answers, refuses a public address
//! without an API key, and ends when killed. The API itself is tested in crates/brook-server.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn serve_prints_its_address_and_answers() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_brook"))
        .args(["serve", "--port", "0", "--model-id", "tiny", "--model"])
        .arg(fixture("qwen35-q4"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("stdout");
    BufReader::new(stdout).read_line(&mut line).expect("line");
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .map(str::to_string);
    let result = std::panic::catch_unwind(|| {
        let addr = addr.expect("address in the first line");
        assert!(addr.starts_with("127.0.0.1:"), "{line}");
        let health = get(&addr, "/health");
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        let models = get(&addr, "/v1/models");
        assert!(models.contains("\"id\":\"tiny\""), "{models}");
        // Without --api-key a request for another host (DNS rebinding) is refused.
        let mut s = TcpStream::connect(&addr).expect("connect");
        write!(
            s,
            "GET /v1/models HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
        )
        .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        assert!(
            out.starts_with("HTTP/1.1 403") && out.contains("host_not_allowed"),
            "{out}"
        );
    });
    child.kill().expect("kill");
    let _ = child.wait();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

#[test]
fn serve_refuses_a_public_address_without_an_api_key() {
    let out = Command::new(env!("CARGO_BIN_EXE_brook"))
        .args(["serve", "--host", "0.0.0.0", "--port", "0", "--model"])
        .arg(fixture("qwen35-q4"))
        .env_remove("BROOK_API_KEY")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--api-key"), "{err}");
}

#[test]
fn serve_refuses_a_parallel_count_out_of_range() {
    for n in ["0", "65"] {
        let out = Command::new(env!("CARGO_BIN_EXE_brook"))
            .args(["serve", "--port", "0", "--parallel", n, "--model"])
            .arg(fixture("qwen35-q4"))
            .output()
            .expect("run");
        assert_eq!(out.status.code(), Some(2), "--parallel {n}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--parallel") && err.contains("1 to 64"),
            "{err}"
        );
    }
}
