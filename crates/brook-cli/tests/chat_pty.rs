//! `brook chat` driven through a pseudo-terminal: a question, a streamed answer, Ctrl-C in the
//! middle of an answer, `/reset`, and leaving.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "../../brook-core/tests/common/chat_model.rs"]
mod chat_model;
use chat_model::chat_model;

struct Pty {
    master: std::fs::File,
    output: Arc<Mutex<String>>,
}

impl Pty {
    fn send(&mut self, s: &str) {
        self.master.write_all(s.as_bytes()).expect("write to pty");
    }

    fn text(&self) -> String {
        self.output.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits until the output after `from` bytes satisfies `pred`.
    fn wait(&self, from: usize, what: &str, pred: impl Fn(&str) -> bool) -> usize {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let t = self.text();
            if t.len() >= from && pred(&t[from..]) {
                return t.len();
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; output:\n{t}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn chat_in_a_terminal_streams_resets_and_stops_on_ctrl_c() {
    let dir = tempfile::tempdir().expect("tmp");
    let model = chat_model(dir.path());
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two fds into the given ints; the name/termios/winsize are null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty");
    // SAFETY: both fds were just returned by openpty and are owned here.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_brook"));
    cmd.args(["chat", "--model"])
        .arg(&model)
        .args([
            "--max-tokens",
            "100000",
            "--temperature",
            "0",
            "--context",
            "8192",
        ])
        .stdin(Stdio::from(slave.try_clone().expect("dup")))
        .stdout(Stdio::from(slave.try_clone().expect("dup")))
        .stderr(Stdio::from(slave));
    // SAFETY: setsid and TIOCSCTTY are async-signal-safe; they make the pty the child's
    // controlling terminal so Ctrl-C on it sends SIGINT to the child.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("spawn brook chat");
    // The parent's copies of the slave side must close, or the reader never sees EOF.
    drop(cmd);
    let master = std::fs::File::from(master);
    let output = Arc::new(Mutex::new(String::new()));
    let reader = {
        let (mut m, out) = (master.try_clone().expect("dup"), output.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = m.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut s) = out.lock() {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        })
    };
    let mut pty = Pty { master, output };

    let at = pty.wait(0, "the first prompt", |t| t.contains(">>> "));
    pty.send("Hello, who are you?\r");
    // A streamed answer: output keeps growing past the echoed question.
    let at = pty.wait(at, "the answer to stream", |t| {
        t.len() > "Hello, who are you?\r\n".len() + 40
    });
    pty.send("\x03"); // Ctrl-C mid-answer
    let at = pty.wait(at, "the stopped answer and a new prompt", |t| {
        t.contains("[stopped]") && t.contains(">>> ")
    });
    pty.send("/reset\r");
    let at = pty.wait(at, "the reset", |t| {
        t.contains("conversation reset") && t.contains(">>> ")
    });
    pty.send("Tell me a story.\r");
    let at = pty.wait(at, "the second answer", |t| t.len() > 60);
    pty.send("\x03");
    let at = pty.wait(at, "the second stop", |t| {
        t.contains("[stopped]") && t.contains(">>> ")
    });
    pty.send("/stats\r");
    let at = pty.wait(at, "stats", |t| t.contains("tok/s") && t.contains(">>> "));
    pty.send("/bye\r");
    let _ = at;
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "brook chat did not exit:\n{}",
            pty.text()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}:\n{}", pty.text());
    assert!(!pty.text().contains("panicked"));
    drop(pty);
    let _ = reader.join();
}
