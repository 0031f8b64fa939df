//! The sampler: greedy is argmax, a seed fixes the draws, top-k / top-p / min-p never pick
//! outside the set computed here independently, penalties move the logits they should, and
//! plain temperature sampling follows the softmax (chi-square bound, fixed seed: never flaky).

use brook_core::text::{Sampler, SamplingParams, TextError};

/// A fixed, uneven logit vector with a few near-ties.
fn logits(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as f32 * 0.618_034).fract();
            4.0 * x - 2.0 + if i % 7 == 0 { 1.5 } else { 0.0 }
        })
        .collect()
}

fn softmax(l: &[f32], t: f32) -> Vec<f64> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = l
        .iter()
        .map(|&x| ((x as f64 - max) / t as f64).exp())
        .collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// Ids sorted by probability, most likely first (ties: lower id).
fn ranked(p: &[f64]) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..p.len()).collect();
    ids.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    ids
}

fn draws(params: SamplingParams, l: &[f32], n: usize) -> Vec<u32> {
    let mut s = Sampler::new(params, l.len()).expect("valid params");
    (0..n)
        .map(|_| {
            let mut x = l.to_vec();
            s.sample(&mut x, &[])
        })
        .collect()
}

#[test]
fn greedy_is_argmax() {
    let l = logits(1000);
    let want = l
        .iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32;
    assert!(
        draws(SamplingParams::default(), &l, 50)
            .iter()
            .all(|&id| id == want)
    );
    let k1 = SamplingParams {
        temperature: 1.0,
        top_k: 1,
        ..Default::default()
    };
    assert!(draws(k1, &l, 50).iter().all(|&id| id == want));
}

