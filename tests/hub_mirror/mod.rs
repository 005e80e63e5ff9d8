//! A Hugging Face mirror in the test: the hub's resolve endpoint over files in a folder,
//! answering as the hub does (`X-Repo-Commit`; small files with their git blob id as
//! `ETag`; `.safetensors` files as large files, a HEAD answering 302 with `X-Linked-Etag`
//! (their SHA-256) and `X-Linked-Size`, a GET redirected to storage that honours `Range`).
//! It records every request, and can cut a download short or serve a file corrupted.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha1::Sha1;
use sha2::{Digest, Sha256};

pub const COMMIT: &str = "5d0f2e1b7c9a4b3e8f6a1d2c3b4a59687f0e1d2c";

/// What the mirror is told to do wrong.
#[derive(Default)]
pub struct Faults {
    /// Downloads of a file whose name ends with `.0` cut after `.1` bytes, this many times.
    pub cut: Option<(String, u64, usize)>,
    /// A file served with its first byte changed (its checksum left as it was).
    pub corrupt: Option<String>,
    /// A pause before each file's bytes, so that downloads at once overlap.
    pub slow: Option<std::time::Duration>,
}

pub struct Mirror {
    pub base: String,
    /// `"HEAD /org/name/resolve/main/config.json"`, `"GET ... range=bytes=10-"`.
    pub requests: Arc<Mutex<Vec<String>>>,
    pub faults: Arc<Mutex<Faults>>,
    /// Files being sent now, and the most there were at once.
    pub sending: Arc<Mutex<(usize, usize)>>,
}

/// Files of one model: name → (bytes, checksum the hub would give).
type Repo = HashMap<String, PathBuf>;

impl Mirror {
    /// Serves `repos` (`org/name` → folder of its files) at commit [`COMMIT`], for `main`
    /// and the commit itself.
    pub fn start(repos: &[(&str, &Path)]) -> Mirror {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let repos: HashMap<String, Repo> = repos
            .iter()
            .map(|(name, dir)| {
                let files = std::fs::read_dir(dir)
                    .unwrap()
                    .map(|e| e.unwrap())
                    .filter(|e| e.file_type().unwrap().is_file())
                    .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
                    .collect();
                (name.to_string(), files)
            })
            .collect();
        let mirror = Mirror {
            base: base.clone(),
            requests: Arc::default(),
            faults: Arc::default(),
            sending: Arc::default(),
        };
        let shared = Arc::new(Shared {
            repos,
            checksums: Mutex::default(),
            requests: mirror.requests.clone(),
            faults: mirror.faults.clone(),
            sending: mirror.sending.clone(),
            base,
        });
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let shared = shared.clone();
                std::thread::spawn(move || shared.answer(stream));
            }
        });
        mirror
    }

    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }

    pub fn clear(&self) {
        self.requests.lock().unwrap().clear();
    }

    /// The most files sent at once.
    pub fn most_at_once(&self) -> usize {
        self.sending.lock().unwrap().1
    }

    /// The GETs among the requests.
    pub fn downloads(&self) -> Vec<String> {
        self.requests()
            .into_iter()
            .filter(|r| r.starts_with("GET"))
            .collect()
    }
}

struct Shared {
    repos: HashMap<String, Repo>,
    /// Path → (checksum, size), computed once.
    checksums: Mutex<HashMap<PathBuf, (String, u64)>>,
    requests: Arc<Mutex<Vec<String>>>,
    faults: Arc<Mutex<Faults>>,
    sending: Arc<Mutex<(usize, usize)>>,
    base: String,
}

fn large(file: &str) -> bool {
    file.ends_with(".safetensors")
}

impl Shared {
    fn checksum(&self, path: &Path, file: &str) -> (String, u64) {
        let mut known = self.checksums.lock().unwrap();
        known
            .entry(path.to_path_buf())
            .or_insert_with(|| {
                let bytes = std::fs::read(path).unwrap();
                let hex = |d: &[u8]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
                let sum = if large(file) {
                    hex(&Sha256::digest(&bytes))
                } else {
                    let mut sha1 = Sha1::new();
                    sha1.update(format!("blob {}\0", bytes.len()).as_bytes());
                    sha1.update(&bytes);
                    hex(&sha1.finalize())
                };
                (sum, bytes.len() as u64)
            })
            .clone()
    }

