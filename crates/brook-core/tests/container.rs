//! The expert container: round trips, corruption detection and resumable repack.

mod common;

use std::path::{Path, PathBuf};

use brook_core::checkpoint::TensorSource;
use brook_core::container::repack::{RepackSource, repack};
use brook_core::container::verify::verify;
use brook_core::container::{Container, layer_file};
use brook_core::{Checkpoint, Error, Logits, Model};
use common::{MODELS, Reference, fixture};

fn repack_to(name: &str, out: &Path) {
    let ck = Checkpoint::open(&fixture(name)).expect("open");
    let src = RepackSource::from_checkpoint(&ck).expect("source");
    repack(&src, out, &mut |_| {}).expect("repack");
}

fn logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    let m = Model::open(dir).expect("open");
    m.forward(&mut m.new_state(), tokens, Logits::All, None)
        .expect("forward")
}

fn verify_dir(dir: &Path, source: Option<&str>) -> brook_core::container::verify::VerifyReport {
    let c = Container::open(dir).expect("open container");
    let src = source.map(|s| Checkpoint::open(&fixture(s)).expect("source"));
    verify(
        &c,
        src.as_ref().map(|s| s as &dyn TensorSource),
        &mut |_, _| {},
    )
    .expect("verify")
}

/// Every file under `dir`, relative path → bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("ls") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((
                    p.strip_prefix(dir).expect("rel").to_path_buf(),
                    std::fs::read(&p).expect("read"),
                ));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn container_logits_equal_checkpoint_logits_on_every_fixture() {
    for name in MODELS {
        let dir = tempfile::tempdir().expect("tmp");
        let out = dir.path().join("c");
        repack_to(name, &out);
        let tokens = Reference::open(name).ids("tokens");
        assert_eq!(
            logits(&out, &tokens),
            logits(&fixture(name), &tokens),
            "{name}"
        );
        let report = verify_dir(&out, Some(name));
        assert!(report.ok(), "{name}: {:?}", report.mismatches);
        assert_eq!(report.experts_checked, 4 * 8);
        assert!(out.join("config.json").is_file() && out.join("generation_config.json").is_file());
    }
}

#[test]
fn layer_files_have_a_16k_stride_and_exact_size() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("c");
    repack_to("qwen35-mixed", &out);
    let c = Container::open(&out).expect("open");
    for (l, info) in c.manifest.experts.layers.iter().enumerate() {
        assert_eq!(info.stride % 16384, 0);
        assert!(info.stride >= info.blob_size);
        let len = std::fs::metadata(out.join(layer_file(l)))
            .expect("meta")
            .len();
        assert_eq!(len, info.stride * 8);
    }
}

#[test]
fn a_flipped_byte_anywhere_in_an_expert_is_reported() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("c");
    repack_to("next-mixed", &out);
    let c = Container::open(&out).expect("open");
    let layers = c.manifest.experts.layers.clone();
    drop(c);
    // Positions: first byte, a byte in every section, the last blob byte, and padding.
    for (l, e) in [(0usize, 0usize), (1, 7), (3, 4)] {
        let info = &layers[l];
        let mut spots: Vec<u64> = info
            .sections
            .iter()
            .map(|s| s.offset + s.size / 2)
            .collect();
        spots.extend([0, info.blob_size - 1, info.stride - 1]);
        for at in spots {
            let path = out.join(&info.file);
            let mut bytes = std::fs::read(&path).expect("read");
            let pos = (e as u64 * info.stride + at) as usize;
            bytes[pos] ^= 0x10;
            std::fs::write(&path, &bytes).expect("write");
            let r = verify_dir(&out, None);
            let first = r.mismatches.first().expect("must be reported");
            assert_eq!(first.expert, Some((l, e)), "byte {at}: {first}");
            bytes[pos] ^= 0x10;
            std::fs::write(&path, &bytes).expect("restore");
        }
    }
    assert!(verify_dir(&out, Some("next-mixed")).ok());
}

#[test]
fn verify_with_source_catches_a_container_of_another_checkpoint() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("c");
    repack_to("next-q4", &out);
    // Same architecture and shapes, different weights.
    let r = verify_dir(&out, Some("next-f32"));
    assert!(!r.ok());
}

#[test]
fn truncated_layer_file_and_corrupt_manifest_fail_at_open() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("c");
    repack_to("qwen35-q4", &out);
    let layer = out.join(layer_file(2));
    let full = std::fs::metadata(&layer).expect("meta").len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&layer)
        .expect("open");
    f.set_len(full - 4096).expect("truncate");
    match Container::open(&out) {
        Err(Error::Checkpoint { path, reason }) => {
            assert_eq!(path, layer);
            assert!(reason.contains("truncated"), "{reason}");
        }
        other => panic!("expected a truncation error, got {other:?}"),
    }
    assert!(Model::open(&out).is_err());
    f.set_len(full).expect("restore");
    let manifest = out.join("manifest.json");
    let good = std::fs::read(&manifest).expect("read");
    for bad in [
        &good[..good.len() / 2],
        b"{}".as_slice(),
        b"\x00\x01garbage".as_slice(),
    ] {
        std::fs::write(&manifest, bad).expect("write");
        match Container::open(&out) {
            Err(Error::Json { path, reason }) => {
                assert_eq!(path, manifest);
                assert!(reason.contains("repack"), "{reason}");
            }
            other => panic!("expected a manifest error, got {other:?}"),
        }
    }
}

