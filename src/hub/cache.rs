//! One model's folder in the Hugging Face cache, as `huggingface_hub` lays it out:
//!
//! ```text
//! models--org--name/
//!   refs/main                      the commit `main` pointed at when last asked
//!   blobs/<etag>                   each file's content once, named by its checksum
//!   snapshots/<commit>/<file>      a link to ../../blobs/<etag>
//!   .no_exist/<commit>/<file>      the hub said the file is not in that commit
//!   .moe-node-headers/<commit>/<file>  a shard's safetensors header, fetched before the
//!                                  shard (moe-node's own; see `Weights::AsRead`)
//! ```
//!
//! Written the same way here, so that `hf`, vLLM and moe-node share one copy; a blob is
//! downloaded under the lock `huggingface_hub` takes for it
//! (`.locks/models--org--name/<etag>.lock` beside the model folders, an advisory `flock`),
//! so two of them fetching one model at once download each file once.

use std::path::{Path, PathBuf};

use super::{HubError, io, is_commit};

/// The cache folder of one model.
#[derive(Debug, Clone)]
pub struct RepoCache {
    root: PathBuf,
}

impl RepoCache {
    /// The folder of `repo` (`org/name`) under the cache root `cache`.
    pub fn new(cache: &Path, repo: &str) -> RepoCache {
        RepoCache {
            root: cache.join(format!("models--{}", repo.replace('/', "--"))),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The commit `revision` stands for in the cache: itself when it is a commit with a
    /// snapshot, else what `refs/<revision>` holds.
    pub fn commit_of(&self, revision: &str) -> Option<String> {
        if is_commit(revision) && self.snapshot(revision).is_dir() {
            return Some(revision.to_string());
        }
        let text = std::fs::read_to_string(self.root.join("refs").join(revision)).ok()?;
        let commit = text.trim();
        is_commit(commit).then(|| commit.to_string())
    }

    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.root.join("snapshots").join(commit)
    }

    pub fn blob(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(etag)
    }

    /// Where a blob is written while it downloads (kept across a cut, to resume).
    pub fn partial(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(format!("{etag}.incomplete"))
    }

    /// Waits for, and holds until the returned file is dropped, the lock on blob `etag`.
    pub fn lock(&self, etag: &str) -> Result<std::fs::File, HubError> {
        let folder = self.root.file_name().unwrap_or_default();
        let locks = self.root.with_file_name(".locks").join(folder);
        std::fs::create_dir_all(&locks).map_err(io(&locks))?;
        let path = locks.join(format!("{etag}.lock"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io(&path))?;
        file.lock().map_err(io(&path))?;
        Ok(file)
    }

    /// Records that `revision` points at `commit` (nothing to record for a commit).
    pub fn set_ref(&self, revision: &str, commit: &str) -> Result<(), HubError> {
        if revision == commit {
            return Ok(());
        }
        let path = self.root.join("refs").join(revision);
        if std::fs::read_to_string(&path).is_ok_and(|t| t.trim() == commit) {
            return Ok(());
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        std::fs::write(&path, commit).map_err(io(&path))
    }

    /// Where the header of shard `file` of `commit` is kept (a node that reads the shards as
    /// it needs them opens the model from every shard's header): beside `.no_exist`, in a
    /// folder of moe-node's own that `huggingface_hub` leaves alone.
    pub fn header(&self, commit: &str, file: &str) -> PathBuf {
        self.root.join(".moe-node-headers").join(commit).join(file)
    }

    /// Whether the hub said `file` is not in `commit`.
    pub fn known_absent(&self, commit: &str, file: &str) -> bool {
        self.root.join(".no_exist").join(commit).join(file).exists()
    }

    /// Records that `file` is not in `commit`.
    pub fn mark_absent(&self, commit: &str, file: &str) -> Result<(), HubError> {
        let path = self.root.join(".no_exist").join(commit).join(file);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        std::fs::write(&path, b"").map_err(io(&path))
    }

    /// Puts blob `etag` at `file` in `commit`'s snapshot (a relative link, as
    /// `huggingface_hub` makes; a copy where links cannot be made).
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> Result<PathBuf, HubError> {
        let target = self.snapshot(commit).join(file);
        let dir = target.parent().unwrap_or(self.root.as_path());
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        // `file` may sit in folders of its own: one `..` for each, then two more.
        let depth = file.split('/').count() + 1;
        let relative: PathBuf = std::iter::repeat_n("..", depth)
            .collect::<PathBuf>()
            .join("blobs")
            .join(etag);
        if std::fs::symlink_metadata(&target).is_ok() {
            std::fs::remove_file(&target).map_err(io(&target))?;
        }
        #[cfg(unix)]
        let linked = std::os::unix::fs::symlink(&relative, &target);
        #[cfg(not(unix))]
        let linked: std::io::Result<()> = Err(std::io::ErrorKind::Unsupported.into());
        if linked.is_err() {
            std::fs::copy(self.blob(etag), &target).map_err(io(&target))?;
        }
        Ok(target)
    }
}
