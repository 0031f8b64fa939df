//! OpenAI request bodies: parsing with the field at fault named, validation of every value, and
//! the translation to brook-core's [`GenOptions`].
//!
//! Unknown fields are ignored (clients such as Open WebUI send extras), but every field brook
//! knows is type-checked, including the ones it only accepts at their default (`n`, `logprobs`,
//! `response_format`), so a client never silently gets something other than what it asked for.
//! Ranges follow OpenAI's documentation (temperature 0..2, penalties -2..2) and vLLM's extras
//! (`top_k` -1 = off, `min_p`, `repetition_penalty`). It must not touch the model.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode, header};
use brook_core::session::GenOptions;
use brook_core::text::{Message, SamplingParams};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult};

/// Most stop strings a request may give (OpenAI allows 4; vLLM more).
const MAX_STOP: usize = 16;

/// Parses a JSON request body: content type checked, size limited (by axum's body limit),
/// and a type error answered with the path of the offending field.
pub fn parse_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> ApiResult<T> {
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = ctype
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if mime != "application/json" && !mime.ends_with("+json") {
        return Err(ApiError::status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "Content-Type must be application/json (got `{}`)",
                if ctype.is_empty() { "none" } else { ctype }
            ),
        ));
    }
    let bytes = body.map_err(|r| {
        let status = r.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::status(
                status,
                "the request body is larger than the server's limit (--max-body)",
            )
        } else {
            ApiError::status(
                status,
                format!("cannot read the request body: {}", r.body_text()),
            )
        }
    })?;
    let mut de = serde_json::Deserializer::from_slice(&bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = format!("the request body is not valid: {inner}");
        if path.is_empty() || path == "." {
            ApiError::invalid(msg)
        } else {
            ApiError::invalid_param(path.clone(), format!("{msg} (at `{path}`)"))
        }
    })?;
    de.end()
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    Ok(value)
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// `response_format`: only `{"type": "text"}` is served.
#[derive(Debug, Clone, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
}

/// The sampling fields both endpoints share.
#[derive(Debug, Clone, Default)]
pub struct Sampling {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    /// vLLM's extension: keep generating past end-of-sequence ids (benchmarks).
    pub ignore_eos: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub stop: Option<Stop>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub enable_thinking: Option<bool>,
    pub n: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub response_format: Option<ResponseFormat>,
    pub logit_bias: Option<Map<String, Value>>,
    pub user: Option<String>,
    /// vLLM's: requests share kept state (the prompt cache) only with the same salt.
    pub cache_salt: Option<String>,
    // The sampling fields are listed flat (serde's `flatten` would lose the field paths).
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    /// vLLM's extension: keep generating past end-of-sequence ids (benchmarks).
    pub ignore_eos: Option<bool>,
}

/// One offered tool: `{"type": "function", "function": {"name", "description", "parameters"}}`.
#[derive(Debug, Clone, Deserialize)]
pub struct Tool {
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: ToolFunction,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ToolFunction {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Map<String, Value>>,
    pub strict: Option<bool>,
}

fn function_kind() -> String {
    "function".into()
}

/// `prompt` of `/v1/completions`: a string, token ids, or a one-element list of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(default)]
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub stop: Option<Stop>,
    pub echo: Option<bool>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub logprobs: Option<i64>,
    pub suffix: Option<String>,
    pub logit_bias: Option<Map<String, Value>>,
    pub user: Option<String>,
    /// vLLM's: requests share kept state (the prompt cache) only with the same salt.
    pub cache_salt: Option<String>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    /// vLLM's extension: keep generating past end-of-sequence ids (benchmarks).
    pub ignore_eos: Option<bool>,
}