/// Repacks `src` into `out` and "kills" the run (a panic) at its `kill_after`-th progress
/// report; whether that point was reached.
fn repack_killed(src: &RepackSource<'_>, out: &Path, kill_after: usize) -> bool {
    let mut calls = 0;
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        repack(src, out, &mut |_| {
            calls += 1;
            if calls == kill_after {
                panic!("simulated kill");
            }
        })
    }))
    .is_err()
}

/// One whole repack of `src` into `out`: (its files, the progress reports it made).
fn repack_counted(src: &RepackSource<'_>, out: &Path) -> (Vec<(PathBuf, Vec<u8>)>, usize) {
    let mut calls = 0;
    repack(src, out, &mut |_| calls += 1).expect("repack");
    (snapshot(out), calls)
}

#[test]
fn repack_killed_at_any_point_resumes_to_an_identical_container() {
    let dir = tempfile::tempdir().expect("tmp");
    let ck = Checkpoint::open(&fixture("next-mixed")).expect("open");
    let src = RepackSource::from_checkpoint(&ck).expect("source");
    // Progress is reported after every dense tensor chunk and every expert (4 layers × 8).
    let (want, total_calls) = repack_counted(&src, &dir.path().join("whole"));
    let dense_calls = total_calls - 32;
    let points = [
        1,
        dense_calls / 2,
        dense_calls,
        dense_calls + 1,
        dense_calls + 4,
        dense_calls + 12,
        dense_calls + 19,
        total_calls - 1,
    ];
    for kill_after in points {
        let out = dir.path().join(format!("killed-{kill_after}"));
        assert!(
            repack_killed(&src, &out, kill_after),
            "kill point {kill_after} not reached"
        );
        assert!(!out.join("manifest.json").exists());
        assert!(
            Container::open(&out).is_err(),
            "an unfinished repack is not a container"
        );
        let mut resumed = 0;
        repack(&src, &out, &mut |p| resumed = p.bytes_resumed).expect("resume");
        assert_eq!(snapshot(&out), want, "kill point {kill_after}");
        if kill_after > dense_calls {
            assert!(resumed > 0, "finished layers must not be redone");
        }
    }
}

#[test]
fn a_resumed_repack_redoes_files_its_state_lists_but_the_disk_lost() {
    let dir = tempfile::tempdir().expect("tmp");
    let ck = Checkpoint::open(&fixture("next-mixed")).expect("open");
    let src = RepackSource::from_checkpoint(&ck).expect("source");
    let (want, total_calls) = repack_counted(&src, &dir.path().join("whole"));
    // Killed during the last expert: the state lists the dense file and three layers done.
    let out = dir.path().join("killed");
    assert!(repack_killed(&src, &out, total_calls - 1));
    // Damage what the state says is done: the dense file cut short, a layer file deleted.
    std::fs::OpenOptions::new()
        .write(true)
        .open(out.join("dense.safetensors"))
        .and_then(|f| f.set_len(10))
        .expect("truncate");
    let _ = std::fs::remove_file(out.join(layer_file(0)));
    repack(&src, &out, &mut |_| {}).expect("resume");
    assert_eq!(snapshot(&out), want);
    Container::open(&out).expect("opens");
}

