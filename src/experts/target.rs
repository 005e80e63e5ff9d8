//! Where the dispatcher sends a group of rows and how the answer comes back: the targets
//! (a device of this node, another node), what a failed send means, the one-shot answer,
//! and the seam to other nodes ([`RemoteNodes`], implemented by `super::remote`).

use std::sync::Arc;
use std::time::Duration;

use super::StagingError;
use crate::compute::cuda::CudaError;
use crate::transport::RemoteError;
use crate::transport::peer::PeerError;
use crate::transport::wire::WireError;

/// Where a group of rows is sent: a device actor of this node, or another node (which runs
/// it on a device of its own that holds the expert).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    Device(u16),
    Node(u16),
}

/// Why a target did not answer a send; decides what happens to its groups.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TargetError {
    /// The target is gone (device actor stopped, link reset, member dead): its groups go
    /// to other replicas, and it gets no more work until it is seen again.
    #[error("{0}")]
    Gone(GoneCause),
    /// The target failed this work (a device error, a remote error): other replicas take it.
    #[error("{0}")]
    Failed(FailCause),
    /// The target does not hold an expert the placement says it holds.
    #[error("expert {expert} of layer {layer} is not held there")]
    NotHeld { layer: usize, expert: u32 },
    /// The target's queue is full: try another replica.
    #[error("overloaded")]
    Overloaded,
}

/// Why a target is gone.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GoneCause {
    /// The placement names a device this node does not have.
    #[error("no device {device} on this node")]
    NoDevice { device: u16 },
    /// The device's actor stopped (its mailbox refuses work).
    #[error("device {device} stopped")]
    DeviceStopped { device: u16 },
    /// The GPU failed while computing and its actor took it out of service.
    #[error("device {device}: {error}")]
    DeviceFailed {
        device: usize,
        error: Arc<CudaError>,
    },
    /// The placement names no such node.
    #[error("no node {node} in the placement")]
    NoNode { node: u16 },
    /// Gossip knows no live member with this node id.
    #[error("node `{node}` is not a live member")]
    MemberDead { node: String },
    /// This node reaches no other node (it runs alone).
    #[error("no peers")]
    NoPeers,
    /// The link to the node failed: no connection, a failed handshake, a reset, or a
    /// client that was closed.
    #[error("{0}")]
    LinkReset(PeerError),
    /// The answer was dropped unsent (a stopped actor's mailbox, a lost connection).
    #[error("dropped without an answer")]
    DroppedUnanswered,
    /// A send to another node went unanswered for this long: given up on.
    #[error("no answer in {:.1} s", .waited.as_secs_f32())]
    NoAnswer { waited: Duration },
}

/// Why a target failed a send it took.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FailCause {
    /// The GPU of this node failed the work (taking experts, for instance).
    #[error("device {device}: {error}")]
    Device {
        device: usize,
        error: Arc<CudaError>,
    },
    /// Rows in GPU memory were sent to a device that is a CPU slot.
    #[error("device {device} is a CPU slot: it takes rows from the host")]
    NotAGpu { device: usize },
    /// Rows could not be brought from GPU memory to the host for this target.
    #[error("{0}")]
    Staging(StagingError),
    /// The other node refused or failed the work (the error frame it answered).
    #[error("{0}")]
    Remote(RemoteError),
    /// The work could not be put on the wire (rows that do not match their groups, a
    /// frame over the limits).
    #[error("{0}")]
    BadRequest(WireError),
    /// The reply does not answer the groups sent.
    #[error("the reply does not answer the groups sent")]
    WrongReply,
    /// The answer has another number of outputs than the send had groups.
    #[error("{outputs} outputs for {groups} groups")]
    WrongOutputCount { outputs: usize, groups: usize },
}

impl TargetError {
    /// What the peer client answered, as the dispatcher acts on it: refusals by the node
    /// (not held, overloaded) keep their meaning, a broken link means the node is gone,
    /// and any other error fails the send.
    pub fn from_peer(error: PeerError) -> Self {
        match error {
            PeerError::Remote(RemoteError::NotHeld { layer, expert }) => TargetError::NotHeld {
                layer: layer as usize,
                expert,
            },
            PeerError::Remote(RemoteError::Overloaded) | PeerError::Overloaded => {
                TargetError::Overloaded
            }
            PeerError::Remote(e) => TargetError::Failed(FailCause::Remote(e)),
            PeerError::BadRequest(e) => TargetError::Failed(FailCause::BadRequest(e)),
            e @ (PeerError::Connect(_)
            | PeerError::Handshake(_)
            | PeerError::LinkDown(_)
            | PeerError::Closed) => TargetError::Gone(GoneCause::LinkReset(e)),
        }
    }
}

/// Output rows per group, or why not.
pub type GroupOutputs = Result<Vec<GroupRows>, TargetError>;

/// One group's output rows (see [`GroupRows`]: a buffer of its own, or a range of a
/// decoded reply's).
pub use crate::transport::GroupRows;

/// Carries one answer back to the dispatcher, exactly once: dropped unanswered (a stopped
/// actor's mailbox, a lost connection), it answers `Gone` itself, so no send is ever lost.
pub struct Answer(Option<Box<dyn FnOnce(GroupOutputs) + Send>>);

