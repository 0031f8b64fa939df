//! Real faults under the `brook` binary: a full disk (ENOSPC) and failing writes (EIO) at
//! every stage of a repack, short writes, read errors while a model runs, and `kill -9` of
//! `repack` and `pull` at random points. The faults come from `tests/faults/shim.c`, built
//! here with the system C compiler and loaded with LD_PRELOAD; they act on the system calls
//! of regular files only. After each fault the command exits with its documented code (4 for
//! I/O), the unfinished output is never taken for a container, and a rerun gives a container
//! byte-identical to an undisturbed one that `brook verify` passes.

#[path = "../../brook-hub/tests/mock/mod.rs"]
mod mock;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use mock::{MockHub, MockRepo};

/// `BROOK_FAULT_SCALE=N` runs N times the fault points and kills (the long form recorded in
/// docs/HARDENING.md); 1 in `cargo test`.
fn scale() -> usize {
    std::env::var("BROOK_FAULT_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/next-q4")
}

/// The shim, compiled once per test run.
fn shim() -> &'static Path {
    static SO: OnceLock<PathBuf> = OnceLock::new();
    SO.get_or_init(|| {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/faults/shim.c");
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("libbrookfault.so");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let st = Command::new(&cc)
            .args(["-shared", "-fPIC", "-O1", "-o"])
            .arg(&out)
            .arg(&src)
            .arg("-ldl")
            .status()
            .unwrap_or_else(|e| panic!("the fault tests build a C shim with `{cc}`: {e}"));
        assert!(st.success(), "building the fault shim failed");
        out
    })
}

/// `brook ARGS` with a private store under `home` and the fault `mode` (none when empty).
fn brook(home: &Path, mode: &str, after: u64) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_brook"));
    cmd.env("BROOK_HOME", home.join("brook"))
        .env("HF_HOME", home.join("hf"))
        .env("HF_HUB_CACHE", home.join("hf/hub"))
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE");
    if !mode.is_empty() {
        cmd.env("LD_PRELOAD", shim())
            .env("BROOK_FAULT", mode)
            .env("BROOK_FAULT_AFTER", after.to_string());
    }
    cmd
}

fn run(mut cmd: Command) -> Output {
    cmd.output().expect("run brook")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every file under `dir` by relative path, with a hash of its bytes (brook-origin.json, which
/// names the local folder a model was pulled into, left out).
fn snapshot(dir: &Path) -> BTreeMap<String, (usize, u64)> {
    snapshot_bytes(dir)
        .into_iter()
        .filter(|(k, _)| k != "brook-origin.json")
        .map(|(k, v)| {
            let h = v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
            (k, (v.len(), h))
        })
        .collect()
}

fn snapshot_bytes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).expect("ls") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                let rel = p
                    .strip_prefix(base)
                    .expect("under")
                    .to_string_lossy()
                    .into_owned();
                out.insert(rel, std::fs::read(&p).expect("read"));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

fn repack(home: &Path, out: &Path, mode: &str, after: u64) -> Output {
    let mut c = brook(home, mode, after);
    c.arg("repack").arg(fixture()).arg(out);
    run(c)
}

/// Four greedy tokens from container `c` through 4 expert slots, under the fault `mode`.
fn generate(home: &Path, c: &Path, mode: &str, after: u64) -> Output {
    let mut g = brook(home, mode, after);
    g.args(["generate", "--prompt-tokens", "1,2,3", "--max-tokens", "4"])
        .args(["--expert-cache", "4", "--model"])
        .arg(c);
    run(g)
}

fn verified(home: &Path, c: &Path) {
    let mut v = brook(home, "", 0);
    v.arg("verify").arg(c);
    let o = run(v);
    assert!(o.status.success(), "verify: {}", stderr(&o));
}

#[test]
fn full_disks_and_failing_writes_end_a_repack_cleanly_and_a_rerun_finishes_it() {
    let home = tempfile::tempdir().expect("tmp");
    let whole = home.path().join("whole");
    assert!(repack(home.path(), &whole, "", 0).status.success());
    let want = snapshot(&whole);
    let total: u64 = want.values().map(|v| v.0 as u64).sum();
    for (mode, what) in [("enospc", "No space left"), ("eio", "Input/output error")] {
        let points = 6 * scale();
        for i in 0..points {
            // From the first byte to the last: 0, then spread over the whole run.
            let after = total * i as u64 / points as u64 + (i as u64 % 7) * 1013;
            let out = home.path().join(format!("{mode}-{after}"));
            let o = repack(home.path(), &out, mode, after);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(4), "{mode} after {after}: {err}");
            assert!(err.contains(what) && !err.contains("panicked"), "{err}");
            assert!(
                !out.join("manifest.json").exists(),
                "an unfinished repack must not look finished"
            );
            let o = repack(home.path(), &out, "", 0);
            assert!(
                o.status.success(),
                "rerun after {mode} at {after}: {}",
                stderr(&o)
            );
            assert_eq!(snapshot(&out), want, "{mode} at {after}");
            verified(home.path(), &out);
        }
    }
}

