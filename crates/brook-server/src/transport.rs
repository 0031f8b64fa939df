//! The connection layer: brook's own accept loop over hyper, so that no client can hold the
//! server's sockets or memory for long without sending a request.
//!
//! - **Header and idle timeout**: a connection must deliver a whole request head within
//!   [`Limits::header_timeout`] of opening or of its previous response ending (hyper's
//!   header-read timer, which also runs while a keep-alive connection sits idle).
//! - **Body timeout**: a request body must arrive whole within [`Limits::body_timeout`]
//!   (`read_body`, a middleware; 408 otherwise), and is refused early (413) when its declared
//!   length or its bytes pass the body limit.
//! - **Bodies in memory**: the bodies being received and handled at once hold at most four
//!   times the body limit (64 MiB by default) between them, whatever the number of
//!   connections; a body that cannot get its share within the body timeout gets 503
//!   `server_busy`.
//! - **Connection cap**: at most [`Limits::max_connections`] connections are served at once.
//!   A new one over the cap closes the oldest connection that has no request in flight (a
//!   socket opened and left silent, or idle between requests), so a flood of silent sockets
//!   cannot lock out real clients; when every connection has a request in flight the newcomer
//!   is answered 503 (`too_many_connections`) and closed.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use crate::App;

/// Connections the kernel queues for `accept` (capped by `net.core.somaxconn`). tokio's
/// default of 1024 let a flood of new connections fill the queue, and a dropped SYN costs its
/// client a second before it retries (a `/health` probe beside 1500 slow sockets took 1.01 s).
pub const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `addr` with a backlog of [`LISTEN_BACKLOG`].
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}
use crate::error::ApiError;

/// The address a request came from (a request extension set by the accept loop).
#[derive(Debug, Clone, Copy)]
pub struct Peer(pub std::net::SocketAddr);

/// The connection limits of [`serve`](crate::serve).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections served at once (see the module docs for what happens beyond).
    pub max_connections: usize,
    /// Time a connection has to send a request head, from opening or from the end of its
    /// previous response.
    pub header_timeout: Duration,
    /// Time a request has to send its whole body once its head arrived.
    pub body_timeout: Duration,
}

impl Default for Limits {
    /// 1024 connections, 15 s for a head (and of idle keep-alive), 60 s for a body.
    fn default() -> Self {
        Self {
            max_connections: 1024,
            header_timeout: Duration::from_secs(15),
            body_timeout: Duration::from_secs(60),
        }
    }
}

/// One served connection: how many of its requests are in flight, and the signal that closes
/// it when a newcomer needs its place.
#[derive(Debug, Default)]
struct Conn {
    busy: AtomicUsize,
    close: Notify,
}

/// The live connections by arrival order (lower ids are older).
#[derive(Debug, Default)]
struct Table {
    next: u64,
    live: BTreeMap<u64, Arc<Conn>>,
}

type Shared = Arc<Mutex<Table>>;

fn lock(t: &Shared) -> std::sync::MutexGuard<'_, Table> {
    t.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Takes a place for a new connection, closing the oldest idle one when the table is full;
/// `None` when every connection has a request in flight.
fn admit(table: &Shared, cap: usize) -> Option<(u64, Arc<Conn>)> {
    let mut t = lock(table);
    while t.live.len() >= cap.max(1) {
        let victim = t
            .live
            .iter()
            .find(|(_, c)| c.busy.load(Ordering::SeqCst) == 0)
            .map(|(&id, _)| id)?;
        if let Some(c) = t.live.remove(&victim) {
            c.close.notify_one();
        }
    }
    let id = t.next;
    t.next += 1;
    let conn = Arc::new(Conn::default());
    t.live.insert(id, conn.clone());
    Some((id, conn))
}

/// Accepts connections on `listener` and serves `router` on each until `stop` resolves.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stop: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let table: Shared = Arc::default();
    let accept = async {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(sp) => sp,
                Err(e) => {
                    // Out of descriptors (EMFILE) or a connection reset before accept: keep
                    // serving the connections there are and try again shortly.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            match admit(&table, limits.max_connections) {
                Some((id, conn)) => {
                    let (router, table, timeout) =
                        (router.clone(), table.clone(), limits.header_timeout);
                    tokio::spawn(async move {
                        run(stream, peer, router, conn.clone(), timeout).await;
                        lock(&table).live.remove(&id);
                    });
                }
                None => {
                    tokio::spawn(refuse(stream, limits.max_connections));
                }
            }
        }
    };
    tokio::select! {
        () = accept => Ok(()),
        () = stop => Ok(()),
    }
}

