//! [`Forward`]: the driver that owns the shell every engine shares.
//!
//! Token checks, the context limit, splitting a call into steps of at most the engine's
//! chunk, which logits each step keeps, placing the state where the engine computes, starting
//! a state afresh after a failed step, and counting: written once here, so an engine writes
//! only its per-step maths. Mirrors mlx-lm's `generate_step` prefill loop (chunks of
//! `prefill_step_size`, logits of the last chunk only).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::engine::{Engine, GivenRoutes, GpuStats, Routing, SeqStep, Step, Trace};
use crate::error::{Error, Result};
use crate::model::state::SeqState;
use crate::model::{Logits, Model, check_tokens};

/// What a [`Forward`] reports: which engine ran and how much.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    /// "reference", "cpu" or "cuda".
    pub engine: String,
    /// Calls through this driver ([`Forward::forward`]).
    pub forward_calls: u64,
    /// Engine steps those calls made (a long prompt takes several).
    pub steps: u64,
    /// Tokens fed.
    pub tokens: u64,
    /// Microseconds spent inside engine steps (from the step's start to its logits on the
    /// host): against wall time, how busy the engine was; the rest went to sampling, text,
    /// scheduling and waiting for callers.
    pub busy_us: u64,
    /// Microseconds the batch scheduler waited between steps for sequences inside a
    /// generation to hand in their next call (their sampling, text and streaming, on their
    /// own threads): the part of the engine's idle time its callers cause.
    pub gather_us: u64,
    /// Steps each engine has run over this driver's model (any driver), by engine name: a
    /// test can tell that the engine asked for ran and no other did.
    pub model_steps: Vec<(String, u64)>,
}

/// A driver's counts, readable from other threads while a call runs (a server's `/health`).
#[derive(Debug, Default)]
pub struct Counters {
    calls: AtomicU64,
    steps: AtomicU64,
    tokens: AtomicU64,
    busy_us: AtomicU64,
    gather_us: AtomicU64,
}

impl Counters {
    /// The counts as stats of `engine` over `model`.
    pub fn stats(&self, engine: &str, model: &Model) -> EngineStats {
        EngineStats {
            engine: engine.to_string(),
            forward_calls: self.calls.load(Ordering::Relaxed),
            steps: self.steps.load(Ordering::Relaxed),
            tokens: self.tokens.load(Ordering::Relaxed),
            busy_us: self.busy_us.load(Ordering::Relaxed),
            gather_us: self.gather_us.load(Ordering::Relaxed),
            model_steps: model.step_counts(),
        }
    }
}

/// The door to the forward pass: an engine behind the shared shell.
#[derive(Debug)]
pub struct Forward<'m> {
    engine: Box<dyn Engine + 'm>,
    /// Longest sequence a state may reach.
    context: usize,
    counters: Arc<Counters>,
    /// The logits of the last call, reused from call to call (the 35B's are 1 MB).
    out: Vec<f32>,
}

impl<'m> Forward<'m> {
    /// `engine` behind the driver, with no context limit of its own (the engine's apply).
    pub fn new(engine: impl Engine + 'm) -> Self {
        Self::with_context(Box::new(engine), usize::MAX)
    }

    /// A boxed engine whose states may hold at most `context` tokens.
    pub fn with_context(engine: Box<dyn Engine + 'm>, context: usize) -> Self {
        Forward {
            engine,
            context,
            counters: Arc::default(),
            out: Vec::new(),
        }
    }

    /// The f32 reference pass over `model`.
    pub fn reference(model: &'m Model) -> Self {
        Self::new(crate::engine::Reference::new(model))
    }

    pub fn engine(&self) -> &dyn Engine {
        self.engine.as_ref()
    }

    pub fn engine_mut(&mut self) -> &mut (dyn Engine + 'm) {
        self.engine.as_mut()
    }

