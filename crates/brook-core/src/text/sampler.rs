//! The token sampler: logits in, one id out, deterministic for a seed.
//!
//! Order as llama.cpp and vLLM document it: penalties (repetition as HF/llama.cpp: divide
//! positive logits, multiply negative ones; presence and frequency as OpenAI), then temperature,
//! top-k, top-p, min-p, then a draw. Temperature 0 is argmax. All scratch is sized in `new`;
//! `sample` never allocates. It must not know about tokenizers or stop conditions.
//!
//! It also draws from a forward call's greedy pick or most likely candidates
//! ([`Sampler::want`], [`Sampler::pick`]) exactly as from the row. The RNG is xoshiro256**
//! seeded through splitmix64 (rng.rs).

use super::rng::Xoshiro256;
use super::{Result, TextError};
use crate::model::{Logits, TOP_CANDIDATES, TopWant, rel_prob};

/// How to pick the next token. The default is greedy (argmax), with every filter off.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = argmax; otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-likely set whose probability reaches `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 = off.
    pub min_p: f32,
    /// > 1 discourages tokens already in the window; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token in the window (OpenAI); 0 = off.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the window (OpenAI); 0 = off.
    pub frequency_penalty: f32,
    /// Penalties look at the last `n` ids of the history; `None` = all of it.
    pub penalty_last_n: Option<usize>,
    /// RNG seed.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: None,
            seed: 0,
        }
    }
}

impl SamplingParams {
    fn validate(&self) -> Result<()> {
        let bad = |name, value: f32, expected| {
            Err(TextError::Sampling {
                name,
                value: value.to_string(),
                expected,
            })
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", self.temperature, "a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "in [0, 1]");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                "repetition_penalty",
                self.repetition_penalty,
                "a finite number > 0",
            );
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", self.presence_penalty, "a finite number");
        }
        if !self.frequency_penalty.is_finite() {
            return bad(
                "frequency_penalty",
                self.frequency_penalty,
                "a finite number",
            );
        }
        Ok(())
    }

    fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// A sampler with its scratch sized for one vocabulary.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
    counts: Vec<u32>, // [vocab] occurrences of each id in the penalty window, zero between calls
    idx: Vec<u32>,    // [vocab] candidate ids, most likely first once sorted
    probs: Vec<f32>,  // [vocab] unnormalised probability of each id
    kept: Vec<(f32, u32)>, // top-k's (logit, id) candidates: room for 2 × KEPT
    block_max: Vec<f32>, // [vocab / BLOCK] the largest logit of each block
    block_sel: Vec<f32>, // [vocab / BLOCK] scratch to select among them
    cands: Vec<(f32, u32)>, // [TOP_CANDIDATES] (logit, id) handed back by a forward call
}

/// Logits a block of the maximum pass (see `Sampler::top_candidates`).
const BLOCK: usize = 64;

/// Candidates top-k keeps between compactions (see `Sampler::top_candidates`); a top-k over
/// half of it takes every id.
const KEPT: usize = 4096;

