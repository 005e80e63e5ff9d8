//! What one endpoint's stream halves (see [`super::stream`]) and its worker share: the
//! messages received and not yet read, the send buffers kept for reuse, and how the endpoint
//! ended. The worker fills it under its own lock; the stream takes from it.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::task::Waker;

use crate::transport::wire::Dtype;

/// What one endpoint's stream halves and its worker share.
#[derive(Default)]
pub struct EpShared {
    state: Mutex<EpState>,
}

#[derive(Default)]
pub struct EpState {
    /// Received, not yet read.
    pub received: Received,
    /// Send buffers whose sends completed, for the writer's next writes (no fresh
    /// allocation, and no first-touch page faults, per write).
    pub spare_send: Vec<Vec<u8>>,
    /// The worker stopped fetching rendezvous messages (too much unread); the reader asks it
    /// to resume.
    pub recv_paused: bool,
    /// Bytes handed to UCX whose sends have not completed.
    pub send_pending: usize,
    /// Why the endpoint is unusable: the peer failed or closed, or a send or receive failed.
    pub failure: Option<Failure>,
    pub read_waker: Option<Waker>,
    pub write_waker: Option<Waker>,
}

/// Send buffers an endpoint keeps for reuse at most, and the largest kept.
pub(super) const SPARE_SEND: usize = 4;
pub(super) const SPARE_SEND_BYTES: usize = 8 << 20;
/// Receive buffers are kept for reuse when their capacity lies in this range (smaller ones
/// cost little to allocate; larger ones would pin memory for a rare message), a few at most.
pub(super) const KEEP_BUFFER_MIN: usize = 64 << 10;
const KEEP_BUFFER_MAX: usize = 16 << 20;
pub(super) const SPARE_BUFFERS: usize = 8;

pub(super) fn worth_keeping(capacity: usize) -> bool {
    (KEEP_BUFFER_MIN..=KEEP_BUFFER_MAX).contains(&capacity)
}

/// The smallest of `buffers` that holds `capacity` bytes, taken out.
pub(super) fn take_best_fit(buffers: &mut Vec<Vec<u8>>, capacity: usize) -> Option<Vec<u8>> {
    let (i, _) = buffers
        .iter()
        .enumerate()
        .filter(|(_, b)| b.capacity() >= capacity)
        .min_by_key(|(_, b)| b.capacity())?;
    Some(buffers.swap_remove(i))
}

/// One received message as the reader takes it.
#[derive(Debug, PartialEq)]
pub enum Payload {
    /// Bytes of the link's stream, exactly as received.
    Bytes(Vec<u8>),
    /// The rows of the frame whose header and groups came just before as bytes, already
    /// decoded to f32 as they were received (see [`super::rows`]), and their wire dtype.
    Rows(Vec<f32>, Dtype),
}

impl Payload {
    /// Bytes the payload holds in memory.
    fn len(&self) -> usize {
        match self {
            Payload::Bytes(bytes) => bytes.len(),
            Payload::Rows(rows, _) => std::mem::size_of_val(rows.as_slice()),
        }
    }
}

/// Messages received and not yet taken by the reader, as UCX delivered them, so a large
/// message reaches the reader without another copy.
#[derive(Default)]
pub struct Received {
    /// Each payload holds what one message carried (bytes as received, rows decoded).
    messages: VecDeque<Payload>,
    unread: usize,
    /// Buffers the reader emptied, for the worker's next receives.
    spare: Vec<Vec<u8>>,
}

impl Received {
    /// Unread bytes, in memory (rows count as their f32 bytes).
    pub fn len(&self) -> usize {
        self.unread
    }

    pub fn is_empty(&self) -> bool {
        self.unread == 0
    }

    pub(super) fn push(&mut self, payload: Payload) {
        self.unread += payload.len();
        self.messages.push_back(payload);
    }

    /// The oldest received message, whole: the reader reads bytes in place, then gives the
    /// buffer back ([`Received::recycle`]).
    pub fn pop_front(&mut self) -> Option<Payload> {
        let payload = self.messages.pop_front()?;
        self.unread -= payload.len();
        Some(payload)
    }

    /// Whether the oldest received message is decoded rows.
    pub fn rows_next(&self) -> bool {
        matches!(self.messages.front(), Some(Payload::Rows(..)))
    }

    /// A buffer the reader is done with, kept for the next receives if worth it.
    pub fn recycle(&mut self, buffer: Vec<u8>) {
        if worth_keeping(buffer.capacity()) && self.spare.len() < SPARE_BUFFERS {
            self.spare.push(buffer);
        }
    }

    /// An emptied buffer of at least `capacity` bytes.
    pub(super) fn take_spare(&mut self, capacity: usize) -> Option<Vec<u8>> {
        take_best_fit(&mut self.spare, capacity)
    }
}

/// How an endpoint ended.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The peer closed the connection (reads see the end of the stream, not an error).
    pub closed_by_peer: bool,
    pub message: String,
}

impl EpShared {
    pub fn lock(&self) -> MutexGuard<'_, EpState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn fail(&self, failure: Failure) {
        let (read, write) = {
            let mut state = self.lock();
            if state.failure.is_none() {
                state.failure = Some(failure);
            }
            (state.read_waker.take(), state.write_waker.take())
        };
        read.into_iter().chain(write).for_each(Waker::wake);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Received messages come out whole and in order, the unread count follows them (rows
    /// counted as the f32 bytes they hold), and the emptied large buffers come back for the
    /// next receives.
    #[test]
    fn received_messages_come_out_whole_in_order_and_their_buffers_come_back() {
        let mut received = Received::default();
        const BIG: usize = 1 << 20;
        let big: Vec<u8> = (0..BIG).map(|i| (i % 251) as u8).collect();
        let rows: Vec<f32> = (0..100).map(|i| i as f32 * 0.5).collect();
        let small: Vec<u8> = (0..10).map(|i| 200 + i).collect();
        received.push(Payload::Bytes(big.clone()));
        received.push(Payload::Rows(rows.clone(), Dtype::Bf16));
        received.push(Payload::Bytes(small.clone()));
        assert_eq!(received.len(), BIG + 400 + 10);
        assert!(!received.rows_next());
        let Some(Payload::Bytes(first)) = received.pop_front() else {
            panic!("the first message is bytes");
        };
        assert_eq!(first, big);
        assert_eq!(received.len(), 410);
        received.recycle(first);
        assert!(received.rows_next());
        assert_eq!(received.pop_front(), Some(Payload::Rows(rows, Dtype::Bf16)));
        let Some(Payload::Bytes(second)) = received.pop_front() else {
            panic!("the third message is bytes");
        };
        assert_eq!(second, small);
        assert!(received.is_empty() && received.pop_front().is_none());
        received.recycle(second);
        assert!(
            received.take_spare(BIG + 1).is_none(),
            "no kept buffer is that large"
        );
        let spare = received
            .take_spare(BIG / 2)
            .expect("the emptied 1 MiB buffer");
        assert_eq!(spare.capacity(), BIG);
        assert!(
            received.take_spare(1).is_none(),
            "the small buffer is not kept"
        );
    }
}
