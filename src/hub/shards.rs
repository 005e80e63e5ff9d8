//! Shards as a node reads them ([`super::Weights::AsRead`]): before the model loads, every
//! shard's safetensors header is fetched with two `Range` requests (its 8-byte length, then
//! the length and the JSON) and kept in the cache; the checkpoint opens from the headers,
//! and a shard's data is downloaded (whole, checksum checked, into the cache's blobs) the
//! first time a tensor in it is read. A node of a cluster thus fetches its dense weights and
//! the experts placed on it, and the shards of experts placed on it later when they are.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use reqwest::StatusCode;
use reqwest::header::RANGE;

use super::download::{Files, Hub};
use super::{HubEnv, HubError, ModelName, RepoCache, io};
use crate::model::{RemoteShards, ShardSource};

/// The longest header a safetensors file may have (the `safetensors` crate's bound).
const MAX_HEADER: u64 = 100_000_000;

impl Files<'_> {
    /// Shard `file`'s header (its first bytes: length and JSON), from the cache or fetched
    /// and kept there.
    pub(super) fn header(&self, file: &str) -> Result<Vec<u8>, HubError> {
        let kept = self.cache.header(self.commit, file);
        if let Ok(bytes) = std::fs::read(&kept) {
            return Ok(bytes);
        }
        let length = self.first_bytes(file, 8)?;
        let length = u64::from_le_bytes(length.try_into().unwrap_or_default());
        if length > MAX_HEADER {
            return Err(HubError::BadIndex {
                name: self.hub.name.clone(),
                file: file.to_string(),
                why: format!(
                    "its header announces {length} bytes, more than a safetensors file may hold"
                ),
            });
        }
        let header = self.first_bytes(file, 8 + length)?;
        if let Some(dir) = kept.parent() {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        // Written aside and renamed: a header half written is never read as whole.
        let aside = kept.with_extension(format!("incomplete-{}", std::process::id()));
        std::fs::write(&aside, &header).map_err(io(&aside))?;
        std::fs::rename(&aside, &kept).map_err(io(&kept))?;
        Ok(header)
    }

    /// The first `count` bytes of `file`, asked with `Range` (a server that ignores it sends
    /// the whole file, of which as much is read).
    fn first_bytes(&self, file: &str, count: u64) -> Result<Vec<u8>, HubError> {
        let url = self.hub.url(self.commit, file);
        let response = self
            .hub
            .authorized(self.hub.files.get(&url))
            .header(RANGE, format!("bytes=0-{}", count - 1))
            .send()
            .map_err(self.hub.unreachable(&url))?;
        match response.status() {
            StatusCode::OK | StatusCode::PARTIAL_CONTENT => {}
            StatusCode::NOT_FOUND => return Err(self.hub.not_found(self.commit, file)),
            status => return Err(self.hub.refused(&url, status)),
        }
        let mut bytes = Vec::new();
        response
            .take(count)
            .read_to_end(&mut bytes)
            .map_err(|source| HubError::Download {
                name: self.hub.name.clone(),
                file: file.to_string(),
                tries: 1,
                source,
            })?;
        if bytes.len() as u64 != count {
            return Err(HubError::Download {
                name: self.hub.name.clone(),
                file: file.to_string(),
                tries: 1,
                source: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("{} of the header's {count} bytes came", bytes.len()),
                ),
            });
        }
        Ok(bytes)
    }
}

/// The shards of one snapshot of a model by name, fetched as they are read.
pub(super) struct HubShards {
    name: ModelName,
    env: HubEnv,
    cache: RepoCache,
    commit: String,
}

impl HubShards {
    /// The source of the shards the snapshot folder `snapshot` lacks.
    pub(super) fn source(name: &ModelName, env: &HubEnv, snapshot: &Path) -> RemoteShards {
        let commit = snapshot
            .file_name()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        RemoteShards(Arc::new(HubShards {
            name: name.clone(),
            env: env.clone(),
            cache: RepoCache::new(&env.cache, &name.repo),
            commit,
        }))
    }

    fn offline(&self, what: &str) -> String {
        format!(
            "HF_HUB_OFFLINE is set and the cache lacks {what} of {}: download it first \
             (`hf download {}`), or unset HF_HUB_OFFLINE",
            self.name, self.name.repo
        )
    }

    /// `each` over this snapshot's files, on a thread of its own: shards are read on the
    /// device actors' threads, which run an async runtime that a blocking HTTP client may
    /// not be made or used on.
    fn files<T: Send>(
        &self,
        each: impl FnOnce(&Files<'_>) -> Result<T, HubError> + Send,
    ) -> Result<T, String> {
        std::thread::scope(|scope| {
            let fetching = scope.spawn(|| {
                let hub = Hub::new(&self.name, &self.env)?;
                let files = Files {
                    hub: &hub,
                    cache: &self.cache,
                    commit: &self.commit,
                };
                each(&files)
            });
            match fetching.join() {
                Ok(done) => done.map_err(|e| e.to_string()),
                Err(_) => Err("the download thread panicked".into()),
            }
        })
    }
}

impl ShardSource for HubShards {
    fn header(&self, file: &str) -> Result<Vec<u8>, String> {
        let kept = self.cache.header(&self.commit, file);
        match std::fs::read(&kept) {
            Ok(bytes) => Ok(bytes),
            Err(_) if self.env.offline => Err(self.offline(&format!("the header of {file}"))),
            Err(_) => self.files(|files| files.header(file)),
        }
    }

    fn fetch(&self, file: &str) -> Result<(), String> {
        if self.cache.snapshot(&self.commit).join(file).is_file() {
            return Ok(());
        }
        if self.env.offline {
            return Err(self.offline(file));
        }
        tracing::info!(model = %self.name, file, "fetching a shard this node reads");
        self.files(|files| files.fetch(file, None, true).map(drop))
    }
}
