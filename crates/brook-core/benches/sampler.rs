//! The sampler's time per token over a real-sized vocabulary (Qwen3.5/3.6: 248320 logits):
//! greedy, the Qwen3.6 generation config (temperature 1, top-k 20, top-p 0.95), and top-p
//! alone. A decode step of the 35B on the GPU takes about 3.3 ms, so a sampler in the
//! milliseconds is a visible share of what a user gets. Run:
//! `cargo bench -p brook-core --bench sampler`.

use std::hint::black_box;
use std::time::Duration;

use brook_core::text::{Sampler, SamplingParams};
use criterion::{Criterion, criterion_group, criterion_main};

const VOCAB: usize = 248_320;

/// Logits shaped like a model's: most around -5 with spread 2, a few tens well above.
fn logits(seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..VOCAB)
        .map(|i| {
            let base = -5.0 + 2.0 * (next() + next() + next() - 1.5);
            if i % 9973 == 0 {
                base + 12.0 * next()
            } else {
                base
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let source = logits(7);
    let cases = [
        ("greedy", SamplingParams::default()),
        (
            "qwen3.6 default (t 1, top-k 20, top-p 0.95)",
            SamplingParams {
                temperature: 1.0,
                top_k: 20,
                top_p: 0.95,
                ..Default::default()
            },
        ),
        (
            "top-p 0.9 alone (t 0.7)",
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                ..Default::default()
            },
        ),
    ];
    let mut g = c.benchmark_group("sampler 248320");
    for (name, params) in cases {
        let mut s = Sampler::new(params, VOCAB).expect("params");
        let mut l = source.clone();
        g.bench_function(name, |b| {
            b.iter(|| {
                l.copy_from_slice(&source);
                black_box(s.sample(&mut l, &[]))
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
