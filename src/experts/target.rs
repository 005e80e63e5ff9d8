//! Where the dispatcher sends a group of rows and how the answer comes back: the targets
//! (a device of this node, another node), what a failed send means, the one-shot answer,
//! and the seam to other nodes ([`RemoteNodes`], implemented by `super::remote`).

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
    Gone(String),
    /// The target failed this work (a device error, a remote error): other replicas take it.
    #[error("{0}")]
    Failed(String),
    /// The target does not hold an expert the placement says it holds.
    #[error("expert {expert} of layer {layer} is not held there")]
    NotHeld { layer: usize, expert: u32 },
    /// The target's queue is full: try another replica.
    #[error("overloaded")]
    Overloaded,
}

/// Output rows per group, or why not.
pub type GroupOutputs = Result<Vec<Vec<f32>>, TargetError>;

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
            f(Err(TargetError::Gone("dropped without an answer".into())));
        }
    }
}

/// Groups of rows for the experts of one layer, to run on another node.
pub struct RemoteWork {
    pub layer: usize,
    pub placement_version: u64,
    /// `(expert, rows)` per group.
    pub groups: Vec<(u32, u32)>,
    /// Every group's rows, concatenated.
    pub rows: Vec<f32>,
}

/// Other nodes, as the dispatcher reaches them (the peer clients of a cluster).
pub trait RemoteNodes: Send + Sync {
    /// Sends `work` to placement node `node`; `answer` is called with the outputs per group.
    /// An error means nothing was sent.
    fn send(&self, node: u16, work: RemoteWork, answer: Answer) -> Result<(), TargetError>;

    /// Whether work sent to `node` now goes out on a link that is already set up. Work that
    /// must wait for a link (the first send to a node, or one after a reconnect) is answered
    /// after the connect and handshake, which measures the link's set-up, not the node.
    fn link_up(&self, _node: u16) -> bool {
        true
    }
}
