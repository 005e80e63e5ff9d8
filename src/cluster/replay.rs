//! Replay refusal for gossip: every sealed datagram starts with its sender's stamp, the
//! sender's start time and a counter, and a receiver accepts each (sender, stamp) once.
//!
//! Why: the keyring proves a datagram came from a holder of the cluster secret, not that it
//! is new. Foca's probe numbers are 8 bits, so a few minutes of a member's captured acks
//! answer every probe: replayed after the member died, they kept it alive for as long as
//! the replay ran. With the stamp inside the seal, a replayed datagram is refused before
//! foca reads it, and the dead member is declared dead on time.
//!
//! Layout of the plaintext: `epoch (u64 BE) || counter (u64 BE) || foca packet`. The epoch
//! is the sender's start in microseconds since the Unix epoch (the clock that orders a
//! member's identity generations, [`super::NodeIdentity::starting_now`]); the counter
//! grows by one for every datagram the process sends, to any member. A receiver keeps, per
//! sender (its gossip address, from the authenticated foca header), the newest epoch and a
//! window of the counters seen under it:
//!
//! - a newer epoch is a restarted sender: accepted at once, and its old epoch's datagrams
//!   are refused from then on;
//! - an older epoch is a replay of a previous run: refused;
//! - under the same epoch, a counter above the highest seen is accepted, one within
//!   [`WINDOW`] below it is accepted once (UDP may reorder), anything older is refused.
//!
//! The receiver that restarts starts with no state, and takes the first stamp it sees of
//! each sender; replays addressed to its previous identity are still dropped by foca (it
//! reads only what is addressed to its own identity, which a restart renews).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

/// Bytes of the stamp at the head of every sealed plaintext.
pub const STAMP_LEN: usize = 16;
/// How far below the highest counter seen a datagram may arrive and still be taken once.
pub const WINDOW: u64 = 128;
/// Senders remembered at most; past it the one heard from least recently is forgotten.
pub const MAX_SENDERS: usize = 4096;

/// Who sent a datagram and which one it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    /// The sender's start, microseconds since the Unix epoch.
    pub epoch: u64,
    /// The datagram's number in the sender's run.
    pub counter: u64,
}

impl Stamp {
    /// The stamp at the head of `plain` and the packet after it; `None` when too short.
    pub fn split(plain: &[u8]) -> Option<(Stamp, &[u8])> {
        let (head, packet) = plain.split_at_checked(STAMP_LEN)?;
        let (epoch, counter) = head.split_at(8);
        Some((
            Stamp {
                epoch: u64::from_be_bytes(epoch.try_into().ok()?),
                counter: u64::from_be_bytes(counter.try_into().ok()?),
            },
            packet,
        ))
    }
}

/// The sending side: this process's epoch and its next counter.
#[derive(Debug)]
pub struct Stamper {
    epoch: u64,
    next: u64,
}

impl Stamper {
    /// A stamper for a process starting now.
    pub fn starting_now() -> Stamper {
        let micros = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|since| u64::try_from(since.as_micros()).unwrap_or(u64::MAX))
            .unwrap_or(1);
        Stamper::with_epoch(micros)
    }

    /// A stamper with a given epoch (tests, and the fuzz target).
    pub fn with_epoch(epoch: u64) -> Stamper {
        Stamper { epoch, next: 0 }
    }

    /// `packet` with the next stamp in front: the plaintext to seal.
    pub fn stamp(&mut self, packet: &[u8]) -> Vec<u8> {
        let mut plain = Vec::with_capacity(STAMP_LEN + packet.len());
        plain.extend_from_slice(&self.epoch.to_be_bytes());
        plain.extend_from_slice(&self.next.to_be_bytes());
        plain.extend_from_slice(packet);
        self.next = self.next.saturating_add(1);
        plain
    }
}

/// What a receiver knows of one sender.
#[derive(Clone, Copy, Debug)]
struct Seen {
    epoch: u64,
    highest: u64,
    /// Bit `i`: counter `highest - i` was taken.
    window: u128,
    /// When it was last taken, in [`ReplayGuard::check`] calls (for forgetting).
    touched: u64,
}

/// The receiving side: which stamps of each sender were taken.
#[derive(Debug)]
pub struct ReplayGuard {
    senders: HashMap<SocketAddr, Seen>,
    capacity: usize,
    clock: u64,
}

impl Default for ReplayGuard {
    fn default() -> Self {
        ReplayGuard::new(MAX_SENDERS)
    }
}

impl ReplayGuard {
    /// A guard remembering at most `capacity` senders.
    pub fn new(capacity: usize) -> ReplayGuard {
        ReplayGuard {
            senders: HashMap::new(),
            capacity: capacity.max(1),
            clock: 0,
        }
    }

