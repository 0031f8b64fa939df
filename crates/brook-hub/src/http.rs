//! HTTP plumbing: one ureq agent, GETs with the Hub's headers, redirects followed by hand, and
//! unsuccessful statuses turned into [`Error`]s.
//!
//! Redirects are followed here rather than by ureq so that the token goes only to the endpoint's
//! own host: the Hub answers `resolve` for LFS files with a redirect to a signed CDN URL, and
//! huggingface_hub drops `authorization` when the host changes; so do we.

use std::time::Duration;

use crate::Hub;
use crate::error::{Error, Result};

pub(crate) type Response = ureq::http::Response<ureq::Body>;

/// Redirects followed for one request (the Hub uses one, two after a repo rename).
const MAX_REDIRECTS: usize = 5;

/// What the repository lookup was about, to name it in errors.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Subject<'a> {
    pub repo: &'a str,
    pub revision: &'a str,
}

/// The headers of the Hub's own (first) answer for a file, before any CDN redirect.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct FileHeaders {
    /// `X-Repo-Commit`.
    pub commit: Option<String>,
    /// `X-Linked-Etag` (LFS: the sha256) or else `ETag`, without quotes or `W/`.
    pub etag: Option<String>,
    /// `X-Linked-Size`.
    pub size: Option<u64>,
}

pub(crate) fn agent(cfg: &crate::HubConfig) -> ureq::Agent {
    let proxy = cfg
        .proxy
        .as_deref()
        .and_then(|p| match ureq::Proxy::new(p) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!("ignoring proxy `{p}`: {e}");
                None
            }
        });
    ureq::Agent::config_builder()
        .proxy(proxy)
        .http_status_as_error(false)
        .max_redirects(0)
        .max_redirects_will_error(false)
        .user_agent(cfg.user_agent.as_str())
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        // A stalled transfer is a network error, retried with a Range request.
        .timeout_per_read(Some(Duration::from_secs(60)))
        .build()
        .into()
}

/// GETs `url` (from byte `from` on when non-zero), following redirects; returns the final
/// response, successful or not, and the headers of the first one.
pub(crate) fn get(hub: &Hub, url: &str, from: u64) -> Result<(Response, FileHeaders)> {
    let cfg = hub.config();
    if cfg.offline {
        return Err(Error::Offline);
    }
    let home = origin(&cfg.endpoint).to_string();
    let mut url = url.to_string();
    let mut first = None;
    for _ in 0..=MAX_REDIRECTS {
        let mut req = hub.agent.get(&url).header("Accept-Encoding", "identity");
        if let Some(t) = cfg.token.as_ref().filter(|_| origin(&url) == home) {
            req = req.header("Authorization", format!("Bearer {}", t.value()));
        }
        if from > 0 {
            req = req.header("Range", format!("bytes={from}-"));
        }
        let resp = req.call().map_err(|e| network(&url, &e.to_string()))?;
        let first = first.get_or_insert_with(|| file_headers(&resp));
        if !resp.status().is_redirection() {
            return Ok((resp, first.clone()));
        }
        let loc = header(&resp, "location").ok_or_else(|| Error::Protocol {
            url: url.clone(),
            reason: format!("HTTP {} without a Location header", resp.status().as_u16()),
        })?;
        url = join_url(&url, &loc);
    }
    Err(Error::Protocol {
        url,
        reason: format!("more than {MAX_REDIRECTS} redirects"),
    })
}

/// Passes a successful response through; turns any other into the error it means.
pub(crate) fn check(hub: &Hub, resp: Response, url: &str, what: Subject<'_>) -> Result<Response> {
    let status = resp.status().as_u16();
    if resp.status().is_success() {
        return Ok(resp);
    }
    let cfg = hub.config();
    let token = cfg.token.as_ref().map(|t| t.source.clone());
    let code = header(&resp, "x-error-code").unwrap_or_default();
    let mut message = header(&resp, "x-error-message").unwrap_or_default();
    if message.is_empty() {
        message = error_body(resp);
    }
    let repo = what.repo.to_string();
    let endpoint = cfg.endpoint.clone();
    Err(match code.as_str() {
        "RepoNotFound" => Error::RepoNotFound {
            repo,
            endpoint,
            token,
        },
        "RevisionNotFound" => Error::RevisionNotFound {
            repo,
            revision: what.revision.to_string(),
        },
        "GatedRepo" => Error::Gated {
            repo,
            endpoint,
            token,
        },
        _ if status == 404 && url.contains("/api/models/") => Error::RepoNotFound {
            repo,
            endpoint,
            token,
        },
        _ if status == 401 || status == 403 => Error::Unauthorized {
            url: url.to_string(),
            status,
            token,
        },
        _ => Error::Http {
            url: url.to_string(),
            status,
            message,
        },
    })
}

/// The `{"error": "..."}` message of an error body, or its first line.
fn error_body(resp: Response) -> String {
    let text = resp
        .into_body()
        .with_config()
        .limit(64 * 1024)
        .read_to_string()
        .unwrap_or_default();
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_else(|| text.lines().next().unwrap_or_default().trim().to_string())
}

pub(crate) fn header(resp: &Response, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn file_headers(resp: &Response) -> FileHeaders {
    let etag = header(resp, "x-linked-etag").or_else(|| header(resp, "etag"));
    FileHeaders {
        commit: header(resp, "x-repo-commit"),
        // huggingface_hub's `_normalize_etag`: drop a weak `W/` prefix and the quotes.
        etag: etag.map(|e| e.trim_start_matches("W/").trim_matches('"').to_string()),
        size: header(resp, "x-linked-size").and_then(|s| s.trim().parse().ok()),
    }
}

pub(crate) fn network(url: &str, reason: &str) -> Error {
    Error::Network {
        url: url.to_string(),
        reason: reason.to_string(),
    }
}

/// `scheme://host[:port]` of `url`.
fn origin(url: &str) -> &str {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..].find('/').map_or(url.len(), |i| start + i);
    &url[..end]
}

/// `loc` (a Location header) taken relative to `base`.
fn join_url(base: &str, loc: &str) -> String {
    if loc.contains("://") {
        loc.to_string()
    } else if loc.starts_with('/') {
        format!("{}{loc}", origin(base))
    } else {
        let path_end = base.find('?').unwrap_or(base.len());
        let dir = base[..path_end].rfind('/').map_or(base, |i| &base[..=i]);
        format!("{dir}{loc}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_targets_resolve_like_a_browser() {
        let base = "https://huggingface.co/org/m/resolve/main/config.json";
        assert_eq!(origin(base), "https://huggingface.co");
        assert_eq!(
            join_url(base, "https://cdn-lfs.hf.co/x?sig=1"),
            "https://cdn-lfs.hf.co/x?sig=1"
        );
        assert_eq!(
            join_url(base, "/api/resolve-cache/x"),
            "https://huggingface.co/api/resolve-cache/x"
        );
        assert_eq!(
            join_url(base, "other.json"),
            "https://huggingface.co/org/m/resolve/main/other.json"
        );
        assert_eq!(origin("http://127.0.0.1:8080"), "http://127.0.0.1:8080");
    }
}
