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
