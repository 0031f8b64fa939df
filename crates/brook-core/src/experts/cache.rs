//! One global cache of expert slots shared by all layers, filled by concurrent direct reads.
//!
//! Eviction ([`Eviction`], `--cache-eviction`, auto by default): least-recently-used when the
//! slots hold at least one token's experts (on routing with the reuse published for real
//! checkpoints, 0.91-0.98 x Belady's optimum from a fifth of the experts cached,
//! docs/bench/2026-12-03.md); below that least-frequently-used (use counts that survive
//! eviction; brook's only rule before), as LRU there evicts each expert just before its layer
//! asks for it again. `reuse`, a likelihood of reuse learned while running, is a choice: it
//! hits more than LRU offline at two tokens' worth, but not reliably in the running cache
//! yet (docs/bench/2026-12-04.md). Experts held by a caller
//! (the layer being computed) and slots being filled are pinned. All misses of a request are
//! issued at once to a pool of I/O threads; [`ExpertData::wait`] blocks on one slot, so the
//! caller computes the shared expert and the hits while the misses land. The cache changes
//! speed, never results: a slot holds exactly the bytes of the container's blob.
//!
//! A cache may start on part of its slots and take the rest only once that pays
//! ([`ExpertCache::grow_on_demand`]): two shadow directories, one as large as the slots in use
//! and one as large as all of them, replay the demand requests under the same eviction and
//! count what each would have read. Slot memory is resident only once read into, so slots
//! the cache never takes cost no memory.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::container::ExpertLayout;
use crate::error::{Error, Result};
use crate::experts::files::ExpertFiles;
use crate::experts::grow::{GROW_MIN_SAVING, GROW_WINDOW_TOKENS, Growth};
use crate::experts::reuse::ReuseModel;
use crate::experts::slots::SlotBufs;
use crate::experts::source::{ExpertData, ExpertHandle, ExpertSource, ExpertView};
pub use crate::experts::stats::{CacheStats, Eviction, hit_rate};

#[derive(Debug, Clone, PartialEq)]
enum Status {
    Empty,
    Loading,
    Ready,
    Failed(String),
}

#[derive(Debug)]
struct SlotMeta {
    owner: Option<(usize, usize)>,
    pins: u32,
    last_use: u64,
    status: Status,
    /// Filled by a prefetch and not yet requested.
    prefetched: bool,
}

#[derive(Debug)]
struct State {
    /// [layer][expert] → slot index.
    map: Vec<Vec<Option<usize>>>,
    slots: Vec<SlotMeta>,
    /// [layer][expert] use counts; they survive eviction.
    counts: Vec<Vec<u32>>,
    eviction: Eviction,
    /// What [`Eviction::Reuse`] learns from (kept under every rule; it costs a pass over a
    /// layer's experts a request).
    reuse: ReuseModel,
    tick: u64,
    queue: VecDeque<(usize, usize, usize)>, // (slot, layer, expert)
    in_flight: usize,
    busy_since: Option<Instant>,
    stats: CacheStats,
    shutdown: bool,
    /// Slots `0..active` are in use; the rest are taken when [`Growth`] decides it pays.
    active: usize,
    growth: Option<Growth>,
    /// Slots the cache is growing to (`active` when it is not): the grower thread brings
    /// `active..grow_to` into memory a batch at a time and puts each batch in use.
    grow_to: usize,
    grower: Option<std::thread::JoinHandle<()>>,
}

/// Slots the grower brings into memory before putting them in use (about 56 MB of the 35B's).
const GROW_BATCH: usize = 32;

struct Shared {
    state: Mutex<State>,
    /// Signalled when a slot finishes loading.
    loaded: Condvar,
    /// Signalled when a job is queued or on shutdown.
    work: Condvar,
    bufs: SlotBufs,
    store: ExpertFiles,
    layouts: Vec<Arc<ExpertLayout>>,
    /// Whether slots hold their experts in 16-row tiles ([`ExpertCache::tile_experts`]).
    tiles: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The expert cache.
pub struct ExpertCache {
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
    num_experts: usize,
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("slots", &self.shared.bufs.count)
            .field("direct", &self.shared.store.direct)
            .finish()
    }
}

