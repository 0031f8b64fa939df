//! Access control: the API key and, without one, the `Host` check.
//!
//! With a key configured, every `/v1/*` request must carry `Authorization: Bearer <key>`; the
//! page, `/health` and unknown paths stay open. The comparison runs over every byte whatever
//! the first difference, so response time does not tell an attacker how much of a guess was
//! right.
//!
//! Without a key, the server trusts whoever can reach it, which on the default loopback bind
//! is this machine. A web page the user visits can still reach it through DNS rebinding (its
//! own name re-pointed at 127.0.0.1), but its requests then name that page's host. So without
//! a key every request must name a loopback host (`localhost`, `*.localhost`, a loopback
//! address, any port) or one given with `--allowed-host`; others are answered 403. Requests
//! without a `Host` header (no browser sends one) pass.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::App;
use crate::error::ApiError;

pub(crate) async fn require_key(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let Some(key) = app.config.api_key.as_deref() else {
        return next.run(req).await;
    };
    if !req.uri().path().starts_with("/v1") {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        });
    match given {
        None => ApiError::unauthorized(
            "missing API key: send the header `Authorization: Bearer <key>` (the key given to brook serve --api-key)",
        )
        .into_response(),
        Some(g) if !same(g.trim().as_bytes(), key.as_bytes()) => {
            ApiError::unauthorized("incorrect API key").into_response()
        }
        Some(_) => next.run(req).await,
    }
}

pub(crate) async fn check_host(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if app.config.api_key.is_some() {
        return next.run(req).await;
    }
    let host = req
        .headers()
        .get(header::HOST)
        .map(|v| v.to_str().unwrap_or("\u{fffd}"))
        .or_else(|| req.uri().host());
    match host {
        Some(h) if !host_allowed(h, &app.config.allowed_hosts) => {
            let shown: String = h.chars().take(100).collect();
            tracing::warn!("refused a request for host `{shown}`");
            ApiError::status(
                StatusCode::FORBIDDEN,
                format!(
                    "host `{shown}` is not allowed: without --api-key brook serve answers only requests for localhost or a loopback address; add the name with --allowed-host or set an API key"
                ),
            )
            .with_code("host_not_allowed")
            .into_response()
        }
        _ => next.run(req).await,
    }
}

/// Whether a `Host` value names a loopback host or one of `allowed` (case-insensitive, port
/// ignored; `"*"` allows any).
pub fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = host_name(host).to_ascii_lowercase();
    let name = name.strip_suffix('.').unwrap_or(&name);
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    let bare = name.trim_start_matches('[').trim_end_matches(']');
    if bare
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
    {
        return true;
    }
    allowed
        .iter()
        .any(|a| a == "*" || a.trim_end_matches('.').eq_ignore_ascii_case(name))
}

/// The host of a `Host` value without its port (`[::1]:8080` gives `[::1]`).
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if host.starts_with('[') {
        return host.find(']').map_or(host, |i| &host[..=i]);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// Constant-time equality (for equal lengths; the length itself is not secret).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::host_allowed;

    #[test]
    fn loopback_names_and_listed_hosts_pass_and_nothing_else() {
        let none: Vec<String> = Vec::new();
        for ok in [
            "localhost",
            "localhost:8080",
            "LocalHost.",
            "a.b.localhost:1",
            "127.0.0.1",
            "127.9.9.9:80",
            "[::1]",
            "[::1]:8080",
        ] {
            assert!(host_allowed(ok, &none), "{ok}");
        }
        for bad in [
            "",
            "evil.com",
            "localhost.evil.com",
            "127.0.0.1.nip.io",
            "[::2]:80",
            "0.0.0.0",
            "10.0.0.1:8080",
            "localhost:80:80",
        ] {
            assert!(!host_allowed(bad, &none), "{bad}");
        }
        let listed = vec!["box.lan".to_string()];
        assert!(host_allowed("BOX.lan:8080", &listed));
        assert!(!host_allowed("x.box.lan", &listed));
        assert!(host_allowed("anything", &["*".to_string()]));
    }
}
