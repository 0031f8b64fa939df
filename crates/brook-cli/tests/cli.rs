//! The `brook` binary end to end: the commands tests and users rely on.

use std::path::PathBuf;
use std::process::Command;

use brook_core::safetensors::SafeFile;

/// The `brook` binary with a private store (`BROOK_HOME`: checkpoint folders are repacked
/// into it on first use) in a temporary folder that goes when the command is dropped (a store
/// named after the process id stayed behind after every run).
struct Brook {
    cmd: Command,
    _home: tempfile::TempDir,
}

impl std::ops::Deref for Brook {
    type Target = Command;
    fn deref(&self) -> &Command {
        &self.cmd
    }
}

impl std::ops::DerefMut for Brook {
    fn deref_mut(&mut self) -> &mut Command {
        &mut self.cmd
    }
}

fn brook() -> Brook {
    let home = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_brook"));
    cmd.env("BROOK_HOME", home.path());
    Brook { cmd, _home: home }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture(name).join("reference.json")).expect("read"))
        .expect("json")
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .expect("list")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

/// Asserts the command exited 0, showing its stderr if not.
fn succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn join(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

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

/// A mid-size synthetic container (4 layers × 64 experts of 448 KiB, 115 MB of experts).
fn mid_container(dir: &std::path::Path) -> PathBuf {
    let mut cfg = brook_core::synth::preset_config("tiny").expect("preset");
    let t = &mut cfg["text_config"];
    t["hidden_size"] = 512.into();
    t["num_experts"] = 64.into();
    t["num_experts_per_tok"] = 8.into();
    t["moe_intermediate_size"] = 512.into();
    t["shared_expert_intermediate_size"] = 512.into();
    t["vocab_size"] = 8192.into();
    let store = brook_core::synth::SynthModel::from_config("mid", cfg, 4, 7).expect("synth");
    let out = dir.join("mid");
    brook_core::container::repack::repack(&store.repack_source(), &out, &mut |_| {})
        .expect("repack");
    out
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

/// The commit `brook --version` names, in parentheses after the version.
fn commit() -> String {
    let out = brook().arg("--version").output().expect("run");
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let c = v
        .split_once(" (")
        .and_then(|(_, c)| c.strip_suffix(')'))
        .unwrap_or_else(|| panic!("no commit in {v:?}"));
    assert!(
        c == "unknown" || (c.len() >= 7 && c.chars().all(|ch| ch.is_ascii_hexdigit())),
        "{v:?}"
    );
    c.to_string()
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

/// `brook bench --json` on a streamed container: one row per budget, each under its budget,
/// with the speeds, the cache's figures and the disk measured before and after decoding.
#[test]
fn bench_json_reports_one_row_per_budget() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = mid_container(dir.path());
    let out = brook()
        .args(["bench", "--model"])
        .arg(&c)
        .args(["--memory-budget", "100MiB,400MiB", "--context", "256"])
        .args([
            "-p",
            "16",
            "-n",
            "4",
            "-d",
            "8",
            "-r",
            "1",
            "--disk-secs",
            "0.2",
            "--json",
        ])
        .output()
        .expect("run");
    succeeded(&out);
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (row, budget) in rows.iter().zip([100u64 << 20, 400 << 20]) {
        let f = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("{k} in {row}"));
        assert_eq!(row["budget_bytes"].as_u64(), Some(budget));
        // The row names the code it ran: the commit the binary was built from.
        assert_eq!(row["commit"].as_str(), Some(commit().as_str()), "{row}");
        assert!(
            f("pp_tok_s") > 0.0 && f("tg_tok_s") > 0.0 && f("ttft_s") > 0.0,
            "{row}"
        );
        assert!(f("peak_rss_bytes") < budget as f64, "{row}");
        assert!((0.0..=1.0).contains(&f("hit_rate")), "{row}");
        let (before, after) = (f("disk_bw_before_gb_s"), f("disk_bw_after_gb_s"));
        assert!(before > 0.0 && after > 0.0, "{row}");
        assert!(
            (f("disk_bw_gb_s") - (before + after) / 2.0).abs() < 1e-9,
            "{row}"
        );
        // The limit counts the states a token moves beside the weights.
        let state = f("state_bytes_per_token");
        assert!(state > 0.0 && f("limit_tok_s") > 0.0, "{row}");
        assert!(f("limit_tok_s") <= f("limit_weights_tok_s"), "{row}");
        assert_eq!(row["depth"].as_u64(), Some(8), "{row}");
        // The limit's bandwidth is a median of reads: no single read beats the best one.
        let (before, after) = (f("mem_bw_before_gb_s"), f("mem_bw_after_gb_s"));
        assert!(before > 0.0 && after > 0.0, "{row}");
        let (mem, best) = (f("mem_bw_gb_s"), f("mem_bw_best_gb_s"));
        assert!(
            mem > 0.0 && best >= mem && best >= before.max(after),
            "{row}"
        );
    }
    // The small budget streams; the large one holds every expert and reads nothing.
    assert!(rows[0]["bytes_read_per_token"].as_f64().expect("read") > 0.0);
    assert!(rows[0]["hit_rate"].as_f64().expect("hits") < 1.0);
    assert_eq!(
        rows[1]["bytes_read_per_token"].as_f64(),
        Some(0.0),
        "{}",
        rows[1]
    );
    // BROOK_SIMD runs a lower level's kernels on a higher machine, and the row says which.
    let detected = rows[0]["simd"].as_str().expect("simd").to_string();
    let cpu_has = |f: &str| {
        std::fs::read_to_string("/proc/cpuinfo").is_ok_and(|c| c.split_whitespace().any(|w| w == f))
    };
    let vnni2 = if cpu_has("avx_vnni") {
        "avx2+avxvnni"
    } else {
        "avx2"
    };
    for (forced, want) in [
        ("portable", "portable"),
        ("avx2", "avx2"),
        ("avx2vnni", vnni2),
        ("nonsense", ""),
    ] {
        let out = brook()
            .env("BROOK_SIMD", forced)
            .args(["bench", "--model"])
            .arg(&c)
            .args([
                "--memory-budget",
                "400MiB",
                "--context",
                "256",
                "-p",
                "8",
                "-n",
                "2",
            ])
            .args(["-r", "1", "--disk-secs", "0.1", "--json"])
            .output()
            .expect("run");
        succeeded(&out);
        let row: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("row");
        let got = row["simd"].as_str().expect("simd");
        let supported = detected != "portable" || forced == "portable";
        if want.is_empty() {
            assert_eq!(got, detected, "an unknown level is ignored");
        } else if supported {
            assert_eq!(got, want, "BROOK_SIMD={forced}");
        }
    }
    // A decode test deeper than the context is refused before loading, naming the fix.
    let out = brook()
        .args(["bench", "--model"])
        .arg(&c)
        .args(["--context", "64", "-p", "16", "-n", "8", "-d", "60"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "bad input exits 2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs 69 positions") && err.contains("--context"),
        "{err}"
    );
}

/// `brook trace` records a generation's routing and simulates one; `brook bench
/// --routing-trace` replays it, and the cache then hits as that routing lets it.
#[test]
fn trace_records_and_bench_replays_a_routing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = mid_container(dir.path());
    let rec = dir.path().join("rec.jsonl");
    let out = brook()
        .args(["trace", "--model"])
        .arg(&c)
        .args([
            "--prompt-tokens",
            "1,2,3",
            "--max-tokens",
            "20",
            "--temperature",
            "0",
        ])
        .arg("--out")
        .arg(&rec)
        .output()
        .expect("run");
    succeeded(&out);
    let text = std::fs::read_to_string(&rec).expect("trace written");
    assert_eq!(text.lines().count(), 20, "one line per decoded token");
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        let layers = v["layers"].as_array().expect("layers");
        assert_eq!(layers.len(), 4);
        assert!(layers.iter().all(|l| l.as_array().expect("ids").len() == 8));
    }
    let sim = dir.path().join("sim.jsonl");
    let out = brook()
        .args(["trace", "--model"])
        .arg(&c)
        .args(["--simulate", "strong", "--tokens", "48", "--out"])
        .arg(&sim)
        .output()
        .expect("run");
    succeeded(&out);
    let bench = |trace: Option<&std::path::Path>| {
        let mut cmd = brook();
        cmd.args(["bench", "--model"]).arg(&c).args([
            "--expert-cache",
            "64",
            "--no-prefetch",
            "-p",
            "0",
            "-n",
            "24",
            "-r",
            "2",
            "--disk-secs",
            "0",
            "--json",
        ]);
        if let Some(t) = trace {
            cmd.arg("--routing-trace").arg(t);
        }
        let out = cmd.output().expect("run");
        succeeded(&out);
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("row")
    };
    let (plain, replayed) = (bench(None), bench(Some(&sim)));
    let hits = |r: &serde_json::Value| r["demand_hit_rate"].as_f64().expect("hits");
    assert_eq!(replayed["routing_trace_tokens"].as_u64(), Some(48));
    assert_eq!(replayed["prefetch"].as_bool(), Some(false));
    // Random weights route almost uniformly (a quarter of the experts fit); the strong trace
    // repeats most experts from one token to the next.
    assert!(
        hits(&replayed) > hits(&plain) + 0.2,
        "{} vs {}",
        hits(&replayed),
        hits(&plain)
    );
    // A trace of another shape is refused, naming the line.
    std::fs::write(&sim, "{\"layers\": [[1, 2]]}\n").expect("write");
    let out = brook()
        .args(["bench", "--model"])
        .arg(&c)
        .arg("--routing-trace")
        .arg(&sim)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 1: 1 layer lists"), "{err}");
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