impl ExpertCache {
    /// A cache of `slots` slots over `store`, with `io_threads` readers.
    pub fn new(
        store: ExpertFiles,
        layouts: Vec<Arc<ExpertLayout>>,
        stride: usize,
        num_experts: usize,
        slots: usize,
        io_threads: usize,
    ) -> Self {
        let layers = layouts.len();
        let state = State {
            map: vec![vec![None; num_experts]; layers],
            slots: (0..slots)
                .map(|_| SlotMeta {
                    owner: None,
                    pins: 0,
                    last_use: 0,
                    status: Status::Empty,
                    prefetched: false,
                })
                .collect(),
            counts: vec![vec![0; num_experts]; layers],
            eviction: Eviction::default(),
            reuse: ReuseModel::new(layers, num_experts),
            tick: 0,
            queue: VecDeque::new(),
            in_flight: 0,
            busy_since: None,
            stats: CacheStats::default(),
            shutdown: false,
            active: slots,
            growth: None,
            grow_to: slots,
            grower: None,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            loaded: Condvar::new(),
            work: Condvar::new(),
            bufs: SlotBufs::new(slots, stride),
            store,
            layouts,
            tiles: std::sync::atomic::AtomicBool::new(false),
        });
        let threads = (0..io_threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("brook-io-{i}"))
                    .stack_size(256 << 10)
                    .spawn(move || io_loop(&s))
                    .expect("spawning an I/O thread")
            })
            .collect();
        ExpertCache {
            shared,
            threads,
            num_experts,
        }
    }

    /// Has every expert read from now on moved into 16-row tiles in its slot by the I/O
    /// thread that read it, for the CPU backend's VNNI kernels. Meant for a cache that holds
    /// every expert (streamed, the move's extra pass over each read slowed decode by a
    /// quarter); call it before the first fetch.
    pub fn tile_experts(&self) {
        self.shared
            .tiles
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the eviction rule (call it before the first fetch).
    pub fn set_eviction(&self, eviction: Eviction) {
        let mut st = self.shared.lock();
        st.eviction = eviction;
        if let Some(g) = &mut st.growth {
            g.set_eviction(eviction);
        }
    }

    /// Tells the reuse rule how many experts a decoded token asks of a layer (top-k), so
    /// that it learns from decode requests only.
    pub fn set_top_k(&self, k: usize) {
        self.shared.lock().reuse.top_k = k;
    }

    /// Slots in use now.
    pub fn slots(&self) -> usize {
        self.shared.lock().active
    }

    /// Has the cache start on `start` of its slots, one token requesting `per_token` experts
    /// (top-k x layers), and take all of them once, over the last 8 tokens' requests, a cache
    /// that large would have read at least [`GROW_MIN_SAVING`] fewer experts than the slots in
    /// use did (and at least one a token fewer). It never shrinks. Call it before the first
    /// fetch; a `start` at or above the slot count changes nothing.
    pub fn grow_on_demand(&self, start: usize, per_token: usize) {
        let mut st = self.shared.lock();
        let total = st.slots.len();
        if start >= total {
            return;
        }
        let (layers, experts) = (st.map.len(), self.num_experts);
        st.active = start.max(1);
        st.grow_to = st.active;
        let mut g = Growth::new(st.active, total, layers, experts, per_token);
        g.set_eviction(st.eviction);
        st.growth = Some(g);
    }

    /// Whether reads bypass the page cache.
    pub fn direct(&self) -> bool {
        self.shared.store.direct
    }

    /// Picks a slot in use for a new expert: empty first, else the unpinned ready slot with
    /// the lowest (use count under LFU or likelihood of reuse under Reuse, last use).
    fn victim(st: &State) -> Option<usize> {
        let mut best: Option<(f64, usize, u64, usize)> = None;
        for (i, s) in st.slots[..st.active].iter().enumerate() {
            match s.status {
                Status::Empty | Status::Failed(_) if s.pins == 0 => return Some(i),
                Status::Ready if s.pins == 0 => {
                    let (l, e) = s.owner.unwrap_or((0, 0));
                    let (score, far) = match st.eviction {
                        Eviction::Lru => (0.0, 0),
                        Eviction::Lfu => (st.counts[l][e] as f64, 0),
                        Eviction::Reuse => st.reuse.score(l, e),
                    };
                    let key = (score, far, s.last_use, i);
                    if best.is_none_or(|b| {
                        key.0
                            .total_cmp(&b.0)
                            .then((key.1, key.2, key.3).cmp(&(b.1, b.2, b.3)))
                            .is_lt()
                    }) {
                        best = Some(key);
                    }
                }
                _ => {}
            }
        }
        best.map(|b| b.3)
    }

    /// Assigns `slot` to (layer, e) and queues its read.
    fn load(st: &mut State, slot: usize, layer: usize, e: usize) {
        if let Some((ol, oe)) = st.slots[slot].owner.take() {
            st.map[ol][oe] = None;
            st.stats.evictions += 1;
        }
        st.map[layer][e] = Some(slot);
        let s = &mut st.slots[slot];
        s.owner = Some((layer, e));
        s.status = Status::Loading;
        st.queue.push_back((slot, layer, e));
        st.stats.reads += 1;
    }
}

