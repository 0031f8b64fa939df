//! A mock Hugging Face Hub on 127.0.0.1 for tests, speaking the real API's shapes:
//!
//! - `GET /api/models/{repo}/revision/{rev}?blobs=true`: `{"id","sha","siblings":[{"rfilename",
//!   "size","blobId","lfs":{"sha256","size","pointerSize"}}]}`;
//! - `GET /{repo}/resolve/{rev}/{path}`: small files served directly with `ETag` (git sha1) and
//!   `X-Repo-Commit`; LFS files answered `302` to a CDN on another port, with `X-Linked-Etag`
//!   (sha256) and `X-Linked-Size`, as huggingface.co redirects to its CDN;
//! - `Range: bytes=N-` answered `206` with `Content-Range`;
//! - errors with the Hub's `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `GatedRepo`).
//!
//! Faults for the tests: drop the connection after N bytes of a file, serve a file corrupted.
//! Every request and every body byte served is recorded. Dropping the [`MockHub`] stops both
//! listeners and joins every thread.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use sha1::Digest;

pub struct MockFile {
    pub path: String,
    pub data: Vec<u8>,
    pub lfs: bool,
}

pub struct MockRepo {
    pub id: String,
    pub commit: String,
    pub files: Vec<MockFile>,
    /// When set, every request must carry `Authorization: Bearer {token}` (a gated repo).
    pub token: Option<String>,
}

