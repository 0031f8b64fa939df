//! OpenAI-style errors at the HTTP edge: `{"error": {"message", "type", "param", "code"}}` with
//! the status a client expects, plus the mapping from brook-core's typed errors.
//!
//! Every rejection the server makes goes through [`ApiError`], so no client ever sees axum's
//! plain-text rejections or an empty body. Statuses follow OpenAI's API where it has one (400
//! for malformed or wrongly typed input, 401 bad key, 404 unknown model or path, 413 body too
//! large, 429 queue full) and plain HTTP otherwise (405, 415).

use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// An error answered as OpenAI-style JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, as a JSON path (`messages[0].content`).
    pub param: Option<String>,
    /// A stable machine-readable code (`context_length_exceeded`, `model_not_found`, ...).
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (429 only).
    pub retry_after: Option<u64>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400: the request is malformed or a value is out of range.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the field at fault.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::invalid(message).with_param(param)
    }

    /// 500: brook itself failed; `message` is sent as is, so it must not carry details of
    /// the machine (paths, panic text): see [`ApiError::internal_logged`].
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// 500 for a failure whose details (file paths, OS errors, panic messages) belong to the
    /// operator: they go to the log under a fresh error id, the client gets only the id.
    pub fn internal_logged(detail: impl std::fmt::Display) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let id = format!(
            "{:04x}-{}",
            crate::request::random_seed() as u16,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        tracing::error!(error_id = %id, "internal error: {detail}");
        Self::internal(format!(
            "brook failed while serving this request (error id {id}; the server's log has the details)"
        ))
    }

    /// 503 `timeout`: the request ran out of its time (`--request-timeout`).
    pub fn timed_out(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message).with_code("timeout")
    }

    /// 401: the API key is missing or wrong.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
            .with_code("invalid_api_key")
    }

    /// 404: no such route.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).with_code("not_found")
    }

    /// 404: the request named a model this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{asked}` does not exist; this server serves `{served}` (see GET /v1/models)"),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    /// 429: the request queue is full.
    pub fn busy(running: usize, queue: usize, retry_after: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!(
                "the server is busy: {running} requests are running and {queue} are waiting; retry in about {retry_after} s or raise --queue or --parallel"
            ),
        )
        .with_code("queue_full");
        e.retry_after = Some(retry_after);
        e
    }

    /// Any status with a message (405, 413, 415, ...).
    pub fn status(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, "invalid_request_error", message)
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after
            && let Ok(v) = HeaderValue::from_str(&s.to_string())
        {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
        r
    }
}

impl From<brook_core::Error> for ApiError {
    /// Input the caller supplied (a conversation the template rejects, bad sampling values)
    /// is the client's fault; anything about model files, I/O or the runtime is ours.
    fn from(e: brook_core::Error) -> Self {
        use brook_core::Error as E;
        use brook_core::text::TextError as T;
        match &e {
            E::Invalid(_) => Self::invalid(e.to_string()),
            E::Text(
                T::TemplateRaised { .. }
                | T::InvalidInput(_)
                | T::Sampling { .. }
                | T::TemplateRender { .. },
            ) => Self::invalid(e.to_string()),
            E::Stopped(m) => Self::timed_out(m.clone()),
            _ => Self::internal_logged(&e),
        }
    }
}

impl From<brook_core::text::TextError> for ApiError {
    fn from(e: brook_core::text::TextError) -> Self {
        brook_core::Error::Text(e).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_500_names_an_error_id_but_no_detail_of_the_machine() {
        let io = brook_core::Error::io(
            "/home/someone/models/secret/model-00001.safetensors",
            std::io::Error::other("Input/output error"),
        );
        let e = ApiError::from(io);
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(e.message.contains("error id"), "{}", e.message);
        assert!(
            !e.message.contains("/home") && !e.message.contains("Input/output"),
            "{}",
            e.message
        );
        // Two failures get different ids.
        let again = ApiError::internal_logged("x");
        assert_ne!(e.message, again.message);
        // Client faults keep their explanation.
        let bad = ApiError::from(brook_core::Error::Invalid(
            "token id 7 is out of range".into(),
        ));
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
        assert!(bad.message.contains("out of range"));
    }
}
