//! Listing a repository: `GET {endpoint}/api/models/{repo}/revision/{revision}?blobs=true`.
//!
//! The answer (what huggingface_hub's `model_info(..., files_metadata=True)` reads) carries the
//! commit the revision resolves to in `sha`, and one entry per file in `siblings`:
//! `{"rfilename", "size", "blobId", "lfs": {"sha256", "size", "pointerSize"}}`. `blobId` is the
//! git blob sha1, and `lfs.sha256` the content hash of an LFS file; the cache names blobs by the
//! latter, else the former (the `ETag` the Hub sends for the file).

use serde::Deserialize;

use crate::Hub;
use crate::error::{Error, Result};
use crate::http::{self, Subject};
use crate::repo::{RepoId, is_commit, is_safe_relative, quote};

/// One file of a repository at a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoFile {
    /// Path inside the repository, `/`-separated.
    pub path: String,
    /// Bytes of the file itself (for LFS files, of the content, not the pointer).
    pub size: u64,
    /// The git blob sha1 (40 hex digits).
    pub blob_id: String,
    /// For LFS files, the sha256 of the content (64 hex digits).
    pub sha256: Option<String>,
}

impl RepoFile {
    /// The blob name in the cache: the sha256 for LFS files, else the git sha1.
    pub fn etag(&self) -> &str {
        self.sha256.as_deref().unwrap_or(&self.blob_id)
    }
}

/// The files of a repository at one commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoListing {
    pub repo: RepoId,
    /// The revision asked for (branch, tag or commit).
    pub revision: String,
    /// The commit it resolved to.
    pub commit: String,
    pub files: Vec<RepoFile>,
}

impl RepoListing {
    /// Bytes of all files.
    pub fn total_size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

#[derive(Deserialize)]
struct RevisionJson {
    sha: Option<String>,
    siblings: Option<Vec<SiblingJson>>,
}

#[derive(Deserialize)]
struct SiblingJson {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<LfsJson>,
}

#[derive(Deserialize)]
struct LfsJson {
    sha256: String,
    size: u64,
}

/// Largest listing accepted (a repository with 100k files is about 20 MB of JSON).
const MAX_LISTING: u64 = 256 << 20;

pub(crate) fn list(hub: &Hub, repo: &RepoId, revision: &str) -> Result<RepoListing> {
    if !is_safe_relative(revision) {
        return Err(Error::RevisionNotFound {
            repo: repo.to_string(),
            revision: revision.to_string(),
        });
    }
    let url = format!(
        "{}/api/models/{repo}/revision/{}?blobs=true",
        hub.config().endpoint,
        quote(revision, false)
    );
    let what = Subject {
        repo: repo.as_str(),
        revision,
    };
    let (resp, _) = http::get(hub, &url, 0)?;
    let resp = http::check(hub, resp, &url, what)?;
    let text = resp
        .into_body()
        .with_config()
        .limit(MAX_LISTING)
        .read_to_string()
        .map_err(|e| http::network(&url, &e.to_string()))?;
    parse(&text, repo, revision).map_err(|reason| Error::Protocol { url, reason })
}

/// Checks and converts the revision JSON; the error is a reason for [`Error::Protocol`].
pub(crate) fn parse(
    text: &str,
    repo: &RepoId,
    revision: &str,
) -> std::result::Result<RepoListing, String> {
    let json: RevisionJson =
        serde_json::from_str(text).map_err(|e| format!("not the revision JSON: {e}"))?;
    let commit = json.sha.ok_or("no `sha` (commit) in the revision JSON")?;
    if !is_commit(&commit) {
        return Err(format!("`sha` is `{commit}`, not a commit hash"));
    }
    let siblings = json.siblings.ok_or("no `siblings` in the revision JSON")?;
    let mut files = Vec::with_capacity(siblings.len());
    for s in siblings {
        let name = &s.rfilename;
        if !is_safe_relative(name) {
            return Err(format!("unsafe file name `{name}` in the listing"));
        }
        let blob_id = s
            .blob_id
            .filter(|b| is_hex(b, 40))
            .ok_or_else(|| format!("`{name}` has no git blob id (is this endpoint a Hub?)"))?;
        let (size, sha256) = match s.lfs {
            Some(l) if is_hex(&l.sha256, 64) => (l.size, Some(l.sha256)),
            Some(l) => return Err(format!("`{name}`: bad lfs.sha256 `{}`", l.sha256)),
            None => (s.size.ok_or_else(|| format!("`{name}` has no size"))?, None),
        };
        files.push(RepoFile {
            path: name.clone(),
            size,
            blob_id,
            sha256,
        });
    }
    Ok(RepoListing {
        repo: repo.clone(),
        revision: revision.to_string(),
        commit,
        files,
    })
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn parses_the_hub_revision_json() {
        let text = format!(
            r#"{{"_id":"x","id":"org/m","sha":"{SHA}","siblings":[
            {{"rfilename":"config.json","size":12,"blobId":"{SHA}"}},
            {{"rfilename":"model.safetensors","size":1000,"blobId":"{SHA}",
              "lfs":{{"sha256":"{}","size":1000,"pointerSize":134}}}}]}}"#,
            "ab".repeat(32)
        );
        let repo = RepoId::parse("org/m").expect("repo");
        let l = parse(&text, &repo, "main").expect("parse");
        assert_eq!(l.commit, SHA);
        assert_eq!(l.files.len(), 2);
        assert_eq!(l.files[0].etag(), SHA);
        assert_eq!(l.files[1].etag(), "ab".repeat(32));
        assert_eq!(l.total_size(), 1012);
    }

    #[test]
    fn refuses_listings_that_could_escape_the_cache() {
        let text = format!(
            r#"{{"sha":"{SHA}","siblings":[{{"rfilename":"../../x","size":1,"blobId":"{SHA}"}}]}}"#
        );
        let repo = RepoId::parse("org/m").expect("repo");
        let err = parse(&text, &repo, "main").expect_err("unsafe name");
        assert!(err.contains("unsafe file name"), "{err}");
    }
}
