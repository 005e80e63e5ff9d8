//! When the membership thread speaks without being spoken to: announcing to the seeds
//! while alone (and saying so), and announcing to known members that fell silent. Plain
//! state fed with time, tested without sockets.

use std::time::{Duration, Instant};

/// Bad traffic from one source is logged at most once per this period, and being alone
/// once per this period after the first warning.
pub const WARN_PERIOD: Duration = Duration::from_secs(60);
/// How long a node may stay alone before it says its seeds do not answer.
const ALONE_WARNING_AFTER_PERIODS: u32 = 5;

/// When to announce to the seeds: while alone, every probe period at first, backing off to
/// every 8 periods; and when to say that nobody answers.
#[derive(Debug)]
pub struct SeedSchedule {
    base: Duration,
    interval: Duration,
    next: Instant,
    alone_since: Instant,
    warned_at: Option<Instant>,
}

/// What the seed schedule asks for now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SeedActions {
    /// Announce to every seed.
    pub announce: bool,
    /// Warn that this node is alone (seeds silent or not sharing our secret).
    pub warn_alone: bool,
}

impl SeedSchedule {
    /// Announce at once, then every `probe_period` while alone.
    pub fn new(probe_period: Duration, now: Instant) -> SeedSchedule {
        SeedSchedule {
            base: probe_period,
            interval: probe_period,
            next: now,
            alone_since: now,
            warned_at: None,
        }
    }

    /// What to do now, given whether this node knows any other active member.
    pub fn poll(&mut self, alone: bool, now: Instant) -> SeedActions {
        if !alone {
            self.interval = self.base;
            self.next = now + self.base;
            self.alone_since = now;
            self.warned_at = None;
            return SeedActions::default();
        }
        let mut actions = SeedActions::default();
        if now >= self.next {
            actions.announce = true;
            self.next = now + self.interval;
            self.interval = (self.interval * 2).min(self.base * 8);
        }
        let alone_for = now.saturating_duration_since(self.alone_since);
        let warn_due = match self.warned_at {
            None => alone_for >= self.base * ALONE_WARNING_AFTER_PERIODS,
            Some(at) => now.saturating_duration_since(at) >= WARN_PERIOD,
        };
        if warn_due {
            self.warned_at = Some(now);
            actions.warn_alone = true;
        }
        actions
    }
}

/// When a node that knows active members but hears from none of them announces to them
/// again. Foca sends nothing of its own accord while disconnected, and it disconnects
/// itself on every identity change (each new placement version): if the datagrams that
/// would reconnect it are lost, two members that each believe the other active can stay
/// silent for good. An announce is accepted whatever identity its receiver has now.
#[derive(Debug)]
pub struct SilenceWatch {
    limit: Duration,
    heard_at: Instant,
    next: Instant,
}

impl SilenceWatch {
    pub fn new(limit: Duration, now: Instant) -> SilenceWatch {
        SilenceWatch {
            limit,
            heard_at: now,
            next: now + limit,
        }
    }

    /// A datagram from a member was accepted.
    pub fn heard(&mut self, now: Instant) {
        self.heard_at = now;
    }

    /// Whether to announce to the known members now: they are there, nothing has been heard
    /// for the limit, and the last such announce is a limit ago.
    pub fn poll(&mut self, knows_members: bool, now: Instant) -> bool {
        if !knows_members || now.saturating_duration_since(self.heard_at) < self.limit {
            return false;
        }
        if now < self.next {
            return false;
        }
        self.next = now + self.limit;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_announced_to_at_once_then_with_backoff_while_alone() {
        let period = Duration::from_secs(1);
        let start = Instant::now();
        let mut schedule = SeedSchedule::new(period, start);
        assert!(schedule.poll(true, start).announce);
        assert!(!schedule.poll(true, start + period / 2).announce);
        assert!(schedule.poll(true, start + period).announce);
        // Next wait is 2 periods, then 4, then capped at 8.
        assert!(!schedule.poll(true, start + period * 2).announce);
        assert!(schedule.poll(true, start + period * 3).announce);
        let mut at = start + period * 3;
        let mut gaps = Vec::new();
        let mut last = at;
        while gaps.len() < 4 {
            at += Duration::from_millis(100);
            if schedule.poll(true, at).announce {
                gaps.push((at - last).as_millis());
                last = at;
            }
        }
        assert_eq!(gaps, vec![4000, 8000, 8000, 8000]);
    }

    #[test]
    fn silence_from_known_members_is_answered_by_an_announce_once_per_limit() {
        let limit = Duration::from_secs(8);
        let start = Instant::now();
        let mut watch = SilenceWatch::new(limit, start);
        assert!(!watch.poll(true, start + limit / 2));
        // Alone: the seed schedule's business, not this one's.
        assert!(!watch.poll(false, start + limit * 2));
        assert!(watch.poll(true, start + limit * 2));
        assert!(!watch.poll(true, start + limit * 2 + limit / 2));
        assert!(watch.poll(true, start + limit * 3));
        // Heard from someone: quiet again until a limit of silence.
        watch.heard(start + limit * 3);
        assert!(!watch.poll(true, start + limit * 4 - Duration::from_millis(1)));
        assert!(watch.poll(true, start + limit * 4));
    }

    #[test]
    fn being_alone_is_reported_after_five_periods_then_once_a_minute() {
        let period = Duration::from_millis(100);
        let start = Instant::now();
        let mut schedule = SeedSchedule::new(period, start);
        assert!(!schedule.poll(true, start + period * 4).warn_alone);
        assert!(schedule.poll(true, start + period * 5).warn_alone);
        assert!(!schedule.poll(true, start + period * 6).warn_alone);
        assert!(
            schedule
                .poll(true, start + period * 5 + WARN_PERIOD)
                .warn_alone
        );
        // Company resets everything: no announce, no warning.
        let later = start + WARN_PERIOD * 2;
        assert_eq!(schedule.poll(false, later), SeedActions::default());
        assert!(!schedule.poll(true, later + period).warn_alone);
    }
}
