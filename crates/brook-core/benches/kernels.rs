//! Kernel throughput in GB/s of weight bytes read, beside a plain memory-read baseline
//! measured in the same run (sum of a 512 MiB f32 buffer on 1 and 2 threads).
//!
//! Napkin math: a decoded token of Qwen3.6-35B-A3B at 4 bits reads ~1.7 GB of weights, so at
//! the 2-thread read bandwidth B GB/s decode cannot beat B / 1.7 tok/s; a kernel at X GB/s
//! runs at X / B of that bound. Run: `cargo bench -p brook-core --bench kernels`.

use std::hint::black_box;
use std::time::Duration;

use brook_core::cpu::kernels::attention::attend;
use brook_core::cpu::kernels::ops::silu_inplace;
use brook_core::cpu::kernels::pool::{SharedMut, split};
use brook_core::cpu::testutil::{Format, Rng, random_linear};
use brook_core::cpu::{
    CpuPool, Precision, SimdLevel, SwigluScratch, XBatch, XPrep, expert_swiglu, qmatmul_pool,
    qmatmul_pool_at, qmatvec_pool_at,
};
use brook_core::dtype::DType;
use brook_core::experts::source::ExpertData;
use brook_core::linear::{Linear, Weights};
use brook_core::model::weights::Expert;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn nbytes(w: &Linear) -> u64 {
    w.nbytes() as u64
}

