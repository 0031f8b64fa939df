//! [`Batch`]: several sequences driven by one program, one engine step at a time.
//!
//! The library face of batched decoding, beside [`crate::session::Session`] (one conversation,
//! blocking calls) and the batcher behind sessions on several threads: a program adds
//! sequences (prompt ids and generation options) whenever it likes, calls [`Batch::step`], and
//! gets back the token each sequence sampled in that step. Every live sequence takes part in
//! every step: a prompt in chunks of the engine's size, then one token at a time; a sequence
//! joins or leaves between two steps. Each sequence's tokens are the ones it would generate
//! alone (the engines' steps keep each sequence's bits: `cpu/engine.rs`). It must not know
//! about text, templates or HTTP: it works in token ids.

use std::sync::Arc;

use crate::engine::Part;
use crate::error::{Error, Result};
use crate::model::Logits;
use crate::model::state::SeqState;
use crate::session::{FinishReason, GenOptions, Llm};
use crate::text::Sampler;

/// A sequence's handle in a [`Batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// What one sequence did in a [`Batch::step`].
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// It read this many more prompt tokens (no token sampled yet).
    Prefilled(usize),
    /// It sampled a token; `finish` is set when that token ends it (the sequence then leaves
    /// the batch; its state is dropped).
    Token {
        token: u32,
        finish: Option<FinishReason>,
    },
    /// Its step failed; the sequence left the batch.
    Failed(String),
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    state: SeqState,
    prompt: Vec<u32>,
    /// Prompt tokens fed.
    fed: usize,
    /// Every token fed or sampled (the samplers' penalty history).
    history: Vec<u32>,
    sampler: Sampler,
    stop_ids: Vec<u32>,
    max_tokens: usize,
    generated: usize,
    /// The sampled token to feed next.
    next: Option<u32>,
    logits: Vec<f32>,
}

/// Sequences decoded together; see the module.
#[derive(Debug)]
pub struct Batch {
    llm: Arc<Llm>,
    seqs: Vec<Seq>,
    next_id: u64,
}

impl Batch {
    /// An empty batch over `llm`'s engine (steps take its lock, so other users of the same
    /// `Llm` wait between steps).
    pub fn new(llm: Arc<Llm>) -> Self {
        Batch {
            llm,
            seqs: Vec::new(),
            next_id: 0,
        }
    }

    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Adds a sequence that reads `prompt` and then generates as `opts` say (sampling,
    /// `max_tokens`, `ignore_eos`; stop strings and templates are text and belong to the
    /// caller). It takes part from the next step on.
    pub fn add(&mut self, prompt: &[u32], opts: &GenOptions) -> Result<SeqId> {
        let context = self.llm.options.context;
        if prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty".into()));
        }
        if prompt.len() >= context {
            return Err(Error::Invalid(format!(
                "the prompt needs {} tokens but the context is {context}; raise --context or shorten it",
                prompt.len()
            )));
        }
        crate::model::check_tokens(prompt, self.llm.model.cfg.vocab_size)?;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let sampler = Sampler::new(self.llm.sampling(opts), self.llm.model.cfg.vocab_size)?;
        self.seqs.push(Seq {
            id,
            state: self.llm.new_state(),
            prompt: prompt.to_vec(),
            fed: 0,
            history: Vec::with_capacity(prompt.len() + 64),
            sampler,
            stop_ids: self.llm.stop_ids(opts),
            max_tokens: opts
                .max_tokens
                .unwrap_or(usize::MAX)
                .min(context - prompt.len()),
            generated: 0,
            next: None,
            logits: Vec::new(),
        });
        Ok(id)
    }

    /// Takes a sequence out (cancelled by its caller); false if it is not in the batch.
    pub fn remove(&mut self, id: SeqId) -> bool {
        let before = self.seqs.len();
        self.seqs.retain(|s| s.id != id);
        self.seqs.len() != before
    }

    /// One engine step for every sequence: the next chunk of each prompt still being read and
    /// the last sampled token of the others; then each sequence whose prompt is done samples.
    /// Sequences that finish (a stop id, `max_tokens`, the context) leave the batch.
    pub fn step(&mut self) -> Result<Vec<(SeqId, SeqEvent)>> {
        if self.seqs.is_empty() {
            return Ok(Vec::new());
        }
        let chunk = self.llm.options.prefill_chunk.max(1);
        let feeds: Vec<(Vec<u32>, Logits)> = self
            .seqs
            .iter()
            .map(|s| {
                // Only what the sampler needs (the greedy pick, the most likely few).
                let want = s.sampler.want();
                if s.fed < s.prompt.len() {
                    let end = (s.fed + chunk).min(s.prompt.len());
                    (
                        s.prompt[s.fed..end].to_vec(),
                        want.for_chunk(end == s.prompt.len()),
                    )
                } else {
                    (vec![s.next.expect("a sampled token to feed")], want)
                }
            })
            .collect();
        let results: Vec<Result<()>> = {
            let mut parts: Vec<Part<'_>> = self
                .seqs
                .iter_mut()
                .zip(&feeds)
                .map(|(s, (tokens, want))| {
                    s.logits.clear();
                    Part {
                        state: &mut s.state,
                        tokens,
                        want: *want,
                        out: &mut s.logits,
                        result: Ok(()),
                    }
                })
                .collect();
            self.llm.step_parts(&mut parts);
            parts.into_iter().map(|p| p.result).collect()
        };
        let context = self.llm.options.context;
        let vocab = self.llm.model.cfg.vocab_size;
        let mut events = Vec::with_capacity(self.seqs.len());
        let mut leave = Vec::new();
        for ((s, (tokens, _)), r) in self.seqs.iter_mut().zip(&feeds).zip(results) {
            if let Err(e) = r {
                events.push((s.id, SeqEvent::Failed(e.to_string())));
                leave.push(s.id);
                continue;
            }
            s.history.extend_from_slice(tokens);
            if s.fed < s.prompt.len() {
                s.fed += tokens.len();
                if s.fed < s.prompt.len() {
                    events.push((s.id, SeqEvent::Prefilled(tokens.len())));
                    continue;
                }
            }
            let token = s.sampler.pick(&mut s.logits, vocab, &s.history);
            s.generated += 1;
            let finish = if s.stop_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if s.generated >= s.max_tokens || s.state.pos + 1 >= context {
                Some(FinishReason::Length)
            } else {
                None
            };
            s.next = Some(token);
            if finish.is_some() {
                leave.push(s.id);
            }
            events.push((s.id, SeqEvent::Token { token, finish }));
        }
        self.seqs.retain(|s| !leave.contains(&s.id));
        Ok(events)
    }
}