/// The first index of the largest non-NaN value, one branch per logit.
fn argmax_plain(l: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in l.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

#[test]
fn argmax_takes_the_first_largest_and_skips_nan() {
    use brook_core::text::argmax;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for n in [0, 1, 2, 15, 16, 17, 63, 64, 65, 200, 1000, 4099] {
        for case in 0..8 {
            let mut l: Vec<f32> = (0..n)
                .map(|_| (next() % 2000) as f32 / 100.0 - 10.0)
                .collect();
            if n > 0 {
                let at = |r: u64| (r % n as u64) as usize;
                match case {
                    // Ties with the largest value, before and after it.
                    1 => {
                        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                        let (a, b) = (at(next()), at(next()));
                        (l[a], l[b]) = (m, m);
                    }
                    2 => l.iter_mut().for_each(|v| *v = f32::NAN),
                    3 => {
                        for _ in 0..n / 3 + 1 {
                            let i = at(next());
                            l[i] = f32::NAN;
                        }
                    }
                    4 => l.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
                    5 => {
                        let i = at(next());
                        l[i] = f32::INFINITY;
                    }
                    6 => l.iter_mut().for_each(|v| *v = 0.0),
                    7 => {
                        let i = at(next());
                        (l[i], l[n - 1 - i]) = (0.0, -0.0);
                        l.iter_mut().filter(|v| **v != 0.0).for_each(|v| *v = -1.0);
                    }
                    _ => {}
                }
            }
            assert_eq!(argmax(&l), argmax_plain(&l), "n {n}, case {case}: {l:?}");
        }
    }
}

#[test]
fn same_seed_same_draws_other_seed_other_draws() {
    let l = logits(500);
    let p = |seed| SamplingParams {
        temperature: 1.0,
        seed,
        ..Default::default()
    };
    let a = draws(p(42), &l, 300);
    assert_eq!(a, draws(p(42), &l, 300));
    assert_ne!(a, draws(p(43), &l, 300));
    let mut s = Sampler::new(p(42), l.len()).expect("valid");
    let first: Vec<u32> = (0..10).map(|_| s.sample(&mut l.clone(), &[])).collect();
    s.reseed(42);
    let again: Vec<u32> = (0..10).map(|_| s.sample(&mut l.clone(), &[])).collect();
    assert_eq!(first, again);
}

#[test]
fn top_k_never_leaves_the_k_best() {
    let l = logits(2000);
    let allowed = &ranked(&softmax(&l, 1.0))[..5];
    let params = SamplingParams {
        temperature: 1.5,
        top_k: 5,
        seed: 7,
        ..Default::default()
    };
    let got = draws(params, &l, 5000);
    assert!(got.iter().all(|id| allowed.contains(&(*id as usize))));
    for id in allowed {
        assert!(got.contains(&(*id as u32)), "top-k id {id} never drawn");
    }
}

#[test]
fn top_p_never_leaves_the_nucleus() {
    let l = logits(3000);
    let t = 0.7;
    let p = softmax(&l, t);
    let mut nucleus = Vec::new();
    let mut mass = 0.0;
    for id in ranked(&p) {
        nucleus.push(id);
        mass += p[id];
        if mass >= 0.6 {
            break;
        }
    }
    let params = SamplingParams {
        temperature: t,
        top_p: 0.6,
        seed: 11,
        ..Default::default()
    };
    let got = draws(params, &l, 5000);
    assert!(
        got.iter().all(|id| nucleus.contains(&(*id as usize))),
        "nucleus {}",
        nucleus.len()
    );
}

#[test]
fn min_p_never_picks_unlikely_tokens() {
    let l = logits(3000);
    let t = 1.0;
    let p = softmax(&l, t);
    let pmax = p.iter().copied().fold(0.0, f64::max);
    let params = SamplingParams {
        temperature: t,
        min_p: 0.3,
        seed: 5,
        ..Default::default()
    };
    let got = draws(params, &l, 5000);
    assert!(
        got.iter()
            .all(|&id| p[id as usize] >= 0.3 * pmax * (1.0 - 1e-4))
    );
}

#[test]
fn combined_filters_apply_in_order() {
    // top-k 50 first, then top-p within those 50, then min-p: the result is inside all three.
    let l = logits(4000);
    let p = softmax(&l, 0.8);
    let order = ranked(&p);
    let top50 = &order[..50];
    let params = SamplingParams {
        temperature: 0.8,
        top_k: 50,
        top_p: 0.9,
        min_p: 0.05,
        seed: 3,
        ..Default::default()
    };
    let pmax = p[order[0]];
    for id in draws(params, &l, 3000) {
        let id = id as usize;
        assert!(top50.contains(&id));
        assert!(p[id] >= 0.05 * pmax * (1.0 - 1e-4));
    }
}

#[test]
fn temperature_sampling_follows_softmax() {
    // Chi-square over 8 outcomes, 20,000 draws: the 99.99th percentile for 7 degrees of
    // freedom is 29.9; a fixed seed makes the statistic the same number every run.
    let l = [1.0f32, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.25];
    let t = 0.9;
    let p = softmax(&l, t);
    let n = 20_000;
    let params = SamplingParams {
        temperature: t,
        seed: 2024,
        ..Default::default()
    };
    let mut counts = [0usize; 8];
    for id in draws(params, &l, n) {
        counts[id as usize] += 1;
    }
    let chi2: f64 = counts
        .iter()
        .zip(&p)
        .map(|(&c, &pi)| {
            let e = pi * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum();
    assert!(chi2 < 29.9, "chi2 = {chi2}, counts {counts:?}");
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let mut s = Sampler::new(
        SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        },
        4,
    )
    .expect("valid");
    let mut l = [4.0f32, -1.0, 3.0, 1.0];
    // Token 0 repeated: 4 / 2 = 2 < 3, so greedy moves to token 2; token 1 goes to -2.
    assert_eq!(s.sample(&mut l, &[0, 1, 0]), 2);
    assert_eq!(l, [2.0, -2.0, 3.0, 1.0]);
}

#[test]
fn presence_and_frequency_penalties_follow_openai() {
    let params = SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..Default::default()
    };
    let mut s = Sampler::new(params, 3).expect("valid");
    let mut l = [1.0f32, 1.0, 1.0];
    s.sample(&mut l, &[0, 0, 0, 1]);
    // id 0: 1 - 0.5 - 3 * 0.25; id 1: 1 - 0.5 - 0.25; id 2 untouched.
    assert_eq!(l, [-0.25, 0.25, 1.0]);
    // Counts are reset between calls: the same history gives the same change again.
    let mut l = [1.0f32, 1.0, 1.0];
    s.sample(&mut l, &[0, 0, 0, 1]);
    assert_eq!(l, [-0.25, 0.25, 1.0]);
}

#[test]
fn penalty_window_only_sees_the_last_n_ids() {
    let params = SamplingParams {
        presence_penalty: 1.0,
        penalty_last_n: Some(2),
        ..Default::default()
    };
    let mut s = Sampler::new(params, 3).expect("valid");
    let mut l = [0.0f32; 3];
    s.sample(&mut l, &[0, 1, 2, 2]);
    assert_eq!(l, [0.0, 0.0, -1.0]);
}

#[test]
fn bad_parameters_are_typed_errors() {
    for params in [
        SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.0,
            ..Default::default()
        },
        SamplingParams {
            min_p: 1.5,
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: 0.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: f32::NAN,
            ..Default::default()
        },
    ] {
        assert!(matches!(
            Sampler::new(params, 10),
            Err(TextError::Sampling { .. })
        ));
    }
}

#[test]
fn odd_logits_do_not_panic() {
    let mut s = Sampler::new(
        SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        },
        4,
    )
    .expect("valid");
    assert_eq!(s.sample(&mut [f32::NEG_INFINITY; 4], &[]), 0);
    assert_eq!(s.sample(&mut [f32::NAN, 1.0, f32::NAN, 0.0], &[9, 99]), 1);
    let id = s.sample(&mut [0.0, 0.0], &[]); // shorter than the vocabulary
    assert!(id < 2);
}

