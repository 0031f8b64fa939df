//! A persistent thread pool for the kernels: one job at a time, each of its shares run once.
//!
//! Owns the worker threads and the hand-off of one borrowed job (`&dyn Fn(share)`) to all of
//! them. A call allocates nothing: the job is published through a pointer slot and an epoch
//! counter, workers spin for a short while (a decode step issues hundreds of jobs a few µs
//! apart) and then park on a condvar. A job has one share per thread. Each thread first
//! claims its own share, then any share still unclaimed: a thread the OS has not run yet
//! (preempted by another program, or still waking) holds up no job, its share runs on a
//! thread that is running. The calling thread claims shares too and returns only after every
//! share has finished, which is what makes lending a borrowed closure sound. It must not know
//! about matrices or models; splitting work is the job's business ([`split`], [`Chunks`]).
//! No reference to mirror: running a job on one thread gives the same result.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Spins before a waiting thread sleeps (~10 µs): long enough to bridge the gaps between a
/// decode step's jobs, short enough not to starve a preempted partner on a shared box.
const SPINS: u32 = 1 << 12;

type Job<'a> = dyn Fn(usize) + Sync + 'a;

/// The epoch (job number) in which a share was last claimed, on a cache line of its own: its
/// owner claims it with one uncontended compare-and-swap.
#[derive(Debug, Default)]
#[repr(align(64))]
struct ShareSlot(AtomicU64);

struct Shared {
    /// The job in flight; valid from an epoch's publication until `done` reaches the share
    /// count.
    job: UnsafeCell<Option<*const Job<'static>>>,
    /// The current job's number (from 1); a share belongs to the job whose epoch its claim
    /// wrote into its slot.
    epoch: AtomicU64,
    shares: Box<[ShareSlot]>,
    /// Shares of the current job not yet claimed, and finished.
    unclaimed: AtomicUsize,
    done: AtomicUsize,
    sleepers: AtomicUsize,
    stop: AtomicBool,
    panicked: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    /// The caller waits on `all_done` (after spinning) for `done` to reach the share count.
    caller_sleeping: AtomicBool,
    all_done: Condvar,
}

// SAFETY: `job` is written only by the one caller holding `CpuPool::caller`, while no share of
// a job is claimed and unfinished (before publishing an epoch, after every share finished);
// threads read it only between claiming a share of the current epoch and counting it done,
// and the epoch cannot end before that. The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

impl Shared {
    /// Claims share `t` for job `epoch`: true exactly once per share and job, and never once
    /// that job has ended (every share is claimed before it can end, and epochs only grow).
    fn claim(&self, t: usize, epoch: u64) -> bool {
        let slot = &self.shares[t].0;
        let was = slot.load(Ordering::Relaxed);
        if was >= epoch {
            return false;
        }
        if slot
            .compare_exchange(was, epoch, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        self.unclaimed.fetch_sub(1, Ordering::AcqRel);
        true
    }

    /// Runs every share of job `epoch` this thread can claim, its own (`me`) first. The
    /// caller (`me` = 0) gets the first panic of one of them back; a worker's panic sets
    /// `panicked` before its share counts as done.
    fn run_shares(&self, me: usize, epoch: u64) -> Option<Box<dyn std::any::Any + Send>> {
        let n = self.shares.len();
        let mut first_panic = None;
        for t in (0..n).map(|i| (me + i) % n) {
            if t != me && self.unclaimed.load(Ordering::Acquire) == 0 {
                break;
            }
            if !self.claim(t, epoch) {
                continue;
            }
            // SAFETY: a claimed share of the current epoch keeps the job alive until it is
            // counted done below (see `Shared`); the slot was written before the epoch was
            // published, which this thread's claim (AcqRel) synchronises with.
            let job = unsafe { *self.job.get() };
            if let Some(job) = job {
                // SAFETY: see above; the pointee outlives this call.
                let f = unsafe { &*job };
                if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(t))) {
                    if me == 0 {
                        first_panic.get_or_insert(p);
                    } else {
                        // Before the share counts as done: once the last one does, the
                        // caller may look.
                        self.panicked.store(true, Ordering::SeqCst);
                    }
                }
            }
            // SeqCst against the caller's `caller_sleeping` store then `done` load: one of
            // the two sees the other.
            if self.done.fetch_add(1, Ordering::SeqCst) + 1 == n
                && self.caller_sleeping.load(Ordering::SeqCst)
            {
                let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.all_done.notify_all();
            }
        }
        first_panic
    }
}

/// Threads that run one job at a time. `CpuPool::new(1)` runs jobs on the caller only.
pub struct CpuPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
    caller: Mutex<()>,
}

impl std::fmt::Debug for CpuPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuPool")
            .field("threads", &self.threads)
            .finish()
    }
}

impl CpuPool {
    /// A pool of `threads` threads in all, the caller included (at least 1).
    pub fn new(threads: usize) -> Self {
        Self::build(threads.max(1), 0)
    }

