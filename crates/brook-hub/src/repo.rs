//! Repository ids (`org/name`) and the few string encodings the Hub's URLs and cache need.

use crate::error::{Error, Result};

/// A checked model repository id such as `mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit`.
///
/// Only what the Hub itself allows gets through (letters, digits, `-`, `_`, `.`; no `..`, at most
/// one `/`), so the id can go into URLs and folder names as it is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RepoId(String);

impl RepoId {
    /// Checks `s`.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || Error::InvalidRepoId(s.to_string());
        let parts: Vec<&str> = s.split('/').collect();
        if parts.len() > 2 || s.len() > 96 {
            return Err(bad());
        }
        for p in &parts {
            let ok_chars = p
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
            if p.is_empty() || !ok_chars || p.contains("..") || p.starts_with(['-', '.']) {
                return Err(bad());
            }
        }
        Ok(RepoId(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The cache folder name: `models--{org}--{name}` (huggingface_hub's `repo_folder_name`).
    pub fn cache_folder(&self) -> String {
        format!("models--{}", self.0.replace('/', "--"))
    }
}

impl std::fmt::Display for RepoId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Percent-encodes `s` for one URL path segment (`/` encoded too when `keep_slash` is false),
/// like Python's `urllib.parse.quote`.
pub(crate) fn quote(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        let plain = b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~');
        if plain || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Whether `s` is a full 40-hex-digit commit hash.
pub(crate) fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `s` is a relative path with no `.`, `..` or empty component, safe to join under a
/// snapshot folder (a hostile listing must not write outside the cache).
pub(crate) fn is_safe_relative(s: &str) -> bool {
    !s.is_empty()
        && !s.contains('\\')
        && !s.contains('\0')
        && s.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_checked() {
        for ok in [
            "mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit",
            "gpt2",
            "a.b/c_d",
        ] {
            assert!(RepoId::parse(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/b/c", "../x", "a/..", "a b/c", "a/", "/a", "a/-x"] {
            assert!(RepoId::parse(bad).is_err(), "{bad}");
        }
        let r = RepoId::parse("mlx-community/Qwen3").expect("valid");
        assert_eq!(r.cache_folder(), "models--mlx-community--Qwen3");
    }

    #[test]
    fn quoting_matches_urllib() {
        assert_eq!(quote("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(quote("dir/a b.json", true), "dir/a%20b.json");
        assert!(is_safe_relative("a/b.json"));
        for bad in ["../x", "a//b", "/abs", "a/./b", ""] {
            assert!(!is_safe_relative(bad), "{bad}");
        }
    }
}
