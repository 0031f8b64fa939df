//! Streaming experts through the cache: results never depend on the cache size, prefill reads
//! each needed expert once per chunk, budgets are enforced, and I/O errors reach the caller.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use brook_core::container::layer_file;
use brook_core::container::repack::{RepackSource, repack};
use brook_core::model::open::OpenOptions;
use brook_core::{Checkpoint, Logits, Model, Stage};
use common::{MODELS, Reference, argmax, fixture};

fn container(name: &str, out: &Path) {
    let ck = Checkpoint::open(&fixture(name)).expect("open");
    repack(
        &RepackSource::from_checkpoint(&ck).expect("src"),
        out,
        &mut |_| {},
    )
    .expect("repack");
}

fn open(dir: &Path, slots: usize) -> Model {
    let opts = OpenOptions {
        expert_cache: Some(slots),
        io_threads: 3,
        ..Default::default()
    };
    Model::open_with(dir, &opts).expect("open")
}

/// Logits of the prompt then 8 greedy steps.
fn run(m: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut st = m.new_state();
    let mut out = vec![
        m.forward(&mut st, tokens, Logits::All, None)
            .expect("prefill"),
    ];
    let v = m.cfg.vocab_size;
    for _ in 0..8 {
        let last = &out.last().expect("some")[..];
        let next = argmax(&last[last.len() - v..]);
        out.push(
            m.forward(&mut st, &[next], Logits::Last, None)
                .expect("step"),
        );
    }
    out
}

#[test]
fn output_is_bit_identical_for_every_cache_size() {
    for name in MODELS {
        let dir = tempfile::tempdir().expect("tmp");
        let c = dir.path().join("c");
        container(name, &c);
        let tokens = Reference::open(name).ids("tokens");
        let want = run(&Model::open(&fixture(name)).expect("resident"), &tokens);
        // top-k (3), fewer than top-k, half of the 32 experts, and all of them.
        for slots in [3, 2, 16, 32] {
            for prefetch in [false, true] {
                let mut m = open(&c, slots);
                m.prefetch = prefetch;
                assert_eq!(
                    run(&m, &tokens),
                    want,
                    "{name}: {slots} slots, prefetch {prefetch}"
                );
            }
        }
    }
}

#[test]
fn chunked_prefill_reads_each_needed_expert_once_per_chunk() {
    let dir = tempfile::tempdir().expect("tmp");
    let c = dir.path().join("c");
    container("qwen35-q4", &c);
    let tokens: Vec<u32> = (0..40).map(|i| (i * 97 + 13) % 1003).collect();
    for chunk in [40, 16, 7] {
        let mut m = open(&c, 3); // far fewer slots than a chunk needs
        m.prefill_chunk = chunk;
        let mut needed: Vec<Vec<BTreeSet<usize>>> = Vec::new(); // [chunk][layer]
        let mut layer_of_chunk = 0;
        let before = m.experts.stats().expect("cache stats");
        let mut st = m.new_state();
        m.forward(
            &mut st,
            &tokens,
            Logits::Last,
            Some(&mut |s: Stage<'_>| {
                if let Stage::Routes(l, routes) = s {
                    if l == 0 {
                        needed.push(vec![BTreeSet::new(); 4]);
                        layer_of_chunk = needed.len() - 1;
                    }
                    for r in routes {
                        needed[layer_of_chunk][l].extend(r.experts.iter().copied());
                    }
                }
            }),
        )
        .expect("forward");
        let stats = m.experts.stats().expect("stats").since(&before);
        let distinct: usize = needed.iter().flatten().map(BTreeSet::len).sum();
        assert_eq!(needed.len(), tokens.len().div_ceil(chunk));
        assert_eq!(
            stats.reads as usize,
            distinct - stats.hits as usize,
            "chunk {chunk}"
        );
        assert!(stats.reads as usize <= distinct, "chunk {chunk}: {stats:?}");
    }
}

