//! The route table and the small endpoints: models, health, the JSON 404/405 fallbacks and the
//! last-resort panic answer.

use std::any::Any;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{Method, Response, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::error::{ApiError, ApiResult};
use crate::{App, chat, completions, page};

pub(crate) fn routes(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(page::page))
        .route("/page.js", get(page::script))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(app)
}

fn model_object(app: &App) -> Value {
    json!({
        "id": app.config.model_id,
        "object": "model",
        "created": app.started,
        "owned_by": "brook",
        "max_model_len": app.llm.options.context,
    })
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&app)]}))
}

async fn model(
    State(app): State<Arc<App>>,
    id: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<Value>> {
    let Path(id) = id.map_err(|e| ApiError::invalid(format!("bad model id in the path: {e}")))?;
    app.check_model(Some(&id))?;
    Ok(Json(model_object(&app)))
}

async fn health(State(app): State<Arc<App>>) -> Json<Value> {
    let admitted = app.queue.len();
    Json(json!({
        "status": "ok",
        "model": app.config.model_id,
        "running": admitted.min(app.config.parallel),
        "waiting": admitted.saturating_sub(app.config.parallel),
        "queue_limit": app.config.queue,
        "parallel": app.config.parallel,
        "engine": app.llm.engine_stats(),
    }))
}

async fn metrics(State(app): State<Arc<App>>) -> impl axum::response::IntoResponse {
    let admitted = app.queue.len();
    let p = app.config.parallel;
    let gpu = {
        let mut last = app.last_gpu.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(now) = app.llm.try_gpu_stats() {
            *last = Some(now);
        }
        last.clone()
    };
    let g = crate::metrics::Gauges {
        running: admitted.min(p),
        waiting: admitted.saturating_sub(p),
        parallel: p,
        engine: app.llm.engine_stats(),
        host_cache: app.llm.model.experts.stats(),
        gpu,
    };
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(&g),
    )
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found(format!(
        "no route for {method} {}; the API is under /v1 (chat/completions, completions, models)",
        uri.path()
    ))
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on {}", uri.path()),
    )
    .with_code("method_not_allowed")
}

/// The answer when a handler panicked (a bug in brook; the request's input cannot be trusted
/// to say more).
pub(crate) fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response<Body> {
    let what = brook_core::util::panic_message(&*panic);
    ApiError::internal_logged(format!("handler panicked: {what}")).into_response()
}
