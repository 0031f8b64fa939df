//! The one-token MoE's schedule: which units (a block of an expert's gate/up rows, a block of
//! its down rows) are claimed and done, shared by the pool's threads through atomic counters.
//! Gate/up blocks come first, preferring experts already in memory (the routed ones by rank,
//! then the shared expert); when a slot's last gate/up block is done its activations are
//! prepared and its down blocks open up, so the down projections of the experts that landed
//! run while the rest are still being read. Split out of `moe.rs`.
//!
//! No lock: a decode step of the 35B claims about 11,000 units, and at 16 threads a mutex
//! taken two or three times a unit made the threads queue on it (docs/bench/2026-12-04.md,
//! "h200 host"). Each slot's counters sit on a cache line of their own, so threads working on
//! different experts do not contend. Which thread computes which rows does not change any
//! row's result.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::error::Error;

/// One unit of the one-token MoE's work.
pub(super) enum Unit {
    /// Gate and up rows of block `.1` of slot `.0` (a routed expert or the shared one).
    GateUp(usize, usize),
    /// Down rows of block `.1` of slot `.0` (routed, or the shared expert at slot k).
    Down(usize, usize),
    /// Nothing claimable now, but claimed work will make some: try again.
    Wait,
    Done,
}

/// A slot's counters (in the MoE scratch: nothing is allocated per token).
#[derive(Debug, Default)]
#[repr(align(64))]
pub(super) struct SlotCounters {
    /// Next gate/up block to claim.
    next_gu: AtomicUsize,
    /// Gate/up blocks done.
    done_gu: AtomicUsize,
    /// Next down block to claim; `usize::MAX` until the slot's activations are prepared.
    next_down: AtomicUsize,
}

/// The units of one MoE block's one-token job, claimed by the pool's threads.
pub(super) struct Schedule<'a> {
    slot: &'a [SlotCounters],
    /// Routed experts per token: slot s is a shared expert where s % (k+1) = k.
    k: usize,
    /// Gate/up blocks of a routed expert, and of the shared expert (slot k).
    per: usize,
    per_shared: usize,
    /// Down blocks of every expert.
    per_down: usize,
    /// Slots with gate/up blocks whose activations are not prepared yet: work that opens more.
    unprepared: AtomicUsize,
    stop: AtomicBool,
    failed: Mutex<Option<Error>>,
}

impl<'a> Schedule<'a> {
    /// A schedule over `counters` (one per slot, reset here).
    pub(super) fn new(
        counters: &'a mut [SlotCounters],
        k: usize,
        per: usize,
        per_shared: usize,
        per_down: usize,
    ) -> Self {
        for c in counters.iter_mut() {
            *c.next_gu.get_mut() = 0;
            *c.done_gu.get_mut() = 0;
            *c.next_down.get_mut() = usize::MAX;
        }
        let mut s = Schedule {
            slot: counters,
            k,
            per,
            per_shared,
            per_down,
            unprepared: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
        };
        let open = (0..s.slot.len()).filter(|&i| s.blocks(i) > 0).count();
        *s.unprepared.get_mut() = open;
        s
    }

    /// Gate/up blocks of `slot`.
    fn blocks(&self, slot: usize) -> usize {
        if slot % (self.k + 1) < self.k {
            self.per
        } else {
            self.per_shared
        }
    }

    /// The next unit: gate/up of an expert that has landed, else a down block that is open,
    /// else gate/up of the first expert still being read (the caller blocks on it).
    /// `wait`: also hand out gate/up of an expert still being read (false: only units that
    /// can start now, for a claim ahead).
    pub(super) fn claim(&self, landed: impl Fn(usize) -> bool, wait: bool) -> Unit {
        if self.stop.load(Ordering::Relaxed) {
            return Unit::Done;
        }
        // Read before the scans: if every slot was prepared by then, every down block is
        // open to them, so scans that find nothing mean every unit has been claimed.
        let unprepared = self.unprepared.load(Ordering::Acquire);
        let slots = 0..self.slot.len();
        for i in slots.clone() {
            if let Some(b) = take(&self.slot[i].next_gu, self.blocks(i), || landed(i)) {
                return Unit::GateUp(i, b);
            }
        }
        for i in slots.clone() {
            if let Some(b) = take(&self.slot[i].next_down, self.per_down, || true) {
                return Unit::Down(i, b);
            }
        }
        if wait {
            for i in slots.filter(|i| i % (self.k + 1) < self.k) {
                if let Some(b) = take(&self.slot[i].next_gu, self.per, || true) {
                    return Unit::GateUp(i, b);
                }
            }
        }
        if unprepared > 0 {
            Unit::Wait
        } else {
            Unit::Done
        }
    }

