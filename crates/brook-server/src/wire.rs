//! OpenAI response shapes: chat completions and their stream chunks, text completions, usage,
//! tool calls; built from brook-core's [`Event`]s and [`Completion`].
//!
//! Reasoning is sent twice, as `reasoning_content` (llama.cpp, SGLang, mistral.rs, LM Studio)
//! and `reasoning` (vLLM since #27752), because clients read one or the other (see
//! docs/PEERS.md section 3). A tool call is sent whole in one delta (id, name and the complete
//! arguments), which OpenAI's clients accumulate like any split call. Usage carries OpenAI's
//! `prompt_tokens_details.cached_tokens` and, in the non-standard `timings` object named after
//! llama.cpp's, the prefill and decode speeds. It must not run or queue anything.

use brook_core::session::{Completion, Event, FinishReason, Usage};
use brook_core::text::ToolCall;
use serde_json::{Value, json};

/// What every response of one request shares.
#[derive(Debug, Clone)]
pub struct Meta {
    /// `chatcmpl-...` or `cmpl-...`.
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Leave out `timings` and `cached_tokens` (`--hide-timings`).
    pub hide_timings: bool,
}

/// OpenAI's name for a finish reason (a cancelled generation has no client left to read it).
pub fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop | FinishReason::Cancelled => "stop",
        FinishReason::Length => "length",
        FinishReason::ToolCalls => "tool_calls",
    }
}

/// `usage`, with cached prompt tokens and timings unless `hide` (then only the counts).
pub fn usage(u: &Usage, hide: bool) -> Value {
    let counts = json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    });
    if hide {
        return counts;
    }
    let per_s = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let prefilled = u.prompt_tokens.saturating_sub(u.cached_tokens);
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "timings": {
            "prompt_n": prefilled,
            "prompt_ms": u.prefill_s * 1e3,
            "prompt_per_second": per_s(prefilled, u.prefill_s),
            "predicted_n": u.completion_tokens,
            "predicted_ms": u.decode_s * 1e3,
            "predicted_per_second": per_s(u.completion_tokens, u.decode_s),
        },
    })
}

/// One tool call in OpenAI's shape; `index` is its position in the turn (streaming only).
pub fn tool_call(c: &ToolCall, index: Option<usize>) -> Value {
    let mut v = json!({
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    });
    if let (Some(i), Some(o)) = (index, v.as_object_mut()) {
        o.insert("index".into(), i.into());
    }
    v
}

/// The assistant message of a finished chat turn.
pub fn chat_message(c: &Completion) -> Value {
    let mut m = json!({"role": "assistant"});
    let content = if c.content.is_empty() && !c.tool_calls.is_empty() {
        Value::Null
    } else {
        c.content.clone().into()
    };
    m["content"] = content;
    if !c.reasoning.is_empty() {
        m["reasoning_content"] = c.reasoning.clone().into();
        m["reasoning"] = c.reasoning.clone().into();
    }
    if !c.tool_calls.is_empty() {
        m["tool_calls"] = c.tool_calls.iter().map(|t| tool_call(t, None)).collect();
    }
    m
}

/// A whole (non-streamed) chat completion.
pub fn chat_completion(meta: &Meta, c: &Completion) -> Value {
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": chat_message(c),
            "logprobs": null,
            "finish_reason": c.finish.map(finish_reason),
        }],
        "usage": usage(&c.usage, meta.hide_timings),
    })
}

/// A whole (non-streamed) text completion; `prefix` is the echoed prompt, if asked for.
pub fn text_completion(meta: &Meta, c: &Completion, prefix: &str) -> Value {
    json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "text": format!("{prefix}{}", c.content),
            "logprobs": null,
            "finish_reason": c.finish.map(finish_reason),
        }],
        "usage": usage(&c.usage, meta.hide_timings),
    })
}

/// Turns one request's events into stream chunks (chat or text completion shape).
#[derive(Debug)]
pub struct Chunker {
    pub meta: Meta,
    /// Chat (`chat.completion.chunk`, deltas) or text (`text_completion`, `text`).
    pub chat: bool,
    pub include_usage: bool,
    tool_calls: usize,
}

impl Chunker {
    pub fn new(meta: Meta, chat: bool, include_usage: bool) -> Self {
        Self {
            meta,
            chat,
            include_usage,
            tool_calls: 0,
        }
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.meta.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        })
    }

    fn choice(&self, delta: Value, finish: Option<&str>) -> Value {
        if self.chat {
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}])
        } else {
            let text = delta.get("content").cloned().unwrap_or_else(|| "".into());
            json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}])
        }
    }

    /// The first chunk of a chat stream: the assistant role.
    pub fn role(&self) -> Value {
        self.chunk(self.choice(json!({"role": "assistant", "content": ""}), None))
    }

    /// A text piece outside the generation (the echoed prompt of a text completion).
    pub fn text(&self, s: &str) -> Value {
        self.chunk(self.choice(json!({"content": s}), None))
    }

    /// The chunk for one event, if it makes one (usage and finish wait for [`Chunker::end`]).
    pub fn event(&mut self, ev: &Event) -> Option<Value> {
        let delta = match ev {
            Event::Content(s) => json!({"content": s}),
            Event::Reasoning(s) if self.chat => json!({"reasoning_content": s, "reasoning": s}),
            Event::ToolCall(c) if self.chat => {
                let i = self.tool_calls;
                self.tool_calls += 1;
                json!({"tool_calls": [tool_call(c, Some(i))]})
            }
            _ => return None,
        };
        Some(self.chunk(self.choice(delta, None)))
    }

    /// The closing chunks: the finish reason, then the usage chunk when asked for.
    pub fn end(&self, c: &Completion) -> Vec<Value> {
        let reason = c.finish.map(finish_reason).unwrap_or("stop");
        let mut last = self.chunk(self.choice(json!({}), Some(reason)));
        let mut out = Vec::with_capacity(2);
        if self.include_usage {
            out.push(last);
            let mut u = self.chunk(json!([]));
            u["usage"] = usage(&c.usage, self.meta.hide_timings);
            out.push(u);
        } else if self.meta.hide_timings {
            out.push(last);
        } else {
            // Clients that never asked for usage ignore unknown fields; the page reads the
            // timings from here.
            last["timings"] = usage(&c.usage, false)["timings"].clone();
            out.push(last);
        }
        out
    }
}
