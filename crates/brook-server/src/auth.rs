//! The API key check: with a key configured, every `/v1/*` request must carry
//! `Authorization: Bearer <key>`; the page, `/health` and unknown paths stay open.
//!
//! The comparison runs over every byte whatever the first difference, so response time does
//! not tell an attacker how much of a guess was right.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
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

/// Constant-time equality (for equal lengths; the length itself is not secret).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
