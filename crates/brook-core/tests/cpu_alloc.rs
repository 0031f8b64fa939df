//! A decode step of `CpuModel` performs no heap allocation once warmed up.
//!
//! A counting global allocator (this test binary only) counts every `alloc`/`realloc` made by
//! any thread while a flag is set; after a prefill and two warm-up steps, 20 one-token steps
//! with `Logits::Last` must count zero. The state's KV cache is reserved by `new_state`; the
//! first fast step after a prefill allocates the bf16 recurrent states (`cpu/state.rs`).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use brook_core::cpu::{CpuModel, CpuOptions, Precision};
use brook_core::{Logits, Model};
use common::{MODELS, Reference, argmax, fixture};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn decode_step_allocates_nothing_after_warm_up() {
    // Each fixture as opened, and with its dense weights in 16-row tiles (as the CPU
    // backend holds them where AVX-512 VNNI exists).
    for (name, tiles) in MODELS.iter().flat_map(|m| [(*m, false), (*m, true)]) {
        let mut model = Model::open(&fixture(name)).expect("open");
        if tiles && model.dense.tile() == 0 {
            continue;
        }
        let tokens = Reference::open(name).ids("tokens");
        for precision in [Precision::Exact, Precision::Split24, Precision::Fast] {
            let opts = CpuOptions {
                threads: 2,
                max_chunk: 32,
                max_context: 64,
                level: None,
                precision,
                max_seqs: 1,
            };
            let mut cpu = CpuModel::new(&model, opts).expect("cpu");
            let mut st = cpu.new_state(64);
            let mut next = argmax(
                cpu.forward(&mut st, &tokens, Logits::Last)
                    .expect("prefill"),
            );
            for _ in 0..2 {
                next = argmax(
                    cpu.forward(&mut st, &[next], Logits::Last)
                        .expect("warm-up"),
                );
            }
            ALLOCS.store(0, Ordering::SeqCst);
            COUNTING.store(true, Ordering::SeqCst);
            for _ in 0..20 {
                next = argmax(cpu.forward(&mut st, &[next], Logits::Last).expect("step"));
            }
            COUNTING.store(false, Ordering::SeqCst);
            assert_eq!(
                ALLOCS.load(Ordering::SeqCst),
                0,
                "{name} tiles {tiles} {precision:?}: allocations in 20 decode steps"
            );
            // The counter does see allocations: the reference path allocates per step.
            COUNTING.store(true, Ordering::SeqCst);
            model
                .forward(&mut st, &[next], Logits::Last, None)
                .expect("reference step");
            COUNTING.store(false, Ordering::SeqCst);
            assert!(
                ALLOCS.load(Ordering::SeqCst) > 0,
                "{name}: counter saw nothing"
            );
        }
    }
}
