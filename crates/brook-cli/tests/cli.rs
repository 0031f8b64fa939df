//! The `brook` binary end to end: the commands tests and users rely on.

use std::path::PathBuf;
use std::process::Command;

use brook_core::safetensors::SafeFile;

fn brook() -> Command {
    Command::new(env!("CARGO_BIN_EXE_brook"))
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
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
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
