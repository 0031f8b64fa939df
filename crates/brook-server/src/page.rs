//! The web chat page at `/`: one self-contained HTML file (inline CSS and JS, no CDN, works
//! offline) compiled into the binary.
//!
//! The Content-Security-Policy header lets the page talk only to this server and load nothing
//! from elsewhere, so the offline promise is enforced by the browser, not only kept by hand.

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("page.html");

const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
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
