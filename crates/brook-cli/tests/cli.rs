//! The `brook` binary end to end: the commands tests and users rely on.

mod common;
use brook_core::safetensors::SafeFile;
use common::*;

#[test]
fn logits_command_writes_every_position() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("logits.safetensors");
    let r = reference("qwen35-q4");
    let tokens = ids(&r["tokens"]);
    let status = brook()
        .args(["logits", "--model"])
        .arg(fixture("qwen35-q4"))
        .args(["--tokens", &join(&tokens), "--out"])
        .arg(&out)
        .status()
        .expect("run");
    assert!(status.success());
    let f = SafeFile::open(&out).expect("open output");
    let info = &f.tensors["logits"];
    assert_eq!(info.shape, vec![tokens.len(), 1003]);
    let mut got = Vec::new();
    brook_core::dtype::floats_to_f32(info.dtype, &f.read(info).expect("read"), &mut got);
    let rf = SafeFile::open(&fixture("qwen35-q4").join("reference.safetensors")).expect("ref");
    let mut want = Vec::new();
    let ri = &rf.tensors["logits"];
    brook_core::dtype::floats_to_f32(ri.dtype, &rf.read(ri).expect("read"), &mut want);
    let num: f64 = got
        .iter()
        .zip(&want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    assert!((num / den).sqrt() < 1e-4);
}

