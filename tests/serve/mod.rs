//! A `moe-node serve` process for the integration tests: started with its log captured, its
//! HTTP address read from the log once it listens, killed when dropped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const BIN: &str = env!("CARGO_BIN_EXE_moe-node");

pub struct Process {
    pub child: Child,
    /// `http://ADDR` of its API.
    pub base: String,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Process {
    /// `moe-node serve --listen 127.0.0.1:0 ARGS...`, waiting until it listens.
    pub fn serve(args: &[&std::ffi::OsStr]) -> Process {
        let mut child = Command::new(BIN)
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let _ = addr_tx.send(rest.trim().to_string());
                }
                lines.lock().unwrap().push(line);
            }
        });
        let addr = addr_rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("server did not start: {:?}", log.lock().unwrap()));
        Process {
            child,
            base: format!("http://{addr}"),
            log,
        }
    }

    pub fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    pub fn log_contains(&self, needle: &str) -> bool {
        self.log.lock().unwrap().iter().any(|l| l.contains(needle))
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        // A paused process would not die of SIGKILL before it is waited on otherwise.
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