#[test]
fn budget_too_small_for_the_dense_core_is_refused_before_loading() {
    let dir = tempfile::tempdir().expect("tmp");
    let c = dir.path().join("c");
    container("next-q8", &c);
    let opts = OpenOptions {
        memory_budget: Some(1 << 20),
        ..Default::default()
    };
    let e = Model::open_with(&c, &opts).expect_err("refused");
    assert!(e.to_string().contains("at least"), "{e}");
    // A checkpoint folder cannot stream: a budget below its size says to repack.
    let e = Model::open_with(&fixture("next-q8"), &opts).expect_err("refused");
    assert!(e.to_string().contains("brook repack"), "{e}");
}

#[test]
fn a_budget_that_holds_everything_streams_nothing_after_open() {
    let dir = tempfile::tempdir().expect("tmp");
    let c = dir.path().join("c");
    container("next-q4", &c);
    let opts = OpenOptions {
        memory_budget: Some(8 << 30),
        ..Default::default()
    };
    let m = Model::open_with(&c, &opts).expect("open");
    let before = m.experts.stats().expect("stats");
    assert_eq!(before.reads, 32, "all experts loaded at open");
    assert_eq!(before.hits + before.misses, 0, "{before:?}");
    let tokens = Reference::open("next-q4").ids("tokens");
    run(&m, &tokens);
    let after = m.experts.stats().expect("stats");
    assert_eq!(after.reads, 32);
    // Every expert asked for was in memory: the hit rate is 1, not the load's 0. (A prompt
    // asks for each expert its chunk routes to once, so at most every token's picks.)
    let cfg = &m.cfg;
    let picks = (tokens.len() * cfg.num_experts_per_tok * cfg.num_hidden_layers) as u64;
    assert!(
        after.hits > 0 && after.hits <= picks && after.misses == 0,
        "{after:?}"
    );
    assert_eq!(after.hit_rate(), 1.0);
    // Nor is an untied embedding table read a row at a time: it is resident too, and its
    // rows are the checkpoint's.
    use brook_core::model::embedding::Embedding;
    let c = dir.path().join("q35");
    container("qwen35-q4", &c);
    let m = Model::open_with(&c, &opts).expect("open");
    let Embedding::Resident(table) = &m.dense.embed_tokens else {
        panic!("the table should be resident when the budget holds everything")
    };
    let want = Model::open(&fixture("qwen35-q4")).expect("resident");
    let Embedding::Resident(want) = &want.dense.embed_tokens else {
        panic!("a checkpoint's table is resident")
    };
    assert_eq!(
        format!("{:?}", table.weights),
        format!("{:?}", want.weights)
    );
}

#[test]
fn a_layer_file_that_shrinks_or_disappears_gives_an_error_not_a_crash() {
    let dir = tempfile::tempdir().expect("tmp");
    let c = dir.path().join("c");
    container("qwen35-q8", &c);
    let tokens = Reference::open("qwen35-q8").ids("tokens");
    let m = open(&c, 3);
    let mut st = m.new_state();
    m.forward(&mut st, &tokens[..4], Logits::Last, None)
        .expect("healthy");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(c.join(layer_file(1)))
        .expect("open");
    f.set_len(100).expect("truncate");
    let e = m
        .forward(&mut st, &tokens, Logits::Last, None)
        .expect_err("must fail");
    assert!(
        e.to_string().contains("layer-001.bin") || e.to_string().contains("shrank"),
        "{e}"
    );
    // A container replaced on disk under a running model (`brook pull` of a new revision
    // swaps the folder): the model keeps serving from its open files, the same logits.
    let c2 = dir.path().join("c2");
    container("qwen35-q8", &c2);
    let m = open(&c2, 3);
    let want = m
        .forward(&mut m.new_state(), &tokens, Logits::Last, None)
        .expect("healthy");
    let moved = dir.path().join("c2-old");
    std::fs::rename(&c2, &moved).expect("mv");
    std::fs::remove_dir_all(&moved).expect("rm");
    let got = m
        .forward(&mut m.new_state(), &tokens, Logits::Last, None)
        .expect("served from the open files");
    assert_eq!(got, want);
}

