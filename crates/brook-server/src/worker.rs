//! The model workers: `parallel` OS threads (slots), each owning one [`Session`] and running
//! one request at a time from a shared bounded queue, streaming their events back to the HTTP
//! handlers. Slots generate at the same time; the [`Llm`]'s batcher runs their forward calls
//! as shared steps (continuous batching: a request joins or leaves between two steps).
//!
//! The queue admits `parallel` running requests plus `queue` waiting ones; beyond that
//! `reserve` refuses (the handler answers 429). A free slot takes the oldest waiting job of
//! the client whose conversation it holds, else the oldest job no other free slot holds the
//! conversation of, so a client's next turn lands where its state is. A handler reserves its place before it renders and
//! tokenizes the prompt, so that work is bounded by the queue too. A [`Ticket`] is the handler's side of a job: dropping it
//! (the client went away, so axum dropped the response stream or the handler future) cancels
//! the job through its [`CancelToken`], and a job whose receiver is gone is cancelled at its
//! next event too, so the model is free for the next request within a token. A chat request
//! hands the session its history and then its last message, so a conversation that extends the
//! previous one reuses the kept state (the session finds the shared prefix itself), but only
//! for the same client: a job from another client (another API key or `user`) starts from a
//! fresh state on its slot, so no client can learn from `cached_tokens` or timings what another sent.
//!
//! It must not know about HTTP or JSON: errors come back as [`ApiError`] values only because
//! that is the type the handlers answer with. Generation runs off the async runtime, since a
//! forward pass blocks for tens of milliseconds or more.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use brook_core::session::{CancelToken, Completion, Event, GenOptions, Llm, Session};
use brook_core::text::{Message, StreamOptions, TextStream};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::metrics::Metrics;

/// What a job asks the model to do.
#[derive(Debug)]
pub enum Work {
    /// Continue `history` with `last` through the chat template.
    Chat {
        history: Vec<Message>,
        last: Message,
    },
    /// Complete raw token ids (no template).
    Raw { ids: Vec<u32> },
}

/// What the worker sends back for a job, in order: `Started`, `Event`s, then `Done` or
/// `Failed`.
#[derive(Debug)]
pub enum Out {
    /// The job left the queue after waiting this long.
    Started {
        queued_s: f64,
    },
    Event(Event),
    Done(Box<Completion>),
    Failed(ApiError),
}

#[derive(Debug)]
struct Job {
    work: Work,
    /// Whose conversation this is: the session's kept state is reused only for the same one.
    client: String,
    opts: GenOptions,
    cancel: CancelToken,
    tx: mpsc::UnboundedSender<Out>,
    queued_at: Instant,
    _slot: SlotGuard,
}

/// A place in the queue, given back once: when the job is done, failed or skipped, or as soon
/// as its client leaves (a cancelled job no longer counts, even before the worker drops it).
#[derive(Debug)]
struct Slot {
    admitted: Arc<AtomicUsize>,
    held: AtomicBool,
}

