//! Runs a chat template's render in a forked child process, so that a template from a hostile
//! checkpoint can at worst end its own child: the child has a deadline ([`RENDER_SECS`], by
//! `alarm`), an address-space ceiling ([`RENDER_MEMORY`] above what the process already maps)
//! and its own stack, and answers through a pipe. minijinja bounds instructions (fuel) but not
//! the depth of a value printed by `~` or compared, nor the growth of a string doubled in a
//! loop; in a child, either ends as a clean error instead of the whole process.
//!
//! The child only renders: the template and its context are already built, minijinja takes no
//! lock while it renders, and the allocator survives `fork` (glibc's registers fork handlers;
//! brook's huge-page allocator maps with plain `mmap`). Where `fork` fails, the render runs in
//! the process as before.
//!
//! Cost: a fork copies page tables. brook's large buffers sit on 2 MiB pages, so a render in a
//! process holding 3 GiB of them took 2.3 ms (0.6 ms in a small process; the same 3 GiB on
//! 4 KiB pages, as a program on the system allocator might hold them, 149 ms), measured on
//! dev-2c. A chat request renders twice.

use std::io::{Read, Write};
use std::os::fd::FromRawFd;

use super::{Result, TextError};

/// Longest a render may take.
pub const RENDER_SECS: u32 = 10;
/// Memory a render may map beyond what the process maps already.
pub const RENDER_MEMORY: u64 = 2 << 30;

/// What a render gives back: the prompt, or an error the template raised, or a render error.
enum Answer {
    Ok(String),
    Raised(String),
    Failed(String),
}

/// Runs `render` in a child process and returns its result.
pub(crate) fn render(render: impl FnOnce() -> Result<String>) -> Result<String> {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` is a valid out-array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return render();
    }
    // Read before fork: the child must not touch /proc or allocate more than it needs.
    let mapped = mapped_bytes();
    // SAFETY: the child runs only `child` below and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        // SAFETY: closing the two descriptors pipe2 returned.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        return render();
    }
    if pid == 0 {
        // SAFETY: in the child; `fds[1]` is the write end it owns.
        unsafe {
            libc::close(fds[0]);
            child(fds[1], mapped, render)
        }
    }
    // SAFETY: the parent owns the read end; the write end belongs to the child now.
    unsafe { libc::close(fds[1]) };
    // SAFETY: `fds[0]` is an open descriptor nobody else closes.
    let mut pipe = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    let mut bytes = Vec::new();
    let read = pipe.read_to_end(&mut bytes);
    let mut status = 0;
    // SAFETY: waiting for our own child.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0
        && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
    {}
    let failed = |message: String| TextError::TemplateRender { message };
    if read.is_err() || bytes.is_empty() {
        let why = if libc::WIFSIGNALED(status) {
            match libc::WTERMSIG(status) {
                libc::SIGALRM => format!("it ran longer than {RENDER_SECS} s"),
                libc::SIGSEGV | libc::SIGBUS => {
                    "it recursed until the stack ran out (a value that contains itself?)".into()
                }
                libc::SIGABRT => format!(
                    "it failed inside (out of memory past {} GiB, or a stack overflow)",
                    RENDER_MEMORY >> 30
                ),
                s => format!("it was ended by signal {s}"),
            }
        } else {
            format!("it exited with status {}", libc::WEXITSTATUS(status))
        };
        return Err(failed(format!(
            "the chat template could not render this conversation: {why}; the template is part of the model files"
        )));
    }
    match decode(&bytes) {
        Some(Answer::Ok(s)) => Ok(s),
        Some(Answer::Raised(m)) => Err(TextError::TemplateRaised { message: m }),
        Some(Answer::Failed(m)) => Err(failed(m)),
        None => Err(failed("the template render returned garbage".into())),
    }
}

/// The child: limits, render, answer, `_exit`.
///
/// # Safety
/// Only to be called in a freshly forked child; `fd` is the pipe's write end.
unsafe fn child(fd: i32, mapped: u64, render: impl FnOnce() -> Result<String>) -> ! {
    // SAFETY (whole block): plain system calls on this process; `fd` is ours.
    unsafe {
        libc::signal(libc::SIGALRM, libc::SIG_DFL);
        libc::alarm(RENDER_SECS);
        let lim = libc::rlimit {
            rlim_cur: mapped.saturating_add(RENDER_MEMORY),
            rlim_max: mapped.saturating_add(RENDER_MEMORY),
        };
        libc::setrlimit(libc::RLIMIT_AS, &lim);
        let answer = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(render)) {
            Ok(Ok(s)) => Answer::Ok(s),
            Ok(Err(TextError::TemplateRaised { message })) => Answer::Raised(message),
            Ok(Err(TextError::TemplateRender { message })) => Answer::Failed(message),
            Ok(Err(e)) => Answer::Failed(e.to_string()),
            Err(_) => Answer::Failed("the template render panicked".into()),
        };
        let mut pipe = std::fs::File::from_raw_fd(fd);
        let ok = pipe.write_all(&encode(&answer)).is_ok();
        libc::_exit(if ok { 0 } else { 1 })
    }
}

fn encode(a: &Answer) -> Vec<u8> {
    let (tag, s) = match a {
        Answer::Ok(s) => (b'O', s),
        Answer::Raised(s) => (b'R', s),
        Answer::Failed(s) => (b'F', s),
    };
    let mut out = Vec::with_capacity(s.len() + 1);
    out.push(tag);
    out.extend_from_slice(s.as_bytes());
    out
}

fn decode(b: &[u8]) -> Option<Answer> {
    let (&tag, rest) = b.split_first()?;
    let s = String::from_utf8(rest.to_vec()).ok()?;
    match tag {
        b'O' => Some(Answer::Ok(s)),
        b'R' => Some(Answer::Raised(s)),
        b'F' => Some(Answer::Failed(s)),
        _ => None,
    }
}

/// Bytes this process maps now (VmSize), the base of the child's address-space ceiling.
fn mapped_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        // SAFETY: sysconf has no preconditions.
        .map(|pages| pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64)
        .unwrap_or(u64::MAX / 4)
}