impl ChatRequest {
    pub fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
        }
    }

    /// Rejects what brook cannot honour and checks the messages.
    pub fn check(&self) -> ApiResult<()> {
        check_n(self.n)?;
        if self.logprobs == Some(true) || self.top_logprobs.is_some_and(|n| n > 0) {
            return Err(unsupported("logprobs", "logprobs are not supported yet"));
        }
        if let Some(f) = &self.response_format
            && f.kind != "text"
        {
            return Err(unsupported(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(unsupported("logit_bias", "logit_bias is not supported"));
        }
        check_stream_options(self.stream, &self.stream_options)?;
        if self.messages.is_empty() {
            return Err(ApiError::invalid_param(
                "messages",
                "`messages` must hold at least one message",
            ));
        }
        for (i, m) in self.messages.iter().enumerate() {
            if !matches!(
                m.role.as_str(),
                "system" | "developer" | "user" | "assistant" | "tool"
            ) {
                return Err(ApiError::invalid_param(
                    format!("messages[{i}].role"),
                    format!(
                        "unknown role `{}`: expected system, developer, user, assistant or tool",
                        m.role
                    ),
                ));
            }
            // OpenAI answers 400 here; without the check a bare turn renders as nothing and
            // the model runs on to the end of the context.
            let needs_content = m.role != "assistant" || m.tool_calls.is_empty();
            if needs_content && m.content.is_none() {
                return Err(ApiError::invalid_param(
                    format!("messages[{i}].content"),
                    format!(
                        "a `{}` message needs `content` (only an assistant message with `tool_calls` may leave it out)",
                        m.role
                    ),
                ));
            }
        }
        for (i, t) in self.tools.iter().flatten().enumerate() {
            if t.kind != "function" || t.function.name.trim().is_empty() {
                return Err(ApiError::invalid_param(
                    format!("tools[{i}]"),
                    "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ));
            }
        }
        Ok(())
    }

    /// The conversation as the template should see it (`developer` is OpenAI's new name for
    /// `system`).
    pub fn conversation(&self) -> Vec<Message> {
        self.messages
            .iter()
            .cloned()
            .map(|mut m| {
                if m.role == "developer" {
                    m.role = "system".into();
                }
                m
            })
            .collect()
    }

    /// Generation options (without a cancel token).
    pub fn options(&self, defaults: SamplingParams) -> ApiResult<GenOptions> {
        let (param, max) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => ("max_completion_tokens", Some(m)),
            (None, m) => ("max_tokens", m),
        };
        let tool_choice_none = self.tool_choice.as_ref().and_then(Value::as_str) == Some("none");
        let tools = match &self.tools {
            Some(t) if !t.is_empty() && !tool_choice_none => Some(tools_json(t)),
            _ => None,
        };
        let mut kwargs = self.chat_template_kwargs.clone().unwrap_or_default();
        let kw_thinking = match kwargs.remove("enable_thinking") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(b),
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "chat_template_kwargs.enable_thinking",
                    "`enable_thinking` must be true or false",
                ));
            }
        };
        let thinking = self.enable_thinking.or(kw_thinking);
        self.finish_options(param, max, tools, kwargs, thinking, defaults)
    }

    fn finish_options(
        &self,
        param: &str,
        max: Option<i64>,
        tools: Option<Vec<Value>>,
        kwargs: Map<String, Value>,
        enable_thinking: Option<bool>,
        defaults: SamplingParams,
    ) -> ApiResult<GenOptions> {
        for key in ["messages", "tools", "documents", "add_generation_prompt"] {
            if kwargs.contains_key(key) {
                return Err(ApiError::invalid_param(
                    format!("chat_template_kwargs.{key}"),
                    format!(
                        "`{key}` is set by the server and cannot be passed in chat_template_kwargs"
                    ),
                ));
            }
        }
        Ok(GenOptions {
            sampling: Some(sampling_params(&self.sampling(), defaults)?),
            max_tokens: max_tokens(param, max)?,
            stop: stop_strings(&self.stop)?,
            enable_thinking,
            tools,
            template_kwargs: kwargs,
            cancel: None,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            routes: Default::default(),
            deadline: None,
        })
    }
}

impl CompletionRequest {
    pub fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
        }
    }

    pub fn check(&self) -> ApiResult<()> {
        check_n(self.n)?;
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(unsupported("best_of", "only best_of = 1 is supported"));
        }
        if self.logprobs.is_some_and(|n| n > 0) {
            return Err(unsupported("logprobs", "logprobs are not supported yet"));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported(
                "suffix",
                "suffix (fill-in-the-middle) is not supported",
            ));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(unsupported("logit_bias", "logit_bias is not supported"));
        }
        check_stream_options(self.stream, &self.stream_options)
    }

    /// Generation options; OpenAI's legacy default is 16 tokens.
    pub fn options(&self, defaults: SamplingParams) -> ApiResult<GenOptions> {
        Ok(GenOptions {
            sampling: Some(sampling_params(&self.sampling(), defaults)?),
            max_tokens: max_tokens("max_tokens", Some(self.max_tokens.unwrap_or(16)))?,
            stop: stop_strings(&self.stop)?,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            ..Default::default()
        })
    }
}