impl Drop for ExpertCache {
    fn drop(&mut self) {
        let grower = {
            let mut st = self.shared.lock();
            st.shutdown = true;
            st.grower.take()
        };
        self.shared.work.notify_all();
        for t in self.threads.drain(..).chain(grower) {
            let _ = t.join();
        }
    }
}

/// Brings the slots a growing cache takes into memory ahead of their first reads, a batch at a
/// time, putting each batch in use once resident. A fresh page's first touch (about 2.5 s a GB
/// on the virtual machine of docs/bench/2026-11-30-to-12-02.md, "Session 18: the cache grows on demand") then
/// happens on this low-priority thread while decode waits on the disk, not inside the reads.
fn grow_loop(s: &Shared) {
    // SAFETY: plain system calls on this thread's own id; failure leaves the priority as is.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
    }
    loop {
        let (from, to) = {
            let st = s.lock();
            if st.shutdown || st.active >= st.grow_to {
                return;
            }
            (st.active, (st.active + GROW_BATCH).min(st.grow_to))
        };
        for i in from..to {
            // SAFETY: slots at or past `active` are in no one's use: `victim` never picks
            // them and only this thread moves `active` while `grow_to` is above it.
            unsafe { s.bufs.populate(i) };
        }
        s.lock().active = to;
        s.loaded.notify_all();
    }
}

fn io_loop(s: &Shared) {
    loop {
        let (slot, layer, e) = {
            let mut st = s.lock();
            loop {
                if st.shutdown {
                    return;
                }
                if let Some(job) = st.queue.pop_front() {
                    if st.in_flight == 0 {
                        st.busy_since = Some(Instant::now());
                    }
                    st.in_flight += 1;
                    break job;
                }
                st = s.work.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        // SAFETY: this thread popped the job for a Loading slot; nobody else touches the
        // buffer until the status changes under the lock below.
        let buf = unsafe { s.bufs.slot_mut(slot) };
        let result = s
            .store
            .check(layer)
            .and_then(|()| s.store.read(layer, e, buf));
        if result.is_ok() && s.tiles.load(std::sync::atomic::Ordering::Relaxed) {
            s.layouts[layer].tile(buf);
        }
        let mut st = s.lock();
        st.in_flight -= 1;
        if st.in_flight == 0
            && let Some(t) = st.busy_since.take()
        {
            st.stats.read_busy_ns += t.elapsed().as_nanos() as u64;
        }
        match result {
            Ok(()) => {
                st.stats.bytes_read += buf.len() as u64;
                st.slots[slot].status = Status::Ready;
            }
            Err(err) => {
                st.slots[slot].status = Status::Failed(err.to_string());
                st.slots[slot].owner = None;
                st.map[layer][e] = None;
            }
        }
        drop(st);
        s.loaded.notify_all();
    }
}

impl ExpertSource for ExpertCache {
    fn fetch(&self, layer: usize, ids: &[usize]) -> Result<Vec<ExpertHandle>> {
        let s = &self.shared;
        let mut st = s.lock();
        if let Some(&bad) = ids.iter().find(|&&e| e >= self.num_experts) {
            return Err(Error::Invalid(format!("no expert {bad} in layer {layer}")));
        }
        st.tick += 1;
        let tick = st.tick;
        st.reuse.begin(layer, ids);
        // Hits are pinned before any miss picks a victim, so a request never evicts one of
        // its own experts (e.g. one a prefetch brought in).
        let mut slots: Vec<Option<usize>> = Vec::with_capacity(ids.len());
        for &e in ids {
            st.counts[layer][e] += 1;
            let slot = st.map[layer][e];
            if let Some(slot) = slot {
                st.stats.hits += 1;
                if std::mem::take(&mut st.slots[slot].prefetched) {
                    st.stats.prefetch_hits += 1;
                }
                st.slots[slot].pins += 1;
                st.slots[slot].last_use = tick;
            }
            slots.push(slot);
        }
        let grow = match &mut *st {
            State {
                growth: Some(g),
                counts,
                ..
            } => g.request(layer, ids, counts, tick),
            _ => false,
        };
        if grow {
            let total = st.slots.len();
            tracing::info!(
                "expert cache grows from {} to {total} slots: over the last {GROW_WINDOW_TOKENS} tokens that many would have read at least {:.0}% fewer experts",
                st.active,
                GROW_MIN_SAVING * 100.0
            );
            st.growth = None;
            st.grow_to = total;
            let shared = s.clone();
            st.grower = std::thread::Builder::new()
                .name("brook-grow".into())
                .stack_size(64 << 10)
                .spawn(move || grow_loop(&shared))
                .ok();
            if st.grower.is_none() {
                st.active = total; // no thread: take the slots now, faulting them on first read
            }
        }
        let mut queued = false;
        for (i, &e) in ids.iter().enumerate() {
            if slots[i].is_some() {
                continue;
            }
            let mut victim = Self::victim(&st);
            // Unpinned slots still loading (prefetches) free up soon, and a growing cache
            // puts more slots in use soon: wait for them.
            while victim.is_none()
                && (st.active < st.grow_to
                    || st.slots[..st.active]
                        .iter()
                        .any(|m| m.pins == 0 && m.status == Status::Loading))
            {
                st = s.loaded.wait(st).unwrap_or_else(|p| p.into_inner());
                victim = Self::victim(&st);
            }
            // More experts pinned at once than the slots in use hold: take one more slot.
            if victim.is_none() && st.active < st.slots.len() {
                st.active += 1;
                st.grow_to = st.active;
                let active = st.active;
                if let Some(g) = st.growth.as_mut() {
                    g.resize_small(active);
                }
                victim = Self::victim(&st);
            }
            let Some(slot) = victim else {
                let n = st.active;
                for s in slots.iter().flatten() {
                    st.slots[*s].pins -= 1;
                }
                return Err(Error::Invalid(format!(
                    "the expert cache has {n} slots, too few for {} experts at once; raise --memory-budget or --expert-cache",
                    ids.len()
                )));
            };
            st.stats.misses += 1;
            Self::load(&mut st, slot, layer, e);
            st.slots[slot].pins += 1;
            st.slots[slot].last_use = tick;
            slots[i] = Some(slot);
            queued = true;
        }
        st.reuse.end(layer, ids);
        let handles: Vec<ExpertHandle> = slots
            .into_iter()
            .flatten()
            .map(|slot| {
                Arc::new(SlotHandle {
                    shared: s.clone(),
                    slot,
                    layer,
                }) as ExpertHandle
            })
            .collect();
        drop(st);
        if queued {
            s.work.notify_all();
        }
        Ok(handles)
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        let s = &self.shared;
        let mut st = s.lock();
        let mut queued = false;
        for &e in ids.iter().filter(|&&e| e < self.num_experts) {
            if st.map[layer][e].is_some() {
                continue;
            }
            let Some(slot) = Self::victim(&st) else { break };
            Self::load(&mut st, slot, layer, e);
            st.slots[slot].prefetched = true;
            st.slots[slot].last_use = st.tick;
            st.stats.prefetches += 1;
            queued = true;
        }
        drop(st);
        if queued {
            s.work.notify_all();
        }
    }

    fn stats(&self) -> Option<CacheStats> {
        let st = self.shared.lock();
        Some(CacheStats {
            slots: st.active as u64,
            slots_max: st.slots.len() as u64,
            ..st.stats
        })
    }

    fn capacity(&self) -> usize {
        self.slots()
    }
}

/// A pinned slot, handed to the compute code.
struct SlotHandle {
    shared: Arc<Shared>,
    slot: usize,
    layer: usize,
}

impl std::fmt::Debug for SlotHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotHandle(layer {}, slot {})", self.layer, self.slot)
    }
}