#[test]
fn short_writes_give_the_same_container() {
    let home = tempfile::tempdir().expect("tmp");
    let whole = home.path().join("whole");
    assert!(repack(home.path(), &whole, "", 0).status.success());
    let out = home.path().join("short");
    let o = repack(home.path(), &out, "short", 0);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(snapshot(&out), snapshot(&whole));
}

#[test]
fn read_errors_while_a_model_runs_are_io_errors_not_crashes() {
    let home = tempfile::tempdir().expect("tmp");
    let c = home.path().join("c");
    assert!(repack(home.path(), &c, "", 0).status.success());
    let ok = generate(home.path(), &c, "", 0);
    assert!(ok.status.success(), "{}", stderr(&ok));
    // Short reads everywhere (files, experts): the same tokens.
    let o = generate(home.path(), &c, "shortread", 0);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(o.stdout, ok.stdout, "short reads changed the output");
    // The error lands in the manifest, the dense file, or an expert read mid-generation.
    for after in [0, 30_000, 400_000, 700_000, 900_000] {
        let o = generate(home.path(), &c, "readeio", after);
        let err = stderr(&o);
        if o.status.success() {
            continue; // the run read less than that
        }
        assert_eq!(o.status.code(), Some(4), "after {after}: {err}");
        assert!(
            err.contains("Input/output error") && !err.contains("panicked"),
            "{err}"
        );
    }
}

/// Starts `cmd` and kills it with SIGKILL after `ms` milliseconds (if still running).
fn kill_after(mut cmd: Command, ms: u64) {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    std::thread::sleep(Duration::from_millis(ms));
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn kill_9_of_repack_and_pull_at_random_points_then_a_rerun_gives_the_same_container() {
    let home = tempfile::tempdir().expect("tmp");
    let whole = home.path().join("whole");
    assert!(repack(home.path(), &whole, "", 0).status.success());
    let want = snapshot(&whole);

    // Each write slowed by 1 ms, so a run lasts long enough to be cut at many points.
    let out = home.path().join("killed");
    let mut x = 0x2545_f491u64;
    for _ in 0..8 * scale() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let ms = 2 + (x >> 33) % 70; // an undisturbed slowed run lasts about 75 ms
        let mut c = brook(home.path(), "slow", 1000);
        c.arg("repack").arg(fixture()).arg(&out);
        kill_after(c, ms);
        assert!(
            !out.join("manifest.json").exists() || snapshot(&out) == want,
            "a killed repack left a manifest over an unfinished container"
        );
    }
    let o = repack(home.path(), &out, "", 0);
    let done = o.status.success() || stderr(&o).contains("already holds a finished container");
    assert!(done, "{}", stderr(&o));
    assert_eq!(snapshot(&out), want);
    verified(home.path(), &out);

    // `brook pull` from a mock Hub on 127.0.0.1: download and repack cut at random points.
    const REPO: &str = "mlx-community/next-q4";
    let hub = MockHub::start(vec![MockRepo::from_dir(REPO, &fixture())]);
    let pull = |home: &Path, mode: &str| {
        let mut c = brook(home, mode, 1000);
        c.env("HF_ENDPOINT", hub.url()).args(["pull", REPO]);
        c
    };
    let clean_home = tempfile::tempdir().expect("tmp");
    let o = run(pull(clean_home.path(), ""));
    assert!(o.status.success(), "{}", stderr(&o));
    let stored = |h: &Path| h.join("brook/models/mlx-community--next-q4");
    let want = snapshot(&stored(clean_home.path()));
    let killed_home = tempfile::tempdir().expect("tmp");
    for _ in 0..8 * scale() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        kill_after(pull(killed_home.path(), "slow"), 5 + (x >> 33) % 200);
    }
    let o = run(pull(killed_home.path(), ""));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(snapshot(&stored(killed_home.path())), want);
    verified(killed_home.path(), &stored(killed_home.path()));
}
