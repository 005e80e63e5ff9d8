//! What the dispatcher knows of each place it sends work to: whether it can be reached, how
//! fast it answers, how much it is working on. Plain state fed with events and the time, so
//! the decisions it drives are tested without a runtime.

use std::time::{Duration, Instant};

/// Whether work may go to a replica; ordered from best to worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reach {
    Up,
    /// Gossip suspects it, or it missed a deadline lately: used only when nothing better is.
    Suspect,
    /// Gossip declared it dead, or its link or device failed: never used.
    Down,
}

/// One replica's health as the replica chooser sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaHealth {
    pub reach: Reach,
    /// Measured answer time of recent requests (an exponential average).
    pub latency_micros: f64,
    /// Rows sent to it and not yet answered.
    pub outstanding_rows: usize,
    /// On this node (no network between).
    pub local: bool,
}

/// Rows of load a local replica may carry beyond a remote one and still be chosen.
pub const LOCAL_SLACK_ROWS: usize = 256;

/// Whether a replica answering in `latency` micros is about as fast as the fastest one
/// (within twice its latency plus a quarter millisecond of jitter): only those share work.
pub fn comparable(latency: f64, fastest: f64) -> bool {
    latency <= 2.0 * fastest + 250.0
}

impl ReplicaHealth {
    /// The load the choice compares: rows outstanding plus `step_rows` given to it in this
    /// step, less the slack a local replica gets.
    pub fn load(&self, step_rows: usize) -> usize {
        let rows = self.outstanding_rows + step_rows;
        if self.local {
            rows.saturating_sub(LOCAL_SLACK_ROWS)
        } else {
            rows
        }
    }
}

/// How long a target that missed a deadline or failed is avoided before it is tried again
/// (gossip's verdict, when it comes, overrides this).
#[derive(Debug, Clone, Copy)]
pub struct Penalties {
    pub slow_for: Duration,
    pub down_for: Duration,
}

/// The dispatcher's record of one target (a local device or a remote node).
#[derive(Debug, Clone)]
pub struct TargetHealth {
    latency_micros: f64,
    samples: u64,
    /// When the last answer came: a measurement older than [`STALE_AFTER`] is forgotten,
    /// so a target that was slow once (and then got no work) is tried again.
    last_answer: Option<Instant>,
    outstanding_rows: usize,
    /// What gossip says (always `Up` for local devices).
    gossip: Reach,
    /// Failed (link reset, device gone): down until then.
    down_until: Option<Instant>,
    /// Missed a deadline: suspect until then.
    slow_until: Option<Instant>,
    /// Down for good (a local device whose actor stopped).
    gone: bool,
    /// Rows sent to it since this node started (hedges and failovers included).
    rows_sent: u64,
}

/// Latency assumed before the first answer: a target is not avoided for being unknown.
const FIRST_LATENCY_MICROS: f64 = 500.0;
/// Weight of a new sample in the average.
const EWMA_WEIGHT: f64 = 0.2;
/// How long a latency measurement counts without a new one.
pub const STALE_AFTER: Duration = Duration::from_secs(5);

impl Default for TargetHealth {
    fn default() -> Self {
        TargetHealth {
            latency_micros: FIRST_LATENCY_MICROS,
            samples: 0,
            last_answer: None,
            outstanding_rows: 0,
            gossip: Reach::Up,
            down_until: None,
            slow_until: None,
            gone: false,
            rows_sent: 0,
        }
    }
}

impl TargetHealth {
    pub fn view(&self, now: Instant) -> ReplicaHealth {
        let reach = if self.gone
            || self.gossip == Reach::Down
            || self.down_until.is_some_and(|t| now < t)
        {
            Reach::Down
        } else if self.gossip == Reach::Suspect || self.slow_until.is_some_and(|t| now < t) {
            Reach::Suspect
        } else {
            Reach::Up
        };
        let stale = self
            .last_answer
            .is_none_or(|t| now.saturating_duration_since(t) > STALE_AFTER);
        ReplicaHealth {
            reach,
            local: false,
            latency_micros: if stale {
                self.latency_micros.min(FIRST_LATENCY_MICROS)
            } else {
                self.latency_micros
            },
            outstanding_rows: self.outstanding_rows,
        }
    }

    /// Average answer time so far.
    pub fn latency(&self) -> Duration {
        Duration::from_secs_f64(self.latency_micros / 1e6)
    }

    pub fn sent(&mut self, rows: usize) {
        self.outstanding_rows += rows;
        self.rows_sent += rows as u64;
    }

    /// Rows sent to it so far, answered or not.
    pub fn rows_sent(&self) -> u64 {
        self.rows_sent
    }

    /// An answer (or a failure) for `rows` sent earlier; `took` is its answer time when it
    /// answered.
    pub fn answered(&mut self, rows: usize, took: Option<Duration>) {
        self.outstanding_rows = self.outstanding_rows.saturating_sub(rows);
        if let Some(took) = took {
            self.last_answer = Some(Instant::now());
            let micros = took.as_secs_f64() * 1e6;
            self.latency_micros = if self.samples == 0 {
                micros
            } else {
                (1.0 - EWMA_WEIGHT) * self.latency_micros + EWMA_WEIGHT * micros
            };
            self.samples += 1;
        }
    }

    /// It missed a deadline: avoid it while other replicas live.
    pub fn missed_deadline(&mut self, now: Instant, penalties: Penalties) {
        self.slow_until = Some(now + penalties.slow_for);
    }

