//! What a starting node is loading right now (a stage, and the layer within it): sent to
//! systemd as `STATUS=` lines while the node starts, and counted so that the start timeout
//! is pushed out only while loading moves (see `server::notify_while_loading`).
//!
//! One process-wide value rather than a handle threaded through every loader: the loads it
//! describes run on the loader thread and on each device's own thread, from the model,
//! device and CUDA layers alike, and a node loads one thing at a time (devices load one
//! after another). Outside start-up (a device started again, a rebalance) reports are
//! only counted.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Layer lines within one stage are sent at most this often; every stage line is sent.
pub const LAYER_LINES_EVERY: Duration = Duration::from_millis(100);

struct Now {
    stage: String,
    /// The layer reached and how many there are; `None` until the stage reports one.
    layer: Option<(usize, usize)>,
    sent: Option<Instant>,
}

struct Progress {
    now: Mutex<Now>,
    /// Bumped on every change, so a reader sees movement without comparing text.
    changes: AtomicU64,
    /// Whether changes are sent to systemd (while the node starts).
    reporting: AtomicBool,
}

static LOADING: Progress = Progress {
    now: Mutex::new(Now {
        stage: String::new(),
        layer: None,
        sent: None,
    }),
    changes: AtomicU64::new(0),
    reporting: AtomicBool::new(false),
};

/// Sends `STATUS=loading: ...` to systemd from now on (`true`), or stops (`false`).
pub fn report_to_systemd(on: bool) {
    LOADING.reporting.store(on, Ordering::Release);
}

/// Starts a stage of loading, e.g. "device 1 (cpu): loading 224 experts".
pub fn stage(text: impl Into<String>) {
    let mut now = LOADING.now.lock().unwrap_or_else(|e| e.into_inner());
    now.stage = text.into();
    now.layer = None;
    LOADING.changes.fetch_add(1, Ordering::Release);
    send(&mut now, true);
}

/// The current stage has reached `layer` (0-based) of `layers`. Repeats are free.
pub fn layer(layer: usize, layers: usize) {
    let mut now = LOADING.now.lock().unwrap_or_else(|e| e.into_inner());
    if now.layer != Some((layer, layers)) {
        let first = now.layer.is_none();
        now.layer = Some((layer, layers));
        LOADING.changes.fetch_add(1, Ordering::Release);
        send(&mut now, first);
    }
}

/// How many changes there have been, and the line that says where loading is now.
pub fn snapshot() -> (u64, String) {
    let now = LOADING.now.lock().unwrap_or_else(|e| e.into_inner());
    (LOADING.changes.load(Ordering::Acquire), line(&now))
}

fn line(now: &Now) -> String {
    match now.layer {
        Some((layer, layers)) => format!("{}, layer {}/{layers}", now.stage, layer + 1),
        None => now.stage.clone(),
    }
}

fn send(now: &mut Now, always: bool) {
    if !LOADING.reporting.load(Ordering::Acquire) {
        return;
    }
    if !always && now.sent.is_some_and(|at| at.elapsed() < LAYER_LINES_EVERY) {
        return;
    }
    now.sent = Some(Instant::now());
    let status = format!("loading: {}", line(now));
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&status)]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_with_a_layer_reads_as_one_line_and_counts_changes() {
        stage("device 0 (cpu): loading 8 experts");
        let (first, line) = snapshot();
        assert_eq!(line, "device 0 (cpu): loading 8 experts");
        layer(2, 61);
        layer(2, 61);
        let (second, line) = snapshot();
        assert_eq!(line, "device 0 (cpu): loading 8 experts, layer 3/61");
        assert_eq!(second, first + 1, "a repeated layer is not a change");
        stage("dense weights");
        assert_eq!(snapshot().1, "dense weights");
    }
}