#[test]
fn an_expert_overwritten_in_place_is_an_error_when_reads_are_verified() {
    let dir = tempfile::tempdir().expect("tmp");
    let c = dir.path().join("c");
    container("qwen35-q8", &c);
    let tokens = Reference::open("qwen35-q8").ids("tokens");
    let opts = |verify: bool| OpenOptions {
        expert_cache: Some(3),
        verify_reads: verify,
        ..Default::default()
    };
    let m = Model::open_with(&c, &opts(true)).expect("open");
    let want = m
        .forward(&mut m.new_state(), &tokens, Logits::Last, None)
        .expect("healthy");
    // Same size, same inode, other bytes: every expert of layer 0.
    let path = c.join(layer_file(0));
    let mut bytes = std::fs::read(&path).expect("read");
    for b in bytes.iter_mut().step_by(97) {
        *b ^= 0x5a;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &bytes))
        .expect("overwrite");
    let e = Model::open_with(&c, &opts(true))
        .and_then(|m| m.forward(&mut m.new_state(), &tokens, Logits::Last, None))
        .expect_err("verified reads catch it");
    assert!(e.to_string().contains("hash"), "{e}");
    // Without verification the damage goes unseen (what the option is for).
    let unverified = Model::open_with(&c, &opts(false))
        .and_then(|m| m.forward(&mut m.new_state(), &tokens, Logits::Last, None))
        .expect("reads");
    assert_ne!(unverified, want);
}

/// A container's embedding table stays in its file: lookups read the same rows the resident
/// table holds, a token past the table is an error, and a dense file cut short under a running
/// model gives an error naming it, not a crash.
#[test]
fn the_embedding_table_stays_on_disk_and_reads_the_same_rows() {
    use brook_core::TensorSource;
    use brook_core::model::embedding::Embedding;
    let dir = tempfile::tempdir().expect("tmp");
    let c = dir.path().join("c");
    container("qwen35-q4", &c);
    let m = open(&c, 8);
    let e = &m.dense.embed_tokens;
    assert!(
        matches!(e, Embedding::Rows(_)),
        "the table should stay on disk"
    );
    assert!(e.nbytes() * 100 < e.table_bytes(), "{} held", e.nbytes());
    let resident = Model::open(&fixture("qwen35-q4")).expect("resident");
    assert!(matches!(
        resident.dense.embed_tokens,
        Embedding::Resident(_)
    ));
    let (v, h) = (m.cfg.vocab_size, m.cfg.hidden_size);
    let (mut a, mut b) = (vec![0.0; h], vec![0.0; h]);
    for tok in [0, 1, v / 2, v - 1] {
        e.row(tok, &mut a).expect("row");
        resident.dense.embed_tokens.row(tok, &mut b).expect("row");
        assert_eq!(a, b, "token {tok}");
    }
    // The whole table read back (what a GPU uploads) is the resident one, byte for byte.
    let (Embedding::Resident(want), Ok(got)) = (&resident.dense.embed_tokens, e.load()) else {
        panic!("a resident table and a loaded one")
    };
    assert_eq!(format!("{:?}", got.weights), format!("{:?}", want.weights));
    let err = e.row(v, &mut a).expect_err("past the table");
    assert!(
        err.to_string().contains("outside the embedding table"),
        "{err}"
    );
    let ct = brook_core::container::Container::open(&c).expect("container");
    let at = ct.info("model.embed_tokens.weight").expect("tensor").offset;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(ct.dense_path())
        .expect("open");
    f.set_len(at + 16).expect("truncate");
    let err = e.row(v - 1, &mut a).expect_err("cut short");
    assert!(err.to_string().contains("dense"), "{err}");
}

