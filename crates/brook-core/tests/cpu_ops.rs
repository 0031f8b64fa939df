//! The CPU forward pass's helpers against the reference functions in `model/`, on random
//! inputs, at every SIMD level this CPU runs.
//!
//! Tolerance: relative L2 1e-5 (f32 summation order differs; measured ~1e-7); router choices
//! must be identical.

mod common;

use brook_core::Model;
use brook_core::cpu::kernels::attention::attend;
use brook_core::cpu::kernels::delta::{self, HeadRows};
use brook_core::cpu::kernels::ops::{
    exp_act, rms_norm, rope, rope_angles, rope_inv_freq, route_top_k, sigmoid_gate, silu_inplace,
    swiglu_act,
};
use brook_core::cpu::testutil::{Format, Rng, random_linear};
use brook_core::cpu::{SimdLevel, SwigluScratch, expert_swiglu};
use brook_core::dtype::DType;
use brook_core::experts::source::ExpertData;
use brook_core::model::delta_net::{DeltaInputs, delta_rule_chunked, delta_rule_recurrent};
use brook_core::model::moe::{route, swiglu};
use brook_core::model::weights::{Expert, MoeWeights};
use brook_core::model::{attention, ops};
use common::{fixture, rel_l2};

const TOL: f64 = 1e-5;

#[test]
fn rms_norm_matches_reference() {
    let mut rng = Rng::new(1);
    for n in [1, 7, 64, 2048, 2051] {
        let (x, w) = (rng.vec(n, 3.0), rng.vec(n, 1.0));
        let mut want = vec![0.0; n];
        ops::rms_norm(&x, &w, 1e-6, &mut want);
        for level in SimdLevel::supported() {
            let mut got = vec![0.0; n];
            rms_norm(level, &x, &w, 1e-6, &mut got);
            assert!(rel_l2(&got, &want) < TOL, "{level:?} n {n}");
        }
    }
}

fn expert(rng: &mut Rng, h: usize, i: usize, fmt: Format) -> Expert {
    Expert {
        gate_proj: random_linear(rng, i, h, fmt),
        up_proj: random_linear(rng, i, h, fmt),
        down_proj: random_linear(rng, h, i, fmt),
    }
}

#[test]
fn expert_swiglu_matches_reference() {
    let mut rng = Rng::new(2);
    let formats = [
        Format::Affine {
            bits: 4,
            group: 64,
            float: DType::BF16,
        },
        Format::Affine {
            bits: 3,
            group: 32,
            float: DType::F16,
        },
        Format::Affine {
            bits: 8,
            group: 128,
            float: DType::F32,
        },
        Format::Float(DType::BF16),
    ];
    for fmt in formats {
        let e = expert(&mut rng, 256, 128, fmt);
        let x = rng.vec(256, 1.0);
        let mut want = vec![0.0; 256];
        swiglu(e.view(), &x, &mut want);
        let mut s = SwigluScratch::default();
        for level in SimdLevel::supported() {
            let mut got = vec![0.0; 256];
            expert_swiglu(level, e.view(), &x, &mut got, &mut s).expect("swiglu");
            assert!(rel_l2(&got, &want) < TOL, "{level:?} {fmt:?}");
        }
    }
}

/// Distance in units in the last place between two finite floats of the same sign.
fn ulps(a: f32, b: f32) -> u32 {
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

#[test]
fn activations_exp_is_within_two_ulp_of_libm() {
    // Every 997th float bit pattern of [-87, 88], both signs, and the ends.
    let mut worst = 0;
    for bits in (0..0x42b0_0000u32).step_by(997).chain([0x42b0_0000]) {
        for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
            if !(-87.0..=88.0).contains(&x) {
                continue;
            }
            let (got, want) = (exp_act(x), x.exp());
            let d = ulps(got, want);
            assert!(d <= 2, "exp({x:e}) = {got:e}, libm {want:e}: {d} ulp");
            worst = worst.max(d);
        }
    }
    assert!(
        worst >= 1,
        "a sweep that never differs from libm tests nothing"
    );
    // Outside the range: saturated, finite, of the right size; NaN stays NaN.
    assert!(exp_act(-1000.0) > 0.0 && exp_act(-1000.0) < 2e-38);
    assert!(exp_act(1000.0).is_finite() && exp_act(1000.0) > 1e38);
    assert!(exp_act(f32::NAN).is_nan());
}