impl Slot {
    fn release(&self) {
        if self.held.swap(false, Ordering::SeqCst) {
            self.admitted.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Gives the slot back when dropped: with the job, or with a reservation never submitted.
#[derive(Debug)]
struct SlotGuard(Arc<Slot>);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// The handler's end of a submitted job. Dropping it cancels the job and frees its place.
#[derive(Debug)]
pub struct Ticket {
    pub events: mpsc::UnboundedReceiver<Out>,
    cancel: CancelToken,
    slot: Arc<Slot>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.slot.release();
    }
}

/// The bounded queue in front of the worker threads.
#[derive(Debug)]
pub struct Queue {
    dispatch: Arc<Dispatch>,
    /// Jobs admitted and not yet finished (running + waiting).
    admitted: Arc<AtomicUsize>,
    /// Waiting jobs allowed besides the running ones.
    pub waiting_limit: usize,
    /// Slots: requests that run at once.
    pub parallel: usize,
}

/// Jobs waiting for a slot, and which free slot holds whose conversation.
#[derive(Debug, Default)]
struct Dispatch {
    state: std::sync::Mutex<Waiting>,
    wake: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct Waiting {
    jobs: std::collections::VecDeque<Job>,
    /// Free slots and the client whose conversation each holds.
    free: Vec<(usize, Option<String>)>,
    closed: bool,
}

impl Drop for Queue {
    fn drop(&mut self) {
        lock(&self.dispatch.state).closed = true;
        self.dispatch.wake.notify_all();
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Dispatch {
    /// The next job for free slot `slot` holding `owner`'s conversation, waiting for one;
    /// `None` once the queue is gone.
    fn next(&self, slot: usize, owner: &Option<String>) -> Option<Job> {
        let mut w = lock(&self.state);
        w.free.push((slot, owner.clone()));
        self.wake.notify_all();
        loop {
            if w.closed {
                return None;
            }
            let mine = w
                .jobs
                .iter()
                .position(|j| owner.as_deref() == Some(j.client.as_str()));
            let pick = mine.or_else(|| {
                w.jobs.iter().position(|j| {
                    !w.free
                        .iter()
                        .any(|(s, o)| *s != slot && o.as_deref() == Some(j.client.as_str()))
                })
            });
            if let Some(i) = pick {
                w.free.retain(|(s, _)| *s != slot);
                return w.jobs.remove(i);
            }
            w = self.wake.wait(w).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Which kind of request last fed the session: raw ids bypass the template, so the session's
/// text bookkeeping only stays valid while the kind does not change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Chat,
    Raw,
}

impl Queue {
    /// Starts `parallel` worker threads for `llm`.
    pub fn spawn(
        llm: Arc<Llm>,
        parallel: usize,
        waiting_limit: usize,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Self> {
        let dispatch = Arc::new(Dispatch::default());
        let parallel = parallel.max(1);
        for slot in 0..parallel {
            let (llm, d, m) = (llm.clone(), dispatch.clone(), metrics.clone());
            std::thread::Builder::new()
                .name(format!("brook-slot-{slot}"))
                .spawn(move || worker_loop(llm, slot, &d, &m))?;
        }
        Ok(Self {
            dispatch,
            admitted: Arc::new(AtomicUsize::new(0)),
            waiting_limit,
            parallel,
        })
    }

    /// Jobs admitted and not finished (the running one included).
    pub fn len(&self) -> usize {
        self.admitted.load(Ordering::SeqCst)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes a place in the queue, or answers `None` when the queue is full. The place is
    /// given back when the reservation is dropped unused.
    pub fn reserve(&self) -> Option<Reservation> {
        let limit = self.waiting_limit.saturating_add(self.parallel);
        let admitted = self
            .admitted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < limit).then_some(n + 1)
            });
        if admitted.is_err() {
            return None;
        }
        Some(Reservation(SlotGuard(Arc::new(Slot {
            admitted: self.admitted.clone(),
            held: AtomicBool::new(true),
        }))))
    }

    /// Queues a job for `client` in the place `reserved`.
    pub fn submit(
        &self,
        reserved: Reservation,
        client: String,
        work: Work,
        mut opts: GenOptions,
    ) -> Ticket {
        let slot = reserved.0.0.clone();
        let cancel = CancelToken::new();
        opts.cancel = Some(cancel.clone());
        let (tx, rx) = mpsc::unbounded_channel();
        let job = Job {
            work,
            client,
            opts,
            cancel: cancel.clone(),
            tx,
            queued_at: Instant::now(),
            _slot: reserved.0,
        };
        lock(&self.dispatch.state).jobs.push_back(job);
        self.dispatch.wake.notify_all();
        Ticket {
            events: rx,
            cancel,
            slot,
        }
    }
}

/// A place in the queue taken before the job is ready to submit.
#[derive(Debug)]
/// Dropped unused, the place is free again; submitted, the job holds it.
pub struct Reservation(SlotGuard);

fn worker_loop(llm: Arc<Llm>, slot: usize, dispatch: &Dispatch, metrics: &Metrics) {
    let mut session = llm.session();
    let mut mode = Mode::Chat;
    let mut owner: Option<String> = None;
    while let Some(job) = dispatch.next(slot, &owner) {
        if job.cancel.is_cancelled() || job.tx.is_closed() {
            continue; // the client left while waiting
        }
        if job.opts.deadline.is_some_and(|d| Instant::now() >= d) {
            let waited = job.queued_at.elapsed().as_secs_f64();
            let _ = job.tx.send(Out::Failed(ApiError::timed_out(format!(
                "the request waited {waited:.0} s in the queue and ran out of time before it started; retry later or raise --request-timeout"
            ))));
            continue;
        }
        if owner.as_deref() != Some(job.client.as_str()) {
            // Another client's conversation: nothing of the last one may be reused.
            session.reset();
            owner = Some(job.client.clone());
        }
        let _ = job.tx.send(Out::Started {
            queued_s: job.queued_at.elapsed().as_secs_f64(),
        });
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            run(&mut session, &mut mode, &job, metrics)
        }));
        let out = match result {
            Ok(Ok(c)) => {
                log_done(&c, job.queued_at);
                metrics.finished(c.finish, Some(&c.usage));
                Out::Done(Box::new(c))
            }
            Ok(Err(e)) => {
                metrics.finished(None, None);
                // A failed turn may leave the state and the session's text out of step (a
                // prefill cut short); start the next request from scratch.
                session.reset();
                Out::Failed(e)
            }
            Err(panic) => {
                metrics.finished(None, None);
                session = llm.session();
                owner = None;
                let what = brook_core::util::panic_message(&*panic);
                Out::Failed(ApiError::internal_logged(format!(
                    "generation panicked: {what}"
                )))
            }
        };
        let _ = job.tx.send(out);
    }
}

fn log_done(c: &Completion, queued_at: Instant) {
    let u = &c.usage;
    tracing::info!(
        prompt = u.prompt_tokens,
        cached = u.cached_tokens,
        completion = u.completion_tokens,
        prefill_s = u.prefill_s,
        decode_s = u.decode_s,
        total_s = queued_at.elapsed().as_secs_f64(),
        finish = ?c.finish,
        "request done"
    );
}

fn run(
    session: &mut Session,
    mode: &mut Mode,
    job: &Job,
    metrics: &Metrics,
) -> Result<Completion, ApiError> {
    let tx = &job.tx;
    let cancel = &job.cancel;
    let mut first = true;
    let mut on_event = |ev: Event| {
        if let Event::Token(_) = ev {
            if first {
                metrics.first_token(job.queued_at.elapsed().as_secs_f64());
                first = false;
            }
            metrics.token();
        }
        if tx.send(Out::Event(ev)).is_err() {
            cancel.cancel();
        }
    };
    match &job.work {
        Work::Chat { history, last } => {
            if *mode != Mode::Chat {
                session.reset();
                *mode = Mode::Chat;
            }
            session.set_messages(history.clone());
            Ok(session.chat(last.clone(), &job.opts, &mut on_event)?)
        }
        Work::Raw { ids } => {
            let held = session.tokens();
            let reuse = *mode == Mode::Raw && ids.len() > held.len() && ids.starts_with(held);
            let start = if reuse { held.len() } else { 0 };
            if !reuse {
                session.reset();
                *mode = Mode::Raw;
            }
            let llm = session.llm().clone();
            let tok = llm.tokenizer()?.clone();
            let mut text = TextStream::new(
                tok,
                StreamOptions {
                    stop_strings: job.opts.stop.clone(),
                    stop_ids: llm.stop_ids(&job.opts),
                    parse_reasoning: false,
                    parse_tool_calls: false,
                    ..Default::default()
                },
            );
            Ok(session.generate(&ids[start..], &job.opts, Some(&mut text), &mut on_event)?)
        }
    }
}