impl Sampler {
    /// A sampler for logits of length `vocab_size` (the model's padded embedding rows).
    pub fn new(params: SamplingParams, vocab_size: usize) -> Result<Self> {
        params.validate()?;
        Ok(Self {
            rng: Xoshiro256::seed_from_u64(params.seed),
            params,
            counts: vec![0; vocab_size],
            idx: vec![0; vocab_size],
            probs: vec![0.0; vocab_size],
            kept: Vec::with_capacity(2 * KEPT),
            block_max: Vec::with_capacity(vocab_size.div_ceil(BLOCK)),
            block_sel: Vec::with_capacity(vocab_size.div_ceil(BLOCK)),
            cands: Vec::with_capacity(TOP_CANDIDATES),
        })
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether every pick is the largest logit's id ([`argmax`]) whatever the history: no
    /// penalty, and temperature 0 or top-k 1. Such a sampler needs only
    /// [`crate::Logits::Best`] from a forward call.
    pub fn greedy(&self) -> bool {
        let p = &self.params;
        !p.has_penalties() && (p.temperature == 0.0 || p.top_k == 1)
    }

    /// What this sampler needs from a forward call: [`Logits::Best`] when it is greedy,
    /// [`Logits::Top`] when a row's most likely candidates can decide it (temperature above
    /// 0, top-k from 2 to below [`TOP_CANDIDATES`], no penalty), else the row.
    pub fn want(&self) -> Logits {
        let p = &self.params;
        if self.greedy() {
            Logits::Best
        } else if !p.has_penalties() && p.top_k >= 2 && p.top_k < TOP_CANDIDATES {
            Logits::Top(TopWant {
                k: p.top_k as u32,
                temperature: p.temperature.to_bits(),
            })
        } else {
            Logits::Last
        }
    }

    /// Picks the next id from what a forward call asking for [`Sampler::want`] returned:
    /// the row of `vocab` logits ([`Sampler::sample`]), the greedy pick, or the candidates,
    /// which give the id the row would.
    pub fn pick(&mut self, out: &mut [f32], vocab: usize, history: &[u32]) -> u32 {
        if out.len() == vocab {
            return self.sample(out, history);
        }
        if out.len() == 1 {
            return Logits::best_id(out);
        }
        let mut cands = std::mem::take(&mut self.cands);
        cands.clear();
        cands.extend(out.chunks_exact(2).map(|p| (p[0], p[1].to_bits())));
        let id = self.sample_top(&cands);
        self.cands = cands;
        id
    }

    /// The pick from `cands`, the largest logits of a row as [`Logits::Top`] orders them,
    /// which decide it ([`crate::model::top_decides`]): the id [`Sampler::sample`] picks from
    /// the whole row, the same random draw.
    pub fn sample_top(&mut self, cands: &[(f32, u32)]) -> u32 {
        let Some(&(max, first)) = cands.first() else {
            // Every logit NaN: argmax's 0.
            return 0;
        };
        if !max.is_finite() || self.params.temperature == 0.0 {
            return first;
        }
        let inv_t = 1.0 / self.params.temperature;
        let n = self.idx.len();
        let mut c = 0;
        for &(l, id) in cands {
            if (id as usize) < n {
                self.probs[id as usize] = rel_prob(l, max, inv_t);
                self.idx[c] = id;
                c += 1;
            }
        }
        let m = if self.params.top_k > 0 && self.params.top_k < c {
            self.select_top(self.params.top_k, c);
            self.params.top_k
        } else {
            c
        };
        let sum = self.idx[..m].iter().map(|&i| self.probs[i as usize]).sum();
        let m = self.narrow(m, sum);
        self.draw(m)
    }

    /// Restarts the random stream at `seed`.
    pub fn reseed(&mut self, seed: u64) {
        self.params.seed = seed;
        self.rng = Xoshiro256::seed_from_u64(seed);
    }

    /// Picks the next id. Penalties are applied to `logits` in place; `history` holds the ids
    /// the penalties look at (prompt and output so far, as the caller decides). Logits beyond
    /// `vocab_size` are ignored; NaN logits are never picked unless every logit is NaN.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let n = logits.len().min(self.idx.len());
        let logits = &mut logits[..n];
        if self.params.has_penalties() {
            self.apply_penalties(logits, history);
        }
        if self.params.temperature == 0.0 || self.params.top_k == 1 || n <= 1 {
            return argmax(logits);
        }
        let Some(m) = self.filter(logits) else {
            return argmax(logits);
        };
        self.draw(m)
    }

    /// Draws one of `idx[..m]` in proportion to its probability.
    fn draw(&mut self, m: usize) -> u32 {
        let total: f32 = self.idx[..m].iter().map(|&i| self.probs[i as usize]).sum();
        let mut target = self.rng.next_f64() as f32 * total;
        for &i in &self.idx[..m] {
            target -= self.probs[i as usize];
            if target < 0.0 {
                return i;
            }
        }
        // Rounding left `target` a hair above zero: the last candidate is the one.
        self.idx[m.saturating_sub(1)]
    }

    fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32]) {
        let start = match self.params.penalty_last_n {
            Some(last) => history.len().saturating_sub(last),
            None => 0,
        };
        let window = &history[start..];
        let n = logits.len();
        for &id in window {
            if let Some(c) = self.counts.get_mut(id as usize) {
                *c += 1;
            }
        }
        let (rp, pp, fp) = (
            self.params.repetition_penalty,
            self.params.presence_penalty,
            self.params.frequency_penalty,
        );
        for &id in window {
            let i = id as usize;
            if i >= n || self.counts[i] == 0 {
                continue;
            }
            let count = self.counts[i] as f32;
            self.counts[i] = 0; // each id once, and the counts are clean for the next call
            let l = &mut logits[i];
            *l = if *l > 0.0 { *l / rp } else { *l * rp };
            *l -= pp + fp * count;
        }
    }

    /// Temperature, top-k, top-p and min-p. Leaves the `m` surviving ids in `idx[..m]` with
    /// their unnormalised probabilities in `probs`, and returns `m`; `None` when no logit is
    /// finite (argmax decides then).
    fn filter(&mut self, logits: &[f32]) -> Option<usize> {
        let n = logits.len();
        let inv_t = 1.0 / self.params.temperature;
        // Each block's largest logit (NaN skipped, as f32::max skips it), then theirs.
        self.block_max.clear();
        self.block_max.extend(
            logits
                .chunks(BLOCK)
                .map(|b| b.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))),
        );
        let max = self
            .block_max
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        if !max.is_finite() {
            return None;
        }
        let prob = |l: f32| rel_prob(l, max, inv_t);
        let top_k = self.params.top_k;
        let mut sum = 0.0f32;
        let mut m = n;
        let fast = if top_k > 0 && top_k < n {
            self.top_candidates(logits, top_k, prob)
        } else {
            None
        };
        if let Some(c) = fast {
            self.select_top(top_k, c);
            m = top_k;
        } else {
            for (i, &l) in logits.iter().enumerate() {
                let p = if l.is_nan() { 0.0 } else { prob(l) };
                self.probs[i] = p;
                sum += p;
                self.idx[i] = i as u32;
            }
            if top_k > 0 && top_k < n {
                self.select_top(top_k, n);
                m = top_k;
            }
        }
        if m < n {
            sum = self.idx[..m].iter().map(|&i| self.probs[i as usize]).sum();
        }
        Some(self.narrow(m, sum))
    }

    /// Top-p and min-p over `idx[..m]` (whose probabilities sum to `sum`), most likely first
    /// where top-k sorted them; returns how many survive.
    fn narrow(&mut self, mut m: usize, sum: f32) -> usize {
        let top_p = self.params.top_p;
        if top_p < 1.0 {
            m = self.top_p_cut(m, sum * top_p);
        }
        if self.params.min_p > 0.0 {
            // probs are relative to the best logit, whose probability is exactly 1.
            let threshold = self.params.min_p;
            let probs = &self.probs;
            let mut kept = 0;
            for j in 0..m {
                let id = self.idx[j];
                if probs[id as usize] >= threshold {
                    self.idx[kept] = id;
                    kept += 1;
                }
            }
            m = kept.max(1);
        }
        m
    }

    /// Top-k without a probability for every id: puts in `idx[..c]` (returned) every id
    /// whose probability can reach the `k`-th largest, with its probability in `probs`.
    /// `block_max` holds the largest logit of each block of [`BLOCK`]. `None` (nothing
    /// decided: the caller takes every id) when a step of `margin` below the k-th largest
    /// logit does not separate probabilities (underflow, or a temperature so high that the
    /// step is lost in rounding), when more than the scratch's room lie within it (near-equal
    /// logits), or when fewer than `k` blocks or logits hold numbers.
    ///
    /// Exact: a probability is a non-decreasing function of its logit, so the k-th largest
    /// probability is that of the k-th largest logit `lk`; an id left out has a logit below
    /// `lk − margin`, so a probability at most `prob(lk − margin)`, which is checked to be
    /// below `prob(lk)`: no id left out can be among the k most likely, ties included.
    fn top_candidates(
        &mut self,
        logits: &[f32],
        k: usize,
        prob: impl Fn(f32) -> f32,
    ) -> Option<usize> {
        // One temperature unit: candidates within a factor e of the k-th probability.
        let margin = self.params.temperature.max(f32::MIN_POSITIVE);
        if k > KEPT / 2 || self.block_max.len() < k {
            return None;
        }
        // The first floor: the k largest block maxima are k distinct logits, so the k-th
        // largest logit is at least the k-th largest of them. The floor only rises after
        // (to the k-th largest of what was kept so far, at most the final one, less the
        // margin), so any id passed over lies below the final k-th largest less the margin.
        let sel = &mut self.block_sel;
        sel.clear();
        sel.extend_from_slice(&self.block_max);
        sel.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let mut floor = sel[k - 1] - margin;
        if !floor.is_finite() {
            return None;
        }
        let kept = &mut self.kept;
        kept.clear();
        kept.reserve(2 * KEPT); // a clone's scratch starts empty
        let kth = |kept: &mut Vec<(f32, u32)>| {
            kept.select_nth_unstable_by(k - 1, |a, b| b.0.total_cmp(&a.0));
            kept[k - 1].0
        };
        for (b, block) in logits.chunks(BLOCK).enumerate() {
            if self.block_max[b] < floor {
                continue;
            }
            for (j, &l) in block.iter().enumerate() {
                if l >= floor {
                    kept.push((l, (b * BLOCK + j) as u32));
                    if kept.len() == 2 * KEPT {
                        floor = kth(kept) - margin;
                        kept.retain(|e| e.0 >= floor);
                        if kept.len() > KEPT {
                            return None;
                        }
                    }
                }
            }
        }
        if kept.len() < k {
            return None;
        }
        let lk = kth(kept);
        // Strictly below (NaN fails too, as it should).
        if prob(lk - margin).partial_cmp(&prob(lk)) != Some(std::cmp::Ordering::Less) {
            return None;
        }
        let mut c = 0;
        for &(l, id) in kept.iter().filter(|e| e.0 >= lk - margin) {
            self.probs[id as usize] = prob(l);
            self.idx[c] = id;
            c += 1;
        }
        Some(c)
    }

    /// Moves the `k` most likely of the ids in `idx[..len]` to `idx[..k]`, sorted most likely
    /// first (ties: lower id).
    fn select_top(&mut self, k: usize, len: usize) {
        let probs = &self.probs;
        let order = |a: &u32, b: &u32| {
            probs[*b as usize]
                .total_cmp(&probs[*a as usize])
                .then(a.cmp(b))
        };
        let ids = &mut self.idx[..len];
        let k = k.min(len);
        if k < len {
            ids.select_nth_unstable_by(k - 1, order);
        }
        ids[..k].sort_unstable_by(order);
    }

    /// Among `idx[..m]`, keeps the shortest most-likely prefix whose mass reaches `mass`. Sorts
    /// only as much as needed: 256 candidates first, growing fourfold.
    fn top_p_cut(&mut self, m: usize, mass: f32) -> usize {
        let mut sorted = 0;
        let mut k = 256.min(m);
        loop {
            if k > sorted {
                let probs = &self.probs;
                let order = |a: &u32, b: &u32| {
                    probs[*b as usize]
                        .total_cmp(&probs[*a as usize])
                        .then(a.cmp(b))
                };
                let part = &mut self.idx[sorted..m];
                let want = k - sorted;
                if want < part.len() {
                    part.select_nth_unstable_by(want - 1, order);
                }
                part[..want].sort_unstable_by(order);
                sorted = k;
            }
            let mut acc = 0.0f32;
            for (j, &id) in self.idx[..sorted].iter().enumerate() {
                acc += self.probs[id as usize];
                if acc >= mass {
                    return j + 1;
                }
            }
            if sorted >= m {
                return m;
            }
            k = (k * 4).min(m);
        }
    }
}