#[test]
fn swiglu_silu_and_sigmoid_gates_match_reference() {
    let mut rng = Rng::new(5);
    for n in [1, 15, 16, 17, 512, 1027] {
        let (g, u) = (rng.vec(n, 12.0), rng.vec(n, 2.0));
        let want: Vec<f32> = g.iter().zip(&u).map(|(&a, &b)| ops::silu(a) * b).collect();
        let silu: Vec<f32> = g.iter().map(|&a| ops::silu(a)).collect();
        let gate: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&a, &b)| b * ops::sigmoid(a))
            .collect();
        for level in SimdLevel::supported() {
            let mut got = g.clone();
            swiglu_act(level, &mut got, &u);
            let mut x = u.clone();
            sigmoid_gate(level, &mut x, &g);
            let mut s = g.clone();
            silu_inplace(level, &mut s);
            for (what, got, want) in [
                ("swiglu", &got, &want),
                ("sigmoid gate", &x, &gate),
                ("silu", &s, &silu),
            ] {
                for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(
                        (a - b).abs() <= 4.0 * f32::EPSILON * b.abs() + 1e-30,
                        "{what} {level:?} n={n} [{i}]: {a:e} vs reference {b:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn router_top_k_chooses_what_the_reference_chooses() {
    let model = Model::open(&fixture("qwen35-q4")).expect("open");
    let mut rng = Rng::new(3);
    for (e_n, k, norm) in [(8, 3, true), (64, 8, true), (512, 10, false)] {
        let mut cfg = model.cfg.clone();
        cfg.num_experts = e_n;
        cfg.num_experts_per_tok = k;
        cfg.norm_topk_prob = norm;
        let h = cfg.hidden_size;
        let f32w = Format::Float(DType::F32);
        let w = MoeWeights {
            gate: random_linear(&mut rng, e_n, h, f32w),
            shared_expert: expert(&mut rng, h, 8, f32w),
            shared_expert_gate: random_linear(&mut rng, 1, h, f32w),
        };
        for _ in 0..20 {
            let x = rng.vec(h, 2.0);
            let want = route(&w, &cfg, &x);
            let mut p = vec![0.0; e_n];
            w.gate.forward(&x, &mut p);
            let (mut sel, mut wts) = (vec![0; k], vec![0.0; k]);
            route_top_k(&mut p, norm, &mut sel, &mut wts);
            assert_eq!(sel, want.experts);
            assert!(rel_l2(&wts, &want.weights) < TOL);
        }
        // Ties keep the lower index first, as the reference's stable order does.
        let mut p = vec![0.0; e_n];
        let (mut sel, mut wts) = (vec![0; k], vec![0.0; k]);
        route_top_k(&mut p, norm, &mut sel, &mut wts);
        assert_eq!(sel, (0..k).collect::<Vec<_>>());
        // Choosing none is no error.
        route_top_k(&mut p, norm, &mut [], &mut []);
        // Many partial ties: the k largest by value, lower index first among equals.
        for _ in 0..50 {
            let logits: Vec<f32> = rng
                .vec(e_n, 1.0)
                .iter()
                .map(|v| (v * 2.0).round())
                .collect();
            let mut p = logits.clone();
            let (mut sel, mut wts) = (vec![0; k], vec![0.0; k]);
            route_top_k(&mut p, false, &mut sel, &mut wts);
            let mut order: Vec<usize> = (0..e_n).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            assert_eq!(sel, order[..k], "{logits:?}");
            assert!(sel.iter().zip(&wts).all(|(&e, &w)| p[e] == w));
        }
    }
}

#[test]
fn rope_matches_reference() {
    let model = Model::open(&fixture("next-q4")).expect("open");
    let cfg = &model.cfg;
    let inv = rope_inv_freq(cfg);
    let mut rng = Rng::new(4);
    for pos in [0, 1, 17, 4095, 100_000] {
        let x = rng.vec(cfg.head_dim, 1.0);
        let (mut a, mut b) = (x.clone(), x);
        attention::rope(&mut a, pos, cfg);
        let mut cs = vec![0.0; 2 * inv.len()];
        rope_angles(pos, &inv, &mut cs);
        rope(&mut b, &cs);
        assert_eq!(a, b, "pos {pos}");
    }
}

#[test]
fn attention_over_a_cache_matches_a_direct_softmax() {
    let mut rng = Rng::new(5);
    let (nkv, hd) = (2, 64);
    for visible in [1, 5, 300] {
        let keys = rng.vec(visible * nkv * hd, 1.0);
        let values = rng.vec(visible * nkv * hd, 1.0);
        let q = rng.vec(hd, 1.0);
        let kvh = 1;
        let scale = (hd as f32).powf(-0.5);
        let mut sc: Vec<f32> = (0..visible)
            .map(|p| {
                let kp = &keys[(p * nkv + kvh) * hd..][..hd];
                q.iter().zip(kp).map(|(a, b)| a * b).sum::<f32>() * scale
            })
            .collect();
        ops::softmax(&mut sc);
        let mut want = vec![0.0; hd];
        for (p, &pr) in sc.iter().enumerate() {
            for (o, &v) in want.iter_mut().zip(&values[(p * nkv + kvh) * hd..][..hd]) {
                *o += pr * v;
            }
        }
        for level in SimdLevel::supported() {
            let (mut scores, mut got) = (vec![0.0; visible], vec![0.0; hd]);
            attend(
                level,
                &q,
                hd,
                &keys,
                &values,
                nkv,
                kvh,
                visible,
                scale,
                &mut scores,
                &mut got,
            );
            assert!(rel_l2(&got, &want) < TOL, "{level:?} visible {visible}");
        }
    }
}

/// Random normalised delta-rule inputs for T tokens (nk = 1, nv = 2 value heads).
struct Inputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
}

fn delta_inputs(rng: &mut Rng, t: usize, nv: usize, dk: usize, dv: usize) -> Inputs {
    let mut unit = |n: usize| {
        let mut v = rng.vec(n, 1.0);
        for h in v.chunks_exact_mut(dk) {
            let norm = h.iter().map(|x| x * x).sum::<f32>().sqrt();
            h.iter_mut().for_each(|x| *x /= norm);
        }
        v
    };
    let (q, k) = (unit(t * dk), unit(t * dk));
    let v = rng.vec(t * nv * dv, 1.0);
    let g = (0..t * nv).map(|_| -0.3 * (1.0 + rng.f32())).collect();
    let beta = (0..t * nv).map(|_| 0.5 + 0.4 * rng.f32()).collect();
    Inputs { q, k, v, g, beta }
}

#[test]
fn delta_rule_step_and_chunked_match_reference() {
    let mut rng = Rng::new(6);
    // Odd widths (the chunked form's edge blocks), the models' own 128 × 128 heads (its
    // full register blocks), and values wider than one of `step`'s 128-column blocks.
    let cases = [
        (2, 32, 48, 1),
        (2, 32, 48, 3),
        (2, 32, 48, 64),
        (2, 32, 48, 150),
        (2, 128, 128, 70),
        (1, 64, 80, 130),
        (1, 16, 200, 4),
    ];
    for (nv, dk, dv, t) in cases {
        let x = delta_inputs(&mut rng, t, nv, dk, dv);
        let s0 = rng.vec(nv * dk * dv, 0.5);
        let inputs = DeltaInputs {
            q: &x.q,
            k: &x.k,
            v: &x.v,
            g: &x.g,
            beta: &x.beta,
            nk: 1,
            nv,
            dk,
            dv,
        };
        let (mut s_ref, mut o_ref) = (s0.clone(), vec![0.0; t * nv * dv]);
        delta_rule_recurrent(&inputs, &mut s_ref, &mut o_ref);
        let (mut s_ch, mut o_ch) = (s0.clone(), vec![0.0; t * nv * dv]);
        delta_rule_chunked(&inputs, &mut s_ch, &mut o_ch);
        for level in SimdLevel::supported() {
            // Token by token with `step`.
            let mut s = s0.clone();
            let mut o = vec![0.0; t * nv * dv];
            for ti in 0..t {
                for h in 0..nv {
                    let oh = &mut o[(ti * nv + h) * dv..][..dv];
                    delta::step(
                        level,
                        &mut s[h * dk * dv..(h + 1) * dk * dv],
                        &x.q[ti * dk..][..dk],
                        &x.k[ti * dk..][..dk],
                        &x.v[(ti * nv + h) * dv..][..dv],
                        x.g[ti * nv + h],
                        x.beta[ti * nv + h],
                        oh,
                    );
                }
            }
            assert!(rel_l2(&o, &o_ref) < TOL, "{level:?} step T={t} output");
            assert!(rel_l2(&s, &s_ref) < TOL, "{level:?} step T={t} state");
            // All tokens at once with `chunked`, one head at a time.
            let mut s = s0.clone();
            let mut scratch = vec![0.0; delta::chunked_scratch(dk, dv)];
            for h in 0..nv {
                let rows = HeadRows {
                    q: &x.q,
                    k: &x.k,
                    v: &x.v[h * dv..],
                    g: &x.g[h..],
                    beta: &x.beta[h..],
                    q_stride: dk,
                    v_stride: nv * dv,
                    gb_stride: nv,
                    dk,
                    dv,
                };
                let mut oh = vec![0.0; t * dv];
                delta::chunked(
                    level,
                    &rows,
                    t,
                    &mut s[h * dk * dv..(h + 1) * dk * dv],
                    &mut scratch,
                    &mut oh,
                );
                let want: Vec<f32> = (0..t)
                    .flat_map(|ti| o_ch[(ti * nv + h) * dv..][..dv].to_vec())
                    .collect();
                assert!(rel_l2(&oh, &want) < TOL, "{level:?} chunked T={t} head {h}");
            }
            assert!(rel_l2(&s, &s_ch) < TOL, "{level:?} chunked T={t} state");
        }
    }
}

#[test]
fn bf16_rounding_is_to_nearest_even_and_flushes_subnormals() {
    let mut rng = Rng::new(31);
    let mut xs: Vec<f32> = (0..20_000).map(|_| rng.f32() * 8.0 - 4.0).collect();
    xs.extend((0..20_000).map(|_| f32::from_bits((rng.next_u64() >> 32) as u32)));
    // Exact ties (low half 0x8000) both ways, the largest finite values, subnormals, zeros.
    xs.extend([
        f32::from_bits(0x3F80_8000),
        f32::from_bits(0x3F81_8000),
        f32::from_bits(0xBF80_8000),
        f32::MAX,
        f32::MIN,
        f32::from_bits(0x7F7F_8000),
        f32::from_bits(1),
        f32::from_bits(0x0000_8000),
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]);
    for x in xs {
        let got = delta::bf16_bits(x);
        if x.is_nan() {
            assert!(delta::bf16_to_f32(got).is_nan(), "{:#x}", x.to_bits());
            continue;
        }
        // Subnormal inputs flush to a zero of their sign (as `vcvtneps2bf16` does).
        let want = if x != 0.0 && x.abs() < f32::MIN_POSITIVE {
            half::bf16::from_f32(0.0f32.copysign(x)).to_bits()
        } else {
            half::bf16::from_f32(x).to_bits()
        };
        assert_eq!(got, want, "{:#x}", x.to_bits());
        assert_eq!(
            delta::bf16_to_f32(got),
            half::bf16::from_bits(want).to_f32()
        );
    }
    // A signalling NaN whose payload sits in the low half only stays a NaN.
    assert!(delta::bf16_to_f32(delta::bf16_bits(f32::from_bits(0x7F80_0001))).is_nan());
}

/// `step_bf16` is `step` plus the rounding of the new state: from the same (bf16) state one
/// step gives the same output bits and the f32 step's state rounded to bf16; along 200 tokens
/// the rounding errors stay at bf16's level (bound 1e-2 relative L2 on the outputs and the
/// state; measured below 4e-3).
#[test]
fn delta_step_on_a_bf16_state_tracks_the_f32_step() {
    let mut rng = Rng::new(32);
    for (nv, dk, dv, t) in [(2, 128, 128, 200), (1, 32, 48, 64), (1, 16, 200, 30)] {
        let x = delta_inputs(&mut rng, t, nv, dk, dv);
        let s0: Vec<u16> = rng
            .vec(nv * dk * dv, 0.5)
            .iter()
            .map(|&v| delta::bf16_bits(v))
            .collect();
        for level in SimdLevel::supported() {
            let mut s32: Vec<f32> = s0.iter().map(|&b| delta::bf16_to_f32(b)).collect();
            let mut s16 = s0.clone();
            let (mut o32, mut o16) = (vec![0.0; t * nv * dv], vec![0.0; t * nv * dv]);
            let mut worst = 0.0f64;
            for ti in 0..t {
                for h in 0..nv {
                    let (q, k) = (&x.q[ti * dk..][..dk], &x.k[ti * dk..][..dk]);
                    let v = &x.v[(ti * nv + h) * dv..][..dv];
                    let (g, b) = (x.g[ti * nv + h], x.beta[ti * nv + h]);
                    let at = h * dk * dv..(h + 1) * dk * dv;
                    let oh = (ti * nv + h) * dv..(ti * nv + h + 1) * dv;
                    if ti == 0 {
                        let mut one = s16[at.clone()].to_vec();
                        let mut o_one = vec![0.0; dv];
                        delta::step_bf16(level, &mut one, q, k, v, g, b, &mut o_one);
                        let mut s_f = s32[at.clone()].to_vec();
                        let mut o_f = vec![0.0; dv];
                        delta::step(level, &mut s_f, q, k, v, g, b, &mut o_f);
                        assert_eq!(o_one, o_f, "{level:?} first step output");
                        let rounded: Vec<u16> = s_f.iter().map(|&v| delta::bf16_bits(v)).collect();
                        assert_eq!(one, rounded, "{level:?} first step state");
                    }
                    delta::step(
                        level,
                        &mut s32[at.clone()],
                        q,
                        k,
                        v,
                        g,
                        b,
                        &mut o32[oh.clone()],
                    );
                    delta::step_bf16(level, &mut s16[at], q, k, v, g, b, &mut o16[oh]);
                }
                let got: Vec<f32> = s16.iter().map(|&b| delta::bf16_to_f32(b)).collect();
                worst = worst.max(rel_l2(&got, &s32));
            }
            let out = rel_l2(&o16, &o32);
            println!(
                "({nv}, {dk}, {dv}) × {t} {level:?}: outputs {out:.2e}, state worst {worst:.2e}"
            );
            assert!(out < 1e-2, "{level:?} bf16 outputs {out:e}");
            assert!(worst < 1e-2, "{level:?} bf16 state {worst:e}");
        }
    }
}

#[test]
fn grouped_attention_equals_attention_per_head() {
    // Attention over several query heads of one kv head at once (a chunk's unit, or a
    // decode unit) must give each head exactly what one head per call gives it.
    let mut rng = Rng::new(21);
    // 84 dimensions: 32-wide, 16-wide and scalar steps (scores one head at a time); 80: a
    // multiple of 16, so AVX-512 scores blocks of four heads by four positions; 96: of 32 too,
    // so AVX-512 also weighs the values of eight heads in its own loop. 14 heads: an
    // eight, a four and two singles (three blocks of four and two alone); up to 37 positions:
    // three blocks of 16 positions, the last partial, and nine of four with one left over.
    let (nkv, group, len) = (3, 14, 37);
    for (level, hd) in SimdLevel::supported().flat_map(|l| [(l, 84), (l, 80), (l, 96)]) {
        let keys = rng.vec(len * nkv * hd, 1.0);
        let values = rng.vec(len * nkv * hd, 1.0);
        let qs = rng.vec(group * hd, 2.0);
        for (kvh, visible) in [(0, 1), (1, 29), (2, 37)] {
            let mut scores = vec![0.0; group * len];
            let mut got = vec![f32::NAN; group * hd];
            attend(
                level,
                &qs,
                hd,
                &keys,
                &values,
                nkv,
                kvh,
                visible,
                0.1,
                &mut scores,
                &mut got,
            );
            for (g, qh) in qs.chunks_exact(hd).enumerate() {
                let mut want = vec![f32::NAN; hd];
                let mut sc = vec![0.0; len];
                attend(
                    level, qh, hd, &keys, &values, nkv, kvh, visible, 0.1, &mut sc, &mut want,
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got[g * hd..(g + 1) * hd]),
                    bits(&want),
                    "{level:?} kv head {kvh}, {visible} visible, head {g}"
                );
                // Each output is the weights' sum over positions in order, one FMA a term,
                // whatever blocks of positions the kernel takes (`sc` holds the weights).
                let stride = nkv * hd;
                let in_order: Vec<f32> = (0..hd)
                    .map(|d| {
                        (0..visible).fold(0.0f32, |a, p| {
                            sc[p].mul_add(values[p * stride + kvh * hd + d], a)
                        })
                    })
                    .collect();
                assert_eq!(bits(&want), bits(&in_order), "{level:?} {visible} visible");
            }
        }
    }
}