#[test]
fn a_repack_killed_while_it_writes_its_manifest_finishes_with_nothing_left_over() {
    let dir = tempfile::tempdir().expect("tmp");
    let ck = Checkpoint::open(&fixture("next-q4")).expect("open");
    let src = RepackSource::from_checkpoint(&ck).expect("source");
    let whole = dir.path().join("whole");
    let (want, total_calls) = repack_counted(&src, &whole);
    let manifest = std::fs::read(whole.join("manifest.json")).expect("manifest");
    let tmp = |d: &Path| d.join("manifest.json.partial");

    // Killed before the state file went: the state resumes; a whole or a cut
    // `manifest.json.partial` is written again.
    for cut in [manifest.len(), manifest.len() / 2] {
        let out = dir.path().join(format!("state-{cut}"));
        assert!(repack_killed(&src, &out, total_calls - 1));
        std::fs::write(tmp(&out), &manifest[..cut]).expect("write");
        assert!(Container::open(&out).is_err(), "not a container yet");
        repack(&src, &out, &mut |_| {}).expect("resume");
        assert_eq!(snapshot(&out), want, "cut at {cut}");
    }

    // Killed after the state file went, before the rename: the next run renames.
    let out = dir.path().join("renamed");
    repack(&src, &out, &mut |_| {}).expect("repack");
    std::fs::rename(out.join("manifest.json"), tmp(&out)).expect("rename");
    assert!(Container::open(&out).is_err(), "not a container yet");
    let mut calls = 0;
    repack(&src, &out, &mut |_| calls += 1).expect("finish");
    assert_eq!(calls, 0, "nothing is written again");
    assert_eq!(snapshot(&out), want);
    Container::open(&out).expect("opens");

    // The same leftover from another checkpoint is not taken for this one's.
    let other = Checkpoint::open(&fixture("next-q8")).expect("open");
    let other_src = RepackSource::from_checkpoint(&other).expect("source");
    let foreign = dir.path().join("foreign");
    repack(&other_src, &foreign, &mut |_| {}).expect("repack");
    std::fs::rename(foreign.join("manifest.json"), tmp(&foreign)).expect("rename");
    let e = repack(&src, &foreign, &mut |_| {}).expect_err("refused");
    assert!(e.to_string().contains("not empty"), "{e}");
    assert!(!foreign.join("manifest.json").exists());
}

#[test]
fn a_repack_that_cannot_fit_is_refused_before_writing() {
    let dir = tempfile::tempdir().expect("tmp");
    let e = brook_core::util::ensure_free_space(dir.path(), u64::MAX / 4, "the repack")
        .expect_err("no disk is that large");
    assert_eq!(e.kind(), std::io::ErrorKind::StorageFull);
    assert!(e.to_string().contains("GB free"), "{e}");
    brook_core::util::ensure_free_space(dir.path(), 1, "a byte").expect("a byte fits");
}

#[test]
fn repack_refuses_foreign_folders() {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("notes.txt"), "mine").expect("write");
    let ck = Checkpoint::open(&fixture("next-q4")).expect("open");
    let src = RepackSource::from_checkpoint(&ck).expect("source");
    let e = repack(&src, dir.path(), &mut |_| {}).expect_err("refused");
    assert!(e.to_string().contains("not empty"), "{e}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("notes.txt")).expect("kept"),
        "mine"
    );
    // A finished container is not overwritten either.
    let out = dir.path().join("c");
    repack(&src, &out, &mut |_| {}).expect("repack");
    assert!(repack(&src, &out, &mut |_| {}).is_err());
    // Nor is the unfinished output of another checkpoint.
    let other = Checkpoint::open(&fixture("next-q8")).expect("open");
    let other_src = RepackSource::from_checkpoint(&other).expect("source");
    let part = dir.path().join("part");
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        repack(&other_src, &part, &mut |_| panic!("stop"))
    }));
    let e = repack(&src, &part, &mut |_| {}).expect_err("refused");
    assert!(e.to_string().contains("different checkpoint"), "{e}");
}

#[test]
fn every_synth_preset_has_real_shapes_and_finite_activations() {
    use brook_core::synth::{PRESETS, SynthModel};
    // Sizes in GB of the 4-bit presets (MODEL.md §6 for the 35B and 80B).
    for (preset, lo, hi) in [
        ("qwen3.6-35b-a3b", 19.4, 19.6),
        ("qwen3.5-35b-a3b", 19.4, 19.6),
        ("qwen3-next-80b-a3b", 44.7, 44.9),
        ("qwen3.5-122b-a10b", 68.0, 69.5),
        ("qwen3.5-397b-a17b", 222.0, 224.5),
    ] {
        assert!(PRESETS.contains(&preset));
        let s = SynthModel::new(preset, 4, 0).expect(preset);
        let gb = s.total_bytes() as f64 / 1e9;
        assert!(gb > lo && gb < hi, "{preset}: {gb:.2} GB");
    }
    // The tiny preset runs: every layer's output is finite and of moderate size.
    let dir = tempfile::tempdir().expect("tmp");
    let s = SynthModel::new("tiny", 4, 0).expect("tiny");
    let out = dir.path().join("c");
    repack(&s.repack_source(), &out, &mut |_| {}).expect("repack");
    let m = Model::open(&out).expect("open");
    let tokens: Vec<u32> = (0..24).map(|i| i * 131 % 4096).collect();
    let mut rms = Vec::new();
    m.forward(
        &mut m.new_state(),
        &tokens,
        Logits::Last,
        Some(&mut |st: brook_core::Stage<'_>| {
            if let brook_core::Stage::Layer(_, x) = st {
                let r = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
                rms.push(r);
            }
        }),
    )
    .expect("forward");
    assert!(
        rms.iter().all(|r| r.is_finite() && *r > 0.1 && *r < 100.0),
        "{rms:?}"
    );
}
