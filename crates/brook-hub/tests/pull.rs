//! brook-hub against a mock Hub on 127.0.0.1: the cache layout, resume, verification and errors.

mod mock;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use brook_hub::{Error, FileEvent, Hub, HubConfig, RepoId, Snapshot, Token};
use mock::{MockHub, MockRepo, git_sha1, sha256};

const REPO: &str = "mlx-community/next-q4";
/// The largest file of the fixture (about 400 KB), the one the faults hit.
const SHARD: &str = "model-00002-of-00003.safetensors";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/next-q4")
}

fn config(hub: &MockHub, cache: &Path) -> HubConfig {
    let mut c = HubConfig::from_vars(|_| None);
    c.endpoint = hub.url();
    c.cache_dir = cache.to_path_buf();
    c.retries = 0;
    c.retry_delay = Duration::ZERO;
    c
}

fn pull(cfg: HubConfig, repo: &str) -> Result<Snapshot, Error> {
    let repo = RepoId::parse(repo).expect("repo id");
    Hub::new(cfg).snapshot(&repo, "main", &|_| {})
}

fn fixture_hub() -> MockHub {
    MockHub::start(vec![MockRepo::from_dir(REPO, &fixture())])
}

#[test]
fn pull_writes_the_hf_cache_layout() {
    let hub = fixture_hub();
    let cache = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&hub, cache.path());
    cfg.token = Some(Token::new("hf_public_too"));
    let last = Mutex::new((0, 0));
    let snap = Hub::new(cfg.clone())
        .snapshot(&RepoId::parse(REPO).expect("id"), "main", &|p| {
            *last.lock().expect("lock") = (p.done, p.total);
        })
        .expect("pull");

    let repo_dir = cache.path().join("models--mlx-community--next-q4");
    let commit = std::fs::read_to_string(repo_dir.join("refs/main")).expect("refs/main");
    assert_eq!(commit, snap.commit, "refs/main holds the bare commit hash");
    assert_eq!(snap.dir, repo_dir.join("snapshots").join(&commit));
    let (done, total) = *last.lock().expect("lock");
    assert_eq!((done, total), (snap.bytes, snap.bytes));
    assert_eq!(snap.fetched, snap.bytes);
    for entry in std::fs::read_dir(fixture()).expect("fixture") {
        let src = entry.expect("entry").path();
        let name = src
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let data = std::fs::read(&src).expect("read");
        let etag = if name.ends_with(".safetensors") {
            sha256(&data)
        } else {
            git_sha1(&data)
        };
        let link = snap.dir.join(&name);
        let target = std::fs::read_link(&link).expect("snapshot entries are symlinks");
        assert_eq!(
            target,
            PathBuf::from(format!("../../blobs/{etag}")),
            "{name}"
        );
        assert_eq!(std::fs::read(&link).expect("follow"), data, "{name}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(repo_dir.join("blobs"))
        .expect("blobs")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".incomplete"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    for s in hub.seen() {
        let cdn = s.port == hub.cdn_port();
        assert_eq!(
            s.auth.is_some(),
            !cdn,
            "token only to the Hub, never the CDN: {s:?}"
        );
    }

    let again = pull(cfg, REPO).expect("second pull");
    assert_eq!(
        again.fetched, 0,
        "a second pull finds everything in the cache"
    );
}

#[test]
fn interrupted_download_resumes_with_a_range_request() {
    let hub = fixture_hub();
    let cache = tempfile::tempdir().expect("tempdir");
    hub.drop_after(SHARD, 100_000);
    let err = pull(config(&hub, cache.path()), REPO).expect_err("connection dropped");
    assert!(matches!(err, Error::Network { .. }), "{err}");
    assert!(err.to_string().contains("run again"), "{err}");
    let size = std::fs::metadata(fixture().join(SHARD))
        .expect("stat")
        .len();
    let served_first: Vec<(String, u64)> = std::fs::read_dir(fixture())
        .expect("fixture")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .map(|n| (n.clone(), hub.served(&n)))
        .collect();
    assert_eq!(hub.served(SHARD), 100_000);

    let snap = pull(config(&hub, cache.path()), REPO).expect("resumed pull");
    assert_eq!(
        hub.served(SHARD),
        size,
        "the shard's first 100000 bytes were not sent again"
    );
    let cdn_ranges: Vec<_> = hub
        .seen()
        .into_iter()
        .filter(|s| s.port == hub.cdn_port())
        .filter_map(|s| s.range)
        .collect();
    assert_eq!(cdn_ranges, ["bytes=100000-"]);
    for (name, first) in served_first {
        if name != SHARD && first > 0 {
            assert_eq!(
                hub.served(&name),
                first,
                "{name} was complete and not fetched again"
            );
        }
    }
    let data = std::fs::read(fixture().join(SHARD)).expect("read");
    assert_eq!(std::fs::read(snap.dir.join(SHARD)).expect("read"), data);
}

#[test]
fn dropped_connection_is_retried_within_one_pull() {
    let hub = fixture_hub();
    let cache = tempfile::tempdir().expect("tempdir");
    hub.drop_after(SHARD, 4096);
    let mut cfg = config(&hub, cache.path());
    cfg.retries = 2;
    let retried = Mutex::new(0);
    Hub::new(cfg)
        .snapshot(&RepoId::parse(REPO).expect("id"), "main", &|p| {
            if let FileEvent::Retrying { .. } = p.event {
                *retried.lock().expect("lock") += 1;
            }
        })
        .expect("retried pull");
    assert_eq!(*retried.lock().expect("lock"), 1);
    let size = std::fs::metadata(fixture().join(SHARD))
        .expect("stat")
        .len();
    assert_eq!(hub.served(SHARD), size);
}

#[test]
fn corrupt_download_is_refused_and_removed() {
    let hub = fixture_hub();
    let cache = tempfile::tempdir().expect("tempdir");
    hub.corrupt(Some(SHARD));
    let err = pull(config(&hub, cache.path()), REPO).expect_err("bad hash");
    let text = err.to_string();
    assert!(matches!(err, Error::Integrity { .. }), "{text}");
    assert!(text.contains(SHARD) && text.contains("sha256"), "{text}");
    let data = std::fs::read(fixture().join(SHARD)).expect("read");
    let blobs = cache.path().join("models--mlx-community--next-q4/blobs");
    let sha = sha256(&data);
    assert!(
        !blobs.join(format!("{sha}.incomplete")).exists(),
        "partial file removed"
    );
    assert!(!blobs.join(&sha).exists(), "no blob for a bad file");

    hub.corrupt(None);
    let snap = pull(config(&hub, cache.path()), REPO).expect("clean pull");
    assert_eq!(std::fs::read(snap.dir.join(SHARD)).expect("read"), data);
}

#[test]
fn missing_repo_says_check_the_name_or_set_hf_token() {
    let hub = fixture_hub();
    let cache = tempfile::tempdir().expect("tempdir");
    let err = pull(config(&hub, cache.path()), "nobody/nothing").expect_err("404");
    let text = err.to_string();
    assert!(matches!(err, Error::RepoNotFound { .. }), "{text}");
    assert!(
        text.contains("repository not found: nobody/nothing"),
        "{text}"
    );
    assert!(
        text.contains("set HF_TOKEN if it is private/gated"),
        "{text}"
    );

    let repo = RepoId::parse(REPO).expect("id");
    let err = Hub::new(config(&hub, cache.path()))
        .list(&repo, "no-such-branch")
        .expect_err("revision 404");
    assert!(
        err.to_string()
            .contains("revision `no-such-branch` not found"),
        "{err}"
    );
}

#[test]
fn gated_repo_asks_for_hf_token_and_accepts_the_right_one() {
    let mut repo = MockRepo::from_dir("org/gated", &fixture());
    repo.token = Some("hf_good".into());
    let hub = MockHub::start(vec![repo]);
    let cache = tempfile::tempdir().expect("tempdir");

    let err = pull(config(&hub, cache.path()), "org/gated").expect_err("401");
    let text = err.to_string();
    assert!(matches!(err, Error::Gated { token: None, .. }), "{text}");
    assert!(
        text.contains("org/gated is gated") && text.contains("set HF_TOKEN"),
        "{text}"
    );

    let mut cfg = config(&hub, cache.path());
    cfg.token = Some(Token::new("hf_wrong"));
    let text = pull(cfg.clone(), "org/gated")
        .expect_err("wrong token")
        .to_string();
    assert!(
        text.contains("the token from the configured token has no access"),
        "{text}"
    );

    cfg.token = Some(Token::new("hf_good"));
    pull(cfg, "org/gated").expect("the right token pulls");
}

#[test]
fn unreachable_endpoint_is_a_network_error() {
    let cache = tempfile::tempdir().expect("tempdir");
    // A port nothing listens on: bind one, note it, and close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let mut cfg = HubConfig::from_vars(|_| None);
    cfg.endpoint = format!("http://127.0.0.1:{port}");
    cfg.cache_dir = cache.path().to_path_buf();
    let err = pull(cfg, REPO).expect_err("nothing listens");
    assert!(matches!(err, Error::Network { .. }), "{err}");
    assert!(err.to_string().contains("check the connection"), "{err}");
}

#[test]
fn concurrent_pulls_download_each_file_once() {
    let hub = fixture_hub();
    let cache = tempfile::tempdir().expect("tempdir");
    let results: Vec<Result<Snapshot, Error>> = std::thread::scope(|s| {
        let pulls: Vec<_> = (0..2)
            .map(|_| s.spawn(|| pull(config(&hub, cache.path()), REPO)))
            .collect();
        pulls.into_iter().map(|p| p.join().expect("join")).collect()
    });
    let mut fetched = 0;
    for r in results {
        fetched += r.expect("both pulls succeed").fetched;
    }
    let total: u64 = std::fs::read_dir(fixture())
        .expect("fixture")
        .map(|e| e.expect("entry").metadata().expect("stat").len())
        .sum();
    assert_eq!(
        fetched, total,
        "the blob locks let only one pull fetch each file"
    );
    assert_eq!(
        hub.served(SHARD),
        std::fs::metadata(fixture().join(SHARD))
            .expect("stat")
            .len()
    );
}
