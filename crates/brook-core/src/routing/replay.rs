//! Offline cache models on a routing trace: the demand hit rate a cache of N slots would reach
//! under Belady's optimum (evict the expert needed furthest in the future), least recently
//! used, and least frequently used with counts that survive eviction (brook's policy before
//! the traces; docs/bench/2026-12-03.md).
//!
//! The requests are those of decode: each token asks each layer, in layer order, for its top-k
//! experts at once, and a request never evicts one of its own experts (the real cache pins
//! them), so N must be at least top-k.

use std::collections::{BTreeSet, BinaryHeap, HashMap};

use crate::error::{Error, Result};
use crate::routing::RoutingTrace;

/// An eviction rule of the offline models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    Belady,
    Lru,
    Lfu,
    /// Evict the expert least likely to be asked for at its layer's next turn, the likelihood
    /// learned online from the trace so far by how long ago the expert was last used and how
    /// often in the last [`REUSE_WINDOW`] turns (ties: the one whose turn is furthest).
    Reuse,
}

/// Turns of a layer over which [`Policy::Reuse`] counts an expert's uses.
pub const REUSE_WINDOW: usize = 8;
/// Ages (turns since last use) [`Policy::Reuse`] tells apart; older ones share a class.
pub(crate) const REUSE_AGES: usize = 16;
/// Classes of [`Uses::class_at`].
pub(crate) const REUSE_CLASSES: usize = (REUSE_AGES + 1) * (REUSE_WINDOW + 1);

/// Demand hit rate of `slots` slots under `policy` on `trace`: hits / picks.
pub fn hit_rate(trace: &RoutingTrace, slots: usize, policy: Policy) -> Result<f64> {
    if slots < trace.top_k {
        return Err(Error::Invalid(format!(
            "{slots} slots cannot hold one request of {} experts",
            trace.top_k
        )));
    }
    let hits = match policy {
        Policy::Belady => belady(trace, slots),
        Policy::Lru | Policy::Lfu => ordered(trace, slots, policy == Policy::Lfu),
        Policy::Reuse => reuse(trace, slots),
    };
    let picks = (trace.tokens() * trace.layers * trace.top_k).max(1);
    Ok(hits as f64 / picks as f64)
}

/// The requests in order: (layer, experts).
fn requests(t: &RoutingTrace) -> impl Iterator<Item = (usize, &[u32])> {
    (0..t.tokens()).flat_map(move |tok| (0..t.layers).map(move |l| (l, t.experts(tok, l))))
}

/// LRU or LFU: the victim is the smallest (count or 0, last use, key) outside the request.
fn ordered(trace: &RoutingTrace, slots: usize, lfu: bool) -> u64 {
    let e_n = trace.num_experts;
    // key -> (count, last use) of every expert seen; `held` orders the cached ones.
    let mut meta: HashMap<usize, (u64, u64)> = HashMap::new();
    let mut held: BTreeSet<(u64, u64, usize)> = BTreeSet::new();
    let rank = |m: (u64, u64), key: usize| (if lfu { m.0 } else { 0 }, m.1, key);
    let (mut hits, mut tick) = (0u64, 0u64);
    let mut cached: HashMap<usize, bool> = HashMap::new();
    for (l, ids) in requests(trace) {
        tick += 1;
        let keys: Vec<usize> = ids.iter().map(|&e| l * e_n + e as usize).collect();
        // Hits first, each moved to now (so it is not a victim of its own request).
        for &k in &keys {
            let m = meta.entry(k).or_insert((0, 0));
            if cached.get(&k).copied().unwrap_or(false) {
                hits += 1;
                held.remove(&rank(*m, k));
                *m = (m.0 + 1, tick);
                held.insert(rank(*m, k));
            } else {
                *m = (m.0 + 1, m.1);
            }
        }
        for &k in &keys {
            if cached.get(&k).copied().unwrap_or(false) {
                continue;
            }
            if held.len() >= slots {
                // The request's own experts carry `tick` and rank after every other one
                // under LRU; under LFU skip them explicitly.
                let victim = held
                    .iter()
                    .find(|&&(_, t, _)| t != tick)
                    .copied()
                    .expect("slots >= top-k");
                held.remove(&victim);
                cached.insert(victim.2, false);
            }
            let m = meta.get_mut(&k).expect("seen");
            m.1 = tick;
            held.insert(rank(*m, k));
            cached.insert(k, true);
        }
    }
    hits
}

