//! [`Session`]: one conversation over an [`Llm`], its turns (chat and raw generation), the
//! prefill of their new tokens and the decode loop that streams [`Event`]s.

use std::sync::Arc;
use std::time::Instant;

use super::{CancelToken, Completion, Event, FinishReason, GenOptions, Llm, Routes, Usage};
use crate::error::{Error, Result};
use crate::model::Logits;
use crate::model::state::SeqState;
use crate::text::{
    Message, Sampler, StopReason, StreamEvent, StreamOptions, TextStream, ToolSchemas,
    prompt_opens_reasoning,
};

/// One conversation with its model state.
#[derive(Debug)]
pub struct Session {
    pub(super) llm: Arc<Llm>,
    pub(super) state: SeqState,
    /// Every token fed into `state`, in order.
    pub(super) fed: Vec<u32>,
    pub(super) messages: Vec<Message>,
    /// The text `fed` stands for (rendered prompts and generated replies).
    pub(super) text: String,
    /// Tokens prefilled by the last turn (for tests and stats).
    pub(super) prefilled: usize,
    /// The state at the end of the last turn's messages, before its generation prompt.
    pub(super) snapshot: Option<Snapshot>,
    /// Where (tokens fed, text) the next feed should take that snapshot.
    pub(super) snapshot_at: Option<(usize, String)>,
    /// [V] logits of the last token fed, reused from token to token.
    pub(super) logits: Vec<f32>,
}

/// A copy of the state at a known point of the conversation.
#[derive(Debug, Clone)]
pub(super) struct Snapshot {
    pub(super) state: SeqState,
    pub(super) fed: usize,
    pub(super) text: String,
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
        self.snapshot = None;
        self.renew_state();
        self.fed.clear();
        self.messages.clear();
        self.text.clear();
        self.snapshot_at = None;
    }

    /// A fresh state: this one cleared in place where the host holds it (the 35B's 60 MB of
    /// recurrent state zeroed in 8 ms against 65 ms for new pages, 2-core development VM),
    /// else let go of before a new one is taken, so that an engine that keeps ended
    /// sequences' states (the GPU's) hands this one's back at once.
    fn renew_state(&mut self) {
        if self.state.clear_host() {
            return;
        }
        self.state = SeqState::empty();
        self.state = self.llm.new_state();
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
                self.snapshot = None;
                self.renew_state();
                self.fed.clear();
                self.text.clear();
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
                self.renew_state();
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
        let mut sampler = Sampler::new(llm.sampling(opts), llm.model.cfg.vocab_size)?;
        // A greedy sampler needs only the largest logit's id, and one without penalties and
        // with a top-k only the most likely few, which a GPU hands back without the whole
        // vocabulary's logits.
        let want = sampler.want();
        let vocab = llm.model.cfg.vocab_size;
        self.feed(prompt, want, &cancel, opts.deadline)?;
        // What the last token fed asked for (`want`); the buffer goes back to the session
        // at the end.
        let mut logits = std::mem::take(&mut self.logits);
        self.prefilled = prompt.len();
        usage.prefill_s = t0.elapsed().as_secs_f64();
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
            let next = sampler.pick(&mut logits, vocab, &self.fed);
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
            self.decode(next, want, &opts.routes, out.tokens.len() - 1)?;
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
            self.decode(last, want, &opts.routes, out.tokens.len() - 1)?;
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

    /// Runs `ids` through the model, appending them to the state; leaves what `want` asks of
    /// the last token in `self.logits` (the earlier chunks ask for none).
    fn feed(
        &mut self,
        ids: &[u32],
        want: Logits,
        cancel: &CancelToken,
        deadline: Option<Instant>,
    ) -> Result<()> {
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
            let want = want.for_chunk(tail.is_empty());
            self.llm
                .forward_into(&mut self.state, part, want, &mut self.logits)?;
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

    /// Runs one decoded token (see [`Routes`]); leaves what `want` asks of it in
    /// `self.logits`.
    fn decode(&mut self, token: u32, want: Logits, routes: &Routes, decoded: usize) -> Result<()> {
        if matches!(routes, Routes::Router) {
            return self.feed(&[token], want, &CancelToken::new(), None);
        }
        self.take_snapshot_if_due();
        self.llm.decode_into(
            &mut self.state,
            token,
            want,
            routes,
            decoded,
            &mut self.logits,
        )?;
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
