//! `brook pull`, `brook list` and `brook rm` end to end against a mock Hub on 127.0.0.1.
//!
//! Each command runs as a child process with its own HF_* and BROOK_HOME, so tests running in
//! parallel never share the process environment.

#[path = "../../brook-hub/tests/mock/mod.rs"]
mod mock;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use mock::{MockHub, MockRepo};

const REPO: &str = "mlx-community/next-q4";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/next-q4")
}

/// `brook` with a private Hub cache and store under `home`, talking to `hub`.
fn brook(hub: &MockHub, home: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_brook"));
    for var in [
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
        "HUGGINGFACE_HUB_CACHE",
        "ALL_PROXY",
        "all_proxy",
        "HTTP_PROXY",
        "http_proxy",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("HF_ENDPOINT", hub.url())
        .env("HF_HOME", home.join("hf"))
        .env("HF_HUB_CACHE", home.join("hf/hub"))
        .env("BROOK_HOME", home.join("brook"))
        .args(args)
        .output()
        .expect("run brook")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn pull_list_generate_and_rm_a_model() {
    let hub = MockHub::start(vec![MockRepo::from_dir(REPO, &fixture())]);
    let home = tempfile::tempdir().expect("tempdir");
    let out = brook(&hub, home.path(), &["pull", REPO]);
    assert!(out.status.success(), "{}", stderr(&out));
    let container = home.path().join("brook/models/mlx-community--next-q4");
    assert!(
        container.join("manifest.json").is_file(),
        "{}",
        stderr(&out)
    );
    let snapshots = home
        .path()
        .join("hf/hub/models--mlx-community--next-q4/snapshots");
    assert_eq!(snapshots.read_dir().expect("snapshots").count(), 1);
    let refs = home
        .path()
        .join("hf/hub/models--mlx-community--next-q4/refs/main");
    assert_eq!(std::fs::read_to_string(refs).expect("ref").len(), 40);

    let again = brook(&hub, home.path(), &["pull", REPO]);
    assert!(again.status.success());
    assert!(
        stderr(&again).contains("is up to date"),
        "{}",
        stderr(&again)
    );

    let list = brook(&hub, home.path(), &["list"]);
    let table = String::from_utf8_lossy(&list.stdout);
    assert!(list.status.success());
    assert!(table.lines().any(|l| l.starts_with(REPO)), "{table}");

    let verify = brook(
        &hub,
        home.path(),
        &["verify", container.to_str().expect("utf8")],
    );
    assert!(verify.status.success(), "{}", stderr(&verify));
    let generated = brook(
        &hub,
        home.path(),
        &[
            "generate",
            "--model",
            REPO,
            "--prompt-tokens",
            "1,2",
            "--max-tokens",
            "2",
        ],
    );
    assert!(
        generated.status.success(),
        "generate --model by name: {}",
        stderr(&generated)
    );
    let logits = home.path().join("logits.safetensors");
    let run = brook(
        &hub,
        home.path(),
        &[
            "logits",
            "--model",
            REPO,
            "--tokens",
            "1,2,3",
            "--out",
            logits.to_str().expect("utf8"),
        ],
    );
    assert!(run.status.success(), "--model by name: {}", stderr(&run));

    let rm = brook(&hub, home.path(), &["rm", REPO]);
    assert!(rm.status.success(), "{}", stderr(&rm));
    assert!(!container.exists());
    let list = brook(&hub, home.path(), &["list"]);
    assert!(stderr(&list).contains("no models in"), "{}", stderr(&list));
    let rm = brook(&hub, home.path(), &["rm", REPO]);
    assert_eq!(rm.status.code(), Some(2), "{}", stderr(&rm));
}

#[test]
fn pull_errors_are_clear_and_mapped_to_exit_codes() {
    let mut gated = MockRepo::from_dir("org/gated", &fixture());
    gated.token = Some("hf_ok".into());
    let hub = MockHub::start(vec![gated]);
    let home = tempfile::tempdir().expect("tempdir");

    let out = brook(&hub, home.path(), &["pull", "nobody/nothing"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("repository not found"),
        "{}",
        stderr(&out)
    );

    let out = brook(&hub, home.path(), &["pull", "org/gated"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("set HF_TOKEN"), "{}", stderr(&out));

    let out = brook(&hub, home.path(), &["pull", "not a repo"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("not a Hugging Face repo id"),
        "{}",
        stderr(&out)
    );

    let out = brook(
        &hub,
        home.path(),
        &[
            "logits",
            "--model",
            "org/absent",
            "--tokens",
            "1",
            "--out",
            "x",
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("brook pull org/absent"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn help_names_flags_and_shows_an_example() {
    let hub = MockHub::start(Vec::new());
    let home = tempfile::tempdir().expect("tempdir");
    for (cmd, flag) in [("pull", "--revision"), ("list", "--json"), ("rm", "<NAME>")] {
        let out = brook(&hub, home.path(), &[cmd, "--help"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(flag) && text.contains("Example:"),
            "{cmd}: {text}"
        );
    }
}