impl MockRepo {
    /// A repo holding every file of `dir`; `*.safetensors` are LFS files.
    pub fn from_dir(id: &str, dir: &Path) -> Self {
        let mut files: Vec<MockFile> = std::fs::read_dir(dir)
            .expect("fixture dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.is_file())
            .map(|p| {
                let path = p.file_name().expect("name").to_string_lossy().into_owned();
                MockFile {
                    lfs: path.ends_with(".safetensors"),
                    data: std::fs::read(&p).expect("read fixture"),
                    path,
                }
            })
            .collect();
        files.sort_by(|a, b| a.path.cmp(&b.path));
        MockRepo {
            id: id.to_string(),
            commit: hex(&sha1::Sha1::digest(id.as_bytes())),
            files,
            token: None,
        }
    }

    fn file(&self, path: &str) -> Option<&MockFile> {
        self.files.iter().find(|f| f.path == path)
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn sha256(data: &[u8]) -> String {
    hex(&sha2::Sha256::digest(data))
}

/// git's blob id: sha1 of `blob {len}\0` + content.
pub fn git_sha1(data: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", data.len()).as_bytes());
    h.update(data);
    hex(&h.finalize())
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub port: u16,
    pub path: String,
    pub range: Option<String>,
    pub auth: Option<String>,
}

#[derive(Default)]
struct Faults {
    /// (file, bytes): the next transfer of `file` stops after `bytes` body bytes.
    drop_after: Option<(String, usize)>,
    corrupt: Option<String>,
}

struct State {
    repos: Vec<MockRepo>,
    hub_port: u16,
    cdn_port: u16,
    faults: Mutex<Faults>,
    served: Mutex<HashMap<String, u64>>,
    seen: Mutex<Vec<Seen>>,
}

pub struct MockHub {
    state: Arc<State>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl MockHub {
    pub fn start(repos: Vec<MockRepo>) -> Self {
        let hub = TcpListener::bind("127.0.0.1:0").expect("bind hub");
        let cdn = TcpListener::bind("127.0.0.1:0").expect("bind cdn");
        let state = Arc::new(State {
            repos,
            hub_port: hub.local_addr().expect("addr").port(),
            cdn_port: cdn.local_addr().expect("addr").port(),
            faults: Mutex::default(),
            served: Mutex::default(),
            seen: Mutex::default(),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let threads = [hub, cdn]
            .into_iter()
            .map(|l| {
                let (state, stop) = (state.clone(), stop.clone());
                std::thread::spawn(move || serve(l, state, stop))
            })
            .collect();
        MockHub {
            state,
            stop,
            threads,
        }
    }

    /// The endpoint, for `HF_ENDPOINT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.state.hub_port)
    }

    /// Body bytes of `file` served so far (directly or by the CDN).
    pub fn served(&self, file: &str) -> u64 {
        let served = self.state.served.lock().expect("lock");
        served.get(file).copied().unwrap_or(0)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().expect("lock").clone()
    }

    pub fn cdn_port(&self) -> u16 {
        self.state.cdn_port
    }

    /// The next transfer of `file` closes the connection after `bytes` body bytes.
    pub fn drop_after(&self, file: &str, bytes: usize) {
        self.state.faults.lock().expect("lock").drop_after = Some((file.to_string(), bytes));
    }

    /// `file` is served with one byte flipped, until further notice.
    pub fn corrupt(&self, file: Option<&str>) {
        self.state.faults.lock().expect("lock").corrupt = file.map(str::to_string);
    }
}

impl Drop for MockHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for port in [self.state.hub_port, self.state.cdn_port] {
            let _ = TcpStream::connect(("127.0.0.1", port));
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve(listener: TcpListener, state: Arc<State>, stop: Arc<AtomicBool>) {
    let mut conns = Vec::new();
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        let state = state.clone();
        conns.push(std::thread::spawn(move || {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            handle(stream, &state);
        }));
    }
    for c in conns {
        let _ = c.join();
    }
}

/// The answer to one request: status, headers, body, and how many body bytes to send.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Stop after this many body bytes and close (a dropped connection).
    cut: Option<usize>,
    /// Which repo file the body is, for the byte count.
    file: Option<String>,
}

impl Reply {
    fn new(status: u16) -> Self {
        Reply {
            status,
            headers: Vec::new(),
            body: Vec::new(),
            cut: None,
            file: None,
        }
    }

    fn header(mut self, k: &str, v: impl Into<String>) -> Self {
        self.headers.push((k.to_string(), v.into()));
        self
    }

    fn error(status: u16, code: &str, message: &str) -> Self {
        let mut r = Reply::new(status)
            .header("X-Error-Code", code)
            .header("X-Error-Message", message)
            .header("Content-Type", "application/json");
        r.body = serde_json::json!({ "error": message })
            .to_string()
            .into_bytes();
        r
    }
}

fn handle(mut stream: TcpStream, state: &State) {
    let Some((path, headers)) = read_request(&stream) else {
        return;
    };
    let port = stream.local_addr().map(|a| a.port()).unwrap_or(0);
    let range = headers.get("range").cloned();
    let auth = headers.get("authorization").cloned();
    state.seen.lock().expect("lock").push(Seen {
        port,
        path: path.clone(),
        range: range.clone(),
        auth: auth.clone(),
    });
    let reply = if port == state.cdn_port {
        cdn(state, &path, range.as_deref())
    } else {
        hub(state, &path, range.as_deref(), auth.as_deref())
    };
    write_reply(&mut stream, state, reply);
}

fn read_request(stream: &TcpStream) -> Option<(String, HashMap<String, String>)> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let path = line.split_whitespace().nth(1)?.to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).ok()? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    Some((path, headers))
}

fn hub(state: &State, path: &str, range: Option<&str>, auth: Option<&str>) -> Reply {
    let path = path.split('?').next().unwrap_or_default();
    let (id, rest, api) = if let Some(p) = path.strip_prefix("/api/models/") {
        match p.split_once("/revision/") {
            Some((id, rev)) => (id, rev, true),
            None => return Reply::new(404),
        }
    } else {
        match path.trim_start_matches('/').split_once("/resolve/") {
            Some((id, rest)) => (id, rest, false),
            None => return Reply::new(404),
        }
    };
    let Some(repo) = state.repos.iter().find(|r| r.id == id) else {
        return Reply::error(404, "RepoNotFound", "Repository not found");
    };
    let wanted = repo.token.as_ref().map(|t| format!("Bearer {t}"));
    if wanted.is_some() && auth != wanted.as_deref() {
        let msg = format!(
            "Access to model {id} is restricted. You must have access to it and be authenticated to access it. Please log in."
        );
        return Reply::error(401, "GatedRepo", &msg);
    }
    let (rev, file) = if api {
        (decode(rest), String::new())
    } else {
        let (rev, file) = rest.split_once('/').unwrap_or((rest, ""));
        (decode(rev), decode(file))
    };
    if rev != "main" && rev != repo.commit {
        return Reply::error(404, "RevisionNotFound", &format!("Invalid rev id: {rev}"));
    }
    if api {
        return revision_json(repo);
    }
    let Some(f) = repo.file(&file) else {
        return Reply::error(404, "EntryNotFound", &format!("{file} does not exist"));
    };
    let r = Reply::new(302).header("X-Repo-Commit", repo.commit.as_str());
    if f.lfs {
        let sha = sha256(&f.data);
        let loc = format!(
            "http://127.0.0.1:{}/cdn/{sha}?X-Amz-Signature=x",
            state.cdn_port
        );
        return r
            .header("ETag", format!("\"{}\"", git_sha1(&f.data)))
            .header("X-Linked-Etag", format!("\"{sha}\""))
            .header("X-Linked-Size", f.data.len().to_string())
            .header("Location", loc);
    }
    let mut r = content(state, f, range);
    r.headers
        .push(("X-Repo-Commit".into(), repo.commit.clone()));
    r.headers
        .push(("ETag".into(), format!("\"{}\"", git_sha1(&f.data))));
    r
}

fn revision_json(repo: &MockRepo) -> Reply {
    let siblings: Vec<serde_json::Value> = repo
        .files
        .iter()
        .map(|f| {
            let mut s = serde_json::json!({
                "rfilename": f.path,
                "size": f.data.len(),
                "blobId": git_sha1(&f.data),
            });
            if f.lfs {
                s["lfs"] = serde_json::json!({
                    "sha256": sha256(&f.data), "size": f.data.len(), "pointerSize": 134
                });
            }
            s
        })
        .collect();
    let json = serde_json::json!({
        "_id": "0", "id": repo.id, "private": false, "sha": repo.commit,
        "siblings": siblings, "tags": ["mlx"],
    });
    let mut r = Reply::new(200).header("Content-Type", "application/json");
    r.body = json.to_string().into_bytes();
    r
}

fn cdn(state: &State, path: &str, range: Option<&str>) -> Reply {
    let sha = path
        .trim_start_matches("/cdn/")
        .split('?')
        .next()
        .unwrap_or_default();
    let file = state
        .repos
        .iter()
        .flat_map(|r| &r.files)
        .find(|f| f.lfs && sha256(&f.data) == sha);
    match file {
        Some(f) => content(state, f, range),
        None => Reply::new(404),
    }
}

/// A file's bytes, honouring `Range: bytes=N-` and the faults.
fn content(state: &State, f: &MockFile, range: Option<&str>) -> Reply {
    let mut data = f.data.clone();
    let mut faults = state.faults.lock().expect("lock");
    if faults.corrupt.as_deref() == Some(f.path.as_str()) {
        let mid = data.len() / 2;
        data[mid] ^= 0xff;
    }
    let from = range
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.trim_end_matches('-').parse::<usize>().ok());
    let mut r = match from {
        Some(n) if n >= data.len() => return Reply::new(416),
        Some(n) => Reply::new(206).header(
            "Content-Range",
            format!("bytes {n}-{}/{}", data.len() - 1, data.len()),
        ),
        None => Reply::new(200),
    };
    r.body = data.split_off(from.unwrap_or(0));
    if faults
        .drop_after
        .as_ref()
        .is_some_and(|(p, _)| *p == f.path)
    {
        r.cut = faults.drop_after.take().map(|(_, n)| n);
    }
    r.file = Some(f.path.clone());
    r.header("Accept-Ranges", "bytes")
}

fn write_reply(stream: &mut TcpStream, state: &State, r: Reply) {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        r.status,
        reason(r.status),
        r.body.len()
    );
    for (k, v) in &r.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let send = r.cut.unwrap_or(r.body.len()).min(r.body.len());
    let ok = stream.write_all(head.as_bytes()).is_ok() && stream.write_all(&r.body[..send]).is_ok();
    if let (true, Some(file)) = (ok, r.file) {
        *state.served.lock().expect("lock").entry(file).or_default() += send as u64;
    }
    let _ = stream.flush();
    let _ = stream.shutdown(Shutdown::Both);
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        401 => "Unauthorized",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        _ => "Other",
    }
}

/// Undoes URL percent-encoding.
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = (b[i] == b'%' && i + 2 < b.len() + 1)
            .then(|| s.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(v) => {
                out.push(v);
                i += 3;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