impl Answer {
    pub fn new(f: impl FnOnce(GroupOutputs) + Send + 'static) -> Self {
        Answer(Some(Box::new(f)))
    }

    pub fn send(mut self, outputs: GroupOutputs) {
        if let Some(f) = self.0.take() {
            f(outputs);
        }
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f(Err(TargetError::Gone(GoneCause::DroppedUnanswered)));
        }
    }
}

/// Groups of rows for the experts of one layer, to run on another node. The rows are
/// borrowed where the dispatch holds them: the wire encoding reads them from there.
pub struct RemoteWork<'a> {
    pub layer: usize,
    pub placement_version: u64,
    /// `(expert, rows)` per group.
    pub groups: Vec<(u32, u32)>,
    /// Each group's rows, in group order.
    pub rows: Vec<&'a [f32]>,
}

/// Other nodes, as the dispatcher reaches them (the peer clients of a cluster).
pub trait RemoteNodes: Send + Sync {
    /// Sends `work` to placement node `node`; `answer` is called with the outputs per group.
    /// An error means nothing was sent.
    fn send(&self, node: u16, work: RemoteWork<'_>, answer: Answer) -> Result<(), TargetError>;

    /// Whether work sent to `node` now goes out on a link that is already set up. Work that
    /// must wait for a link (the first send to a node, or one after a reconnect) is answered
    /// after the connect and handshake, which measures the link's set-up, not the node.
    fn link_up(&self, _node: u16) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::handshake::HandshakeError;

    /// What the peer client answers decides what the dispatcher does: refusals keep their
    /// meaning, a broken link is the node gone, the rest fails the send; and each reads as
    /// the peer's error did.
    #[test]
    fn peer_errors_become_the_target_errors_the_dispatcher_acts_on() {
        let not_held = PeerError::Remote(RemoteError::NotHeld {
            layer: 2,
            expert: 9,
        });
        assert!(matches!(
            TargetError::from_peer(not_held),
            TargetError::NotHeld {
                layer: 2,
                expert: 9
            }
        ));
        for overloaded in [
            PeerError::Overloaded,
            PeerError::Remote(RemoteError::Overloaded),
        ] {
            assert!(matches!(
                TargetError::from_peer(overloaded),
                TargetError::Overloaded
            ));
        }
        let failed = PeerError::Remote(RemoteError::DeviceFailed("out of memory".into()));
        let error = TargetError::from_peer(failed);
        assert!(matches!(
            &error,
            TargetError::Failed(FailCause::Remote(RemoteError::DeviceFailed(_)))
        ));
        assert_eq!(error.to_string(), "remote device failed: out of memory");
        let bad = PeerError::BadRequest(WireError::Malformed("row width 0".into()));
        assert!(matches!(
            TargetError::from_peer(bad),
            TargetError::Failed(FailCause::BadRequest(_))
        ));
        for gone in [
            PeerError::Connect("10.0.0.2:7000: refused".into()),
            PeerError::Handshake(HandshakeError::WrongSecret),
            PeerError::LinkDown("reset".into()),
            PeerError::Closed,
        ] {
            let text = gone.to_string();
            let error = TargetError::from_peer(gone);
            assert!(
                matches!(&error, TargetError::Gone(GoneCause::LinkReset(_))),
                "{text}"
            );
            assert_eq!(error.to_string(), text);
        }
    }

    #[test]
    fn causes_read_as_log_lines() {
        let lines = [
            (
                TargetError::Gone(GoneCause::DeviceStopped { device: 3 }),
                "device 3 stopped",
            ),
            (
                TargetError::Gone(GoneCause::MemberDead { node: "b".into() }),
                "node `b` is not a live member",
            ),
            (
                TargetError::Gone(GoneCause::NoAnswer {
                    waited: Duration::from_millis(1500),
                }),
                "no answer in 1.5 s",
            ),
            (
                TargetError::Failed(FailCause::WrongOutputCount {
                    outputs: 1,
                    groups: 2,
                }),
                "1 outputs for 2 groups",
            ),
        ];
        for (error, line) in lines {
            assert_eq!(error.to_string(), line);
        }
    }

    #[test]
    fn an_answer_dropped_unsent_answers_gone() {
        let (tx, rx) = std::sync::mpsc::channel();
        drop(Answer::new(move |outputs| tx.send(outputs).unwrap()));
        assert!(matches!(
            rx.recv().unwrap(),
            Err(TargetError::Gone(GoneCause::DroppedUnanswered))
        ));
    }

    #[test]
    fn group_rows_read_their_range_of_a_shared_reply() {
        let reply = Arc::new(vec![0.0, 1.0, 2.0, 3.0]);
        let second = GroupRows::Shared(reply.clone(), 1..3);
        assert_eq!(&*second, &[1.0, 2.0]);
        assert_eq!(second.into_vec(), vec![1.0, 2.0]);
        assert_eq!(&*GroupRows::Own(vec![5.0]), &[5.0]);
        assert!(GroupRows::default().is_empty());
    }
}
