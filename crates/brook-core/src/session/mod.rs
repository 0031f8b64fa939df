//! The library API: open a model with options, hold conversations, stream events.
//!
//! An [`Llm`] is a loaded model plus its tokenizer, chat template and generation defaults. A
//! [`Session`] is one conversation: it keeps the model state between turns, so the next turn
//! prefills only its new tokens; it streams [`Event`]s (content, reasoning, tool calls, usage,
//! finish reason); it can be cancelled from another thread through a [`CancelToken`]; and its
//! state can be saved to a file and restored. It must not know about HTTP or terminals.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::error::{Error, Result};

mod batch;
mod conversation;
mod persist;
use crate::engine::driver::Counters;
use crate::engine::{EngineStats, Forward, GivenRoutes, GpuStats, Routing};
use crate::model::Model;
use crate::model::open::OpenOptions;
use crate::model::state::SeqState;
use crate::model::{Logits, Stage};
use crate::routing::RoutingTrace;
use crate::text::{ChatTemplate, GenerationConfig, Message, SamplingParams, Tokenizer, ToolCall};
pub use batch::{Batch, SeqEvent, SeqId};
pub use conversation::Session;
use conversation::Snapshot;

/// A loaded model with everything needed to turn text into tokens and back.
#[derive(Debug)]
pub struct Llm {
    pub model: Arc<Model>,
    /// The forward pass over `model` the options chose, behind the driver.
    forward: Arc<std::sync::Mutex<Forward<'static>>>,
    /// Continuous batching of calls from several threads (`max_seqs` > 1).
    batcher: Option<crate::engine::batch::Batcher>,
    /// The driver's counts and its engine's name, readable while a forward call runs.
    counters: (Arc<Counters>, &'static str),
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
    /// Ids that end generation (generation_config's EOS list, then config.json's).
    pub stop_ids: Vec<u32>,
    pub dir: PathBuf,
    pub options: OpenOptions,
}

/// A flag another thread sets to stop a generation between two tokens.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
    /// Clears the flag for the next request.
    pub fn reset(&self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Options of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenOptions {
    /// Sampling; `None` takes generation_config.json's defaults (greedy if it has none).
    pub sampling: Option<SamplingParams>,
    /// Most tokens to generate; `None` runs to the context limit.
    pub max_tokens: Option<usize>,
    /// Strings that end generation (not included in the output).
    pub stop: Vec<String>,
    /// Passed to the chat template (`enable_thinking`); `None` keeps the template's default.
    pub enable_thinking: Option<bool>,
    /// Tools offered (OpenAI function schemas), rendered by the template.
    pub tools: Option<Vec<serde_json::Value>>,
    /// Extra template variables.
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    pub cancel: Option<CancelToken>,
    /// Keep generating past the model's end-of-sequence ids (benchmarks, as llama-bench and
    /// vLLM's `ignore_eos` do); stop strings still apply.
    pub ignore_eos: bool,
    /// Where decoded tokens' routed experts come from, or where they are recorded.
    pub routes: Routes,
    /// When to give up: a prompt still being read then fails with [`Error::Stopped`] (checked
    /// between prefill chunks), a generation ends with [`FinishReason::Length`] before its
    /// next token.
    pub deadline: Option<Instant>,
}

/// What a generation does with the routing of its decoded tokens (the prompt always routes
/// with the model's routers).
#[derive(Clone, Default)]
pub enum Routes {
    /// Each layer's router picks: the model as trained.
    #[default]
    Router,
    /// Decoded token `i` uses the experts of the trace's token `(start + i) % len` in every
    /// layer, weighted by the router's probabilities at those ids (a benchmark of streaming on
    /// a recorded or simulated routing; the text is meaningless). Needs an engine that
    /// replays (`cpu`, `cuda`).
    Replay {
        trace: Arc<RoutingTrace>,
        start: usize,
    },
    /// Each decoded token's routing is appended to the trace (needs an engine that reports
    /// its routes: `cpu`, `reference`).
    Record(Arc<std::sync::Mutex<RoutingTrace>>),
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Routes::Router => f.write_str("Router"),
            Routes::Replay { trace, start } => {
                write!(f, "Replay {{ tokens: {}, start: {start} }}", trace.tokens())
            }
            Routes::Record(_) => f.write_str("Record"),
        }
    }
}