#[test]
fn generate_json_lists_the_greedy_tokens() {
    for name in ["next-mixed", "qwen35-q8"] {
        let r = reference(name);
        let out = brook()
            .args(["generate", "--model"])
            .arg(fixture(name))
            .args(["--prompt-tokens", &join(&ids(&r["tokens"]))])
            .args(["--max-tokens", "16", "--temperature", "0", "--json"])
            .output()
            .expect("run");
        succeeded(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let got = ids(&v["tokens"]);
        // The fixture's greedy run ignores EOS; ours may stop early at an EOS id.
        let want = ids(&r["greedy"]);
        assert!(!got.is_empty());
        assert_eq!(got[..], want[..got.len()], "{name}");
    }
}

#[test]
fn bad_input_exits_with_a_message_not_a_panic() {
    let cases: Vec<(Vec<String>, &str, i32)> = vec![
        (
            vec!["--prompt-tokens".into(), "1,x".into()],
            "not a token id",
            2,
        ),
        (
            vec!["--prompt-tokens".into(), "5000".into()],
            "out of range",
            2,
        ),
        (vec!["--prompt-tokens".into(), "".into()], "no token ids", 2),
        // A context no machine holds is refused, not an overflow panic.
        (
            vec![
                "--prompt-tokens".into(),
                "1".into(),
                "--context".into(),
                u64::MAX.to_string(),
            ],
            "not a context length",
            2,
        ),
        (
            vec![
                "--prompt-tokens".into(),
                "1".into(),
                "--context".into(),
                "4000000000".into(),
            ],
            "not a context length",
            2,
        ),
    ];
    for (args, msg, code) in cases {
        let out = brook()
            .args(["generate", "--model"])
            .arg(fixture("next-q4"))
            .args(&args)
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(msg), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let out = brook()
        .args([
            "generate",
            "--model",
            "/nonexistent",
            "--prompt-tokens",
            "1",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(3));
}

#[test]
fn peak_rss_stays_under_a_small_budget() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = mid_container(dir.path());
    let budget: u64 = 100 << 20;
    let run = |fill: bool| {
        let mut cmd = brook();
        cmd.args(["generate", "--model"])
            .arg(&c)
            .args(["--memory-budget", "100MiB", "--context", "256"])
            .args([
                "--prompt-tokens",
                "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20",
            ])
            .args(["--max-tokens", "8", "--json"]);
        if fill {
            cmd.arg("--fill-cache");
        }
        let out = cmd.output().expect("run");
        succeeded(&out);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        let n = |k: &str| v["cache"][k].as_u64().unwrap_or_else(|| panic!("{k}: {v}"));
        let peak = v["peak_rss_bytes"].as_u64().expect("peak");
        assert!(n("misses") > 0, "must stream: {v}");
        assert!(peak < budget, "VmHWM {peak} over the budget {budget}");
        (peak, n("evictions"), n("slots"), n("slots_max"))
    };
    // Every slot the budget pays for, taken from the start.
    let (peak, evictions, slots, max) = run(true);
    assert!(evictions > 0, "the cache must be full");
    assert_eq!(slots, max);
    assert!(
        peak > budget / 2,
        "VmHWM {peak}: the budget should be used, not ignored"
    );
    // The default starts smaller and may grow to the same ceiling. Each process plans with
    // its own baseline RSS (measured at open), so the two ceilings can differ by a slot.
    let (_, _, slots, grown_max) = run(false);
    assert!(grown_max.abs_diff(max) <= 1, "{grown_max} against {max}");
    assert!(
        slots <= grown_max && slots >= 72,
        "{slots} slots of {grown_max}"
    );
}

#[test]
fn version_names_the_commit_built_from() {
    let c = commit();
    // Built in a git checkout (as the tests are), it is that checkout's HEAD.
    if let Ok(out) = std::process::Command::new("git")
        .args(["rev-parse", "--short=7", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        && out.status.success()
    {
        assert_eq!(c, String::from_utf8_lossy(&out.stdout).trim());
    }
}

#[test]
fn every_command_help_names_its_flags_and_shows_an_example() {
    let top = brook().arg("--help").output().expect("run");
    let text = String::from_utf8_lossy(&top.stdout).to_string();
    let commands: Vec<String> = text
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() >= 13, "{commands:?}");
    for c in commands {
        let out = brook().args([c.as_str(), "--help"]).output().expect("run");
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{c}");
        assert!(
            help.contains("Example"),
            "`brook {c} --help` shows no example:\n{help}"
        );
        assert!(
            help.contains("Options:") && help.contains("--help"),
            "{c}: {help}"
        );
    }
}

/// `--backend cuda`: a clear GPU error where there is no GPU (CI), greedy tokens equal to the
/// CPU's where there is one.
#[test]
fn backend_cuda_runs_or_says_why_not() {
    let run = |backend: &str| {
        brook()
            .args(["generate", "--json", "--model"])
            .arg(fixture("next-q4"))
            .args([
                "--prompt-tokens",
                "1,2,3",
                "--max-tokens",
                "4",
                "--temperature",
                "0",
            ])
            .args(["--backend", backend])
            .output()
            .expect("run")
    };
    let out = run("cuda");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    if out.status.success() {
        let cpu = run("cpu");
        let tokens = |o: &std::process::Output| {
            serde_json::from_slice::<serde_json::Value>(&o.stdout).expect("json")["tokens"].clone()
        };
        assert_eq!(tokens(&out), tokens(&cpu));
    } else {
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("GPU: ") && err.contains("--backend cpu"),
            "{err}"
        );
    }
}

#[test]
fn verify_and_open_refuse_damaged_containers_with_exit_3() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("c");
    let r = brook()
        .arg("repack")
        .arg(fixture("next-q4"))
        .arg(&out)
        .output()
        .expect("run");
    succeeded(&r);
    succeeded(&brook().arg("verify").arg(&out).output().expect("run"));

    // A flipped byte inside an expert: verify exits 3 (bad model files).
    let layer = out.join("experts/layer-000.bin");
    let mut bytes = std::fs::read(&layer).expect("read");
    bytes[100] ^= 0x40;
    std::fs::write(&layer, &bytes).expect("write");
    let r = brook().arg("verify").arg(&out).output().expect("run");
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(3), "{err}");
    assert!(err.contains("verification failed"), "{err}");
    bytes[100] ^= 0x40;
    std::fs::write(&layer, &bytes).expect("write");

    // A manifest naming a file outside the container: refused at open, exit 3.
    let mpath = out.join("manifest.json");
    let good = std::fs::read_to_string(&mpath).expect("read");
    let mut m: serde_json::Value = serde_json::from_str(&good).expect("json");
    m["experts"]["layers"][0]["file"] = "../../etc/passwd".into();
    std::fs::write(&mpath, m.to_string()).expect("write");
    let r = brook().arg("verify").arg(&out).output().expect("run");
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(3), "{err}");
    assert!(err.contains("outside the container"), "{err}");

    // A stride far past the blob (a sparse file could back it): refused, exit 3.
    let mut m: serde_json::Value = serde_json::from_str(&good).expect("json");
    let stride = m["experts"]["layers"][0]["stride"]
        .as_u64()
        .expect("stride");
    m["experts"]["layers"][0]["stride"] = (stride << 20).into();
    std::fs::write(&mpath, m.to_string()).expect("write");
    let r = brook().arg("verify").arg(&out).output().expect("run");
    assert_eq!(r.status.code(), Some(3));
    assert!(!String::from_utf8_lossy(&r.stderr).contains("panicked"));
}