    /// Whether the datagram stamped `stamp` from `sender` is new; if so it is recorded, so
    /// the same stamp is refused next time.
    pub fn check(&mut self, sender: SocketAddr, stamp: Stamp) -> bool {
        self.clock += 1;
        let touched = self.clock;
        let fresh = Seen {
            epoch: stamp.epoch,
            highest: stamp.counter,
            window: 1,
            touched,
        };
        let Some(seen) = self.senders.get_mut(&sender) else {
            self.make_room();
            self.senders.insert(sender, fresh);
            return true;
        };
        if stamp.epoch != seen.epoch {
            if stamp.epoch < seen.epoch {
                return false;
            }
            *seen = fresh;
            return true;
        }
        if stamp.counter > seen.highest {
            let shift = stamp.counter - seen.highest;
            seen.window = if shift >= WINDOW {
                1
            } else {
                (seen.window << shift) | 1
            };
            seen.highest = stamp.counter;
            seen.touched = touched;
            return true;
        }
        let behind = seen.highest - stamp.counter;
        if behind >= WINDOW || seen.window & (1u128 << behind) != 0 {
            return false;
        }
        seen.window |= 1u128 << behind;
        seen.touched = touched;
        true
    }

    /// Forgets the sender taken from least recently when the guard is full.
    fn make_room(&mut self) {
        if self.senders.len() < self.capacity {
            return;
        }
        let oldest = self
            .senders
            .iter()
            .min_by_key(|(_, seen)| seen.touched)
            .map(|(sender, _)| *sender);
        if let Some(oldest) = oldest {
            self.senders.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sender(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    fn stamp(epoch: u64, counter: u64) -> Stamp {
        Stamp { epoch, counter }
    }

    #[test]
    fn a_stamp_travels_at_the_head_of_the_plaintext() {
        let mut stamper = Stamper::with_epoch(0x0102_0304_0506_0708);
        let first = stamper.stamp(b"packet");
        let second = stamper.stamp(b"");
        assert_eq!(first.len(), STAMP_LEN + 6);
        let (read, packet) = Stamp::split(&first).expect("stamped");
        assert_eq!(read, stamp(0x0102_0304_0506_0708, 0));
        assert_eq!(packet, b"packet");
        assert_eq!(
            Stamp::split(&second).map(|(s, p)| (s.counter, p.len())),
            Some((1, 0))
        );
        assert_eq!(Stamp::split(&first[..STAMP_LEN - 1]), None);
    }

    #[test]
    fn each_stamp_is_taken_once_and_reordering_within_the_window_is_fine() {
        let mut guard = ReplayGuard::default();
        let a = sender(1);
        assert!(guard.check(a, stamp(5, 10)));
        assert!(!guard.check(a, stamp(5, 10)), "the same datagram again");
        assert!(guard.check(a, stamp(5, 14)));
        assert!(guard.check(a, stamp(5, 12)), "late, but new");
        assert!(!guard.check(a, stamp(5, 12)));
        assert!(!guard.check(a, stamp(5, 14)));
        assert!(guard.check(a, stamp(5, 14 + WINDOW)));
        assert!(!guard.check(a, stamp(5, 14)), "fell out of the window");
        assert!(guard.check(a, stamp(5, 15)), "still inside it");
        // Another sender's counters are its own.
        assert!(guard.check(sender(2), stamp(5, 10)));
    }

    #[test]
    fn a_restarted_sender_is_taken_at_once_and_its_previous_run_is_refused() {
        let mut guard = ReplayGuard::default();
        let a = sender(1);
        for counter in 0..300 {
            assert!(guard.check(a, stamp(100, counter)));
        }
        // Restarted: a later epoch, counting from 0 again.
        assert!(guard.check(a, stamp(200, 0)));
        assert!(guard.check(a, stamp(200, 1)));
        // Everything the previous run sent, replayed, is refused.
        for counter in 0..400 {
            assert!(!guard.check(a, stamp(100, counter)), "old run {counter}");
        }
        assert!(guard.check(a, stamp(200, 2)));
    }

    #[test]
    fn a_full_guard_forgets_the_sender_heard_from_least_recently() {
        let mut guard = ReplayGuard::new(2);
        assert!(guard.check(sender(1), stamp(1, 0)));
        assert!(guard.check(sender(2), stamp(1, 0)));
        assert!(guard.check(sender(1), stamp(1, 1)));
        assert!(guard.check(sender(3), stamp(1, 0)));
        assert_eq!(guard.senders.len(), 2);
        assert!(!guard.check(sender(1), stamp(1, 1)), "still remembered");
        assert!(guard.senders.contains_key(&sender(3)));
        assert!(!guard.senders.contains_key(&sender(2)));
    }
}