/// An expert's uses for [`Policy::Reuse`] (and the cache's `Eviction::Reuse`): the last turn
/// of its layer it was asked for and a bit per earlier turn.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Uses {
    /// Turn of the last use (`None`: never used).
    pub(crate) last: Option<usize>,
    /// Bit j: used at turn `last - j`.
    mask: u32,
}

impl Uses {
    /// The class (age, uses in the window) seen from turn `at` (after `last`), as an index
    /// into a table of [`REUSE_CLASSES`]; `None` for an expert never used.
    pub(crate) fn class_at(&self, at: usize) -> Option<usize> {
        self.class(at).map(|(a, f)| a * (REUSE_WINDOW + 1) + f)
    }

    /// (age, uses in the window) seen from turn `at` (after `last`).
    fn class(&self, at: usize) -> Option<(usize, usize)> {
        let last = self.last?;
        let age = at.saturating_sub(last).max(1);
        let f = if age <= REUSE_WINDOW {
            let keep = (1u64 << (REUSE_WINDOW - age + 1)) - 1;
            (self.mask as u64 & keep).count_ones() as usize
        } else {
            0
        };
        Some((age.min(REUSE_AGES), f))
    }

    pub(crate) fn used(&mut self, at: usize) {
        self.mask = match self.last {
            Some(l) if at >= l && at - l < 32 => (self.mask << (at - l)) | 1,
            _ => 1,
        };
        self.last = Some(at);
    }
}

/// [`Policy::Reuse`]: the turn of a layer is the token index (decode asks each layer once a
/// token).
fn reuse(trace: &RoutingTrace, slots: usize) -> u64 {
    let (e_n, layers) = (trace.num_experts, trace.layers);
    let classes = (REUSE_AGES + 1) * (REUSE_WINDOW + 1);
    // [class] (asked for at the turn, trials), with a prior of one in two.
    let mut table = vec![(1.0f64, 2.0f64); classes];
    let at = |c: (usize, usize)| c.0 * (REUSE_WINDOW + 1) + c.1;
    let mut uses = vec![
        Uses {
            last: None,
            mask: 0
        };
        layers * e_n
    ];
    let mut cached: Vec<usize> = Vec::with_capacity(slots);
    let mut is_cached = vec![false; layers * e_n];
    let mut hits = 0u64;
    for t in 0..trace.tokens() {
        for l in 0..layers {
            let keys: Vec<usize> = trace
                .experts(t, l)
                .iter()
                .map(|&e| l * e_n + e as usize)
                .collect();
            // Learn: how often each class of this layer's experts is asked for now.
            for e in 0..e_n {
                let k = l * e_n + e;
                if let Some(c) = uses[k].class(t) {
                    let cell = &mut table[at(c)];
                    cell.1 += 1.0;
                    if keys.contains(&k) {
                        cell.0 += 1.0;
                    }
                }
            }
            hits += keys.iter().filter(|&&k| is_cached[k]).count() as u64;
            for &k in &keys {
                if is_cached[k] {
                    continue;
                }
                if cached.len() >= slots {
                    // The least likely to be asked for at its layer's next turn.
                    let score = |k: usize| {
                        let kl = k / e_n;
                        let next = if kl > l { t } else { t + 1 };
                        let p = uses[k].class(next).map_or(0.0, |c| {
                            let (h, n) = table[at(c)];
                            h / n
                        });
                        let dist = (kl + layers - l) % layers;
                        (p, layers - if dist == 0 { layers } else { dist })
                    };
                    let (i, _) = cached
                        .iter()
                        .enumerate()
                        .filter(|&(_, k)| !keys.contains(k))
                        .map(|(i, &k)| (i, score(k)))
                        .min_by(|a, b| a.1.0.total_cmp(&b.1.0).then(a.1.1.cmp(&b.1.1)))
                        .expect("slots >= top-k");
                    is_cached[cached.swap_remove(i)] = false;
                }
                cached.push(k);
                is_cached[k] = true;
            }
            for &k in &keys {
                uses[k].used(t);
            }
        }
    }
    hits
}

