//! [`Batcher`]: continuous batching of forward calls made from several threads.
//!
//! Each sequence (a [`crate::session::Session`], a server slot) stays an ordinary blocking
//! caller of `forward`; the batcher's one scheduler thread gathers the calls waiting at a
//! step and runs them as one engine step ([`Forward::step_parts`]), so sequences decoding
//! together read the dense weights once. A call joins between two steps and leaves when
//! its last part ran; a long prompt goes in chunks of the engine's size, one chunk a step,
//! beside the other sequences' decoded tokens, so it delays them by a chunk at a time
//! instead of stalling them for the whole prompt. Chunks keep the boundaries they would have
//! alone, so a sequence's results do not depend on what runs beside it where the engine's
//! are not (the CPU engine's: `cpu/engine.rs`).
//!
//! Between steps the scheduler waits, at most [`GATHER`], for every sequence that is inside a
//! generation ([`Batcher::join`]) to hand in its next call: a decoding sequence samples its
//! next token between two calls, and stepping without it would split the batch in two.
//!
//! It must not know about text, sessions or HTTP.

use std::collections::VecDeque;
use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::engine::driver::{Forward, Part};
use crate::error::{Error, Result};
use crate::model::Logits;
use crate::model::state::SeqState;

/// Longest the scheduler waits for the sequences of a generation to hand in their calls.
pub const GATHER: Duration = Duration::from_millis(5);

/// Continuous batching in front of a [`Forward`] (see the module).
#[derive(Debug)]
pub struct Batcher {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
}

#[derive(Debug, Default)]
struct Queue {
    waiting: VecDeque<Call>,
    /// Sequences inside a generation (their next call is coming).
    joined: usize,
    closed: bool,
}

/// A call handed to the scheduler: owned, so the caller's thread only waits.
#[derive(Debug)]
struct Call {
    state: SeqState,
    tokens: Vec<u32>,
    want: Logits,
    out: Vec<f32>,
    /// Tokens fed so far.
    fed: usize,
    reply: SyncSender<(SeqState, Vec<f32>, Result<()>)>,
}

/// A sequence inside a generation, from [`Batcher::join`] until dropped.
#[derive(Debug)]
pub struct Joined {
    shared: Arc<Shared>,
}

impl Drop for Joined {
    fn drop(&mut self) {
        let mut q = lock(&self.shared.queue);
        q.joined = q.joined.saturating_sub(1);
        drop(q);
        self.shared.wake.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Batcher {
    /// Starts the scheduler thread over `forward` (shared with direct callers, who lock it
    /// between steps).
    pub fn spawn(forward: Arc<Mutex<Forward<'static>>>) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        std::thread::Builder::new()
            .name("brook-batch".into())
            .spawn(move || schedule(&s, &forward))
            .map_err(|e| Error::Invalid(format!("cannot start the batch scheduler: {e}")))?;
        Ok(Batcher { shared })
    }

    /// Marks a sequence as generating until the guard drops: the scheduler then waits for
    /// its calls between steps (at most [`GATHER`]).
    pub fn join(&self) -> Joined {
        lock(&self.shared.queue).joined += 1;
        Joined {
            shared: self.shared.clone(),
        }
    }

    /// Feeds `tokens` into `state` in the next steps, beside other callers' calls, and
    /// leaves the logits asked for in `out` (replaced), as [`Forward::forward_into`].
    pub fn forward_into(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::Invalid("no tokens to feed".into()));
        }
        let (tx, rx) = sync_channel(1);
        let mut call = Call {
            state: std::mem::replace(state, SeqState::empty()),
            tokens: tokens.to_vec(),
            want,
            out: std::mem::take(out),
            fed: 0,
            reply: tx,
        };
        call.out.clear();
        {
            let mut q = lock(&self.shared.queue);
            if q.closed {
                *state = call.state;
                return Err(Error::Invalid("the batch scheduler has stopped".into()));
            }
            q.waiting.push_back(call);
        }
        self.shared.wake.notify_all();
        match rx.recv() {
            Ok((st, o, r)) => {
                *state = st;
                *out = o;
                r
            }
            Err(_) => Err(Error::Invalid(
                "the batch scheduler stopped during the call; the state is lost, start the sequence again".into(),
            )),
        }
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        lock(&self.shared.queue).closed = true;
        self.shared.wake.notify_all();
    }
}

