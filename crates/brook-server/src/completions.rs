//! `POST /v1/completions`: raw text (or token ids) in, a continuation out, no chat template.
//!
//! The prompt is tokenized here (with the tokenizer's special tokens, as vLLM does) and run
//! through [`brook_core::session::Session::generate`]; a prompt that extends the previous raw
//! prompt and its answer reuses the kept state. Reasoning and tool-call tags are left in the
//! text: a raw completion is the model's plain output.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use brook_core::session::Llm;

use crate::App;
use crate::chat::{blocking, check_length, collect, sse};
use crate::error::{ApiError, ApiResult};
use crate::request::{CompletionRequest, Prompt, parse_body};
use crate::wire::{self, Chunker};
use crate::worker::Work;

pub(crate) async fn completions(
    State(app): State<Arc<App>>,
    peer: Option<axum::Extension<crate::transport::Peer>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let peer = peer.map(|axum::Extension(p)| p.0);
    match complete(app, peer, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn complete(
    app: Arc<App>,
    peer: Option<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<Response> {
    let arrived = Instant::now();
    let req: CompletionRequest = parse_body(&headers, body)?;
    app.check_model(req.model.as_deref())?;
    req.check()?;
    let mut opts = req.options(app.llm.generation.sampling_params())?;
    app.limit(&mut opts, arrived);
    // The place in the queue comes first, so tokenizing is bounded by it.
    let reserved = app.queue.reserve().ok_or_else(|| app.busy())?;
    let (llm, prompt) = (app.llm.clone(), req.prompt.clone());
    let (ids, text) = blocking(move || prompt_ids(&llm, prompt)).await??;
    check_length(ids.len(), app.llm.options.context)?;
    let echo = if req.echo == Some(true) {
        text
    } else {
        String::new()
    };
    let client = crate::client_of(req.cache_salt.as_deref(), req.user.as_deref(), peer);
    let ticket = app.queue.submit(reserved, client, Work::Raw { ids }, opts);
    let meta = app.meta("cmpl");
    if req.stream == Some(true) {
        let usage = req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let chunker = Chunker::new(meta, false, usage);
        let first = if echo.is_empty() {
            Vec::new()
        } else {
            vec![chunker.text(&echo)]
        };
        Ok(sse(ticket, chunker, first, &app))
    } else {
        let c = collect(ticket).await?;
        Ok(Json(wire::text_completion(&meta, &c, &echo)).into_response())
    }
}

/// The prompt's token ids and its text.
fn prompt_ids(llm: &Llm, prompt: Prompt) -> ApiResult<(Vec<u32>, String)> {
    let tok = llm.tokenizer()?;
    let one = |n: usize| -> ApiResult<()> {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid_param(
                "prompt",
                format!("only one prompt per request is supported (got {n})"),
            ))
        }
    };
    let (ids, text) = match prompt {
        Prompt::Text(s) => (tok.encode(&s, true)?, s),
        Prompt::Texts(mut v) => {
            one(v.len())?;
            let s = v.pop().unwrap_or_default();
            (tok.encode(&s, true)?, s)
        }
        Prompt::Ids(ids) => {
            let s = decode_ids(llm, &ids)?;
            (ids, s)
        }
        Prompt::IdLists(mut v) => {
            one(v.len())?;
            let ids = v.pop().unwrap_or_default();
            let s = decode_ids(llm, &ids)?;
            (ids, s)
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
    }
    Ok((ids, text))
}

fn decode_ids(llm: &Llm, ids: &[u32]) -> ApiResult<String> {
    let vocab = llm.model.cfg.vocab_size;
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("token id {bad} is out of range: the vocabulary has {vocab} ids"),
        ));
    }
    Ok(llm.tokenizer()?.decode(ids, false)?)
}
