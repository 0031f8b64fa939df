//! brook-server: an OpenAI-compatible HTTP server and a web chat page over one brook model.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as SSE or not),
//! `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`, and the chat page at `/`. Requests
//! run one at a time on a model thread behind a bounded queue ([`worker`]); a client that goes
//! away cancels its generation. Every error is OpenAI-style JSON ([`error`]); a panic in a
//! handler is caught and answered 500 rather than taking the connection down.
//!
//! It owns HTTP, JSON shapes and scheduling; the model, tokenizer, template and sampler are
//! brook-core's, reached only through [`brook_core::session`]. The API shape follows OpenAI's
//! reference and the servers compared in docs/PEERS.md section 3 (llama.cpp, vLLM).

mod auth;
mod chat;
mod completions;
pub mod error;
mod page;
pub mod request;
mod routes;
pub mod wire;
pub mod worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use brook_core::session::Llm;

pub use error::ApiError;

/// How the server behaves.
#[derive(Debug, Clone)]
pub struct Config {
    /// The id `/v1/models` lists and requests must name (or leave out).
    pub model_id: String,
    /// Requests allowed to wait while one runs; more are answered 429.
    pub queue: usize,
    /// Bearer key required on `/v1/*`; `None` leaves the API open (loopback use).
    pub api_key: Option<String>,
    /// Largest request body in bytes; larger ones are answered 413.
    pub max_body: usize,
    /// SSE comment interval while a streamed request waits or prefills, so proxies keep the
    /// connection and a vanished client is noticed.
    pub keep_alive: Duration,
}

impl Config {
    /// Defaults for serving `model_id`: queue 8, no key, 16 MiB bodies, 5 s keep-alive.
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            queue: 8,
            api_key: None,
            max_body: 16 << 20,
            keep_alive: Duration::from_secs(5),
        }
    }
}

/// Shared state of the handlers.
#[derive(Debug)]
pub(crate) struct App {
    pub llm: Arc<Llm>,
    pub config: Config,
    pub queue: worker::Queue,
    /// Unix seconds at start (`created` of the model object).
    pub started: u64,
    ids: AtomicU64,
    id_prefix: u64,
}

impl App {
    /// A new response id such as `chatcmpl-5f3a9c1e0000002a`.
    pub fn next_id(&self, kind: &str) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        format!("{kind}-{:08x}{n:08x}", self.id_prefix as u32)
    }

    /// Checks the request's `model` (absent is accepted and means the one served).
    pub fn check_model(&self, asked: Option<&str>) -> Result<(), ApiError> {
        match asked {
            None => Ok(()),
            Some(m) if m == self.config.model_id => Ok(()),
            Some(m) => Err(ApiError::unknown_model(m, &self.config.model_id)),
        }
    }

    /// The 429 answer for a full queue.
    pub fn busy(&self) -> ApiError {
        ApiError::busy(self.config.queue, 5)
    }
}

/// Unix time in seconds.
pub(crate) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The server's router for `llm`; starts the model thread.
pub fn router(llm: Arc<Llm>, config: Config) -> std::io::Result<Router> {
    let queue = worker::Queue::spawn(llm.clone(), config.queue)?;
    let max_body = config.max_body;
    let app = Arc::new(App {
        llm,
        config,
        queue,
        started: now(),
        ids: AtomicU64::new(0),
        id_prefix: request::random_seed(),
    });
    Ok(routes::routes(app.clone())
        .layer(axum::middleware::from_fn_with_state(app, auth::require_key))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            routes::panic_response,
        )))
}

/// Serves `router` on `listener` until `stop` resolves. Connections still open then (a long
/// stream) are not waited for: they end with the runtime, so stopping never waits for a
/// generation to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    use std::future::{Future, IntoFuture};
    use std::task::Poll;
    let mut server = std::pin::pin!(axum::serve(listener, router).into_future());
    let mut stop = std::pin::pin!(stop);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = server.as_mut().poll(cx) {
            return Poll::Ready(r);
        }
        stop.as_mut().poll(cx).map(|()| Ok(()))
    })
    .await
}