pub use crate::model::argmax;

#[cfg(test)]
mod tests {
    use super::{Sampler, SamplingParams, Xoshiro256};

    /// The k most likely ids by (probability, then lower id), every probability computed.
    fn naive_top(logits: &[f32], t: f32, k: usize) -> Vec<(u32, f32)> {
        let max = logits
            .iter()
            .copied()
            .filter(|l| !l.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        let mut all: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                let p = if l.is_nan() {
                    0.0
                } else {
                    ((l - max) * (1.0 / t)).exp()
                };
                (i as u32, p)
            })
            .collect();
        all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        all.truncate(k);
        all
    }

    #[test]
    fn top_k_from_candidates_is_the_top_k_of_every_probability() {
        let mut r = Xoshiro256::seed_from_u64(3);
        let mut fast = 0;
        let mut cases = 0;
        for n in [100usize, 1000, 4097, 70_000, 248_320] {
            for shape in 0..5 {
                let logits: Vec<f32> = (0..n)
                    .map(|i| {
                        let u = r.next_f64() as f32;
                        match shape {
                            0 => 10.0 * u - 5.0,
                            // Ties everywhere: a few distinct values.
                            1 => (8.0 * u).floor(),
                            // NaN and -inf sprinkled, a few far above the rest.
                            2 if i % 97 == 0 => f32::NAN,
                            2 if i % 89 == 0 => f32::NEG_INFINITY,
                            2 if i % 1013 == 0 => 30.0 + u,
                            // Near-equal values: one ulp apart.
                            3 => f32::from_bits(1.0f32.to_bits() + (u * 50.0) as u32),
                            // Sorted rising: the floor rises at every compaction.
                            4 => i as f32 * 1e-3,
                            _ => u,
                        }
                    })
                    .collect();
                for t in [1e-30f32, 0.05, 0.7, 1.0, 4.0, 1e30] {
                    for k in [1usize, 2, 20, 100, 1500, 2049] {
                        if k >= n {
                            continue;
                        }
                        let params = SamplingParams {
                            temperature: t,
                            top_k: k,
                            ..Default::default()
                        };
                        let mut s = Sampler::new(params, n).expect("params");
                        s.filter(&logits).expect("finite logits");
                        let got: Vec<(u32, f32)> = s.idx[..k]
                            .iter()
                            .map(|&i| (i, s.probs[i as usize]))
                            .collect();
                        let want = naive_top(&logits, t, k);
                        let same = got.len() == want.len()
                            && got
                                .iter()
                                .zip(&want)
                                .all(|(a, b)| a.0 == b.0 && a.1.to_bits() == b.1.to_bits());
                        assert!(same, "n {n} shape {shape} t {t} k {k}");
                        // Logits like a model's (a bulk and a few far above it) at the
                        // usual temperatures and k: the candidates' path must take them.
                        let usual =
                            shape == 2 && n == 248_320 && (0.05..=1.0).contains(&t) && k <= 100;
                        if usual {
                            cases += 1;
                            let max = logits
                                .iter()
                                .copied()
                                .filter(|l| !l.is_nan())
                                .fold(f32::NEG_INFINITY, f32::max);
                            let prob = |l: f32| ((l - max) * (1.0 / t)).exp();
                            if s.top_candidates(&logits, k, prob).is_some() {
                                fast += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(
            fast, cases,
            "of the usual cases, {fast} of {cases} took the candidates"
        );
    }
}