/// The scheduler thread: gather, step, answer, until the batcher is dropped.
fn schedule(shared: &Shared, forward: &Mutex<Forward<'static>>) {
    let mut active: Vec<Call> = Vec::new();
    loop {
        let gathered = if active.is_empty() {
            match gather(shared) {
                Some((calls, waited)) => {
                    active.extend(calls);
                    waited
                }
                None => return,
            }
        } else {
            // A prompt still in chunks: whoever has handed in a call joins the next step.
            active.extend(lock(&shared.queue).waiting.drain(..));
            Duration::ZERO
        };
        let mut fw = lock(forward);
        fw.count_gather(gathered);
        let caps = fw.engine().caps();
        let (max_seqs, max_tokens, chunk) = (
            caps.max_seqs.max(1),
            caps.max_tokens.max(1),
            caps.max_chunk.max(1),
        );
        let mut pick = pick_parts(&active, max_seqs, max_tokens, chunk);
        let mut parts: Vec<Part<'_>> = Vec::with_capacity(pick.len());
        pick.sort_unstable();
        let mut picked = pick.iter().peekable();
        for (j, c) in active.iter_mut().enumerate() {
            let Some(&(_, n)) = picked.next_if(|p| p.0 == j) else {
                continue;
            };
            let last = c.fed + n == c.tokens.len();
            let want = c.want.for_chunk(last);
            parts.push(Part {
                state: &mut c.state,
                tokens: &c.tokens[c.fed..c.fed + n],
                want,
                out: &mut c.out,
                result: Ok(()),
            });
        }
        // A panic in a step (a bug) fails that step's calls, not the scheduler: a caller
        // waiting on a scheduler that died would wait forever.
        let ran =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fw.step_parts(&mut parts)));
        let results: Vec<Result<()>> = match ran {
            Ok(()) => parts.into_iter().map(|p| p.result).collect(),
            Err(panic) => {
                let what = crate::util::panic_message(&*panic);
                tracing::error!("a batched forward step panicked: {what}");
                let fresh = fw.new_state(0);
                parts
                    .into_iter()
                    .map(|p| {
                        // Half-updated: start afresh, as after a failed step.
                        p.state.clone_from(&fresh);
                        Err(Error::Invalid(format!("the forward step panicked: {what}")))
                    })
                    .collect()
            }
        };
        // Answer the calls that are done or failed; the rest stay for the next step.
        let mut done = Vec::new();
        for (&(i, n), r) in pick.iter().zip(results) {
            let c = &mut active[i];
            match r {
                Ok(()) => {
                    c.fed += n;
                    if c.fed == c.tokens.len() {
                        done.push((i, Ok(())));
                    }
                }
                Err(e) => done.push((i, Err(e))),
            }
        }
        for _ in &done {
            fw.count_call();
        }
        drop(fw);
        done.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
        for (i, r) in done {
            let c = active.swap_remove(i);
            // The caller may have gone (a panic in its thread); nothing to answer then.
            let _ = c.reply.send((c.state, c.out, r));
        }
    }
}

/// Waits for calls while none is active, then gathers the calls of every sequence inside a
/// generation (at most [`GATHER`] more): the calls, and the time waited for callers inside
/// a generation (the wait for the first while someone is generating, at most GATHER: longer,
/// nobody's call was coming, as when the last one's generation ends; then the gathering of
/// the rest). `None` once the batcher is dropped and no call is left.
fn gather(shared: &Shared) -> Option<(Vec<Call>, Duration)> {
    let mut q = lock(&shared.queue);
    let since = Instant::now();
    let mut callers = q.joined > 0;
    while q.waiting.is_empty() && !q.closed {
        q = shared.wake.wait(q).unwrap_or_else(|p| p.into_inner());
        callers &= q.joined > 0;
    }
    if q.closed && q.waiting.is_empty() {
        return None;
    }
    let first = since.elapsed();
    let mut waited = if callers && first <= GATHER {
        first
    } else {
        Duration::ZERO
    };
    // Everyone generating hands in a call, or the wait ends.
    let start = Instant::now();
    let until = start + GATHER;
    while q.waiting.len() < q.joined && !q.closed {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        q = shared
            .wake
            .wait_timeout(q, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    waited += start.elapsed();
    Some((q.waiting.drain(..).collect(), waited))
}

/// This step's (call, tokens), in `active`'s order of picking: decoded tokens first (cheap,
/// and someone waits on each), then chunks of prompts in arrival order while they fit the
/// engine's `max_seqs` and `max_tokens`.
fn pick_parts(
    active: &[Call],
    max_seqs: usize,
    max_tokens: usize,
    chunk: usize,
) -> Vec<(usize, usize)> {
    let mut pick: Vec<(usize, usize)> = Vec::new();
    let mut tokens = 0;
    for single in [true, false] {
        for (i, c) in active.iter().enumerate() {
            let n = (c.tokens.len() - c.fed).min(chunk);
            if (n == 1) != single || pick.len() == max_seqs {
                continue;
            }
            if pick.is_empty() || tokens + n <= max_tokens {
                pick.push((i, n));
                tokens += n;
            }
        }
    }
    pick
}