/// The CPU engine's decode with prefetch (the next layer's likeliest experts read during its
/// mixer) gives the same bits as without, and does read ahead.
#[test]
fn cpu_decode_with_prefetch_is_bit_identical_and_reads_ahead() {
    use brook_core::cpu::{CpuModel, CpuOptions, Precision, SimdLevel};
    for name in MODELS {
        let dir = tempfile::tempdir().expect("tmp");
        let c = dir.path().join("c");
        container(name, &c);
        let tokens = Reference::open(name).ids("tokens");
        let run = |m: &Model| {
            let opts = CpuOptions {
                threads: 2,
                max_chunk: 8,
                max_context: 64,
                level: Some(SimdLevel::detect()),
                precision: Precision::Exact,
                max_seqs: 1,
            };
            let mut cpu = CpuModel::new(m, opts).expect("cpu");
            let mut st = cpu.new_state(64);
            let mut logits = cpu
                .forward(&mut st, &tokens, Logits::Last)
                .expect("prefill")
                .to_vec();
            let mut out = logits.clone();
            for _ in 0..6 {
                let next = argmax(&logits);
                logits = cpu
                    .forward(&mut st, &[next], Logits::Last)
                    .expect("step")
                    .to_vec();
                out.extend_from_slice(&logits);
            }
            out
        };
        let mut off = open(&c, 8);
        off.prefetch = false;
        let want = run(&off);
        let mut on = open(&c, 8);
        on.prefetch = true;
        assert_eq!(run(&on), want, "{name}");
        let stats = on.experts.stats().expect("a cache");
        assert!(stats.prefetches > 0, "{name}: nothing read ahead");
        assert_eq!(off.experts.stats().expect("a cache").prefetches, 0);
    }
}

/// A cache that starts on a few of its slots and takes the rest mid-run, once the larger cache
/// would have read less, gives the same bits as the resident model.
#[test]
fn a_cache_growing_mid_run_changes_only_its_reads() {
    use brook_core::container::Container;
    use brook_core::experts::ExpertCache;
    use brook_core::experts::files::ExpertFiles;
    for name in MODELS {
        let dir = tempfile::tempdir().expect("tmp");
        let c = dir.path().join("c");
        container(name, &c);
        let tokens = Reference::open(name).ids("tokens");
        // Slots in use after the prompt, and the logits.
        let decode = |m: &Model| {
            let mut st = m.new_state();
            let mut logits = m
                .forward(&mut st, &tokens, Logits::Last, None)
                .expect("prefill");
            let after_prompt = m.experts.stats().map(|s| s.slots);
            let mut out = logits.clone();
            for _ in 0..24 {
                logits = m
                    .forward(&mut st, &[argmax(&logits)], Logits::Last, None)
                    .expect("step");
                out.extend_from_slice(&logits);
            }
            (after_prompt, out)
        };
        let want = decode(&Model::open(&fixture(name)).expect("resident")).1;
        let mut m = open(&c, 3);
        let ct = Container::open(&c).expect("container");
        let stride = ct.manifest.experts.layers.iter().map(|l| l.stride).max();
        let (k, layers) = (m.cfg.num_experts_per_tok, m.cfg.num_hidden_layers);
        let total = m.cfg.num_experts * layers;
        let cache = ExpertCache::new(
            ExpertFiles::open(&ct).expect("store"),
            ct.layouts.clone(),
            stride.expect("experts") as usize,
            m.cfg.num_experts,
            total,
            3,
        );
        cache.grow_on_demand(k, k * layers);
        assert_eq!(cache.slots(), k);
        m.experts = Box::new(cache);
        let (after_prompt, got) = decode(&m);
        assert_eq!(got, want, "{name}");
        assert_eq!(after_prompt, Some(k as u64), "{name}: grew before decode");
        // The grower thread puts the new slots in use a batch at a time.
        let t = std::time::Instant::now();
        let mut s = m.experts.stats().expect("a cache");
        while s.slots < total as u64 && t.elapsed().as_secs() < 30 {
            std::thread::sleep(std::time::Duration::from_millis(10));
            s = m.experts.stats().expect("a cache");
        }
        assert_eq!(
            (s.slots, s.slots_max),
            (total as u64, total as u64),
            "{name}: {s:?}"
        );
    }
}
