//! The web chat page at `/` and its script at `/page.js`: two files (inline CSS, no CDN, works
//! offline) compiled into the binary.
//!
//! The Content-Security-Policy header lets the page talk only to this server, load nothing from
//! elsewhere and run no inline script (the page's own script is a file of this server), so the
//! offline promise is enforced by the browser, and markup that slipped past the Markdown
//! renderer could not run.

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("page.html");
const SCRIPT: &str = include_str!("page.js");

const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; \
                   connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

pub(crate) async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        PAGE,
    )
}

pub(crate) async fn script() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        SCRIPT,
    )
}
