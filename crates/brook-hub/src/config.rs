//! Where the Hub is, who we are and where files go: the only module that reads the environment.
//!
//! Mirrors `huggingface_hub.constants` so that brook and the Python tools agree on every path:
//! `HF_ENDPOINT` (default <https://huggingface.co>), `HF_HOME` (default
//! `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`), `HF_HUB_CACHE` (legacy
//! `HUGGINGFACE_HUB_CACHE`, default `$HF_HOME/hub`), and the token from `HF_TOKEN` (legacy
//! `HUGGING_FACE_HUB_TOKEN`), else the file at `HF_TOKEN_PATH` (default `$HF_HOME/token`, which
//! `hf auth login` writes). `HF_HUB_OFFLINE=1` refuses every request.
//!
//! Tests build a [`HubConfig`] with [`HubConfig::from_vars`] over their own map, so nothing here
//! depends on the process environment of a test binary whose tests run in parallel.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The public Hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Everything a [`crate::Hub`] needs to know.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Base URL without a trailing slash, e.g. `https://huggingface.co`.
    pub endpoint: String,
    /// Sent as `Authorization: Bearer …` to the endpoint (never to a CDN on another host).
    pub token: Option<Token>,
    /// The Hub cache root holding `models--{org}--{name}/` folders.
    pub cache_dir: PathBuf,
    /// Files downloaded at once.
    pub threads: usize,
    /// Times one file's download is resumed after a dropped connection before giving up.
    pub retries: u32,
    /// Pause before the first retry; doubled for each further one.
    pub retry_delay: Duration,
    /// `HF_HUB_OFFLINE` is set: refuse to touch the network.
    pub offline: bool,
    /// Proxy for every request: `HTTPS_PROXY` (`HTTP_PROXY` for an http endpoint), else
    /// `ALL_PROXY`; none when `NO_PROXY` names the endpoint's host.
    pub proxy: Option<String>,
    pub user_agent: String,
}

/// An access token and where it came from, so errors can name the variable or file to fix.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    value: String,
    pub source: TokenSource,
}

/// Where a [`Token`] was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// The named environment variable (`HF_TOKEN` or the legacy `HUGGING_FACE_HUB_TOKEN`).
    Env(&'static str),
    /// A token file (`HF_TOKEN_PATH`, default `$HF_HOME/token`).
    File(PathBuf),
    /// Given by the program.
    Explicit,
}

impl Token {
    /// A token given by the program.
    pub fn new(value: impl Into<String>) -> Self {
        Token {
            value: value.into(),
            source: TokenSource::Explicit,
        }
    }

    /// The secret itself.
    pub fn value(&self) -> &str {
        &self.value
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token(<redacted>, from {})", self.source)
    }
}

impl std::fmt::Display for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSource::Env(var) => write!(f, "{var}"),
            TokenSource::File(p) => write!(f, "token file {} (HF_TOKEN_PATH)", p.display()),
            TokenSource::Explicit => write!(f, "the configured token"),
        }
    }
}

impl HubConfig {
    /// The configuration the process environment describes.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var_os(k))
    }

    /// The configuration described by `var`, a lookup standing in for the environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Self {
        let get = |k: &str| var(k).filter(|v| !v.is_empty());
        let home = get("HOME").map(PathBuf::from);
        let path = |k: &str| get(k).map(|v| expand_home(PathBuf::from(v), home.as_deref()));
        let hf_home = path("HF_HOME").unwrap_or_else(|| {
            path("XDG_CACHE_HOME")
                .or_else(|| home.as_ref().map(|h| h.join(".cache")))
                .unwrap_or_else(|| PathBuf::from(".cache"))
                .join("huggingface")
        });
        let cache_dir = path("HF_HUB_CACHE")
            .or_else(|| path("HUGGINGFACE_HUB_CACHE"))
            .unwrap_or_else(|| hf_home.join("hub"));
        let token_path = path("HF_TOKEN_PATH").unwrap_or_else(|| hf_home.join("token"));
        let from_env = |name: &'static str| {
            let v = get(name)?.to_string_lossy().trim().to_string();
            (!v.is_empty()).then_some(Token {
                value: v,
                source: TokenSource::Env(name),
            })
        };
        let token = from_env("HF_TOKEN")
            .or_else(|| from_env("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| read_token_file(&token_path));
        let endpoint = get("HF_ENDPOINT")
            .map(|v| v.to_string_lossy().trim_end_matches('/').to_string())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let offline = get("HF_HUB_OFFLINE").is_some_and(|v| is_true(&v.to_string_lossy()));
        let proxy = proxy_for(&endpoint, |k| {
            get(k).map(|v| v.to_string_lossy().into_owned())
        });
        HubConfig {
            endpoint,
            token,
            cache_dir,
            threads: 4,
            retries: 5,
            retry_delay: Duration::from_secs(1),
            offline,
            proxy,
            user_agent: format!("brook/{}", env!("CARGO_PKG_VERSION")),
        }
    }
}

