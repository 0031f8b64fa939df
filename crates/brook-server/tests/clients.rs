//! Real clients against a running server: the official `openai` Python package
//! (tests/python/test_openai.py) and the chat page in headless Chromium driven by
//! playwright-core (tests/browser/chat_page.mjs).
//!
//! Where to find them comes from the environment, as .ci/run sets it up:
//! - `BROOK_TEST_PYTHON`: a Python with `openai` installed (default `python3`);
//! - `BROOK_TEST_BROWSER_DIR`: a folder with `node_modules/playwright-core` (default
//!   tests/browser, after `npm ci` there), `BROOK_TEST_NODE` (default `node`) and
//!   `BROOK_TEST_CHROMIUM` (default `/usr/bin/chromium`).
//!
//! Without them a test prints a SKIP notice and passes, for local runs; with
//! `BROOK_REQUIRE_CLIENT_TESTS=1` (set by .ci/run) a missing client fails the test instead.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Each client script must finish within this (they take seconds; the margin is for a busy
/// machine).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(300);

fn here() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests")
}

/// Skips (or, in CI, fails) when a client is missing.
fn missing(what: &str, how: &str) {
    if std::env::var("BROOK_REQUIRE_CLIENT_TESTS").is_ok_and(|v| v == "1") {
        panic!("{what} is required (BROOK_REQUIRE_CLIENT_TESTS=1) but missing: {how}");
    }
    eprintln!(
        "SKIP: {what} not run: {how}. .ci/run installs it; see the header of tests/clients.rs"
    );
}

fn works(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `cmd` to completion (killed after [`CLIENT_TIMEOUT`]), echoing its output; true on
/// success.
fn run(mut cmd: Command) -> bool {
    let t = Instant::now();
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn client");
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if t.elapsed() > CLIENT_TIMEOUT {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = child.wait_with_output().expect("output");
    eprintln!("{}", String::from_utf8_lossy(&out.stdout));
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("client ran {:.1} s", t.elapsed().as_secs_f64());
    status.is_some_and(|s| s.success())
}

#[test]
fn official_openai_python_client() {
    let python = std::env::var("BROOK_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    if !works(Command::new(&python).args(["-c", "import openai"])) {
        return missing(
            "the openai Python client test",
            &format!(
                "`{python} -c \"import openai\"` failed; set BROOK_TEST_PYTHON to a Python with `pip install -r crates/brook-server/tests/python/requirements.txt`"
            ),
        );
    }
    let _g = common::exclusive();
    let server = common::start_default();
    let mut cmd = Command::new(&python);
    cmd.arg(here().join("python/test_openai.py"))
        .env("BROOK_BASE_URL", format!("http://{}/v1", server.addr))
        .env("BROOK_MODEL", "chat-model")
        .env("PYTHONDONTWRITEBYTECODE", "1");
    assert!(run(cmd), "the openai client tests failed (output above)");
}

#[test]
fn chat_page_in_headless_chromium() {
    let dir = std::env::var_os("BROOK_TEST_BROWSER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| here().join("browser"));
    let node = std::env::var("BROOK_TEST_NODE").unwrap_or_else(|_| "node".into());
    let chromium =
        std::env::var("BROOK_TEST_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if !dir.join("node_modules/playwright-core").is_dir() {
        return missing(
            "the browser test",
            &format!(
                "no node_modules/playwright-core in {} (run `npm ci` there)",
                dir.display()
            ),
        );
    }
    if !Path::new(&chromium).exists() {
        return missing(
            "the browser test",
            &format!(
                "no Chromium at {chromium} (apt-get install chromium, or set BROOK_TEST_CHROMIUM)"
            ),
        );
    }
    if !works(Command::new(&node).arg("--version")) {
        return missing(
            "the browser test",
            &format!("`{node}` does not run (set BROOK_TEST_NODE)"),
        );
    }
    let _g = common::exclusive();
    let server = common::start_default();
    let mut cmd = Command::new(&node);
    cmd.arg(here().join("browser/chat_page.mjs"))
        .arg(format!("http://{}/", server.addr))
        .env("BROOK_TEST_BROWSER_DIR", &dir)
        .env("BROOK_TEST_CHROMIUM", &chromium);
    assert!(run(cmd), "the browser test failed (output above)");
}