/// One token of a trace, given to every layer of a one-token step.
struct TraceToken<'a> {
    trace: &'a RoutingTrace,
    token: usize,
}

impl GivenRoutes for TraceToken<'_> {
    fn experts(&self, _seq: usize, token: usize, layer: usize) -> Option<&[u32]> {
        (token == 0).then(|| self.trace.experts(self.token, layer))
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An EOS id or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// The model called tools.
    ToolCalls,
    /// A [`CancelToken`] fired.
    Cancelled,
}

/// Token counts and timings of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose state was reused from earlier turns.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// What a generation streams.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A sampled token id, before its text (which may wait for the following tokens).
    Token(u32),
    Content(String),
    Reasoning(String),
    ToolCall(ToolCall),
    Usage(Usage),
    Finish(FinishReason),
}

/// The whole result of one turn.
#[derive(Debug, Clone, Default)]
pub struct Completion {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
    pub tokens: Vec<u32>,
    pub usage: Usage,
    pub finish: Option<FinishReason>,
}

impl Llm {
    /// Opens a container or checkpoint folder; tokenizer and template are optional.
    pub fn open(dir: &Path, options: OpenOptions) -> Result<Self> {
        let model = Arc::new(Model::open_with(dir, &options)?);
        let forward = crate::engine::open(&model, dir, &options)?;
        let counters = (forward.counters(), forward.name());
        let forward = Arc::new(std::sync::Mutex::new(forward));
        let batcher = if options.max_seqs > 1 {
            Some(crate::engine::batch::Batcher::spawn(forward.clone())?)
        } else {
            None
        };
        let tokenizer = Tokenizer::from_dir(dir)?.map(Arc::new);
        let template = ChatTemplate::from_dir(dir)?;
        let generation = GenerationConfig::from_dir(dir)?.unwrap_or_default();
        let tok_eos = template
            .as_ref()
            .and_then(|t| t.eos_token.as_deref())
            .and_then(|e| tokenizer.as_ref().and_then(|t| t.token_to_id(e)));
        let stop_ids = generation.stop_ids(&model.cfg.eos_token_ids, tok_eos);
        Ok(Llm {
            model,
            forward,
            batcher,
            counters,
            tokenizer,
            template,
            generation,
            stop_ids,
            dir: dir.to_path_buf(),
            options,
        })
    }