    pub fn name(&self) -> &'static str {
        self.engine.name()
    }

    pub fn model(&self) -> &Model {
        self.engine.model()
    }

    /// A fresh state with room for `reserve_tokens` (see [`Engine::new_state`]).
    pub fn new_state(&self, reserve_tokens: usize) -> SeqState {
        self.engine.new_state(reserve_tokens)
    }

    /// Feeds `tokens` into `state` and returns the logits asked for: \[T, V\], \[V\] or empty.
    pub fn forward(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<&[f32]> {
        self.forward_traced(state, tokens, want, None)
    }

    /// [`Forward::forward`] reporting intermediate values to `trace` (engines that can).
    pub fn forward_traced(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        trace: Trace<'_>,
    ) -> Result<&[f32]> {
        self.forward_own(state, tokens, want, Routing::Router, trace)
    }

    /// [`Forward::forward_into`] with the routed experts given (a routing trace replayed) or
    /// the router's, reporting intermediate values to `trace` (engines that can).
    pub fn forward_with(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        routing: Routing<'_>,
        trace: Trace<'_>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.run(state, tokens, want, routing, trace, out)
    }

    /// A call whose logits land in the driver's own buffer.
    fn forward_own(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        routing: Routing<'_>,
        trace: Trace<'_>,
    ) -> Result<&[f32]> {
        let mut out = std::mem::take(&mut self.out);
        let r = self.run(state, tokens, want, routing, trace, &mut out);
        self.out = out;
        r.map(|()| &self.out[..])
    }

    /// [`Forward::forward`] into the caller's buffer (replaced, its memory reused).
    pub fn forward_into(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.run(state, tokens, want, Routing::Router, None, out)
    }

    fn run(
        &mut self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        routing: Routing<'_>,
        trace: Trace<'_>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let c = &self.counters;
        c.calls.fetch_add(1, Ordering::Relaxed);
        let call = Call {
            state,
            tokens,
            want,
            routing,
            trace,
            context: self.context,
        };
        let t = Instant::now();
        let steps = drive(self.engine.as_mut(), call, out);
        c.busy_us
            .fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        let steps = steps?;
        c.steps.fetch_add(steps, Ordering::Relaxed);
        c.tokens.fetch_add(tokens.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// One engine step over several sequences' parts (each at most the engine's chunk, all
    /// together within its [`Caps`]): the shell of [`Forward::forward`] for each (token
    /// checks, the context limit, placement), then one step, appending each part's logits to
    /// its `out`. A part whose checks fail is left out and reported in its `result`; if the
    /// step fails, every state in it starts afresh and each part reports the error.
    ///
    /// [`Caps`]: super::Caps
    pub fn step_parts(&mut self, parts: &mut [Part<'_>]) {
        let caps = self.engine.caps();
        let (vocab, context) = (self.engine.model().cfg.vocab_size, self.context);
        for p in parts.iter_mut() {
            p.result = if p.tokens.is_empty() || p.tokens.len() > caps.max_chunk.max(1) {
                Err(Error::Invalid(format!(
                    "a step part of {} tokens; the engine takes 1 to {}",
                    p.tokens.len(),
                    caps.max_chunk
                )))
            } else {
                check_feed(p.state, p.tokens, vocab, context)
                    .and_then(|()| self.engine.place(p.state, p.tokens.len()))
            };
        }
        let mut ok: Vec<&mut Part<'_>> = parts.iter_mut().filter(|p| p.result.is_ok()).collect();
        let mut start = 0;
        while start < ok.len() {
            // As many parts as the engine takes in one step.
            let (mut end, mut tokens) = (start, 0usize);
            while end < ok.len()
                && end - start < caps.max_seqs.max(1)
                && (end == start || tokens + ok[end].tokens.len() <= caps.max_tokens)
            {
                tokens += ok[end].tokens.len();
                end += 1;
            }
            let group = &mut ok[start..end];
            let lens: Vec<usize> = group.iter().map(|p| p.out.len()).collect();
            let mut seqs: Vec<SeqStep<'_>> = group
                .iter_mut()
                .map(|p| SeqStep {
                    state: &mut *p.state,
                    tokens: p.tokens,
                    want: p.want,
                    logits: &mut *p.out,
                })
                .collect();
            let t = Instant::now();
            let r = self.engine.step(Step {
                seqs: &mut seqs,
                routing: Routing::Router,
                trace: None,
            });
            self.counters
                .busy_us
                .fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
            drop(seqs);
            match r {
                Ok(()) => {
                    for (p, &at) in group.iter_mut().zip(&lens) {
                        if let Err(e) = settle_best(p.want, p.out, at, vocab) {
                            p.result = Err(e);
                        }
                    }
                    self.engine.model().count_step(self.engine.name());
                    self.counters.steps.fetch_add(1, Ordering::Relaxed);
                    self.counters
                        .tokens
                        .fetch_add(tokens as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    let msg = e.to_string();
                    for p in group.iter_mut() {
                        // Half-updated: start afresh (as `drive` does).
                        *p.state = self.engine.new_state(0);
                        p.result = Err(Error::Invalid(format!("a batched step failed: {msg}")));
                    }
                }
            }
            start = end;
        }
    }

    /// Counts time the batch scheduler waited for its callers (see [`EngineStats::gather_us`]).
    pub fn count_gather(&self, waited: std::time::Duration) {
        self.counters
            .gather_us
            .fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
    }

    /// Counts one call that [`Forward::step_parts`] fed (a request of several steps).
    pub fn count_call(&self) {
        self.counters.calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Which engine ran and how much.
    pub fn stats(&self) -> EngineStats {
        self.counters.stats(self.engine.name(), self.engine.model())
    }

    /// The counts behind [`Forward::stats`], to read while this driver is busy.
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// The GPU engine's counters, if a GPU runs.
    pub fn gpu_stats(&self) -> Option<GpuStats> {
        self.engine.gpu_stats()
    }
}

/// One sequence's part of [`Forward::step_parts`].
#[derive(Debug)]
pub struct Part<'a> {
    pub state: &'a mut SeqState,
    pub tokens: &'a [u32],
    pub want: Logits,
    /// Receives the logits asked for (appended).
    pub out: &'a mut Vec<f32>,
    /// Set by the step: whether this part ran.
    pub result: Result<()>,
}

/// One forward call: what [`drive`] feeds.
pub struct Call<'a, 't> {
    pub state: &'a mut SeqState,
    pub tokens: &'a [u32],
    pub want: Logits,
    pub routing: Routing<'a>,
    pub trace: Trace<'t>,
    /// Longest sequence the state may reach.
    pub context: usize,
}

impl std::fmt::Debug for Call<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Call")
            .field("tokens", &self.tokens.len())
            .field("want", &self.want)
            .field("routing", &self.routing)
            .finish_non_exhaustive()
    }
}

/// The shell around an engine's steps: checks `call`, places the state, feeds the tokens in
/// steps of at most the engine's chunk, keeps the logits asked for in `out` (replaced), and
/// starts the state afresh if a step fails. Returns the steps taken.
pub fn drive(
    engine: &mut (dyn Engine + '_),
    call: Call<'_, '_>,
    out: &mut Vec<f32>,
) -> Result<u64> {
    let Call {
        state,
        tokens,
        want,
        routing,
        mut trace,
        context,
    } = call;
    out.clear();
    let caps = engine.caps();
    check_feed(state, tokens, engine.model().cfg.vocab_size, context)?;
    if matches!(routing, Routing::Given(_)) && !caps.given_routes {
        return Err(Error::Invalid(format!(
            "the {} engine cannot replay a routing; use another --backend",
            engine.name()
        )));
    }
    if trace.is_some() && !caps.trace {
        return Err(Error::Invalid(format!(
            "the {} engine does not report intermediate values",
            engine.name()
        )));
    }
    engine.place(state, tokens.len())?;
    let chunk = caps.max_chunk.max(1);
    let n = tokens.len().div_ceil(chunk);
    let vocab = engine.model().cfg.vocab_size;
    for (i, part) in tokens.chunks(chunk).enumerate() {
        let want = want.for_chunk(i + 1 == n);
        let start = out.len();
        let mut seqs = [SeqStep {
            state: &mut *state,
            tokens: part,
            want,
            logits: &mut *out,
        }];
        // Given routes are indexed from the call's first token; a step's from its own.
        let shifted = Shifted {
            routing,
            by: i * chunk,
        };
        let step = Step {
            seqs: &mut seqs,
            routing: match routing {
                Routing::Given(_) if i > 0 => Routing::Given(&shifted),
                r => r,
            },
            trace: match trace {
                Some(ref mut f) => Some(&mut **f),
                None => None,
            },
        };
        if let Err(e) = engine
            .step(step)
            .and_then(|()| settle_best(want, out, start, vocab))
        {
            // The state may be half-updated: start the sequence afresh rather than let a
            // later call continue from garbage.
            *state = engine.new_state(0);
            return Err(e);
        }
        engine.model().count_step(engine.name());
    }
    Ok(n as u64)
}

/// After a step asked for [`Logits::Best`]: an engine that handed back the last position's
/// logits (`out[start..]`, `vocab` floats) has them reduced to the id; one that handed back
/// the id is left alone.
fn settle_best(want: Logits, out: &mut Vec<f32>, start: usize, vocab: usize) -> Result<()> {
    if want != Logits::Best {
        return Ok(());
    }
    match out.len().saturating_sub(start) {
        1 => Ok(()),
        n if n == vocab => {
            let id = crate::model::argmax(&out[start..]);
            out.truncate(start);
            out.push(Logits::best_float(id));
            Ok(())
        }
        n => Err(Error::Invalid(format!(
            "the engine handed back {n} floats for a greedy pick (expected 1 or {vocab})"
        ))),
    }
}

/// The checks every feed passes before an engine sees it: token ids inside the vocabulary,
/// and room for them within `context`.
fn check_feed(state: &SeqState, tokens: &[u32], vocab: usize, context: usize) -> Result<()> {
    check_tokens(tokens, vocab)?;
    if state.pos.saturating_add(tokens.len()) > context {
        return Err(Error::Invalid(format!(
            "context full: {} + {} tokens exceed the context of {context} (open with a larger --context)",
            state.pos,
            tokens.len(),
        )));
    }
    Ok(())
}

/// Given routes seen from a later step of the same call: token `t` of the step is token
/// `by + t` of the call.
struct Shifted<'a> {
    routing: Routing<'a>,
    by: usize,
}

impl GivenRoutes for Shifted<'_> {
    fn experts(&self, seq: usize, token: usize, layer: usize) -> Option<&[u32]> {
        match self.routing {
            Routing::Given(g) => g.experts(seq, self.by + token, layer),
            Routing::Router => None,
        }
    }
}

/// One call through [`drive`] on an engine that keeps its own logits buffer (`buf` finds it):
/// the shorthand `forward` of an engine used alone (tests, benchmarks), with no context limit
/// beyond the engine's.
pub fn drive_own<'e, E: Engine>(
    engine: &'e mut E,
    buf: fn(&mut E) -> &mut Vec<f32>,
    state: &mut SeqState,
    tokens: &[u32],
    want: Logits,
    trace: Trace<'_>,
) -> Result<&'e [f32]> {
    let mut out = std::mem::take(buf(engine));
    let call = Call {
        state,
        tokens,
        want,
        routing: Routing::Router,
        trace,
        context: usize::MAX,
    };
    let r = drive(engine, call, &mut out);
    *buf(engine) = out;
    r?;
    Ok(&buf(engine)[..])
}