    /// A pool of `threads` shares whose last `absent` have no thread of their own (tests:
    /// threads that never come). A thread that could not be spawned is one more such share:
    /// the threads that run take it.
    fn build(threads: usize, absent: usize) -> Self {
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            epoch: AtomicU64::new(0),
            shares: (0..threads).map(|_| ShareSlot::default()).collect(),
            unclaimed: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            caller_sleeping: AtomicBool::new(false),
            all_done: Condvar::new(),
        });
        let (ready_tx, ready) = std::sync::mpsc::channel::<()>();
        let workers = (1..threads.saturating_sub(absent).max(1))
            .filter_map(|i| {
                let (s, ready_tx) = (shared.clone(), ready_tx.clone());
                std::thread::Builder::new()
                    .name(format!("brook-cpu-{i}"))
                    .stack_size(4 << 20)
                    .spawn(move || {
                        let _ = ready_tx.send(());
                        drop(ready_tx);
                        worker(&s, i);
                    })
                    .ok()
            })
            .collect::<Vec<_>>();
        // Every worker has started before the pool is used: a thread's start allocates,
        // and a decode step must not (tests/cpu_alloc.rs); a share no longer waits for its
        // thread, so the first jobs would not wait for them either.
        drop(ready_tx);
        for _ in 0..workers.len() {
            if ready.recv().is_err() {
                break;
            }
        }
        CpuPool {
            shared,
            workers,
            threads,
            caller: Mutex::new(()),
        }
    }
    /// A pool with one thread per CPU the process may use.
    pub fn with_all_cores() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Threads in all, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `job(t)` once for every share t in 0..threads, concurrently where threads are
    /// free (a thread that is late has its share run by another), and returns when all are
    /// done. A panic in any share is re-raised here.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 {
            job(0);
            return;
        }
        let _one_caller = self.caller.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: erasing the lifetime is sound because this function does not return before
        // every share is done, i.e. before every thread has stopped using the pointer; the
        // slot is written while no share is claimed and unfinished (see `Shared`).
        unsafe {
            let ptr: *const Job<'_> = job;
            *s.job.get() = Some(std::mem::transmute::<*const Job<'_>, *const Job<'static>>(
                ptr,
            ));
        }
        s.done.store(0, Ordering::Relaxed);
        s.unclaimed.store(self.threads, Ordering::Relaxed);
        // Publishing the epoch (a release) makes the job and the counters visible to every
        // claim of it.
        let epoch = s.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = s.run_shares(0, epoch);
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) != self.threads {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
                continue;
            }
            // A thread in a share is late, most likely preempted: sleep rather than burn
            // the core it may be waiting for.
            s.caller_sleeping.store(true, Ordering::SeqCst);
            let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            while s.done.load(Ordering::SeqCst) != self.threads {
                g = s.all_done.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            drop(g);
            s.caller_sleeping.store(false, Ordering::SeqCst);
        }
        // SAFETY: every share is done with the job; clear the dangling pointer.
        unsafe { *s.job.get() = None };
        if let Some(p) = mine {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a brook CPU pool worker panicked while running a job");
        }
    }
}

fn worker(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        while s.epoch.load(Ordering::Acquire) == seen && !s.stop.load(Ordering::Relaxed) {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
                continue;
            }
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            while s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            drop(g);
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        // The newest job: shares of one that already ended can no longer be claimed.
        seen = s.epoch.load(Ordering::Acquire);
        s.run_shares(index, seen);
    }
}

impl Drop for CpuPool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Share `t` of `n` items split into `threads` contiguous parts, in units of `align` items
/// (the last part takes the rest).
pub fn split(n: usize, t: usize, threads: usize, align: usize) -> Range<usize> {
    let units = n.div_ceil(align.max(1));
    let a = (units * t / threads * align).min(n);
    let b = (units * (t + 1) / threads * align).min(n);
    a..b
}

/// Consecutive chunks of 0..n handed to whichever thread asks next. With a static split a
/// thread the OS preempts (this box is shared) stalls the whole job; with chunks it just takes
/// fewer. Lives on the caller's stack: no allocation.
#[derive(Debug)]
pub struct Chunks {
    next: AtomicUsize,
    n: usize,
    size: usize,
    /// Guided: a claim takes 1/`share` of what is left (at least `size`).
    share: usize,
}

impl Chunks {
    /// Chunks of `size` (≥ 1) over 0..n.
    pub fn new(n: usize, size: usize) -> Self {
        Chunks {
            next: AtomicUsize::new(0),
            n,
            size: size.max(1),
            share: 0,
        }
    }

    /// Guided chunks for `threads` threads: each claim takes 1/(2·threads) of what is left,
    /// at least `min`, so the first claims are long runs and the last ones balance the load.
    /// Streaming weights, long runs keep each thread on one sequential stream for its
    /// prefetches: small chunks interleaved between threads cost the one-token matvec about a
    /// sixth of its speed.
    pub fn guided(n: usize, threads: usize, min: usize) -> Self {
        Chunks {
            next: AtomicUsize::new(0),
            n,
            size: min.max(1),
            share: 2 * threads.max(1),
        }
    }

