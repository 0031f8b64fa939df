//! Small file helpers for reading what strangers wrote: whole files with a size cap, and names
//! that must stay inside a folder.

use std::io::Read;
use std::path::{Component, Path};

/// Reads a whole file of at most `max` bytes; a larger one is refused before it is read (a
/// sidecar file that size is corrupt or hostile, and reading it would take that much memory).
/// The refusal is an `InvalidData` I/O error that names the size and the cap.
pub fn read_capped(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let too_big = |n: u64| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "the file is {n} bytes; files of this kind are never above {} MiB, so this one is corrupt or not what its name says",
                max >> 20
            ),
        )
    };
    if len > max {
        return Err(too_big(len));
    }
    let mut out = Vec::with_capacity(len as usize);
    // The file may grow while it is read: never take more than the cap.
    f.take(max + 1).read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(too_big(out.len() as u64));
    }
    Ok(out)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_capped_string(path: &Path, max: u64) -> std::io::Result<String> {
    String::from_utf8(read_capped(path, max)?).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the file is not UTF-8 text",
        )
    })
}

/// Caps of the files read whole: JSON configs and templates, tokenizers, and indexes and
/// manifests (which list every tensor or expert hash). Each is many times the largest real one.
pub const MAX_CONFIG: u64 = 16 << 20;
pub const MAX_TOKENIZER: u64 = 256 << 20;
pub const MAX_INDEX: u64 = 256 << 20;

/// Whether a file name from a manifest stays inside its folder: relative, not empty, and made
/// only of plain components (no `..`, no root, no `.`-only path).
pub fn is_confined(name: &str) -> bool {
    let p = Path::new(name);
    !name.is_empty()
        && !name.contains('\0')
        && p.components().all(|c| matches!(c, Component::Normal(_)))
        && p.components().next().is_some()
}

/// Flushes a directory's entries (a rename or a new file in it) to disk, so a crash after the
/// call cannot lose them. Errors are ignored: some filesystems cannot sync a directory.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Renames `from` to `to` and makes the rename durable (the parent directory synced).
pub fn rename_durable(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::rename(from, to)?;
    if let Some(parent) = to.parent() {
        sync_dir(parent);
    }
    Ok(())
}

/// Swaps two existing paths in one step (Linux `renameat2(RENAME_EXCHANGE)`), so no reader
/// ever finds `b` missing; `Ok(false)` where the filesystem cannot (the caller falls back).
pub fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in a path"))
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two valid NUL-terminated paths; the call only renames.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        if let Some(parent) = b.parent() {
            sync_dir(parent);
        }
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => Ok(false),
        _ => Err(e),
    }
}

/// Bytes free to this user on the filesystem holding `dir` (or its nearest existing parent).
pub fn free_space(dir: &Path) -> std::io::Result<u64> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let mut at = dir;
    while !at.exists() {
        at = at.parent().unwrap_or(Path::new("/"));
        if at.as_os_str().is_empty() {
            at = Path::new(".");
        }
    }
    let c = CString::new(at.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in a path"))?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; `c` is NUL-terminated.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}

/// Refuses to start writing `need` bytes into `dir` when its filesystem has less free (plus a
/// margin of 64 MiB): better a clear error before than a full disk halfway through.
pub fn ensure_free_space(dir: &Path, need: u64, what: &str) -> std::io::Result<()> {
    const MARGIN: u64 = 64 << 20;
    let free = free_space(dir)?;
    if free < need.saturating_add(MARGIN) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            format!(
                "{what} needs {:.2} GB more but the disk has {:.2} GB free; free some space or choose a folder on another disk",
                need as f64 / 1e9,
                free as f64 / 1e9
            ),
        ));
    }
    Ok(())
}

/// The message a caught panic carries (`panic!("...")` gives a `&str` or a `String`).
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_outside_the_folder_are_refused() {
        for ok in ["dense.safetensors", "experts/layer-000.bin", "a/b/c"] {
            assert!(is_confined(ok), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "experts/../../x",
            ".",
            "./",
            "a/./b/..",
            "a\0b",
        ] {
            assert!(!is_confined(bad), "{bad}");
        }
    }

    #[test]
    fn exchange_swaps_two_folders_in_one_step() {
        let dir = tempfile::tempdir().expect("tmp");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a).expect("a");
        std::fs::create_dir_all(&b).expect("b");
        std::fs::write(a.join("which"), "a").expect("write");
        std::fs::write(b.join("which"), "b").expect("write");
        if exchange(&a, &b).expect("exchange") {
            assert_eq!(std::fs::read_to_string(a.join("which")).expect("read"), "b");
            assert_eq!(std::fs::read_to_string(b.join("which")).expect("read"), "a");
        }
        assert!(free_space(dir.path()).expect("statvfs") > 0);
        assert!(free_space(&dir.path().join("not/yet")).expect("nearest parent") > 0);
    }

    #[test]
    fn a_file_over_the_cap_is_refused_unread() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("big.json");
        std::fs::write(&p, vec![b' '; 4096]).expect("write");
        assert_eq!(read_capped(&p, 4096).expect("at the cap").len(), 4096);
        let e = read_capped(&p, 4095).expect_err("over the cap");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("4096 bytes"), "{e}");
    }
}
