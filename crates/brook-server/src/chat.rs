//! `POST /v1/chat/completions`, and the response machinery both completion endpoints share:
//! the SSE stream over a worker [`Ticket`] and the non-streamed wait for the whole result.
//!
//! The request is fully checked before it takes a place in the queue: fields, model name, the
//! template's rendering and the prompt's length against the context, so a rejection always
//! comes with its proper status instead of an error event inside a 200 stream. A streamed
//! answer starts at once (role chunk, then SSE keep-alive comments while the request waits and
//! prefills); a dropped connection drops the stream and with it the ticket, which cancels the
//! generation.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use brook_core::session::{Completion, GenOptions, Llm};
use brook_core::text::Message;
use serde_json::Value;

use crate::App;
use crate::error::{ApiError, ApiResult};
use crate::request::{ChatRequest, parse_body};
use crate::wire::{self, Chunker};
use crate::worker::{Out, Ticket, Work};

pub(crate) async fn chat_completions(
    State(app): State<Arc<App>>,
    peer: Option<axum::Extension<crate::transport::Peer>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let peer = peer.map(|axum::Extension(p)| p.0);
    match chat(app, peer, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat(
    app: Arc<App>,
    peer: Option<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let arrived = Instant::now();
    let req: ChatRequest = parse_body(&headers, body)?;
    app.check_model(req.model.as_deref())?;
    req.check()?;
    let mut opts = req.options(app.llm.generation.sampling_params())?;
    app.limit(&mut opts, arrived);
    let mut messages = req.conversation();
    // The place in the queue comes first, so rendering and tokenizing are bounded by it.
    let reserved = app.queue.reserve().ok_or_else(|| app.busy())?;
    {
        let (llm, m, o) = (app.llm.clone(), messages.clone(), opts.clone());
        blocking(move || check_prompt(&llm, &m, &o)).await??;
    }
    let last = messages
        .pop()
        .ok_or_else(|| ApiError::invalid_param("messages", "no messages"))?;
    let work = Work::Chat {
        history: messages,
        last,
    };
    let client = crate::client_of(req.cache_salt.as_deref(), req.user.as_deref(), peer);
    let ticket = app.queue.submit(reserved, client, work, opts);
    let meta = app.meta("chatcmpl");
    if req.stream == Some(true) {
        let usage = req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let chunker = Chunker::new(meta, true, usage);
        let first = vec![chunker.role()];
        Ok(sse(ticket, chunker, first, &app))
    } else {
        let c = collect(ticket).await?;
        Ok(Json(wire::chat_completion(&meta, &c)).into_response())
    }
}

/// Renders and tokenizes the conversation as the session will, and refuses a prompt that
/// leaves no room in the context.
fn check_prompt(llm: &Llm, messages: &[Message], opts: &GenOptions) -> ApiResult<()> {
    let prompt = llm.render(messages, opts, true)?;
    let n = llm.tokenizer()?.encode(&prompt, false)?.len();
    check_length(n, llm.options.context)
}

/// 400 `context_length_exceeded` unless `n` prompt tokens leave room for one generated token.
pub(crate) fn check_length(n: usize, context: usize) -> ApiResult<()> {
    if n >= context {
        return Err(ApiError::invalid_param(
            "messages",
            format!(
                "This model's maximum context length is {context} tokens, but the prompt has {n} tokens; shorten it or restart brook serve with a larger --context"
            ),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// Runs blocking work (tokenizing, rendering) off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal_logged(format!("a blocking task failed: {e}")))
}

/// Waits for the whole result. If the client goes away, hyper drops this future and the
/// ticket with it, which cancels the generation.
pub(crate) async fn collect(mut ticket: Ticket) -> ApiResult<Completion> {
    while let Some(out) = ticket.events.recv().await {
        match out {
            Out::Done(c) => return Ok(*c),
            Out::Failed(e) => return Err(e),
            Out::Started { .. } | Out::Event(_) => {}
        }
    }
    Err(ApiError::internal(
        "the model thread stopped; restart brook serve",
    ))
}

/// A streamed answer: `first` chunks, then one per event, the closing chunks and `[DONE]`.
pub(crate) fn sse(ticket: Ticket, chunker: Chunker, first: Vec<Value>, app: &App) -> Response {
    let stream = ChunkStream {
        ticket,
        chunker,
        pending: first.iter().map(data).collect(),
        finished: false,
    };
    let mut r = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(app.config.keep_alive))
        .into_response();
    // Tell nginx-style proxies to pass tokens on as they come.
    r.headers_mut().insert(
        "x-accel-buffering",
        axum::http::HeaderValue::from_static("no"),
    );
    r
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// The SSE body. Owning the ticket is what ties the generation to the connection.
struct ChunkStream {
    ticket: Ticket,
    chunker: Chunker,
    pending: VecDeque<SseEvent>,
    finished: bool,
}

impl ChunkStream {
    fn on(&mut self, out: Out) {
        match out {
            Out::Started { .. } => {}
            Out::Event(ev) => {
                if let Some(v) = self.chunker.event(&ev) {
                    self.pending.push_back(data(&v));
                }
            }
            Out::Done(c) => {
                for v in self.chunker.end(&c) {
                    self.pending.push_back(data(&v));
                }
                self.close();
            }
            Out::Failed(e) => {
                self.pending.push_back(data(&e.body()));
                self.close();
            }
        }
    }

    fn close(&mut self) {
        self.pending.push_back(SseEvent::default().data("[DONE]"));
        self.finished = true;
    }
}

impl futures_core::Stream for ChunkStream {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(e) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(e)));
            }
            if this.finished {
                return Poll::Ready(None);
            }
            match this.ticket.events.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(out)) => this.on(out),
                Poll::Ready(None) => {
                    let e = ApiError::internal("the model thread stopped; restart brook serve");
                    this.on(Out::Failed(e));
                }
            }
        }
    }
}