mod no_alloc {
    //! `sample` must not allocate: a counting allocator wraps the system one for this test
    //! binary and counts allocations made by the current thread.

    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    use super::*;

    struct Counting;

    thread_local! {
        static ALLOCS: Cell<usize> = const { Cell::new(0) };
    }

    // SAFETY: forwards every call unchanged to the system allocator; the counter is a
    // const-initialised thread-local Cell, which never allocates.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            ALLOCS.with(|c| c.set(c.get() + 1));
            // SAFETY: same contract as the caller's.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: same contract as the caller's.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            ALLOCS.with(|c| c.set(c.get() + 1));
            // SAFETY: same contract as the caller's.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    #[test]
    fn sample_does_not_allocate() {
        let l = logits(151_936);
        let history: Vec<u32> = (0..512).map(|i| (i * 37) % 151_936).collect();
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.01,
            repetition_penalty: 1.1,
            presence_penalty: 0.5,
            frequency_penalty: 0.1,
            ..Default::default()
        };
        let mut s = Sampler::new(params, l.len()).expect("valid");
        let mut work = l.clone();
        let before = ALLOCS.with(Cell::get);
        for _ in 0..20 {
            work.copy_from_slice(&l);
            s.sample(&mut work, &history);
        }
        assert_eq!(ALLOCS.with(Cell::get) - before, 0);
    }
}

/// A forward call's most likely candidates (`Logits::Top`) give the id the whole row gives,
/// draw for draw, wherever `top_decides` says they decide it; on rows with near-ties,
/// repeated values, NaN, infinities and signed zeros, at temperatures from 0.05 to 4, with
/// top-p and min-p. And they decide the ordinary rows.
#[test]
fn the_most_likely_candidates_pick_what_the_row_picks() {
    use brook_core::Logits;
    use brook_core::model::{TOP_CANDIDATES, top_candidates, top_decides};
    let n = 3000;
    let mut rows: Vec<Vec<f32>> = vec![logits(n)];
    // Pseudo-random rows (an LCG), one of them coarse (many equal values).
    let mut x = 12345u64;
    let mut next = || {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((x >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    };
    rows.push((0..n).map(|_| 6.0 * next()).collect());
    rows.push((0..n).map(|_| (8.0 * next()).round() / 4.0).collect());
    let mut r: Vec<f32> = (0..n).map(|_| 3.0 * next()).collect();
    r[5] = f32::NAN;
    r[77] = f32::INFINITY;
    r[78] = -0.0;
    r[79] = 0.0;
    r[n - 1] = f32::NEG_INFINITY;
    rows.push(r);
    rows.push(vec![1.0; n]);
    let mut r = vec![f32::NAN; n];
    for (i, v) in r.iter_mut().enumerate().take(40) {
        *v = (i % 5) as f32;
    }
    rows.push(r);
    let mut decided = 0;
    let mut cands = Vec::new();
    for (ri, row) in rows.iter().enumerate() {
        let whole = top_candidates(row, &mut cands);
        assert!(cands.len() <= TOP_CANDIDATES);
        // The candidates against an independent sort.
        let mut naive: Vec<(f32, u32)> = row
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (if l == 0.0 { 0.0 } else { l }, i as u32))
            .collect();
        naive.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        naive.truncate(TOP_CANDIDATES);
        assert_eq!(cands, naive, "row {ri}");
        for (t, k, top_p, min_p) in [
            (1.0, 20, 0.95, 0.0),
            (0.7, 40, 1.0, 0.0),
            (0.05, 8, 0.9, 0.0),
            (4.0, 63, 0.5, 0.1),
            (1.0, 2, 1.0, 0.0),
        ] {
            let params = SamplingParams {
                temperature: t,
                top_k: k,
                top_p,
                min_p,
                seed: 9,
                ..Default::default()
            };
            let mut full = Sampler::new(params.clone(), n).expect("params");
            let mut top = Sampler::new(params, n).expect("params");
            let Logits::Top(want) = top.want() else {
                panic!("top-k {k} at temperature {t} should ask for candidates");
            };
            if !top_decides(&cands, whole, want) {
                continue;
            }
            decided += 1;
            let mut pairs: Vec<f32> = cands
                .iter()
                .flat_map(|&(l, id)| [l, f32::from_bits(id)])
                .collect();
            for d in 0..30 {
                let mut x = row.clone();
                let a = full.sample(&mut x, &[]);
                let b = top.pick(&mut pairs, n, &[]);
                assert_eq!(a, b, "row {ri}, temperature {t}, top-k {k}, draw {d}");
            }
        }
    }
    // The first four rows decide every setting but the coarse row's.
    assert!(decided >= 15, "{decided} decided");
}