impl ExpertData for SlotHandle {
    fn wait(&self) -> Result<()> {
        let mut st = self.shared.lock();
        loop {
            match &st.slots[self.slot].status {
                Status::Ready => return Ok(()),
                Status::Failed(msg) => {
                    let msg = msg.clone();
                    // The failed slot is free again once its pins drop.
                    return Err(Error::Io {
                        path: format!("layer {}", self.layer).into(),
                        source: std::io::Error::other(msg),
                    });
                }
                _ => {
                    st = self
                        .shared
                        .loaded
                        .wait(st)
                        .unwrap_or_else(|p| p.into_inner())
                }
            }
        }
    }

    fn landed(&self) -> bool {
        self.shared.lock().slots[self.slot].status != Status::Loading
    }

    fn view(&self) -> ExpertView<'_> {
        // Never hand out a buffer an I/O thread may still be writing; callers that skipped
        // `wait` block here (a failed read leaves stale bytes, which `wait` reports).
        let mut st = self.shared.lock();
        while st.slots[self.slot].status == Status::Loading {
            st = self
                .shared
                .loaded
                .wait(st)
                .unwrap_or_else(|p| p.into_inner());
        }
        drop(st);
        // SAFETY: the slot is pinned by this handle and not Loading, so no I/O thread writes
        // it until the pin is released; a shared borrow for the handle's life is sound.
        let buf = unsafe { self.shared.bufs.slot(self.slot) };
        let tiled = self.shared.tiles.load(std::sync::atomic::Ordering::Relaxed);
        self.shared.layouts[self.layer].view_as(buf, tiled)
    }
}

impl Drop for SlotHandle {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        let meta = &mut st.slots[self.slot];
        meta.pins = meta.pins.saturating_sub(1);
        if meta.pins == 0 && matches!(meta.status, Status::Failed(_)) {
            meta.status = Status::Empty;
        }
    }
}