    fn answer(&self, stream: TcpStream) {
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        if reader.read_line(&mut line).is_err() {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, target) = (
            parts.next().unwrap_or("").to_string(),
            parts.next().unwrap_or("").to_string(),
        );
        let mut range = None;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("range")
            {
                range = Some(value.trim().to_string());
            }
        }
        let record = match &range {
            Some(r) => format!("{method} {target} range={r}"),
            None => format!("{method} {target}"),
        };
        self.requests.lock().unwrap().push(record);
        let _ = self.respond(stream, &method, &target, range.as_deref());
    }

    fn respond(
        &self,
        mut out: TcpStream,
        method: &str,
        target: &str,
        range: Option<&str>,
    ) -> std::io::Result<()> {
        let not_found = "HTTP/1.1 404 Not Found\r\nX-Error-Code: EntryNotFound\r\n\
                         Content-Length: 0\r\nConnection: close\r\n\r\n";
        // Storage: /storage/org/name/file, bytes with Range.
        if let Some(rest) = target.strip_prefix("/storage/") {
            let mut parts = rest.splitn(3, '/');
            let (org, name, file) = (parts.next(), parts.next(), parts.next());
            let (Some(org), Some(name), Some(file)) = (org, name, file) else {
                return out.write_all(not_found.as_bytes());
            };
            let Some(path) = self
                .repos
                .get(&format!("{org}/{name}"))
                .and_then(|r| r.get(file))
            else {
                return out.write_all(not_found.as_bytes());
            };
            return self.send_file(out, path, file, range);
        }
        // The hub: /org/name/resolve/revision/file.
        let parts: Vec<&str> = target.trim_start_matches('/').splitn(5, '/').collect();
        let [org, name, "resolve", revision, file] = parts[..] else {
            return out.write_all(not_found.as_bytes());
        };
        let Some(repo) = self.repos.get(&format!("{org}/{name}")) else {
            let refused = "HTTP/1.1 401 Unauthorized\r\nX-Error-Code: RepoNotFound\r\n\
                           Content-Length: 0\r\nConnection: close\r\n\r\n";
            return out.write_all(refused.as_bytes());
        };
        let Some(path) = repo
            .get(file)
            .filter(|_| revision == "main" || revision == COMMIT)
        else {
            return out.write_all(not_found.as_bytes());
        };
        let (sum, size) = self.checksum(path, file);
        if large(file) {
            // Storage on another host name, as the hub's is: clients stop at this answer.
            let storage = self.base.replace("127.0.0.1", "localhost");
            let head = format!(
                "HTTP/1.1 302 Found\r\nLocation: {storage}/storage/{org}/{name}/{file}\r\n\
                 X-Repo-Commit: {COMMIT}\r\nX-Linked-Etag: \"{sum}\"\r\nX-Linked-Size: {size}\r\n\
                 ETag: \"{sum}\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            return out.write_all(head.as_bytes());
        }
        if method == "HEAD" {
            let head = format!(
                "HTTP/1.1 200 OK\r\nX-Repo-Commit: {COMMIT}\r\nETag: \"{sum}\"\r\n\
                 Content-Length: {size}\r\nConnection: close\r\n\r\n"
            );
            return out.write_all(head.as_bytes());
        }
        self.send_file(out, path, file, range)
    }

    /// The file's bytes from where `range` says, cut or corrupted as the faults say.
    fn send_file(
        &self,
        mut out: TcpStream,
        path: &Path,
        file: &str,
        range: Option<&str>,
    ) -> std::io::Result<()> {
        let size = std::fs::metadata(path)?.len();
        // `bytes=FROM-` or `bytes=FROM-TO` (TO inclusive).
        let (from, to) = range
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.split_once('-'))
            .map_or((0, None), |(from, to)| {
                (from.parse::<u64>().unwrap_or(0), to.parse::<u64>().ok())
            });
        let end = to.map_or(size, |to| (to + 1).min(size));
        let status = if from > 0 || end < size {
            format!(
                "206 Partial Content\r\nContent-Range: bytes {from}-{}/{size}",
                end - 1
            )
        } else {
            "200 OK".to_string()
        };
        let head = format!(
            "HTTP/1.1 {status}\r\nX-Repo-Commit: {COMMIT}\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            end - from
        );
        out.write_all(head.as_bytes())?;
        let mut source = std::fs::File::open(path)?;
        source.seek(SeekFrom::Start(from))?;
        let (cut, corrupt, slow) = {
            let mut faults = self.faults.lock().unwrap();
            let cut = match &mut faults.cut {
                Some((name, after, times)) if name == file && *times > 0 => {
                    *times -= 1;
                    Some(*after)
                }
                _ => None,
            };
            (cut, faults.corrupt.as_deref() == Some(file), faults.slow)
        };
        {
            let mut sending = self.sending.lock().unwrap();
            sending.0 += 1;
            sending.1 = sending.1.max(sending.0);
        }
        if let Some(pause) = slow {
            std::thread::sleep(pause);
        }
        let mut body = Vec::new();
        source
            .take(cut.unwrap_or(u64::MAX).min(end - from))
            .read_to_end(&mut body)?;
        if corrupt && from == 0 && !body.is_empty() {
            body[0] ^= 0xff;
        }
        let sent = out.write_all(&body).and_then(|()| out.flush());
        self.sending.lock().unwrap().0 -= 1;
        // Dropping the stream closes it: a cut download ends short of Content-Length.
        sent
    }
}