    /// A gate/up block of `slot` is done; true when it was the slot's last (the caller then
    /// prepares the slot's activations and calls [`Schedule::prepared`]).
    pub(super) fn gate_up_done(&self, slot: usize) -> bool {
        // AcqRel: the last block's thread sees every other block's rows.
        self.slot[slot].done_gu.fetch_add(1, Ordering::AcqRel) + 1 == self.blocks(slot)
    }

    /// `slot`'s activations are prepared: its down blocks may be claimed.
    pub(super) fn prepared(&self, slot: usize) {
        self.slot[slot].next_down.store(0, Ordering::Release);
        self.unprepared.fetch_sub(1, Ordering::Release);
    }

    /// A read failed: every thread stops at its next claim; the first error is kept.
    pub(super) fn fail(&self, e: Error) {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
        self.stop.store(true, Ordering::Release);
    }

    /// The first error reported, if any.
    pub(super) fn into_error(self) -> Option<Error> {
        self.failed.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

/// Claims the next of `n` blocks counted by `next`, where `ready` (checked only while one is
/// left, as it may cost a load of its own).
fn take(next: &AtomicUsize, n: usize, ready: impl Fn() -> bool) -> Option<usize> {
    if next.load(Ordering::Relaxed) >= n || !ready() {
        return None;
    }
    // Acquire: a down block's claim sees the activations its slot's `prepared` published.
    let b = next.fetch_add(1, Ordering::AcqRel);
    (b < n).then_some(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every unit is handed out exactly once, downs only after their slot is prepared, and
    /// the schedule ends once all are claimed, with several threads claiming at once.
    #[test]
    fn every_unit_is_claimed_once_by_racing_threads() {
        let (k, seqs, per, per_shared, per_down) = (3, 2, 5, 2, 4);
        let slots = seqs * (k + 1);
        let mut counters: Vec<SlotCounters> = (0..slots).map(|_| Default::default()).collect();
        let sched = Schedule::new(&mut counters, k, per, per_shared, per_down);
        let seen: Vec<AtomicUsize> = (0..slots * 2 * 8).map(|_| AtomicUsize::new(0)).collect();
        let ready: Vec<AtomicBool> = (0..slots).map(|_| AtomicBool::new(false)).collect();
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    loop {
                        match sched.claim(|_| true, true) {
                            Unit::Done => return,
                            Unit::Wait => std::thread::yield_now(),
                            Unit::GateUp(s, b) => {
                                seen[(s * 2) * 8 + b].fetch_add(1, Ordering::Relaxed);
                                if sched.gate_up_done(s) {
                                    ready[s].store(true, Ordering::Relaxed);
                                    sched.prepared(s);
                                }
                            }
                            Unit::Down(s, b) => {
                                assert!(ready[s].load(Ordering::Relaxed), "down before prep");
                                seen[(s * 2 + 1) * 8 + b].fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                });
            }
        });
        for s in 0..slots {
            let gu = if s % (k + 1) < k { per } else { per_shared };
            for b in 0..8 {
                let want = |n: usize| usize::from(b < n);
                assert_eq!(seen[(s * 2) * 8 + b].load(Ordering::Relaxed), want(gu));
                assert_eq!(
                    seen[(s * 2 + 1) * 8 + b].load(Ordering::Relaxed),
                    want(per_down)
                );
            }
        }
        assert!(sched.into_error().is_none());
    }

    /// A failure stops every later claim and keeps the first error.
    #[test]
    fn a_failure_stops_the_schedule() {
        let mut counters: Vec<SlotCounters> = (0..3).map(|_| Default::default()).collect();
        let sched = Schedule::new(&mut counters, 2, 4, 4, 4);
        assert!(matches!(sched.claim(|_| true, true), Unit::GateUp(0, 0)));
        sched.fail(Error::Invalid("first".into()));
        sched.fail(Error::Invalid("second".into()));
        assert!(matches!(sched.claim(|_| true, true), Unit::Done));
        assert!(
            sched
                .into_error()
                .is_some_and(|e| e.to_string().contains("first"))
        );
    }

    /// Experts still being read are handed out only to a claim that may wait, after the
    /// landed ones.
    #[test]
    fn landed_experts_come_first() {
        let mut counters: Vec<SlotCounters> = (0..3).map(|_| Default::default()).collect();
        let sched = Schedule::new(&mut counters, 2, 1, 1, 1);
        let landed = |s: usize| s == 1;
        assert!(matches!(sched.claim(landed, false), Unit::GateUp(1, 0)));
        assert!(matches!(sched.claim(landed, false), Unit::Wait));
        assert!(matches!(sched.claim(landed, true), Unit::GateUp(0, 0)));
    }
}
