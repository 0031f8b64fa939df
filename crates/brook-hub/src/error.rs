//! The Hub client's error type: each variant says what went wrong and what to do next.
//!
//! Status codes are read the way huggingface_hub's `hf_raise_for_status` reads them: the Hub's
//! `X-Error-Code` header (`RepoNotFound`, `RevisionNotFound`, `GatedRepo`, `EntryNotFound`)
//! first, then the status.

use std::path::PathBuf;

use crate::config::TokenSource;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a pull can run into.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A repo id that is not `org/name` made of letters, digits, `-`, `_` and `.`.
    #[error(
        "`{0}` is not a Hugging Face repo id (expected org/name, e.g. mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit)"
    )]
    InvalidRepoId(String),

    /// The Hub does not know the repository, or hides it from this (missing) token.
    #[error("repository not found: {repo} on {endpoint}: check the name, or set HF_TOKEN if it is private/gated{}", token_note(.token))]
    RepoNotFound {
        repo: String,
        endpoint: String,
        token: Option<TokenSource>,
    },

    /// The repository exists but the branch, tag or commit does not.
    #[error(
        "revision `{revision}` not found in {repo}: check --revision (a branch, tag or commit hash)"
    )]
    RevisionNotFound { repo: String, revision: String },

    /// A gated repository asked for a token, or refused this one.
    #[error("{repo} is gated: {}", gated_hint(.repo, .endpoint, .token))]
    Gated {
        repo: String,
        endpoint: String,
        token: Option<TokenSource>,
    },

    /// 401 or 403: no token where one is needed, or a token the Hub refused.
    #[error("HTTP {status} from {url}: {}", auth_hint(.token))]
    Unauthorized {
        url: String,
        status: u16,
        token: Option<TokenSource>,
    },

    /// Any other unsuccessful status.
    #[error("HTTP {status} from {url}{}", if .message.is_empty() { String::new() } else { format!(": {}", .message) })]
    Http {
        url: String,
        status: u16,
        message: String,
    },

    /// No connection, or a connection that broke; what was received is kept.
    #[error(
        "network error on {url}: {reason}; check the connection (and HF_ENDPOINT, HTTPS_PROXY), then run again: downloads resume where they stopped"
    )]
    Network { url: String, reason: String },

    /// A response that is not what the Hub API sends.
    #[error("unexpected response from {url}: {reason}")]
    Protocol { url: String, reason: String },

    /// Downloaded bytes that do not match the listing; the partial file has been removed.
    #[error("{file}: {reason}; the bad download was removed, run again to fetch it afresh")]
    Integrity { file: String, reason: String },

    /// No space left for the download.
    #[error("disk full writing {}{}: free some space (or set HF_HUB_CACHE to a larger disk) and run again; finished bytes are kept", .path.display(), space_note(*.needed, *.free))]
    DiskFull {
        path: PathBuf,
        needed: Option<u64>,
        free: Option<u64>,
    },

    /// Any other operating-system error on a named file.
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// `HF_HUB_OFFLINE` is set.
    #[error("HF_HUB_OFFLINE is set, so nothing can be downloaded; unset it to pull")]
    Offline,
}

impl Error {
    /// Wraps an I/O error on `path`, telling a full disk apart.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::StorageFull
            || source.raw_os_error() == Some(libc::ENOSPC)
        {
            return Error::DiskFull {
                path,
                needed: None,
                free: None,
            };
        }
        Error::Io { path, source }
    }

    /// Whether running the same pull again may succeed without changing anything (a dropped
    /// connection, a server error); the download loop retries these.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Network { .. } => true,
            Error::Http { status, .. } => *status == 429 || *status >= 500,
            _ => false,
        }
    }
}

fn token_note(token: &Option<TokenSource>) -> String {
    match token {
        Some(src) => {
            format!(" (a token from {src} was sent: make sure its account can see the repo)")
        }
        None => String::new(),
    }
}

fn gated_hint(repo: &str, endpoint: &str, token: &Option<TokenSource>) -> String {
    match token {
        None => format!(
            "set HF_TOKEN to an access token of an account that accepted its terms at {endpoint}/{repo}"
        ),
        Some(src) => format!(
            "the token from {src} has no access yet; accept the terms at {endpoint}/{repo} with its account"
        ),
    }
}

fn auth_hint(token: &Option<TokenSource>) -> String {
    match token {
        None => "no token was sent; set HF_TOKEN (or log in with `hf auth login`, which writes $HF_HOME/token)".into(),
        Some(src) => format!("the Hub refused the token from {src}; check or replace it"),
    }
}

fn space_note(needed: Option<u64>, free: Option<u64>) -> String {
    match (needed, free) {
        (Some(n), Some(f)) => format!(
            " ({:.2} GB needed, {:.2} GB free)",
            n as f64 / 1e9,
            f as f64 / 1e9
        ),
        _ => String::new(),
    }
}