fn unsupported(param: &str, message: &str) -> ApiError {
    ApiError::invalid_param(param, message).with_code("unsupported_parameter")
}

fn check_n(n: Option<i64>) -> ApiResult<()> {
    match n {
        None | Some(1) => Ok(()),
        Some(_) => Err(unsupported(
            "n",
            "only n = 1 is supported (one choice per request)",
        )),
    }
}

fn check_stream_options(stream: Option<bool>, opts: &Option<StreamOptions>) -> ApiResult<()> {
    if opts.is_some() && stream != Some(true) {
        return Err(ApiError::invalid_param(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true",
        ));
    }
    Ok(())
}

fn tools_json(tools: &[Tool]) -> Vec<Value> {
    tools
        .iter()
        .map(|t| {
            let mut f = Map::new();
            f.insert("name".into(), t.function.name.clone().into());
            if let Some(d) = &t.function.description {
                f.insert("description".into(), d.clone().into());
            }
            if let Some(p) = &t.function.parameters {
                f.insert("parameters".into(), Value::Object(p.clone()));
            }
            serde_json::json!({"type": "function", "function": f})
        })
        .collect()
}

fn max_tokens(param: &str, v: Option<i64>) -> ApiResult<Option<usize>> {
    match v {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid_param(
            param,
            format!("`{param}` must be at least 1 (got {n})"),
        )),
        Some(n) => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
    }
}

fn stop_strings(stop: &Option<Stop>) -> ApiResult<Vec<String>> {
    let v = match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if v.len() > MAX_STOP {
        return Err(ApiError::invalid_param(
            "stop",
            format!(
                "at most {MAX_STOP} stop strings are allowed (got {})",
                v.len()
            ),
        ));
    }
    Ok(v.into_iter().filter(|s| !s.is_empty()).collect())
}

/// The request's sampling fields over the model's defaults, each checked against its range.
pub fn sampling_params(s: &Sampling, defaults: SamplingParams) -> ApiResult<SamplingParams> {
    let mut p = defaults;
    if let Some(t) = s.temperature {
        p.temperature = ranged("temperature", t, 0.0, 2.0)?;
    }
    if let Some(v) = s.top_p {
        if !(v > 0.0 && v <= 1.0) {
            return Err(out_of_range("top_p", v, "in (0, 1]"));
        }
        p.top_p = v as f32;
    }
    if let Some(k) = s.top_k {
        p.top_k = match k {
            -1 | 0 => 0,
            k if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
            k => {
                return Err(out_of_range(
                    "top_k",
                    k as f64,
                    "-1 (off), 0 (off) or positive",
                ));
            }
        };
    }
    if let Some(v) = s.min_p {
        p.min_p = ranged("min_p", v, 0.0, 1.0)?;
    }
    if let Some(v) = s.presence_penalty {
        p.presence_penalty = ranged("presence_penalty", v, -2.0, 2.0)?;
    }
    if let Some(v) = s.frequency_penalty {
        p.frequency_penalty = ranged("frequency_penalty", v, -2.0, 2.0)?;
    }
    if let Some(v) = s.repetition_penalty {
        if !(v > 0.0 && v <= 10.0) {
            return Err(out_of_range("repetition_penalty", v, "in (0, 10]"));
        }
        p.repetition_penalty = v as f32;
    }
    p.seed = match s.seed {
        Some(seed) => seed as u64,
        None => random_seed(),
    };
    Ok(p)
}

fn ranged(name: &str, v: f64, lo: f64, hi: f64) -> ApiResult<f32> {
    if v.is_finite() && (lo..=hi).contains(&v) {
        Ok(v as f32)
    } else {
        Err(out_of_range(name, v, &format!("in [{lo}, {hi}]")))
    }
}

fn out_of_range(name: &str, v: f64, expected: &str) -> ApiError {
    ApiError::invalid_param(
        name,
        format!("`{name}` = {v} is out of range: expected {expected}"),
    )
}

/// A fresh seed per request without one, so sampled answers differ between requests as they
/// do on OpenAI's API (std's `RandomState` is randomly keyed per instance).
pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
