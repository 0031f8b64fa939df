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
pub mod metrics;
mod page;
pub mod request;
mod routes;
pub mod transport;
pub mod wire;
pub mod worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use brook_core::session::{GenOptions, Llm};

pub use error::ApiError;

/// How the server behaves.
#[derive(Debug, Clone)]
pub struct Config {
    /// The id `/v1/models` lists and requests must name (or leave out).
    pub model_id: String,
    /// Requests allowed to wait while `parallel` run; more are answered 429.
    pub queue: usize,
    /// Requests generating at once (slots), each with its own conversation state; their
    /// steps are batched when the model was opened with `max_seqs` ≥ this.
    pub parallel: usize,
    /// Bearer key required on `/v1/*`; `None` leaves the API open (loopback use).
    pub api_key: Option<String>,
    /// Largest request body in bytes; larger ones are answered 413.
    pub max_body: usize,
    /// SSE comment interval while a streamed request waits or prefills, so proxies keep the
    /// connection and a vanished client is noticed.
    pub keep_alive: Duration,
    /// Connection cap and timeouts ([`transport`]).
    pub transport: transport::Limits,
    /// Host names (the `Host` header without its port) allowed besides the loopback ones
    /// when no API key is set; `"*"` allows any. Without a key a request naming another host
    /// is refused (403): that is what a web page reaching the server through DNS rebinding
    /// sends.
    pub allowed_hosts: Vec<String>,
    /// Most tokens one request may generate (requests asking for more, or for no limit, are
    /// held to it); `None` leaves the context as the only limit.
    pub max_tokens: Option<usize>,
    /// Longest a request may take from arrival: one still waiting then is answered 503
    /// (`timeout`), one generating stops with `finish_reason: "length"`.
    pub request_timeout: Option<Duration>,
    /// Leave `timings` and `prompt_tokens_details.cached_tokens` out of responses, so a client
    /// cannot tell from them whether a prompt was cached.
    pub hide_timings: bool,
}

impl Config {
    /// Defaults for serving `model_id`: queue 8, no key, 16 MiB bodies, 5 s keep-alive, the
    /// default [`transport::Limits`], loopback hosts only, no token cap, 30 minutes a
    /// request, timings shown.
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            queue: 8,
            parallel: 1,
            api_key: None,
            max_body: 16 << 20,
            keep_alive: Duration::from_secs(5),
            transport: transport::Limits::default(),
            allowed_hosts: Vec::new(),
            max_tokens: None,
            request_timeout: Some(Duration::from_secs(30 * 60)),
            hide_timings: false,
        }
    }
}

/// Shared state of the handlers.
#[derive(Debug)]
pub(crate) struct App {
    pub llm: Arc<Llm>,
    pub config: Config,
    pub queue: worker::Queue,
    /// What `/metrics` reports.
    pub metrics: Arc<metrics::Metrics>,
    /// The GPU tier's counters when last read (a scrape does not wait for a step).
    pub last_gpu: std::sync::Mutex<Option<brook_core::engine::GpuStats>>,
    /// Unix seconds at start (`created` of the model object).
    pub started: u64,
    /// Request bodies in memory at once, in KiB ([`transport::read_body`]).
    pub bodies: Arc<tokio::sync::Semaphore>,
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
        ApiError::busy(self.config.parallel, self.config.queue, 5)
    }

    /// What every response of a new request of `kind` shares.
    pub fn meta(&self, kind: &str) -> wire::Meta {
        wire::Meta {
            id: self.next_id(kind),
            created: now(),
            model: self.config.model_id.clone(),
            hide_timings: self.config.hide_timings,
        }
    }

    /// Applies the server's limits to a request's options: the token cap and the deadline
    /// counted from `arrived`.
    pub fn limit(&self, opts: &mut GenOptions, arrived: Instant) {
        if let Some(cap) = self.config.max_tokens {
            opts.max_tokens = Some(opts.max_tokens.map_or(cap, |m| m.min(cap)));
        }
        opts.deadline = self.config.request_timeout.map(|t| arrived + t);
    }
}

/// Whose conversation a request continues, for the session's reuse: vLLM's `cache_salt` or
/// the `user` a request names; else the address it came from, unless that is this machine
/// (everyone on loopback together: one person, the usual case). Requests of different
/// clients never share kept state, so neither `cached_tokens` nor timings leak a prompt.
pub(crate) fn client_of(
    salt: Option<&str>,
    user: Option<&str>,
    peer: Option<std::net::SocketAddr>,
) -> String {
    match (salt, user, peer) {
        (Some(s), _, _) => format!("salt:{s}"),
        (None, Some(u), _) => format!("user:{u}"),
        (None, None, Some(p)) if !p.ip().is_loopback() => format!("ip:{}", p.ip()),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn clients_are_told_apart_by_salt_user_or_remote_address() {
        use super::client_of;
        let lan = "192.168.1.7:5000".parse().ok();
        let lan2 = "192.168.1.8:5000".parse().ok();
        let lo = "127.0.0.1:5000".parse().ok();
        assert_eq!(
            client_of(None, None, lo),
            client_of(None, None, "127.0.0.1:6000".parse().ok())
        );
        assert_ne!(client_of(None, None, lan), client_of(None, None, lan2));
        assert_eq!(
            client_of(None, None, lan),
            client_of(None, None, "192.168.1.7:9".parse().ok())
        );
        assert_ne!(
            client_of(None, Some("a"), lo),
            client_of(None, Some("b"), lo)
        );
        assert_eq!(
            client_of(None, Some("a"), lan),
            client_of(None, Some("a"), lan2)
        );
        assert_ne!(
            client_of(Some("s"), Some("a"), lo),
            client_of(None, Some("a"), lo)
        );
    }
}

/// Unix time in seconds.
pub(crate) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A server ready to [`serve`]: the routes and the connection limits.
#[derive(Debug, Clone)]
pub struct Server {
    pub router: Router,
    pub limits: transport::Limits,
}

/// The server for `llm`; starts the model thread.
pub fn router(llm: Arc<Llm>, config: Config) -> std::io::Result<Server> {
    let metrics = Arc::new(metrics::Metrics::default());
    let queue = worker::Queue::spawn(llm.clone(), config.parallel, config.queue, metrics.clone())?;
    let max_body = config.max_body;
    let limits = config.transport.clone();
    let app = Arc::new(App {
        llm,
        config,
        queue,
        metrics,
        last_gpu: std::sync::Mutex::new(None),
        started: now(),
        bodies: Arc::new(tokio::sync::Semaphore::new(transport::body_permits(
            max_body,
        ))),
        ids: AtomicU64::new(0),
        id_prefix: request::random_seed(),
    });
    // Outermost first on the way in: panics caught, the Host checked, the key checked, the
    // body read whole under its limit and deadline, then the route.
    let router = routes::routes(app.clone())
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            transport::read_body,
        ))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            auth::require_key,
        ))
        .layer(axum::middleware::from_fn_with_state(app, auth::check_host))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            routes::panic_response,
        ));
    Ok(Server { router, limits })
}

/// Serves `server` on `listener` until `stop` resolves. Connections still open then (a long
/// stream) are not waited for: they end with the runtime, so stopping never waits for a
/// generation to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    server: Server,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    transport::serve(listener, server.router, server.limits, stop).await
}