    /// Its link or device failed: send it nothing for a while.
    pub fn failed(&mut self, now: Instant, penalties: Penalties) {
        self.down_until = Some(now + penalties.down_for);
    }

    /// A local device whose actor is gone: down for good.
    pub fn gone(&mut self) {
        self.gone = true;
    }

    pub fn is_gone(&self) -> bool {
        self.gone
    }

    /// Gossip's verdict. A member seen alive again (a restart, a healed partition) is tried
    /// at once.
    pub fn set_gossip(&mut self, reach: Reach) {
        if reach == Reach::Up && self.gossip != Reach::Up {
            self.renew();
        }
        self.gossip = reach;
    }

    /// Back (a restart, a healed partition): what was measured before is history.
    pub fn renew(&mut self) {
        *self = TargetHealth {
            gone: self.gone,
            gossip: self.gossip,
            outstanding_rows: self.outstanding_rows,
            rows_sent: self.rows_sent,
            ..TargetHealth::default()
        };
    }
}

/// How long to wait for a target before hedging its work to another replica: a multiple of
/// its measured latency, never below `floor`.
pub fn hedge_after(latency: Duration, floor: Duration) -> Duration {
    (latency * 4).max(floor)
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Penalties = Penalties {
        slow_for: Duration::from_secs(2),
        down_for: Duration::from_secs(1),
    };

    #[test]
    fn failure_and_deadline_penalties_expire() {
        let t0 = Instant::now();
        let mut h = TargetHealth::default();
        assert_eq!(h.view(t0).reach, Reach::Up);
        h.missed_deadline(t0, P);
        assert_eq!(h.view(t0).reach, Reach::Suspect);
        assert_eq!(h.view(t0 + Duration::from_secs(3)).reach, Reach::Up);
        h.failed(t0, P);
        assert_eq!(h.view(t0).reach, Reach::Down);
        assert_eq!(
            h.view(t0 + Duration::from_millis(1500)).reach,
            Reach::Suspect
        );
        // Gossip's dead outlasts any penalty; alive again clears them.
        h.set_gossip(Reach::Down);
        assert_eq!(h.view(t0 + Duration::from_secs(60)).reach, Reach::Down);
        h.failed(t0, P);
        h.set_gossip(Reach::Up);
        assert_eq!(h.view(t0).reach, Reach::Up);
        h.gone();
        h.set_gossip(Reach::Up);
        assert_eq!(h.view(t0).reach, Reach::Down, "a gone device never returns");
    }

    /// A node killed and restarted faster than gossip's suspicion timeout is never seen
    /// down by gossip: its new generation alone clears what its old process failed, while
    /// what gossip says still counts.
    #[test]
    fn a_renewed_node_is_tried_at_once() {
        let t0 = Instant::now();
        let mut h = TargetHealth::default();
        h.failed(t0, P);
        h.missed_deadline(t0, P);
        h.set_gossip(Reach::Up);
        assert_eq!(h.view(t0).reach, Reach::Down, "alive all along: still down");
        h.renew();
        assert_eq!(h.view(t0).reach, Reach::Up);
        h.set_gossip(Reach::Suspect);
        h.renew();
        assert_eq!(
            h.view(t0).reach,
            Reach::Suspect,
            "a renewal keeps gossip's word"
        );
    }

    #[test]
    fn a_slow_measurement_is_forgotten_so_the_target_is_tried_again() {
        let mut h = TargetHealth::default();
        h.sent(1);
        h.answered(1, Some(Duration::from_secs(1)));
        let now = Instant::now();
        assert!(h.view(now).latency_micros > 900_000.0);
        assert_eq!(
            h.view(now + STALE_AFTER + Duration::from_secs(1))
                .latency_micros,
            FIRST_LATENCY_MICROS
        );
        // Seen alive again after gossip doubted it: measured afresh.
        h.set_gossip(Reach::Suspect);
        h.set_gossip(Reach::Up);
        assert_eq!(h.view(now).latency_micros, FIRST_LATENCY_MICROS);
        assert_eq!(
            h.rows_sent(),
            1,
            "what was sent is not forgotten with the measurement"
        );
    }

    #[test]
    fn latency_average_and_outstanding_work() {
        let mut h = TargetHealth::default();
        h.sent(10);
        h.answered(10, Some(Duration::from_millis(2)));
        assert!((h.view(Instant::now()).latency_micros - 2000.0).abs() < 1e-6);
        h.sent(5);
        h.answered(5, Some(Duration::from_millis(12)));
        assert!((h.latency().as_secs_f64() * 1e6 - 4000.0).abs() < 1e-3);
        h.sent(64);
        assert_eq!(h.view(Instant::now()).outstanding_rows, 64);
        assert_eq!(h.rows_sent(), 79, "every row sent counts, answered or not");
        assert_eq!(h.view(Instant::now()).load(10), 74);
        let local = ReplicaHealth {
            local: true,
            ..h.view(Instant::now())
        };
        assert_eq!(local.load(10), 0);
        assert_eq!(local.load(LOCAL_SLACK_ROWS), 64);
        h.answered(100, None);
        assert_eq!(h.view(Instant::now()).outstanding_rows, 0);
        assert_eq!(
            hedge_after(Duration::from_micros(100), Duration::from_millis(50)),
            Duration::from_millis(50)
        );
        assert_eq!(
            hedge_after(Duration::from_millis(30), Duration::from_millis(50)),
            Duration::from_millis(120)
        );
    }
}