/// `~/x` → `$HOME/x`, as `os.path.expanduser` does for huggingface_hub.
fn expand_home(p: PathBuf, home: Option<&Path>) -> PathBuf {
    match (p.strip_prefix("~"), home) {
        (Ok(rest), Some(h)) => h.join(rest),
        _ => p,
    }
}

fn read_token_file(path: &Path) -> Option<Token> {
    let text = std::fs::read_to_string(path).ok()?;
    let value = text.trim().to_string();
    (!value.is_empty()).then(|| Token {
        value,
        source: TokenSource::File(path.to_path_buf()),
    })
}

/// The proxy URL the usual variables give for `endpoint`, as curl reads them.
fn proxy_for(endpoint: &str, get: impl Fn(&str) -> Option<String>) -> Option<String> {
    let scheme = if endpoint.starts_with("http://") {
        "HTTP"
    } else {
        "HTTPS"
    };
    let var =
        |k: &str| get(&format!("{k}_PROXY")).or_else(|| get(&format!("{k}_proxy").to_lowercase()));
    let proxy = var(scheme).or_else(|| var("ALL"))?;
    let host = endpoint.split("://").nth(1).unwrap_or(endpoint);
    let host = host.split(['/', ':']).next().unwrap_or(host);
    let bypass = var("NO").unwrap_or_default();
    let skip = bypass.split(',').map(str::trim).any(|e| {
        let e = e.trim_start_matches('.');
        e == "*" || (!e.is_empty() && (host == e || host.ends_with(&format!(".{e}"))))
    });
    (!skip).then_some(proxy)
}

/// huggingface_hub's `_is_true`: 1, ON, YES, TRUE in any case.
fn is_true(v: &str) -> bool {
    matches!(v.to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> HubConfig {
        let map: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        HubConfig::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_follow_huggingface_hub() {
        let c = cfg(&[("HOME", "/home/u")]);
        assert_eq!(c.endpoint, "https://huggingface.co");
        assert_eq!(c.cache_dir, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert!(c.token.is_none());
        assert!(!c.offline);
        let c = cfg(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/x")]);
        assert_eq!(c.cache_dir, PathBuf::from("/x/huggingface/hub"));
    }

    #[test]
    fn hub_cache_and_home_override_in_order() {
        let c = cfg(&[("HF_HOME", "~/hf"), ("HOME", "/h")]);
        assert_eq!(c.cache_dir, PathBuf::from("/h/hf/hub"));
        let c = cfg(&[("HF_HOME", "/hf"), ("HF_HUB_CACHE", "/cache")]);
        assert_eq!(c.cache_dir, PathBuf::from("/cache"));
        let c = cfg(&[
            ("HF_ENDPOINT", "http://mirror.local/"),
            ("HF_HUB_OFFLINE", "yes"),
        ]);
        assert_eq!(c.endpoint, "http://mirror.local");
        assert!(c.offline);
    }

    #[test]
    fn proxy_variables_are_read_like_curl() {
        let c = cfg(&[("HTTPS_PROXY", "http://p:3128"), ("HTTP_PROXY", "http://q")]);
        assert_eq!(c.proxy.as_deref(), Some("http://p:3128"));
        let c = cfg(&[
            ("all_proxy", "http://a"),
            ("HF_ENDPOINT", "http://127.0.0.1:9"),
        ]);
        assert_eq!(c.proxy.as_deref(), Some("http://a"));
        let c = cfg(&[
            ("HTTPS_PROXY", "http://p"),
            ("NO_PROXY", "localhost,.huggingface.co"),
        ]);
        assert_eq!(c.proxy, None);
        assert_eq!(cfg(&[]).proxy, None);
    }

    #[test]
    fn token_comes_from_env_then_token_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("token"), "hf_file\n").expect("write");
        let home = dir.path().to_str().expect("utf8");
        let c = cfg(&[("HF_HOME", home)]);
        let t = c.token.expect("token from file");
        assert_eq!(t.value(), "hf_file");
        assert_eq!(t.source, TokenSource::File(dir.path().join("token")));
        let c = cfg(&[("HF_HOME", home), ("HF_TOKEN", " hf_env ")]);
        let t = c.token.expect("token from env");
        assert_eq!(
            (t.value(), &t.source),
            ("hf_env", &TokenSource::Env("HF_TOKEN"))
        );
        assert!(
            !format!("{t:?}").contains("hf_env"),
            "Debug must not print the secret"
        );
        let c = cfg(&[("HF_HOME", home), ("HF_TOKEN_PATH", "/nonexistent/token")]);
        assert!(c.token.is_none());
    }
}
