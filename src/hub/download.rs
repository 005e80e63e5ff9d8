//! Fetching a model's files from the hub (or a mirror) into the cache, as `huggingface_hub`
//! does: a HEAD of `{endpoint}/{repo}/resolve/{revision}/{file}` (redirects on the hub's own
//! host followed, the one to its storage not) gives the commit (`X-Repo-Commit`), the
//! checksum (`X-Linked-Etag` for large files: their SHA-256; `ETag` for the others: their
//! git blob id) and the size; a GET downloads into `blobs/<etag>.incomplete`, resumed with
//! `Range` after a cut connection (within a run, and by the next run), and the blob is
//! kept only once its checksum matches.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use reqwest::blocking::{Client, RequestBuilder, Response};
use reqwest::header::{CONTENT_LENGTH, ETAG, LOCATION, RANGE};
use sha1::Sha1;
use sha2::{Digest, Sha256};

use super::{
    CONFIG_FILE, HubEnv, HubError, ModelName, OPTIONAL_FILES, RepoCache, SINGLE_WEIGHTS,
    WEIGHTS_INDEX, Weights, io, is_commit, shards_of,
};

/// Shards downloaded at once: one connection rarely fills a link to the hub's storage
/// (`huggingface_hub`'s snapshot download uses 8).
const PARALLEL_SHARDS: usize = 4;
/// Tries of one file's download (each resuming where the last stopped).
const TRIES: u32 = 5;
/// The longest the hub may stay silent on a connection, or take to accept one.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// How often a download's progress is reported.
const REPORT_EVERY: Duration = Duration::from_secs(2);

/// Downloads what `cache` lacks of `name` at the commit its revision stands for now, and
/// returns that snapshot.
pub(super) fn complete(
    name: &ModelName,
    env: &HubEnv,
    cache: &RepoCache,
    weights: Weights,
) -> Result<std::path::PathBuf, HubError> {
    let hub = Hub::new(name, env)?;
    // The config first: its answer says which commit the revision is now.
    let config = hub
        .head(&name.revision, CONFIG_FILE)?
        .ok_or_else(|| hub.not_found(&name.revision, CONFIG_FILE))?;
    let commit = match &config.commit {
        Some(commit) if is_commit(commit) => commit.clone(),
        _ if is_commit(&name.revision) => name.revision.clone(),
        _ => {
            return Err(HubError::NoCommit {
                url: hub.url(&name.revision, CONFIG_FILE),
                repo: name.repo.clone(),
            });
        }
    };
    cache.set_ref(&name.revision, &commit)?;
    let files = Files {
        hub: &hub,
        cache,
        commit: &commit,
    };
    files.fetch(CONFIG_FILE, Some(config), true)?;
    for file in OPTIONAL_FILES {
        files.fetch(file, None, false)?;
    }
    if weights != Weights::None {
        if files.fetch(WEIGHTS_INDEX, None, false)? {
            let index = cache.snapshot(&commit).join(WEIGHTS_INDEX);
            let shards = shards_of(&index, name)?;
            if weights == Weights::All {
                in_parallel(&shards, |shard| files.fetch(shard, None, true).map(drop))?;
            } else {
                // A shard already here is opened from itself: no header to fetch.
                let snapshot = cache.snapshot(&commit);
                let absent: Vec<String> = shards
                    .into_iter()
                    .filter(|s| !snapshot.join(s).is_file())
                    .collect();
                in_parallel(&absent, |shard| files.header(shard).map(drop))?;
            }
        } else {
            // One file cannot be split: it is downloaded whole.
            files.fetch(SINGLE_WEIGHTS, None, true)?;
        }
    }
    Ok(cache.snapshot(&commit))
}

/// `each` of `items`, [`PARALLEL_SHARDS`] at a time; the first failure stops the rest from
/// starting.
fn in_parallel(
    items: &[String],
    each: impl Fn(&str) -> Result<(), HubError> + Sync,
) -> Result<(), HubError> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..PARALLEL_SHARDS.min(items.len()) {
            scope.spawn(|| {
                loop {
                    let stop = failed.lock().map_or(true, |f| f.is_some());
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(item) = items.get(i).filter(|_| !stop) else {
                        return;
                    };
                    if let Err(e) = each(item) {
                        if let Ok(mut first) = failed.lock() {
                            first.get_or_insert(e);
                        }
                        return;
                    }
                }
            });
        }
    });
    match failed.into_inner() {
        Ok(Some(e)) => Err(e),
        _ => Ok(()),
    }
}

/// What the hub says of one file.
#[derive(Debug, Clone)]
pub(super) struct FileMeta {
    commit: Option<String>,
    /// The checksum it is stored under: a safe file name, or `None`.
    etag: Option<String>,
    size: Option<u64>,
}

