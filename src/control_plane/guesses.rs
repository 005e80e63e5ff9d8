//! Token guesses per source address: each address may fail `per_minute` times in a burst,
//! and earns one more try every `60 / per_minute` seconds; with none left, every request it
//! makes that needs a token is answered 429 before its token is looked at, so guessing
//! from one address runs at `per_minute` tries a minute at most. Nodes behind the same
//! address share its allowance (a node that is refused backs off and retries).
//!
//! Bounded: at most `capacity` addresses are tracked; past it, addresses whose allowance
//! is whole again are forgotten, and while still full, new addresses share one allowance.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
struct Allowance {
    tries: f64,
    at: Instant,
}

/// Failed token tries per source address.
#[derive(Debug)]
pub struct GuessLimiter {
    per_minute: f64,
    capacity: usize,
    sources: HashMap<Option<IpAddr>, Allowance>,
}

impl GuessLimiter {
    /// `per_minute` failures a minute (and in a burst) per address, `capacity` addresses.
    pub fn new(per_minute: u32, capacity: usize) -> GuessLimiter {
        GuessLimiter {
            per_minute: f64::from(per_minute.max(1)),
            capacity: capacity.max(1),
            sources: HashMap::new(),
        }
    }

    /// `Ok` when `source` may try a token now, else how long until it may.
    pub fn check(&mut self, source: Option<IpAddr>, now: Instant) -> Result<(), Duration> {
        let key = if self.sources.contains_key(&source) {
            source
        } else if self.sources.len() >= self.capacity {
            None
        } else {
            return Ok(());
        };
        let Some(allowance) = self.refilled(key, now) else {
            return Ok(());
        };
        if allowance.tries >= 1.0 {
            return Ok(());
        }
        let seconds = (1.0 - allowance.tries) * 60.0 / self.per_minute;
        Err(Duration::from_secs_f64(seconds.max(0.0)).max(Duration::from_secs(1)))
    }

    /// Records a failed try of `source`.
    pub fn failed(&mut self, source: Option<IpAddr>, now: Instant) {
        let key = self.key(source, now);
        let full = Allowance {
            tries: self.per_minute,
            at: now,
        };
        let mut allowance = self.refilled(key, now).unwrap_or(full);
        allowance.tries = (allowance.tries - 1.0).max(0.0);
        self.sources.insert(key, allowance);
    }

    /// The allowance tracked under `key` brought up to `now`.
    fn refilled(&mut self, key: Option<IpAddr>, now: Instant) -> Option<Allowance> {
        let per_minute = self.per_minute;
        let allowance = self.sources.get_mut(&key)?;
        let earned = now.saturating_duration_since(allowance.at).as_secs_f64() * per_minute / 60.0;
        allowance.tries = (allowance.tries + earned).min(per_minute);
        allowance.at = now;
        Some(*allowance)
    }

    /// Where `source`'s failures are counted: its own entry, or the shared one when the
    /// table is full of addresses still short of tries.
    fn key(&mut self, source: Option<IpAddr>, now: Instant) -> Option<IpAddr> {
        if self.sources.contains_key(&source) || self.sources.len() < self.capacity {
            return source;
        }
        let per_minute = self.per_minute;
        self.sources.retain(|_, allowance| {
            let earned =
                now.saturating_duration_since(allowance.at).as_secs_f64() * per_minute / 60.0;
            allowance.tries + earned < per_minute
        });
        if self.sources.len() < self.capacity {
            source
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn a_source_fails_its_burst_then_one_try_per_interval() {
        let mut limiter = GuessLimiter::new(6, 16);
        let start = Instant::now();
        for _ in 0..6 {
            assert_eq!(limiter.check(ip(1), start), Ok(()));
            limiter.failed(ip(1), start);
        }
        let wait = limiter.check(ip(1), start).expect_err("out of tries");
        assert_eq!(wait, Duration::from_secs(10));
        // Another address is not held back.
        assert_eq!(limiter.check(ip(2), start), Ok(()));
        // One try earned every 10 s.
        let later = start + Duration::from_secs(10);
        assert_eq!(limiter.check(ip(1), later), Ok(()));
        limiter.failed(ip(1), later);
        assert!(limiter.check(ip(1), later).is_err());
    }

    #[test]
    fn a_full_table_forgets_whole_allowances_and_shares_one_for_the_rest() {
        let mut limiter = GuessLimiter::new(2, 2);
        let start = Instant::now();
        limiter.failed(ip(1), start);
        limiter.failed(ip(2), start);
        // Full of addresses short of tries: a third shares the overflow allowance.
        limiter.failed(ip(3), start);
        limiter.failed(ip(4), start);
        assert!(limiter.sources.len() <= 3);
        limiter.failed(ip(5), start);
        assert!(
            limiter.check(ip(6), start).is_err(),
            "the shared allowance is spent"
        );
        // A minute later every allowance is whole: room again.
        let later = start + Duration::from_secs(60);
        limiter.failed(ip(7), later);
        assert!(limiter.sources.contains_key(&ip(7)));
    }
}
