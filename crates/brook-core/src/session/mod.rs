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
mod persist;
use crate::engine::driver::Counters;
use crate::engine::{EngineStats, Forward, GivenRoutes, GpuStats, Routing};
use crate::model::Model;
use crate::model::open::OpenOptions;
use crate::model::state::SeqState;
use crate::model::{Logits, Stage};
use crate::routing::RoutingTrace;
use crate::text::{
    ChatTemplate, GenerationConfig, Message, Sampler, SamplingParams, StopReason, StreamEvent,
    StreamOptions, TextStream, Tokenizer, ToolCall, ToolSchemas, prompt_opens_reasoning,
};
pub use batch::{Batch, SeqEvent, SeqId};

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
        routes: &Routes,
        decoded: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let tokens = std::slice::from_ref(&token);
        match routes {
            Routes::Router => self.forward_into(state, tokens, Logits::Last, out),
            Routes::Replay { trace, start } => {
                let given = TraceToken {
                    trace,
                    token: (start + decoded) % trace.tokens(),
                };
                self.engine().forward_with(
                    state,
                    tokens,
                    Logits::Last,
                    Routing::Given(&given),
                    None,
                    out,
                )
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
                    Logits::Last,
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
                "{} has no tokenizer.json; text needs one (token ids work without)",
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

/// One conversation with its model state.
#[derive(Debug)]
pub struct Session {
    llm: Arc<Llm>,
    state: SeqState,
    /// Every token fed into `state`, in order.
    fed: Vec<u32>,
    messages: Vec<Message>,
    /// The text `fed` stands for (rendered prompts and generated replies).
    text: String,
    /// Tokens prefilled by the last turn (for tests and stats).
    prefilled: usize,
    /// The state at the end of the last turn's messages, before its generation prompt.
    snapshot: Option<Snapshot>,
    /// Where (tokens fed, text) the next feed should take that snapshot.
    snapshot_at: Option<(usize, String)>,
    /// [V] logits of the last token fed, reused from token to token.
    logits: Vec<f32>,
}

/// A copy of the state at a known point of the conversation.
#[derive(Debug, Clone)]
struct Snapshot {
    state: SeqState,
    fed: usize,
    text: String,
}

impl Session {
    /// The model this session runs on.
    pub fn llm(&self) -> &Arc<Llm> {
        &self.llm
    }

    /// The conversation so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Tokens the model state holds.
    pub fn tokens(&self) -> &[u32] {
        &self.fed
    }

    /// Tokens the last turn had to prefill (the rest came from the kept state).
    pub fn last_prefill(&self) -> usize {
        self.prefilled
    }

    /// Forgets the conversation and the state.
    pub fn reset(&mut self) {
        self.state = self.llm.new_state();
        self.fed.clear();
        self.messages.clear();
        self.text.clear();
        self.snapshot = None;
        self.snapshot_at = None;
    }

    /// Replaces the conversation history (e.g. an API request's earlier messages). The model
    /// state is kept and reused as far as the new history's rendering agrees with it.
    pub fn set_messages(&mut self, messages: Vec<Message>) {
        self.messages = messages;
    }

    /// Adds `message` (user, system or tool) and generates the assistant's reply, streaming
    /// events to `on_event`. The reply is appended to the conversation.
    ///
    /// The prompt is the template's rendering of the whole conversation, so the model sees
    /// exactly what transformers would give it. The state is reused up to the longest text
    /// prefix it shares with that rendering: either everything fed so far, or the snapshot
    /// taken at the end of the previous turn's messages (templates such as Qwen3.6's drop
    /// earlier reasoning when a new user message arrives, so only the previous reply and the
    /// new message are prefilled then).
    pub fn chat(
        &mut self,
        message: Message,
        opts: &GenOptions,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Completion> {
        self.messages.push(message);
        let prompt = self.llm.render(&self.messages, opts, true)?;
        let base = self.llm.render(&self.messages, opts, false)?;
        let tok = self.llm.tokenizer()?.clone();
        self.rewind_to_prefix_of(&prompt);
        // Feed the messages, snapshot, then feed the generation prompt and generate.
        let mut ids = Vec::new();
        let split = if base.len() >= self.text.len() && prompt.starts_with(&base) {
            ids.extend(tok.encode(&base[self.text.len()..], false)?);
            let n = ids.len();
            ids.extend(tok.encode(&prompt[base.len()..], false)?);
            Some(n)
        } else {
            ids.extend(tok.encode(&prompt[self.text.len()..], false)?);
            None
        };
        let stream = StreamOptions {
            stop_strings: opts.stop.clone(),
            stop_ids: self.llm.stop_ids(opts),
            starts_in_reasoning: prompt_opens_reasoning(&prompt),
            tools: opts
                .tools
                .as_deref()
                .map(ToolSchemas::from_tools)
                .unwrap_or_default(),
            ..Default::default()
        };
        let mut text = TextStream::new(tok.clone(), stream);
        self.snapshot_at = split.map(|n| (self.fed.len() + n, base.clone()));
        self.text = prompt;
        let completion = match self.generate(&ids, opts, Some(&mut text), on_event) {
            Ok(c) => c,
            Err(e) => {
                // The state may hold part of the prompt: drop it rather than let text and
                // state disagree, and take the message back so a retry starts clean.
                self.state = self.llm.new_state();
                self.fed.clear();
                self.text.clear();
                self.snapshot = None;
                self.snapshot_at = None;
                self.messages.pop();
                return Err(e);
            }
        };
        let mut reply = Message::new("assistant", completion.content.clone());
        if !completion.reasoning.is_empty() {
            reply.reasoning_content = Some(completion.reasoning.clone());
        }
        reply.tool_calls = completion
            .tool_calls
            .iter()
            .map(|c| crate::text::MessageToolCall {
                id: Some(c.id.clone()),
                kind: "function".into(),
                function: crate::text::FunctionCall {
                    name: c.name.clone(),
                    arguments: serde_json::from_str(&c.arguments)
                        .unwrap_or(serde_json::Value::String(c.arguments.clone())),
                },
            })
            .collect();
        self.messages.push(reply);
        self.text.push_str(&tok.decode(&completion.tokens, false)?);
        Ok(completion)
    }

    /// Restores the state that covers the longest prefix of `prompt` it can: all that was fed,
    /// else the snapshot, else nothing.
    fn rewind_to_prefix_of(&mut self, prompt: &str) {
        if !self.fed.is_empty() && prompt.starts_with(&self.text) {
            return;
        }
        match self.snapshot.take() {
            Some(snap) if prompt.starts_with(&snap.text) => {
                self.state.clone_from(&snap.state);
                self.fed.truncate(snap.fed);
                self.text = snap.text.clone();
                self.snapshot = Some(snap);
            }
            _ => {
                self.state = self.llm.new_state();
                self.fed.clear();
                self.text.clear();
            }
        }
    }

    /// Feeds `prompt` ids after what the state holds and generates; the low-level entry used
    /// by [`Session::chat`] and by callers that work in token ids.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenOptions,
        mut text: Option<&mut TextStream>,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Completion> {
        let llm = self.llm.clone();
        let context = llm.options.context;
        if prompt.is_empty() && self.fed.is_empty() {
            return Err(Error::Invalid("the prompt is empty".into()));
        }
        if self.fed.len() + prompt.len() >= context {
            return Err(Error::Invalid(format!(
                "the prompt needs {} tokens but the context is {context}; raise --context or shorten the conversation",
                self.fed.len() + prompt.len()
            )));
        }
        // Calls from here on come back to back: a batch waits for them between steps.
        let _joined = llm.batcher.as_ref().map(|b| b.join());
        let mut usage = Usage {
            prompt_tokens: self.fed.len() + prompt.len(),
            cached_tokens: self.fed.len(),
            ..Default::default()
        };
        let cancel = opts.cancel.clone().unwrap_or_default();
        let t0 = Instant::now();
        if prompt.is_empty() {
            return Err(Error::Invalid("nothing new to prefill".into()));
        }
        self.feed(prompt, &cancel, opts.deadline)?;
        // [V] logits of the last token fed; the buffer goes back to the session at the end.
        let mut logits = std::mem::take(&mut self.logits);
        self.prefilled = prompt.len();
        usage.prefill_s = t0.elapsed().as_secs_f64();
        let mut sampler = Sampler::new(llm.sampling(opts), llm.model.cfg.vocab_size)?;
        let max = opts
            .max_tokens
            .unwrap_or(usize::MAX)
            .min(context - self.fed.len());
        let mut out = Completion::default();
        let t1 = Instant::now();
        let mut finish = FinishReason::Length;
        while out.tokens.len() < max {
            if cancel.is_cancelled() {
                finish = FinishReason::Cancelled;
                break;
            }
            if opts.deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            let next = sampler.sample(&mut logits, &self.fed);
            out.tokens.push(next);
            on_event(Event::Token(next));
            let mut stop = !opts.ignore_eos && llm.stop_ids.contains(&next);
            if let Some(ts) = text.as_deref_mut() {
                for ev in ts.push(next) {
                    stop |= emit(ev, &mut out, on_event);
                }
            }
            if stop {
                finish = FinishReason::Stop;
                break;
            }
            if out.tokens.len() == max {
                break;
            }
            std::mem::swap(&mut logits, &mut self.logits);
            self.decode(next, &opts.routes, out.tokens.len() - 1)?;
            std::mem::swap(&mut logits, &mut self.logits);
        }
        self.logits = logits;
        if let Some(ts) = text {
            for ev in ts.finish() {
                emit(ev, &mut out, on_event);
            }
        }
        // The last sampled token is fed now, so the state holds the whole reply.
        if let Some(&last) = out.tokens.last()
            && finish != FinishReason::Cancelled
            && self.fed.len() < context
        {
            self.decode(last, &opts.routes, out.tokens.len() - 1)?;
        }
        if finish == FinishReason::Stop && !out.tool_calls.is_empty() {
            finish = FinishReason::ToolCalls;
        }
        usage.completion_tokens = out.tokens.len();
        usage.decode_s = t1.elapsed().as_secs_f64();
        out.usage = usage;
        out.finish = Some(finish);
        on_event(Event::Usage(usage));
        on_event(Event::Finish(finish));
        Ok(out)
    }

    /// Runs `ids` through the model, appending them to the state; leaves the last token's
    /// logits in `self.logits`.
    fn feed(&mut self, ids: &[u32], cancel: &CancelToken, deadline: Option<Instant>) -> Result<()> {
        let chunk = self.llm.options.prefill_chunk.max(1);
        let mut rest = ids;
        self.take_snapshot_if_due();
        while !rest.is_empty() {
            if cancel.is_cancelled() && ids.len() > 1 {
                return Err(Error::Stopped("cancelled during prefill".into()));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) && ids.len() > 1 {
                return Err(Error::Stopped(format!(
                    "the time limit ran out while reading the prompt ({} of {} tokens read)",
                    ids.len() - rest.len(),
                    ids.len()
                )));
            }
            // Stop a chunk short at the snapshot point so the state there can be copied.
            let mut n = rest.len().min(chunk);
            if let Some((at, _)) = &self.snapshot_at
                && *at > self.fed.len()
            {
                n = n.min(at - self.fed.len());
            }
            let (part, tail) = rest.split_at(n);
            let t = Instant::now();
            self.llm
                .forward_into(&mut self.state, part, Logits::Last, &mut self.logits)?;
            tracing::debug!(
                tokens = part.len(),
                ms = t.elapsed().as_secs_f64() * 1e3,
                "prefill call"
            );
            self.fed.extend_from_slice(part);
            rest = tail;
            self.take_snapshot_if_due();
        }
        Ok(())
    }

    /// Runs one decoded token (see [`Routes`]); leaves its logits in `self.logits`.
    fn decode(&mut self, token: u32, routes: &Routes, decoded: usize) -> Result<()> {
        if matches!(routes, Routes::Router) {
            return self.feed(&[token], &CancelToken::new(), None);
        }
        self.take_snapshot_if_due();
        self.llm
            .decode_into(&mut self.state, token, routes, decoded, &mut self.logits)?;
        self.fed.push(token);
        self.take_snapshot_if_due();
        Ok(())
    }

    fn take_snapshot_if_due(&mut self) {
        if self
            .snapshot_at
            .as_ref()
            .is_some_and(|(at, _)| *at == self.fed.len())
            && let Some((fed, text)) = self.snapshot_at.take()
        {
            let (t, at) = (Instant::now(), fed);
            match &mut self.snapshot {
                // The snapshot it replaces lends its memory.
                Some(snap) => {
                    snap.state.clone_from(&self.state);
                    snap.fed = fed;
                    snap.text = text;
                }
                None => {
                    self.snapshot = Some(Snapshot {
                        state: self.state.clone(),
                        fed,
                        text,
                    })
                }
            }
            tracing::debug!(
                at,
                ms = t.elapsed().as_secs_f64() * 1e3,
                "conversation snapshot"
            );
        }
    }
}

/// Applies one stream event to the completion and the callback; true when it ends generation.
fn emit(ev: StreamEvent, out: &mut Completion, on_event: &mut dyn FnMut(Event)) -> bool {
    match ev {
        StreamEvent::Content(s) => {
            out.content.push_str(&s);
            on_event(Event::Content(s));
        }
        StreamEvent::Reasoning(s) => {
            out.reasoning.push_str(&s);
            on_event(Event::Reasoning(s));
        }
        StreamEvent::ToolCall(c) => {
            out.tool_calls.push(c.clone());
            on_event(Event::ToolCall(c));
        }
        StreamEvent::Stopped(StopReason::StopString(_) | StopReason::StopToken(_)) => return true,
    }
    false
}