    /// Feeds `tokens` into `state` with the engine the options chose and returns the logits
    /// asked for.
    pub fn forward(&self, state: &mut SeqState, tokens: &[u32], want: Logits) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.forward_into(state, tokens, want, &mut out)?;
        Ok(out)
    }

    /// [`Llm::forward`] into `out` (replaced; its memory is reused, so a decode loop allocates
    /// nothing per token).
    pub fn forward_into(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        match &self.batcher {
            Some(b) => b.forward_into(state, tokens, want, out),
            None => self.engine().forward_into(state, tokens, want, out),
        }
    }

    /// One decoded token into `out`, its routing replayed or recorded as `routes` says
    /// (`decoded`: tokens decoded before it in this generation).
    fn decode_into(
        &self,
        state: &mut SeqState,
        token: u32,
        want: Logits,
        routes: &Routes,
        decoded: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let tokens = std::slice::from_ref(&token);
        match routes {
            Routes::Router => self.forward_into(state, tokens, want, out),
            Routes::Replay { trace, start } => {
                let given = TraceToken {
                    trace,
                    token: (start + decoded) % trace.tokens(),
                };
                self.engine()
                    .forward_with(state, tokens, want, Routing::Given(&given), None, out)
            }
            Routes::Record(into) => {
                let mut layers = vec![Vec::new(); self.model.cfg.num_hidden_layers];
                let mut seen = |s: Stage<'_>| {
                    if let Stage::Routes(l, r) = s
                        && let (Some(slot), Some(route)) = (layers.get_mut(l), r.first())
                    {
                        *slot = route.experts.iter().map(|&e| e as u32).collect();
                    }
                };
                self.engine().forward_with(
                    state,
                    tokens,
                    want,
                    Routing::Router,
                    Some(&mut seen),
                    out,
                )?;
                into.lock().unwrap_or_else(|p| p.into_inner()).push(&layers)
            }
        }
    }

    fn engine(&self) -> std::sync::MutexGuard<'_, Forward<'static>> {
        self.forward.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh sequence state for the engine in use, with room for the context.
    pub fn new_state(&self) -> SeqState {
        self.engine().new_state(self.options.context)
    }

    /// Which engine runs and how many forward calls it made.
    pub fn engine_stats(&self) -> EngineStats {
        let (c, name) = &self.counters;
        c.stats(name, &self.model)
    }

    /// The GPU engine's counters, if a GPU runs.
    pub fn gpu_stats(&self) -> Option<GpuStats> {
        self.engine().gpu_stats()
    }

    /// One engine step over several sequences' parts ([`crate::engine::Forward::step_parts`]),
    /// taking the engine's lock for the step.
    pub fn step_parts(&self, parts: &mut [crate::engine::Part<'_>]) {
        self.engine().step_parts(parts)
    }

    /// A [`Batch`] of sequences over this model, driven by the caller.
    pub fn batch(self: &Arc<Self>) -> Batch {
        Batch::new(self.clone())
    }

    /// [`Llm::gpu_stats`] without waiting: `None` while a step runs (or without a GPU).
    pub fn try_gpu_stats(&self) -> Option<GpuStats> {
        match self.forward.try_lock() {
            Ok(f) => f.gpu_stats(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().gpu_stats(),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// A new, empty conversation.
    pub fn session(self: &Arc<Self>) -> Session {
        Session {
            llm: self.clone(),
            state: self.new_state(),
            fed: Vec::new(),
            messages: Vec::new(),
            text: String::new(),
            prefilled: 0,
            snapshot: None,
            snapshot_at: None,
            logits: Vec::new(),
        }
    }

    /// The tokenizer, or an error saying the model folder has none.
    pub fn tokenizer(&self) -> Result<&Arc<Tokenizer>> {
        self.tokenizer.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "{} has no tokenizer.json; reading or writing text needs one (add the model's tokenizer.json there; `brook generate --prompt-tokens` runs on token ids without it)",
                self.dir.display()
            ))
        })
    }

    /// Renders a conversation through the chat template.
    pub fn render(
        &self,
        messages: &[Message],
        opts: &GenOptions,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let t = self.template.as_ref().ok_or_else(|| {
            Error::Invalid(format!("{} has no chat template", self.dir.display()))
        })?;
        let mut extra = opts.template_kwargs.clone();
        if let Some(th) = opts.enable_thinking {
            extra.insert("enable_thinking".into(), th.into());
        }
        Ok(t.render(
            messages,
            opts.tools.as_deref(),
            add_generation_prompt,
            &extra,
        )?)
    }

    /// The ids that end a generation with `opts`: none when it ignores end-of-sequence.
    pub fn stop_ids(&self, opts: &GenOptions) -> Vec<u32> {
        if opts.ignore_eos {
            Vec::new()
        } else {
            self.stop_ids.clone()
        }
    }

    /// Sampling parameters for `opts`.
    pub fn sampling(&self, opts: &GenOptions) -> SamplingParams {
        opts.sampling
            .clone()
            .unwrap_or_else(|| self.generation.sampling_params())
    }
}