fn sum(v: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    for c in v.chunks_exact(16) {
        for l in 0..16 {
            acc[l] += c[l];
        }
    }
    acc.iter().sum()
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

/// `v`'s bytes again in a buffer on 2 MiB pages (`aligned::zeroed_vec`), as brook loads
/// dense weights.
fn on_huge_pages(v: &[u8]) -> Vec<u8> {
    let mut h = brook_core::aligned::zeroed_vec(v.len());
    h.copy_from_slice(v);
    h
}

fn memory_baseline(c: &mut Criterion) {
    let n = 128 << 20;
    let small = vec![1.0f32; n];
    // The same on 2 MiB pages: advised while still untouched, then written.
    let mut huge = vec![0.0f32; n];
    // SAFETY: the bytes of `huge`'s own allocation, viewed as bytes for the advice only.
    brook_core::aligned::advise_huge_pages(unsafe {
        std::slice::from_raw_parts_mut(huge.as_mut_ptr() as *mut u8, n * 4)
    });
    huge.fill(1.0);
    let mut g = c.benchmark_group("memory_read");
    g.throughput(Throughput::Bytes((n * 4) as u64));
    for (buf, pages) in [(&small, ""), (&huge, "_huge_pages")] {
        for threads in [1, 2] {
            let pool = CpuPool::new(threads);
            let mut parts = [0.0f32; 2];
            g.bench_function(format!("sum_f32_512MiB{pages}/{threads}t"), |b| {
                b.iter(|| {
                    let out = SharedMut::new(&mut parts);
                    pool.run(&|t| {
                        let r = split(buf.len(), t, threads, 1 << 16);
                        // SAFETY: each thread writes only its own element.
                        unsafe { out.write(t, sum(&buf[r])) };
                    });
                    black_box(parts)
                })
            });
        }
    }
    g.finish();
}

fn matvec(c: &mut Criterion) {
    let level = SimdLevel::detect();
    let mut rng = Rng::new(1);
    let bf16 = DType::BF16;
    let q = |bits, group| Format::Affine {
        bits,
        group,
        float: bf16,
    };
    let cases: Vec<(&str, Linear, Vec<usize>)> = vec![
        (
            "q4g64_head_248320x2048",
            random_linear(&mut rng, 248320, 2048, q(4, 64)),
            vec![1, 2],
        ),
        (
            "q4g64_8192x2048",
            random_linear(&mut rng, 8192, 2048, q(4, 64)),
            vec![1, 2],
        ),
        (
            "q4g64_l2_512x2048",
            random_linear(&mut rng, 512, 2048, q(4, 64)),
            vec![1],
        ),
        // An expert's down projection: as many bytes, rows a quarter as long.
        (
            "q4g64_l2_2048x512",
            random_linear(&mut rng, 2048, 512, q(4, 64)),
            vec![1],
        ),
        (
            "q8g64_8192x2048",
            random_linear(&mut rng, 8192, 2048, q(8, 64)),
            vec![1, 2],
        ),
        (
            "q3g64_8192x2048",
            random_linear(&mut rng, 8192, 2048, q(3, 64)),
            vec![1, 2],
        ),
        (
            "q6g64_8192x2048",
            random_linear(&mut rng, 8192, 2048, q(6, 64)),
            vec![2],
        ),
        (
            "bf16_4096x2048",
            random_linear(&mut rng, 4096, 2048, Format::Float(bf16)),
            vec![2],
        ),
    ];
    // The 4-bit matrices again in 16-row tiles, as the CPU backend holds them on VNNI.
    let mut cases: Vec<(String, Linear, Vec<usize>)> = cases
        .into_iter()
        .map(|(n, w, t)| (n.to_string(), w, t))
        .collect();
    if SimdLevel::has_vnni() {
        let tiled: Vec<_> = cases
            .iter()
            .filter(|(n, _, _)| n.starts_with("q4"))
            .map(|(n, w, t)| {
                let mut w = w.clone();
                w.tile();
                (format!("{n}_tiles"), w, t.clone())
            })
            .collect();
        // The head in tiles again on 2 MiB pages, as brook holds it.
        let huge: Vec<_> = tiled
            .iter()
            .filter(|(n, _, _)| n.contains("head"))
            .map(|(n, w, t)| {
                let mut w = w.clone();
                if let Weights::Affine {
                    packed,
                    scales,
                    biases,
                    ..
                } = &mut w.weights
                {
                    for v in [packed, scales, biases] {
                        *v = on_huge_pages(v);
                    }
                }
                (format!("{n}_huge_pages"), w, t.clone())
            })
            .collect();
        cases.extend(tiled);
        cases.extend(huge);
    }
    let mut g = c.benchmark_group("matvec");
    for (name, w, threads) in &cases {
        g.throughput(Throughput::Bytes(nbytes(w)));
        let x = rng.vec(w.in_features, 1.0);
        let mut y = vec![0.0; w.out_features];
        let mut xp = XPrep::new();
        // The integer kernels' precisions: AVX-512 VNNI's tiles, or AVX2's rows.
        let split = name.starts_with("q4") && (SimdLevel::has_vnni() || level == SimdLevel::Avx2);
        for &t in threads {
            let pool = CpuPool::new(t);
            for (p, pname) in [
                (Precision::Exact, "f32"),
                (Precision::Split24, "split24"),
                (Precision::Fast, "fast"),
            ] {
                if p != Precision::Exact && !split {
                    continue;
                }
                g.bench_function(format!("{name}/{}/{pname}/{t}t", level.name()), |b| {
                    b.iter(|| qmatvec_pool_at(&pool, level, p, &w.view(), &x, &mut y, &mut xp))
                });
            }
        }
    }
    g.finish();
}

fn expert(c: &mut Criterion) {
    let level = SimdLevel::detect();
    let mut rng = Rng::new(3);
    let q4 = Format::Affine {
        bits: 4,
        group: 64,
        float: DType::BF16,
    };
    let e = Expert {
        gate_proj: random_linear(&mut rng, 512, 2048, q4),
        up_proj: random_linear(&mut rng, 512, 2048, q4),
        down_proj: random_linear(&mut rng, 2048, 512, q4),
    };
    let bytes = nbytes(&e.gate_proj) + nbytes(&e.up_proj) + nbytes(&e.down_proj);
    let x = rng.vec(2048, 1.0);
    let mut y = vec![0.0; 2048];
    let mut s = SwigluScratch::default();
    let mut g = c.benchmark_group("expert_swiglu");
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function(format!("q4g64_2048-512-2048/{}/1t", level.name()), |b| {
        b.iter(|| expert_swiglu(level, e.view(), &x, &mut y, &mut s))
    });
    g.finish();
}

/// One decode unit of the 35B's attention: the eight query heads of a kv head (head_dim 256,
/// two kv heads) over a cache of 64, 512 and 2000 positions (hot in L2/L3), on one thread.
fn attention(c: &mut Criterion) {
    let level = SimdLevel::detect();
    let mut rng = Rng::new(3);
    let (hd, nkv, heads) = (256, 2, 8);
    let mut g = c.benchmark_group("attention");
    for visible in [64, 512, 2000] {
        let keys = rng.vec(visible * nkv * hd, 1.0);
        let values = rng.vec(visible * nkv * hd, 1.0);
        let qs = rng.vec(heads * hd, 1.0);
        let (mut scores, mut out) = (vec![0.0; heads * visible], vec![0.0; heads * hd]);
        g.bench_function(
            format!("{heads}heads_hd{hd}_{visible}pos/{}/1t", level.name()),
            |b| {
                b.iter(|| {
                    attend(
                        level,
                        &qs,
                        hd,
                        &keys,
                        &values,
                        nkv,
                        1,
                        visible,
                        0.0625,
                        &mut scores,
                        &mut out,
                    );
                    black_box(out[0])
                })
            },
        );
    }
    g.finish();
}

/// The per-input work a decode step does on the calling thread or in small jobs: preparing a
/// 2048-wide input for the one-token kernels (about 120 a token for the 35B), the SiLU of
/// a DeltaNet layer's 8192 convolution channels, libm's `expf` against `silu_inplace`, and
/// the greedy pick over the 35B's 248320 logits, one branch per logit against `argmax`.
fn activations(c: &mut Criterion) {
    let level = SimdLevel::detect();
    let mut rng = Rng::new(4);
    let mut g = c.benchmark_group("activations");
    let x = rng.vec(2048, 1.0);
    let mut xp = XPrep::new();
    for p in [Precision::Exact, Precision::Fast] {
        g.bench_function(format!("prepare_2048/{}-{p:?}", level.name()), |b| {
            b.iter(|| {
                xp.prepare_with(level, p, black_box(&x));
                black_box(xp.x()[0])
            })
        });
    }
    let conv = rng.vec(8192, 3.0);
    let mut y = conv.clone();
    g.bench_function("silu_8192/libm", |b| {
        b.iter(|| {
            for (o, &v) in y.iter_mut().zip(black_box(&conv)) {
                *o = brook_core::model::ops::silu(v);
            }
            black_box(y[0])
        })
    });
    g.bench_function(format!("silu_8192/{}", level.name()), |b| {
        b.iter(|| {
            y.copy_from_slice(black_box(&conv));
            silu_inplace(level, &mut y);
            black_box(y[0])
        })
    });
    let logits = rng.vec(248_320, 4.0);
    g.bench_function("argmax_248320/branch", |b| {
        b.iter(|| {
            let (mut best, mut best_v) = (0, f32::NEG_INFINITY);
            for (i, &l) in black_box(&logits).iter().enumerate() {
                if l > best_v {
                    (best, best_v) = (i, l);
                }
            }
            black_box(best)
        })
    });
    g.bench_function("argmax_248320/argmax", |b| {
        b.iter(|| black_box(brook_core::text::argmax(black_box(&logits))))
    });
    g.finish();
}

/// The DeltaNet step over the 35B's 30 layers × 32 value heads of 128 × 128 state (63 MB in
/// f32, 31 MB in bf16: out of cache, as in decode), on one thread; throughput counts the
/// state bytes read (each is written back too).
fn delta_step(c: &mut Criterion) {
    use brook_core::cpu::kernels::delta;
    let level = SimdLevel::detect();
    let mut rng = Rng::new(5);
    let (heads, dk, dv) = (30 * 32, 128, 128);
    let mut g = c.benchmark_group("delta_step");
    let (q, k, v) = (rng.vec(dk, 0.1), rng.vec(dk, 0.1), rng.vec(dv, 1.0));
    let mut o = vec![0.0; dv];
    let mut s32 = rng.vec(heads * dk * dv, 0.5);
    g.throughput(Throughput::Bytes((s32.len() * 4) as u64));
    g.bench_function(format!("35b_f32/{}", level.name()), |b| {
        b.iter(|| {
            for s in s32.chunks_exact_mut(dk * dv) {
                delta::step(level, s, &q, &k, &v, -0.01, 0.5, &mut o);
            }
            black_box(o[0])
        })
    });
    let mut s16: Vec<u16> = s32.iter().map(|&x| delta::bf16_bits(x)).collect();
    drop(s32);
    g.throughput(Throughput::Bytes((s16.len() * 2) as u64));
    g.bench_function(format!("35b_bf16/{}", level.name()), |b| {
        b.iter(|| {
            for s in s16.chunks_exact_mut(dk * dv) {
                delta::step_bf16(level, s, &q, &k, &v, -0.01, 0.5, &mut o);
            }
            black_box(o[0])
        })
    });
    g.finish();
}

fn matmul(c: &mut Criterion) {
    let level = SimdLevel::detect();
    let mut rng = Rng::new(2);
    let q4 = Format::Affine {
        bits: 4,
        group: 64,
        float: DType::BF16,
    };
    // A dense projection over a whole chunk, and an expert's gate and down over the ~16
    // tokens a 512-token chunk routes to each of 256 experts (top-8), and 24 (three panels of
    // AVX2's tile).
    let cases = [
        ("q4g64_2048x2048_T512", 2048, 2048, 512),
        ("q4g64_expert_gate_512x2048_T16", 512, 2048, 16),
        ("q4g64_expert_down_2048x512_T16", 2048, 512, 16),
        ("q4g64_expert_gate_512x2048_T24", 512, 2048, 24),
    ];
    let mut g = c.benchmark_group("matmul");
    for (name, out, inp, t) in cases {
        let w = random_linear(&mut rng, out, inp, q4);
        let x = rng.vec(t * inp, 1.0);
        let mut y = vec![0.0; t * out];
        let mut xb = XBatch::new();
        // Reported as multiply-adds per second: T·out·in / time.
        g.throughput(Throughput::Elements((t * out * inp) as u64));
        for threads in [1, 2] {
            let pool = CpuPool::new(threads);
            g.bench_function(format!("{name}/{}/{threads}t", level.name()), |b| {
                b.iter(|| qmatmul_pool(&pool, level, &w.view(), &x, &mut y, &mut xb))
            });
            if !(SimdLevel::has_vnni() || level == SimdLevel::Avx2) {
                continue;
            }
            // The integer tile of Split24 and Fast (AVX-512 VNNI's, or AVX2's; activations
            // prepared inside, as above).
            for p in [Precision::Split24, Precision::Fast] {
                let id = format!("{name}/{}-{p:?}/{threads}t", level.name());
                g.bench_function(id, |b| {
                    b.iter(|| qmatmul_pool_at(&pool, level, p, &w.view(), &x, &mut y, &mut xb))
                });
            }
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = config();
    targets = memory_baseline, matvec, expert, attention, activations, delta_step, matmul
}
criterion_main!(benches);
