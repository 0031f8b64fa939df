//! A persistent thread pool for the kernels: one job at a time, run by every thread at once.
//!
//! Owns the worker threads and the hand-off of one borrowed job (`&dyn Fn(thread)`) to all of
//! them. A call allocates nothing: the job is published through a pointer slot and an epoch
//! counter, workers spin for a short while (a decode step issues hundreds of jobs a few µs
//! apart) and then park on a condvar. The calling thread runs share 0 itself and returns only
//! after every worker finished, which is what makes lending a borrowed closure sound. It must
//! not know about matrices or models; splitting work is the job's business ([`split`]). No
//! reference to mirror: running a job on one thread gives the same result.

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

struct Shared {
    /// The job in flight; valid from an epoch's publication until `pending` reaches 0.
    job: UnsafeCell<Option<*const Job<'static>>>,
    epoch: AtomicU64,
    pending: AtomicUsize,
    sleepers: AtomicUsize,
    stop: AtomicBool,
    panicked: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    /// The caller waits on `done` (after spinning) for `pending` to reach 0.
    caller_sleeping: AtomicBool,
    done: Condvar,
}

// SAFETY: `job` is written only by the one caller holding `CpuPool::caller`, while no worker
// reads it (before publishing an epoch, after all workers reported done); workers only read it
// between seeing a new epoch and decrementing `pending`. The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

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
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            epoch: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            caller_sleeping: AtomicBool::new(false),
            done: Condvar::new(),
        });
        let workers = (1..threads)
            .filter_map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("brook-cpu-{i}"))
                    .stack_size(4 << 20)
                    .spawn(move || worker(&s, i))
                    .ok()
            })
            .collect::<Vec<_>>();
        // A thread that could not be spawned just means a smaller pool.
        let threads = workers.len() + 1;
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

    /// Runs `job(t)` once for every thread index t in 0..threads, concurrently, and returns
    /// when all are done. A panic in any share is re-raised here.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        if self.threads == 1 {
            job(0);
            return;
        }
        let _one_caller = self.caller.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: erasing the lifetime is sound because this function does not return before
        // `pending` is 0, i.e. before every worker has stopped using the pointer; the slot is
        // written while no worker reads it (see `Shared`).
        unsafe {
            let ptr: *const Job<'_> = job;
            *s.job.get() = Some(std::mem::transmute::<*const Job<'_>, *const Job<'static>>(
                ptr,
            ));
        }
        s.pending.store(self.threads - 1, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(0)));
        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
                continue;
            }
            // A worker is late, most likely preempted: sleep rather than burn the core it
            // may be waiting for.
            s.caller_sleeping.store(true, Ordering::SeqCst);
            let mut g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            while s.pending.load(Ordering::SeqCst) != 0 {
                g = s.done.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            drop(g);
            s.caller_sleeping.store(false, Ordering::SeqCst);
        }
        // SAFETY: every worker is done with the job; clear the dangling pointer.
        unsafe { *s.job.get() = None };
        if let Err(p) = mine {
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
        seen = s.epoch.load(Ordering::Acquire);
        // SAFETY: a new epoch was published after the job slot was written, and the caller
        // keeps the job alive until `pending` (decremented below) reaches 0.
        let job = unsafe { *s.job.get() };
        if let Some(job) = job {
            // SAFETY: see above; the pointee outlives this call.
            let f = unsafe { &*job };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index))).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
        }
        if s.pending.fetch_sub(1, Ordering::SeqCst) == 1 && s.caller_sleeping.load(Ordering::SeqCst)
        {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.done.notify_all();
        }
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
