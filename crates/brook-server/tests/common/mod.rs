//! Helpers shared by the server tests: the small chat model, an in-process server on an
//! ephemeral loopback port, and a raw HTTP/1.1 client over `TcpStream` (raw so that tests can
//! send anything, including requests no HTTP library would produce).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use brook_core::model::open::OpenOptions;
use brook_core::session::Llm;
use serde_json::Value;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

#[path = "../../../brook-core/tests/common/chat_model.rs"]
mod chat_model;
pub use chat_model::chat_model;

/// Context every test server runs with.
pub const CONTEXT: usize = 2048;

/// The model, built once per test binary and shared by every server in it. Its folder is
/// deleted once it is open (the model holds its files open; the whole thing fits in memory),
/// so no run leaves a model behind in the temp directory.
pub fn llm() -> Arc<Llm> {
    static LLM: OnceLock<Arc<Llm>> = OnceLock::new();
    LLM.get_or_init(|| open_chat(1)).clone()
}

/// The model opened for 4 sequences a step (the batcher on), once per test binary.
pub fn llm_parallel() -> Arc<Llm> {
    static LLM: OnceLock<Arc<Llm>> = OnceLock::new();
    LLM.get_or_init(|| open_chat(4)).clone()
}

fn open_chat(max_seqs: usize) -> Arc<Llm> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = chat_model(dir.path());
    let opts = OpenOptions {
        context: CONTEXT,
        max_seqs,
        ..Default::default()
    };
    Arc::new(Llm::open(&path, opts).expect("open"))
}

/// A server running on its own runtime thread; stopped when dropped.
pub struct TestServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Starts a server for the shared model with `config` on 127.0.0.1 and an ephemeral port.
pub fn start(config: brook_server::Config) -> TestServer {
    start_with(llm(), config)
}

/// Starts a server for `llm` with `config` on 127.0.0.1 and an ephemeral port.
pub fn start_with(llm: Arc<Llm>, config: brook_server::Config) -> TestServer {
    let router = brook_server::router(llm, config).expect("router");
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener =
                brook_server::transport::bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
            addr_tx
                .send(listener.local_addr().expect("addr"))
                .expect("send");
            let stop = async {
                let _ = stop_rx.await;
            };
            brook_server::serve(listener, router, stop)
                .await
                .expect("serve");
        });
    });
    let addr = addr_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("server start");
    TestServer {
        addr,
        stop: Some(stop_tx),
    }
}

/// A server with the default config (model id `chat-model`).
pub fn start_default() -> TestServer {
    start(brook_server::Config::new("chat-model"))
}

/// One parsed HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: body is not JSON ({e}): {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Generous, because the machine may be busy: a stuck test fails instead of hanging.
pub const IO_TIMEOUT: Duration = Duration::from_secs(120);

pub fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s.set_write_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s
}

/// Sends raw bytes on a fresh connection and reads the response until the server closes it.
/// A write the server cut short (it answered before reading everything) is not an error.
pub fn raw(addr: SocketAddr, bytes: &[u8]) -> Resp {
    let mut s = connect(addr);
    let _ = s.write_all(bytes);
    let _ = s.flush();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    parse_response(&out).unwrap_or_else(|| {
        panic!(
            "no HTTP response to {:?}: got {:?}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)]),
            String::from_utf8_lossy(&out)
        )
    })
}

/// The bytes of a request with `Connection: close` and a correct Content-Length.
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        r.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    r.push_str("\r\n");
    let mut b = r.into_bytes();
    b.extend_from_slice(body);
    b
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    raw(addr, &request_bytes(method, path, headers, body))
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"")
}

pub fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

fn parse_response(bytes: &[u8]) -> Option<Resp> {
    let end = bytes.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&bytes[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let rest = &bytes[end + 4..];
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    let body = if chunked {
        let mut r = BufReader::new(rest);
        let mut body = Vec::new();
        while let Some(chunk) = read_chunk(&mut r) {
            body.extend(chunk);
        }
        body
    } else {
        rest.to_vec()
    };
    Some(Resp {
        status,
        headers,
        body,
    })
}

/// One chunk of a chunked body; `None` at the last (empty) chunk or the end of input.
fn read_chunk(r: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let size = usize::from_str_radix(line.trim().split(';').next()?, 16).ok()?;
    if size == 0 {
        return None;
    }
    let mut chunk = vec![0; size];
    r.read_exact(&mut chunk).ok()?;
    let mut crlf = [0; 2];
    r.read_exact(&mut crlf).ok()?;
    Some(chunk)
}

/// A streamed (SSE) response read event by event as it arrives.
pub struct SseStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    buf: String,
}

impl SseStream {
    /// Posts `body` to `path` and reads the response head.
    pub fn open(addr: SocketAddr, path: &str, body: &Value) -> Self {
        let mut s = connect(addr);
        let req = request_bytes(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        );
        s.write_all(&req).expect("write");
        let mut reader = BufReader::new(s);
        let mut head = String::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).expect("read head");
            if line == "\r\n" || line.is_empty() {
                break;
            }
            head.push_str(&line);
        }
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|s| s.parse().ok())
            .expect("status line");
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        Self {
            status,
            headers,
            reader,
            buf: String::new(),
        }
    }

    /// The next `data:` payload (comments skipped); `None` when the stream ends.
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..i + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                return Some(data.join("\n"));
            }
            let chunk = read_chunk(&mut self.reader)?;
            self.buf.push_str(&String::from_utf8_lossy(&chunk));
        }
    }

    /// Every remaining payload.
    pub fn rest(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next_data()).collect()
    }

    /// Closes the connection (the client goes away).
    pub fn disconnect(self) {
        let _ = self.reader.get_ref().shutdown(std::net::Shutdown::Both);
    }
}

/// A short greedy chat request body (non-thinking, so the text is content).
pub fn chat_body(user: &str, max_tokens: u64) -> Value {
    serde_json::json!({
        "model": "chat-model",
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "enable_thinking": false,
    })
}

/// Serialises the tests of one binary that need the model to themselves (timing tests).
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}