/// The two clients (one that stops at redirects, for metadata), and whom they ask.
pub(super) struct Hub<'a> {
    pub(super) name: &'a ModelName,
    endpoint: &'a str,
    token: Option<&'a str>,
    metadata: Client,
    pub(super) files: Client,
}

impl<'a> Hub<'a> {
    pub(super) fn new(name: &'a ModelName, env: &'a HubEnv) -> Result<Hub<'a>, HubError> {
        let build = |redirects: reqwest::redirect::Policy| {
            Client::builder()
                .timeout(READ_TIMEOUT)
                .connect_timeout(CONNECT_TIMEOUT)
                .user_agent(concat!("moe-node/", env!("CARGO_PKG_VERSION")))
                .redirect(redirects)
                .tls_backend_rustls()
                .build()
                .map_err(|source| HubError::Unreachable {
                    name: name.clone(),
                    url: env.endpoint.clone(),
                    source,
                })
        };
        Ok(Hub {
            name,
            endpoint: &env.endpoint,
            token: env.token.as_deref(),
            metadata: build(reqwest::redirect::Policy::none())?,
            // reqwest drops the token when a redirect leaves the hub's host.
            files: build(reqwest::redirect::Policy::limited(10))?,
        })
    }

    pub(super) fn url(&self, revision: &str, file: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint,
            self.name.repo,
            escape(revision, false),
            escape(file, true)
        )
    }

    pub(super) fn authorized(&self, request: RequestBuilder) -> RequestBuilder {
        match self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    pub(super) fn unreachable(&self, url: &str) -> impl FnOnce(reqwest::Error) -> HubError + '_ {
        let url = url.to_string();
        move |source| HubError::Unreachable {
            name: self.name.clone(),
            url,
            source,
        }
    }

    pub(super) fn not_found(&self, revision: &str, file: &str) -> HubError {
        HubError::NotFound {
            name: self.name.clone(),
            file: file.to_string(),
            url: self.url(revision, file),
        }
    }

    /// An answer that is neither the file nor a redirect, as an error.
    pub(super) fn refused(&self, url: &str, status: StatusCode) -> HubError {
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            HubError::Refused {
                name: self.name.clone(),
                url: url.to_string(),
                status: status.as_u16(),
            }
        } else {
            HubError::Http {
                url: url.to_string(),
                status: status.as_u16(),
            }
        }
    }

    /// What the hub says of `file` at `revision`; `None` when it is not there (404).
    fn head(&self, revision: &str, file: &str) -> Result<Option<FileMeta>, HubError> {
        let mut url = self.url(revision, file);
        let mut last = StatusCode::OK;
        for _ in 0..5 {
            let response = self
                .authorized(self.metadata.head(&url))
                .header("Accept-Encoding", "identity")
                .send()
                .map_err(self.unreachable(&url))?;
            let status = response.status();
            last = status;
            if status == StatusCode::NOT_FOUND {
                return Ok(None);
            }
            if status.is_redirection() {
                // A renamed repository redirects on the hub's own host: follow it. A redirect
                // elsewhere is the file's storage, and this answer already has its metadata.
                let next = header(&response, LOCATION.as_str())
                    .and_then(|l| reqwest::Url::parse(&url).ok()?.join(&l).ok());
                let same_host = |next: &reqwest::Url| {
                    reqwest::Url::parse(&url).is_ok_and(|now| now.host() == next.host())
                };
                if let Some(next) = next.filter(same_host)
                    && header(&response, "x-linked-etag").is_none()
                {
                    url = next.to_string();
                    continue;
                }
            } else if !status.is_success() {
                return Err(self.refused(&url, status));
            }
            let etag =
                header(&response, "x-linked-etag").or_else(|| header(&response, ETAG.as_str()));
            let size = header(&response, "x-linked-size")
                .or_else(|| header(&response, CONTENT_LENGTH.as_str()))
                .and_then(|s| s.parse().ok());
            return Ok(Some(FileMeta {
                commit: header(&response, "x-repo-commit"),
                etag: etag.as_deref().and_then(blob_name),
                size,
            }));
        }
        // Redirected on the hub's host five times over.
        Err(HubError::Http {
            url,
            status: last.as_u16(),
        })
    }
}