    /// The next unclaimed chunk, or `None` when all are taken.
    pub fn claim(&self) -> Option<Range<usize>> {
        if self.share == 0 {
            let a = self.next.fetch_add(self.size, Ordering::Relaxed);
            return (a < self.n).then(|| a..(a + self.size).min(self.n));
        }
        let mut a = self.next.load(Ordering::Relaxed);
        loop {
            if a >= self.n {
                return None;
            }
            let b = (a + ((self.n - a) / self.share).max(self.size)).min(self.n);
            match self
                .next
                .compare_exchange_weak(a, b, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(a..b),
                Err(now) => a = now,
            }
        }
    }
}

/// A `&mut [T]` that jobs on several threads may share to write disjoint parts of it.
#[derive(Debug)]
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<T> Clone for SharedMut<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<'_, T> {}

// SAFETY: users promise (by the `unsafe` of `slice`/`write`) that concurrent accesses are
// disjoint.
unsafe impl<T: Send> Send for SharedMut<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub fn new(s: &'a mut [T]) -> Self {
        SharedMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: PhantomData,
        }
    }

    /// Writes element `i`.
    ///
    /// # Safety
    /// No other thread may access element `i` concurrently.
    pub unsafe fn write(&self, i: usize, v: T) {
        assert!(i < self.len);
        // SAFETY: in bounds (asserted); exclusivity is the caller's promise.
        unsafe { *self.ptr.add(i) = v };
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `r` of the slice.
    ///
    /// # Safety
    /// No other live reference (from any thread) may overlap `r`.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, r: Range<usize>) -> &'a mut [T] {
        assert!(r.start <= r.end && r.end <= self.len);
        // SAFETY: in bounds (asserted); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.end - r.start) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guided claims cover 0..n once, in order, never shorter than `min` (but the last), and
    /// shrink as the work runs out; fixed claims are all `size` long.
    #[test]
    fn chunks_cover_every_index_once() {
        for (n, threads, min) in [
            (0, 2, 1),
            (1, 2, 1),
            (7, 2, 4),
            (1000, 2, 1),
            (248320, 3, 64),
        ] {
            let c = Chunks::guided(n, threads, min);
            let mut at = 0;
            let mut last_len = usize::MAX;
            while let Some(r) = c.claim() {
                assert_eq!(r.start, at, "n {n}: a gap or overlap");
                assert!(r.end > r.start && r.end <= n);
                assert!(
                    r.len() >= min || r.end == n,
                    "n {n}: claim {r:?} below {min}"
                );
                assert!(r.len() <= last_len.max(min), "n {n}: claims grew");
                last_len = r.len();
                at = r.end;
            }
            assert_eq!(at, n);
            assert!(c.claim().is_none());
        }
        let c = Chunks::new(10, 4);
        let all: Vec<_> = std::iter::from_fn(|| c.claim()).collect();
        assert_eq!(all, vec![0..4, 4..8, 8..10]);
    }

    /// Every share of every job runs exactly once, whichever thread takes it, also when
    /// shares take uneven time and jobs follow each other closely.
    #[test]
    fn every_share_runs_once_per_job() {
        for threads in [2, 3, 5, 8] {
            let pool = CpuPool::new(threads);
            let n = pool.threads();
            for job in 0..300 {
                let runs: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(&|t| {
                    if (t + job) % 7 == 0 {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                    runs[t].fetch_add(1, Ordering::Relaxed);
                });
                let counts: Vec<usize> = runs.iter().map(|r| r.load(Ordering::Relaxed)).collect();
                assert!(
                    counts.iter().all(|&c| c == 1),
                    "{threads} threads, job {job}: {counts:?}"
                );
            }
        }
    }

    /// A thread that never takes part holds up no job: here two of four shares have no
    /// thread of their own, and every job still finishes with every share run once (with a
    /// thread per share, the first job would wait forever).
    #[test]
    fn shares_without_a_running_thread_are_run_by_the_others() {
        let pool = CpuPool::build(4, 2);
        assert_eq!(pool.threads(), 4);
        assert_eq!(pool.workers.len(), 1);
        for _ in 0..200 {
            let runs: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|t| {
                runs[t].fetch_add(1, Ordering::Relaxed);
            });
            assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
        }
    }

    /// Threads claiming guided chunks at once still get every index exactly once.
    #[test]
    fn guided_chunks_are_shared_without_loss() {
        let n = 100_000;
        let c = Chunks::guided(n, 4, 3);
        let seen: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    while let Some(r) = c.claim() {
                        for i in r {
                            seen[i].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert!(seen.iter().all(|v| v.load(Ordering::Relaxed) == 1));
    }
}
