//! Helpers of the `brook` binary's end-to-end tests (`cli.rs`, `bench.rs`); each test binary
//! uses some of them.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// The `brook` binary with a private store (`BROOK_HOME`: checkpoint folders are repacked
/// into it on first use) in a temporary folder that goes when the command is dropped (a store
/// named after the process id stayed behind after every run).
pub struct Brook {
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

pub fn brook() -> Brook {
    let home = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_brook"));
    cmd.env("BROOK_HOME", home.path());
    Brook { cmd, _home: home }
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

pub fn reference(name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixture(name).join("reference.json")).expect("read"))
        .expect("json")
}

pub fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .expect("list")
        .iter()
        .map(|x| x.as_u64().expect("id"))
        .collect()
}

/// Asserts the command exited 0, showing its stderr if not.
pub fn succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn join(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// A mid-size synthetic container (4 layers × 64 experts of 448 KiB, 115 MB of experts).
pub fn mid_container(dir: &std::path::Path) -> PathBuf {
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

/// The commit `brook --version` names, in parentheses after the version.
pub fn commit() -> String {
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