fn header(response: &Response, name: &str) -> Option<String> {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// An ETag as a blob's file name: without `W/` and quotes, and only when it is plain
/// letters and digits (it names a file, and it comes from the network).
fn blob_name(etag: &str) -> Option<String> {
    let etag = etag.trim().trim_start_matches("W/").trim_matches('"');
    (!etag.is_empty()
        && etag.len() <= 128
        && etag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
    .then(|| etag.to_string())
}

/// Percent-escapes what a URL path part may not hold (`/` kept in file paths only).
fn escape(text: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        let plain = byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte);
        if plain || (keep_slash && byte == b'/') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The checksum a blob is checked against, from its ETag.
enum Check {
    /// A large file's SHA-256.
    Sha256(Sha256),
    /// A small file's git blob id: SHA-1 of `blob <size>\0` and the content.
    GitSha1(Sha1),
    /// No checksum given (a mirror that sends none): the size alone, if given.
    None,
}

impl Check {
    fn for_etag(etag: Option<&str>, size: Option<u64>) -> Check {
        let hex = |len: usize| {
            etag.is_some_and(|e| e.len() == len && e.chars().all(|c| c.is_ascii_hexdigit()))
        };
        match size {
            _ if hex(64) => Check::Sha256(Sha256::new()),
            Some(size) if hex(40) => {
                let mut sha1 = Sha1::new();
                sha1.update(format!("blob {size}\0").as_bytes());
                Check::GitSha1(sha1)
            }
            _ => Check::None,
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Check::Sha256(h) => h.update(bytes),
            Check::GitSha1(h) => h.update(bytes),
            Check::None => {}
        }
    }

    fn finish(self) -> Option<String> {
        let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
        match self {
            Check::Sha256(h) => Some(hex(&h.finalize())),
            Check::GitSha1(h) => Some(hex(&h.finalize())),
            Check::None => None,
        }
    }
}

/// One commit's files into the cache.
pub(super) struct Files<'a> {
    pub(super) hub: &'a Hub<'a>,
    pub(super) cache: &'a RepoCache,
    pub(super) commit: &'a str,
}

impl Files<'_> {
    /// Makes `file` present in the snapshot, downloading it if it is not; `Ok(false)` when
    /// the commit has no such file and it is not `required`.
    pub(super) fn fetch(
        &self,
        file: &str,
        meta: Option<FileMeta>,
        required: bool,
    ) -> Result<bool, HubError> {
        if self.cache.snapshot(self.commit).join(file).is_file() {
            return Ok(true);
        }
        if !required && self.cache.known_absent(self.commit, file) {
            return Ok(false);
        }
        let meta = match meta {
            Some(meta) => meta,
            None => match self.hub.head(self.commit, file)? {
                Some(meta) => meta,
                None if required => return Err(self.hub.not_found(self.commit, file)),
                None => {
                    self.cache.mark_absent(self.commit, file)?;
                    return Ok(false);
                }
            },
        };
        // One download of a blob at a time, across processes; whoever waited finds it done.
        let _lock = meta
            .etag
            .as_deref()
            .map(|etag| self.cache.lock(etag))
            .transpose()?;
        // Content already here (under another commit, or just downloaded by someone else)
        // is not downloaded again.
        if let Some(etag) = &meta.etag
            && self.cache.blob(etag).is_file()
        {
            self.cache.link(self.commit, file, etag)?;
            return Ok(true);
        }
        let etag = self.download(file, &meta)?;
        self.cache.link(self.commit, file, &etag)?;
        Ok(true)
    }

    /// Downloads `file` into its blob, resuming a partial one; returns the blob's name.
    fn download(&self, file: &str, meta: &FileMeta) -> Result<String, HubError> {
        let url = self.hub.url(self.commit, file);
        // Without an ETag the blob is named after the SHA-256 computed here.
        let partial_name = meta
            .etag
            .clone()
            .unwrap_or_else(|| format!("{}-{}", self.commit, escape(file, false)));
        let partial = self.cache.partial(&partial_name);
        if let Some(dir) = partial.parent() {
            std::fs::create_dir_all(dir).map_err(io(dir))?;
        }
        let started = Instant::now();
        tracing::info!(model = %self.hub.name, file, bytes = meta.size, "downloading");
        crate::progress::stage(format!("downloading {} {file}", self.hub.name.repo));
        let mut tries = 0;
        let check = loop {
            tries += 1;
            match self.attempt(&url, file, meta, &partial) {
                Ok(check) => break check,
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Cut(error)) if tries >= TRIES => {
                    return Err(HubError::Download {
                        name: self.hub.name.clone(),
                        file: file.to_string(),
                        tries,
                        source: error,
                    });
                }
                Err(Attempt::Cut(error)) => {
                    tracing::warn!(model = %self.hub.name, file, %error, tries, "download cut: resuming");
                    std::thread::sleep(Duration::from_millis(200 << tries.min(5)));
                }
            }
        };
        let actual_size = std::fs::metadata(&partial).map_err(io(&partial))?.len();
        if let Some(expected) = meta.size
            && expected != actual_size
        {
            let _ = std::fs::remove_file(&partial);
            return Err(HubError::Size {
                name: self.hub.name.clone(),
                file: file.to_string(),
                expected,
                actual: actual_size,
            });
        }
        let digest = check.finish();
        let blob = match (&meta.etag, digest) {
            (Some(etag), Some(actual)) if !etag.eq_ignore_ascii_case(&actual) => {
                let _ = std::fs::remove_file(&partial);
                return Err(HubError::Checksum {
                    name: self.hub.name.clone(),
                    file: file.to_string(),
                    expected: etag.clone(),
                    actual,
                });
            }
            (Some(etag), _) => etag.clone(),
            (None, _) => sha256_of(&partial)?,
        };
        let target = self.cache.blob(&blob);
        std::fs::rename(&partial, &target).map_err(io(&target))?;
        tracing::info!(
            model = %self.hub.name, file, bytes = actual_size,
            seconds = started.elapsed().as_secs_f32(), "downloaded"
        );
        Ok(blob)
    }

    /// One GET of `file` into `partial`, from where it stops; the checksum over the whole.
    fn attempt(
        &self,
        url: &str,
        file: &str,
        meta: &FileMeta,
        partial: &Path,
    ) -> Result<Check, Attempt> {
        let fatal = |e: HubError| Attempt::Fatal(e);
        let mut out = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(partial)
            .map_err(|e| fatal(io(partial)(e)))?;
        let mut have = out.metadata().map_err(|e| fatal(io(partial)(e)))?.len();
        if meta.size.is_some_and(|size| have > size) {
            have = 0;
        }
        let mut request = self.hub.authorized(self.hub.files.get(url));
        if have > 0 {
            request = request.header(RANGE, format!("bytes={have}-"));
        }
        let mut check = Check::for_etag(meta.etag.as_deref(), meta.size);
        // A partial blob that is whole already (the last try was cut after its last byte)
        // needs no request.
        let mut response = if meta.size.is_some_and(|size| have == size) {
            None
        } else {
            let sent = request.send();
            Some(sent.map_err(|e| Attempt::Cut(std::io::Error::other(e)))?)
        };
        if let Some(r) = &response {
            match r.status() {
                StatusCode::PARTIAL_CONTENT if have > 0 => {}
                // The whole file: whatever was here goes.
                StatusCode::OK => have = 0,
                StatusCode::RANGE_NOT_SATISFIABLE => {
                    out.set_len(0).map_err(|e| fatal(io(partial)(e)))?;
                    return Err(Attempt::Cut(std::io::Error::other("range not satisfiable")));
                }
                StatusCode::NOT_FOUND => return Err(fatal(self.hub.not_found(self.commit, file))),
                status => return Err(fatal(self.hub.refused(url, status))),
            }
        }
        // The part already here goes into the checksum first.
        out.set_len(have).map_err(|e| fatal(io(partial)(e)))?;
        out.seek(SeekFrom::Start(0))
            .map_err(|e| fatal(io(partial)(e)))?;
        let mut buffer = vec![0u8; 1 << 20];
        let mut left = have;
        while left > 0 {
            let n = out
                .read(&mut buffer[..left.min(1 << 20) as usize])
                .map_err(|e| fatal(io(partial)(e)))?;
            if n == 0 {
                break;
            }
            check.update(&buffer[..n]);
            left -= n as u64;
        }
        out.seek(SeekFrom::Start(have))
            .map_err(|e| fatal(io(partial)(e)))?;
        let Some(response) = response.as_mut() else {
            return Ok(check);
        };
        let mut done = have;
        let mut reported = Instant::now();
        loop {
            let n = match response.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => return Err(Attempt::Cut(e)),
            };
            out.write_all(&buffer[..n])
                .map_err(|e| fatal(io(partial)(e)))?;
            check.update(&buffer[..n]);
            done += n as u64;
            if reported.elapsed() >= REPORT_EVERY {
                reported = Instant::now();
                let of = meta
                    .size
                    .map_or(String::new(), |s| format!(" of {}", s >> 20));
                crate::progress::stage(format!(
                    "downloading {} {file}: {} MiB{of}",
                    self.hub.name.repo,
                    done >> 20
                ));
            }
        }
        out.flush().map_err(|e| fatal(io(partial)(e)))?;
        // A connection closed early reads as an end: the size tells.
        if meta.size.is_some_and(|size| done < size) {
            return Err(Attempt::Cut(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("the connection closed at {done} bytes"),
            )));
        }
        Ok(check)
    }
}

/// Why one GET did not finish.
enum Attempt {
    /// The connection failed or was cut: try again from where it stopped.
    Cut(std::io::Error),
    /// Trying again will not help.
    Fatal(HubError),
}

fn sha256_of(path: &Path) -> Result<String, HubError> {
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(io(path))?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
