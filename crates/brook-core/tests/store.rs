//! The model store: checkpoint folders repacked on first use, names resolved, list and remove.

use std::path::PathBuf;

use brook_core::container::Container;
use brook_core::store::{Origin, Store, StoreEvent};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

#[test]
fn checkpoint_folder_is_repacked_once_then_reused() {
    let home = tempfile::tempdir().expect("tempdir");
    let store = Store::new(home.path());
    let src = fixture("next-q4");
    let mut announced = Vec::new();
    let dir = store
        .resolve(src.to_str().expect("utf8"), &mut |e| {
            if let StoreEvent::Repacking { into, .. } = e {
                announced.push(into.to_path_buf());
            }
        })
        .expect("resolve checkpoint");
    assert_eq!(announced, std::slice::from_ref(&dir));
    assert!(dir.starts_with(store.models_dir()));
    Container::open(&dir).expect("a working container");

    let again = store
        .resolve(src.to_str().expect("utf8"), &mut |e| {
            assert!(!matches!(e, StoreEvent::Repacking { .. }), "repacked twice");
        })
        .expect("second resolve");
    assert_eq!(again, dir);
    let same = store
        .resolve(dir.to_str().expect("utf8"), &mut |_| {})
        .expect("a container path resolves to itself");
    assert_eq!(same, dir);

    let listed = store.list().expect("list");
    assert_eq!(listed.len(), 1);
    assert!(
        listed[0].name.starts_with("local--next-q4-"),
        "{}",
        listed[0].name
    );
    assert!(listed[0].size > 0);
    let origin = listed[0].origin.as_ref().expect("origin");
    assert_eq!(
        origin.source,
        std::fs::canonicalize(&src).expect("canonical")
    );
    assert!(
        !home
            .path()
            .join("models/.partial")
            .read_dir()
            .expect("dir")
            .any(|_| true)
    );
}

#[test]
fn pulled_names_resolve_list_and_remove() {
    let home = tempfile::tempdir().expect("tempdir");
    let store = Store::new(home.path());
    let origin = Origin {
        repo: Some("org/next".into()),
        revision: Some("v1".into()),
        commit: Some("0".repeat(40)),
        source: fixture("next-q4"),
    };
    let dir = store
        .import(&fixture("next-q4"), "org/next@v1", &origin, &mut |_| {})
        .expect("import");
    assert_eq!(dir, home.path().join("models/org--next@v1"));
    assert_eq!(
        store.resolve("org/next@v1", &mut |_| {}).expect("by name"),
        dir
    );
    let err = store
        .resolve("org/next", &mut |_| {})
        .expect_err("other revision");
    assert!(err.to_string().contains("brook pull org/next"), "{err}");

    let listed = store.list().expect("list");
    assert_eq!(listed[0].name, "org/next@v1");
    assert_eq!(listed[0].origin.as_ref(), Some(&origin));

    let gone = store.remove("org/next@v1").expect("remove");
    assert!(gone.size > 0);
    assert!(!dir.exists());
    assert!(store.list().expect("list").is_empty());
    let err = store.remove("org/next@v1").expect_err("already gone");
    assert!(err.to_string().contains("brook list"), "{err}");
}

#[test]
fn opening_one_checkpoint_from_several_places_at_once_repacks_it_once() {
    let home = tempfile::tempdir().expect("tempdir");
    let src = fixture("qwen35-q4");
    let repacks = std::sync::atomic::AtomicUsize::new(0);
    let dirs: Vec<PathBuf> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    Store::new(home.path())
                        .resolve(src.to_str().expect("utf8"), &mut |e| {
                            if matches!(e, StoreEvent::Repacking { .. }) {
                                repacks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            }
                        })
                        .expect("concurrent resolve")
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    assert!(dirs.iter().all(|d| d == &dirs[0]), "{dirs:?}");
    assert_eq!(repacks.into_inner(), 1);
    Container::open(&dirs[0]).expect("a working container");
    // Reopening it from many places at once (several servers or test processes starting
    // together) used to fail: each rewrote the origin file through the same temporary file,
    // and one's rename took another's away ("brook-origin.json: No such file").
    for _ in 0..5 {
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    Store::new(home.path())
                        .resolve(src.to_str().expect("utf8"), &mut |_| {})
                        .expect("concurrent reopen")
                });
            }
        });
    }
}

/// A run killed after its repack finished but before the container moved into place leaves a
/// whole container in the store's scratch folder: the next run installs it (it used to refuse
/// "already holds a finished container" forever; found by the kill -9 fault test).
#[test]
fn a_finished_repack_left_in_scratch_is_installed_by_the_next_run() {
    let home = tempfile::tempdir().expect("tempdir");
    let store = Store::new(home.path());
    let src = fixture("next-q4");
    let dest = store
        .resolve(src.to_str().expect("utf8"), &mut |_| {})
        .expect("resolve");
    let ck = brook_core::Checkpoint::open(&src).expect("checkpoint");
    let rs = brook_core::container::repack::RepackSource::from_checkpoint(&ck).expect("source");
    let key =
        brook_core::container::hash_hex(&serde_json::to_vec(&rs.identity.files).expect("json"));
    let folder = dest
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let scratch = home
        .path()
        .join("models/.partial")
        .join(format!("{folder}-{key}"));
    std::fs::rename(&dest, &scratch).expect("move into scratch");
    let mut repacked = false;
    let again = store
        .resolve(src.to_str().expect("utf8"), &mut |e| {
            repacked |= matches!(e, StoreEvent::Repack(_));
        })
        .expect("the next run installs it");
    assert_eq!(again, dest);
    assert!(
        !repacked,
        "the finished container was repacked instead of installed"
    );
    assert!(!scratch.exists());
    Container::open(&dest).expect("a working container");
}