/// Belady's optimum: evict the cached expert whose next request is furthest away.
fn belady(trace: &RoutingTrace, slots: usize) -> u64 {
    let e_n = trace.num_experts;
    let reqs: Vec<(usize, &[u32])> = requests(trace).collect();
    // next[r][j]: the index of the next request asking for request r's j-th expert.
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); reqs.len()];
    let mut seen: HashMap<usize, usize> = HashMap::new();
    for (r, (l, ids)) in reqs.iter().enumerate().rev() {
        next[r] = ids
            .iter()
            .map(|&e| {
                let k = l * e_n + e as usize;
                seen.insert(k, r).unwrap_or(usize::MAX)
            })
            .collect();
    }
    // Cached keys with their next use; the heap holds (next use, key), stale entries skipped.
    let mut cached: HashMap<usize, usize> = HashMap::new();
    let mut heap: BinaryHeap<(usize, usize)> = BinaryHeap::new();
    let mut hits = 0u64;
    for (r, (l, ids)) in reqs.iter().enumerate() {
        let keys: Vec<usize> = ids.iter().map(|&e| l * e_n + e as usize).collect();
        for &k in &keys {
            if cached.contains_key(&k) {
                hits += 1;
            }
        }
        for (j, &k) in keys.iter().enumerate() {
            if !cached.contains_key(&k) {
                if cached.len() >= slots {
                    let mut kept = Vec::new();
                    while let Some((n, v)) = heap.pop() {
                        if cached.get(&v) != Some(&n) {
                            continue; // stale
                        }
                        if keys.contains(&v) {
                            kept.push((n, v)); // the request's own: pinned
                            continue;
                        }
                        cached.remove(&v);
                        break;
                    }
                    heap.extend(kept);
                }
                cached.insert(k, r);
            }
            // Its next use from here on.
            cached.insert(k, next[r][j]);
            heap.push((next[r][j], k));
        }
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::simulate::{SimParams, simulate};

    fn trace(rows: &[&[u32]]) -> RoutingTrace {
        let mut t = RoutingTrace::new(1, 8, rows[0].len()).expect("new");
        for r in rows {
            t.push(&[r.to_vec()]).expect("push");
        }
        t
    }

    #[test]
    fn the_models_count_what_a_hand_replay_counts() {
        // One layer, one expert a token, 2 slots: 0 1 2 0 1 2 0.
        let t = trace(&[&[0], &[1], &[2], &[0], &[1], &[2], &[0]]);
        // LRU always evicts the one needed next: no hits.
        assert_eq!(hit_rate(&t, 2, Policy::Lru).expect("lru"), 0.0);
        // Belady: miss 0 1 2(evict 1: next at 4, 0 at 3) hit 0, miss 1 (evict 0: next 6 vs
        // 2 at 5), hit 2, miss 0: 2 hits of 7.
        assert!((hit_rate(&t, 2, Policy::Belady).expect("b") - 2.0 / 7.0).abs() < 1e-12);
        // LFU keeps the popular expert through a scan.
        let t = trace(&[&[0], &[0], &[0], &[1], &[2], &[3], &[0]]);
        assert!((hit_rate(&t, 2, Policy::Lfu).expect("lfu") - 3.0 / 7.0).abs() < 1e-12);
        assert!((hit_rate(&t, 2, Policy::Lru).expect("lru") - 2.0 / 7.0).abs() < 1e-12);
        // A request never evicts its own experts, and slots below top-k are refused.
        let t = trace(&[&[0, 1], &[2, 3], &[0, 1]]);
        assert_eq!(hit_rate(&t, 2, Policy::Belady).expect("b"), 0.0);
        assert!(hit_rate(&t, 1, Policy::Lru).is_err());
    }

    #[test]
    fn belady_bounds_every_policy_and_all_slots_hit_all_repeats() {
        let t = simulate(4, 32, 4, 200, SimParams::REALISTIC, 5).expect("sim");
        for slots in [4, 16, 40, 64] {
            let b = hit_rate(&t, slots, Policy::Belady).expect("b");
            for p in [Policy::Lru, Policy::Lfu, Policy::Reuse] {
                let h = hit_rate(&t, slots, p).expect("p");
                assert!(h <= b + 1e-12, "{p:?} {slots}: {h} > {b}");
            }
        }
        // Every expert held: only first uses miss.
        let mut distinct = std::collections::HashSet::new();
        for i in 0..t.tokens() {
            for l in 0..4 {
                for &e in t.experts(i, l) {
                    distinct.insert((l, e));
                }
            }
        }
        let picks = (t.tokens() * 4 * 4) as f64;
        let all = 1.0 - distinct.len() as f64 / picks;
        for p in [Policy::Belady, Policy::Lru, Policy::Lfu, Policy::Reuse] {
            assert!((hit_rate(&t, 128, p).expect("all") - all).abs() < 1e-12);
        }
    }
}