/// Serves one connection until it ends or is told to close.
async fn run(
    stream: TcpStream,
    peer: std::net::SocketAddr,
    router: Router,
    conn: Arc<Conn>,
    header_timeout: Duration,
) {
    let _ = stream.set_nodelay(true);
    let tracked = conn.clone();
    let service =
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            let busy = Busy::new(tracked.clone());
            let mut router = router.clone();
            req.extensions_mut().insert(Peer(peer));
            async move {
                let resp = tower_service::Service::call(&mut router, req.map(Body::new)).await?;
                Ok::<_, Infallible>(resp.map(|inner| Tracked { inner, _busy: busy }))
            }
        });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    let served = builder.serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        r = served => {
            if let Err(e) = r {
                tracing::debug!("connection ended: {e}");
            }
        }
        () = conn.close.notified() => {
            tracing::debug!("closed an idle connection to make room for a new one");
        }
    }
}

/// Answers a connection over the cap with a 503 and closes it.
async fn refuse(mut stream: TcpStream, cap: usize) {
    tracing::warn!("refused a connection: all {cap} connections have a request in flight");
    let body = ApiError::status(
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            "the server has {cap} connections with requests in flight; retry shortly or raise --max-connections"
        ),
    )
    .with_code("too_many_connections")
    .body()
    .to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// Counts a request in flight on its connection until its response body is gone.
#[derive(Debug)]
struct Busy(Arc<Conn>);

impl Busy {
    fn new(conn: Arc<Conn>) -> Self {
        conn.busy.fetch_add(1, Ordering::SeqCst);
        Self(conn)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its connection counted busy while hyper writes it.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// KiB of request bodies the server holds at once: four bodies at the limit.
pub(crate) fn body_permits(max_body: usize) -> usize {
    (max_body.div_ceil(1024).max(1))
        .saturating_mul(4)
        .min(tokio::sync::Semaphore::MAX_PERMITS)
}

/// Middleware: reads the whole request body under the body limit and the body deadline
/// before the handler runs, so no handler waits on a slow client.
pub(crate) async fn read_body(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let limit = app.config.max_body;
    let too_large = || {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is larger than the server's limit of {limit} bytes (--max-body)"
            ),
        )
        .into_response()
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return too_large();
    }
    let timeout = app.config.transport.body_timeout;
    // Its share of the bodies in memory: what it declares, or the whole limit when it does
    // not say (chunked). Held until the handler has answered (it parses the body).
    // A request with neither a length nor a transfer encoding has no body (HTTP/1.1).
    let chunked = req.headers().contains_key(header::TRANSFER_ENCODING);
    let size = match declared {
        Some(n) => n,
        None if chunked => limit as u64,
        None => 0,
    };
    let kib = size.div_ceil(1024);
    let want = u32::try_from(kib)
        .unwrap_or(u32::MAX)
        .min(body_permits(limit) as u32);
    let share = app.bodies.clone().acquire_many_owned(want);
    let _share = match tokio::time::timeout(timeout, share).await {
        Ok(Ok(p)) => p,
        _ => {
            return ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is receiving too many large request bodies at once; retry shortly",
            )
            .with_code("server_busy")
            .into_response();
        }
    };
    let (parts, body) = req.into_parts();
    let read = http_body_util::Limited::new(body, limit).collect();
    match tokio::time::timeout(timeout, read).await {
        Err(_) => ApiError::status(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                timeout.as_secs_f64()
            ),
        )
        .with_code("body_timeout")
        .into_response(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => too_large(),
        Ok(Err(e)) => {
            ApiError::invalid(format!("cannot read the request body: {e}")).into_response()
        }
        Ok(Ok(collected)) => {
            next.run(Request::from_parts(parts, Body::from(collected.to_bytes())))
                .await
        }
    }
}
