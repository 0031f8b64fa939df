//! `brook bench` and `brook trace` end to end: the rows a benchmark prints and the routing it
//! replays.

mod common;
use common::*;

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
