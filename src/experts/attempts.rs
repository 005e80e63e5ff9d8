//! The attempts of one dispatch, as plain state fed with events and the time: which groups
//! still need a target, which sends are in flight, which targets already failed a group,
//! and what a late, failed or missing answer does. [`super::dispatch::Dispatcher`] drives
//! it: it chooses targets for [`Attempts::pending`] groups, carries out the sends
//! [`Attempts::place`] asks for, and feeds back answers ([`Attempts::answered`]) and the
//! passing of time ([`Attempts::tick`]); it applies what comes back (health, load,
//! counters). Nothing here blocks, sends or reads a clock.
//!
//! The rules:
//! - a group is sent to one target at a time; a target that fails it (an error, or no
//!   answer within `give_up`) is excluded for that group and the group is placed again
//!   once no other send still covers it (a failover);
//! - a send to another node that misses its hedge deadline stays outstanding, and its
//!   groups are placed again on other targets (a hedge): the first answer wins, later
//!   ones are counted and dropped;
//! - a group with no target left fails the dispatch, unless the policy may wait: then its
//!   exclusions are forgotten (a restarted target is tried again) and it is placed again
//!   until `wait_for` has passed since the first group found none.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::target::{FailCause, GoneCause, Target, TargetError};

/// What the dispatch may do about a group that has no target left.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Wait for a replica to come back (`on_expert_unavailable = "wait"`, and work that was
    /// not sent here by another node), up to `wait_for`.
    pub may_wait: bool,
    pub wait_for: Duration,
    /// A send to another node unanswered after this long counts as failed.
    pub give_up: Duration,
}

/// One send in flight, or answered.
#[derive(Debug, Clone)]
pub struct Send {
    pub target: Target,
    /// The groups it carries, in the order its outputs come back (taken once it has ended).
    pub groups: Vec<usize>,
    pub rows: usize,
    pub sent: Instant,
    /// It missed its hedge deadline and its groups went to other targets too.
    pub hedged: bool,
    /// Sent on a link still being set up: its answer time includes the set-up.
    pub cold: bool,
    pub finished: bool,
}

/// No target is left for these experts (sorted, each once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoReplica(pub Vec<u32>);

/// What an answer changed.
#[derive(Debug)]
pub enum Answered {
    /// The send had ended already (given up on): nothing changes.
    Stale,
    /// Outputs came. `new_groups` were answered now for the first time; `late` outputs
    /// were for groups another target had answered already.
    Delivered {
        target: Target,
        rows: usize,
        took: Duration,
        /// The time to count as the target's latency: none for a hedged send (an outlier,
        /// already counted as a missed deadline) or a cold one (it measured the link's set-up).
        sample: Option<Duration>,
        new_groups: Vec<usize>,
        late: usize,
    },
    /// The target failed the send; `failovers` groups are to be placed again.
    Failed {
        target: Target,
        rows: usize,
        error: TargetError,
        failovers: usize,
    },
}

/// What the passing of time did to one send to another node.
#[derive(Debug)]
pub enum Overdue {
    /// Unanswered after `give_up`: ended as failed; `failovers` groups are placed again.
    GaveUp {
        target: Target,
        rows: usize,
        error: TargetError,
        failovers: usize,
    },
    /// Past its hedge deadline: `hedges` groups are placed again on other targets too.
    Hedged {
        target: Target,
        waited: Duration,
        hedges: usize,
    },
}

/// The attempts of one dispatch of `groups` groups, with outputs of type `O` per group.
pub struct Attempts<O> {
    experts: Vec<u32>,
    group_rows: Vec<usize>,
    policy: Policy,
    outputs: Vec<Option<O>>,
    remaining: usize,
    /// Sends in flight per group.
    covering: Vec<u32>,
    /// Targets that failed each group (or were hedged away from).
    failed_on: Vec<Vec<Target>>,
    pending: Vec<usize>,
    /// When a group first found no target (the wait policy's clock).
    waiting_since: Option<Instant>,
    sends: Vec<Send>,
}

impl<O> Attempts<O> {
    /// `experts[g]` over `group_rows[g]` rows, every group pending.
    pub fn new(experts: &[u32], group_rows: &[usize], policy: Policy) -> Self {
        let groups = experts.len();
        Attempts {
            experts: experts.to_vec(),
            group_rows: group_rows.to_vec(),
            policy,
            outputs: (0..groups).map(|_| None).collect(),
            remaining: groups,
            covering: vec![0; groups],
            failed_on: vec![Vec::new(); groups],
            pending: (0..groups).collect(),
            waiting_since: None,
            sends: Vec::new(),
        }
    }

    /// Every group has its outputs.
    pub fn is_done(&self) -> bool {
        self.remaining == 0
    }

    /// Groups waiting for a target, in the order [`Attempts::place`] takes choices.
    pub fn pending(&self) -> &[usize] {
        &self.pending
    }

    /// Whether `target` failed group `group` already (it is not to be chosen again).
    pub fn excluded(&self, group: usize, target: Target) -> bool {
        self.failed_on[group].contains(&target)
    }

    /// Takes a choice per pending group (`None`: no usable target) and returns the sends to
    /// make, groups by target (each group to one target). A group with no choice waits if
    /// an earlier send still covers it, else it fails the dispatch or, under the wait
    /// policy, stays pending with its exclusions forgotten.
    pub fn place(
        &mut self,
        choices: &[Option<Target>],
        now: Instant,
    ) -> Result<Vec<(Target, Vec<usize>)>, NoReplica> {
        let mut per_target: BTreeMap<Target, Vec<usize>> = BTreeMap::new();
        let mut unplaced = Vec::new();
        for (&g, choice) in self.pending.iter().zip(choices) {
            match choice {
                Some(target) => per_target.entry(*target).or_default().push(g),
                // Still answered by an earlier send: keep waiting for it.
                None if self.covering[g] > 0 => {}
                None => unplaced.push(g),
            }
        }
        self.pending.clear();
        if !unplaced.is_empty() {
            let since = *self.waiting_since.get_or_insert(now);
            if !(self.policy.may_wait && now.duration_since(since) < self.policy.wait_for) {
                let mut missing: Vec<u32> = unplaced.iter().map(|&g| self.experts[g]).collect();
                missing.sort_unstable();
                missing.dedup();
                return Err(NoReplica(missing));
            }
            for &g in &unplaced {
                self.failed_on[g].clear();
            }
            self.pending = unplaced;
        }
        Ok(per_target.into_iter().collect())
    }

    /// Records a send of `groups` to `target` made at `now`; returns its id for
    /// [`Attempts::answered`].
    pub fn started(
        &mut self,
        target: Target,
        groups: Vec<usize>,
        cold: bool,
        now: Instant,
    ) -> usize {
        for &g in &groups {
            self.covering[g] += 1;
        }
        let rows = groups.iter().map(|&g| self.group_rows[g]).sum();
        self.sends.push(Send {
            target,
            groups,
            rows,
            sent: now,
            hedged: false,
            cold,
            finished: false,
        });
        self.sends.len() - 1
    }

    /// The send `id` as recorded.
    pub fn send(&self, id: usize) -> &Send {
        &self.sends[id]
    }

    /// Send `id` was answered at `now` with outputs per group, or an error.
    pub fn answered(
        &mut self,
        id: usize,
        result: Result<Vec<O>, TargetError>,
        now: Instant,
    ) -> Answered {
        let Some(send) = self.sends.get_mut(id) else {
            return Answered::Stale;
        };
        if send.finished {
            return Answered::Stale;
        }
        send.finished = true;
        let took = now.duration_since(send.sent);
        let (target, rows) = (send.target, send.rows);
        // An ended send's groups are read no more.
        let groups = std::mem::take(&mut send.groups);
        let sample = (!send.hedged && !send.cold).then_some(took);
        for &g in &groups {
            self.covering[g] = self.covering[g].saturating_sub(1);
        }
        let error = match result {
            Ok(outputs) if outputs.len() == groups.len() => {
                let mut new_groups = Vec::with_capacity(groups.len());
                let mut late = 0;
                for (g, output) in groups.into_iter().zip(outputs) {
                    if self.outputs[g].is_some() {
                        late += 1;
                        continue;
                    }
                    self.outputs[g] = Some(output);
                    self.remaining -= 1;
                    new_groups.push(g);
                }
                return Answered::Delivered {
                    target,
                    rows,
                    took,
                    sample,
                    new_groups,
                    late,
                };
            }
            Ok(outputs) => TargetError::Failed(FailCause::WrongOutputCount {
                outputs: outputs.len(),
                groups: groups.len(),
            }),
            Err(e) => e,
        };
        let failovers = self.fail_over(target, &groups);
        Answered::Failed {
            target,
            rows,
            error,
            failovers,
        }
    }

    /// `target` failed `groups`: each one still unanswered excludes it, and is placed
    /// again once nothing else covers it. Returns how many were.
    fn fail_over(&mut self, target: Target, groups: &[usize]) -> usize {
        let mut failovers = 0;
        for &g in groups {
            if self.outputs[g].is_none() {
                self.failed_on[g].push(target);
                if self.covering[g] == 0 {
                    self.pending.push(g);
                    failovers += 1;
                }
            }
        }
        failovers
    }

    /// Looks at the sends to other nodes still in flight at `now`: those unanswered past
    /// `give_up` end as failed, those past `hedge_deadline(target)` are hedged (once).
    /// A local device answers in its mailbox's order however long a big step takes, and a
    /// stopped actor answers by itself: only sends to nodes have deadlines.
    pub fn tick(
        &mut self,
        now: Instant,
        hedge_deadline: impl Fn(Target) -> Duration,
    ) -> Vec<Overdue> {
        let mut overdue = Vec::new();
        for id in 0..self.sends.len() {
            let send = &self.sends[id];
            if send.finished || !matches!(send.target, Target::Node(_)) {
                continue;
            }
            let waited = now.duration_since(send.sent);
            let (target, rows) = (send.target, send.rows);
            if waited >= self.policy.give_up {
                let groups = std::mem::take(&mut self.sends[id].groups);
                self.sends[id].finished = true;
                for &g in &groups {
                    self.covering[g] = self.covering[g].saturating_sub(1);
                }
                let failovers = self.fail_over(target, &groups);
                overdue.push(Overdue::GaveUp {
                    target,
                    rows,
                    error: TargetError::Gone(GoneCause::NoAnswer { waited }),
                    failovers,
                });
            } else if !send.hedged && waited >= hedge_deadline(target) {
                self.sends[id].hedged = true;
                let mut hedges = 0;
                for i in 0..self.sends[id].groups.len() {
                    let g = self.sends[id].groups[i];
                    if self.outputs[g].is_none() && !self.failed_on[g].contains(&target) {
                        // The slow target stays a candidate only if nothing else is.
                        self.failed_on[g].push(target);
                        self.pending.push(g);
                        hedges += 1;
                    }
                }
                overdue.push(Overdue::Hedged {
                    target,
                    waited,
                    hedges,
                });
            }
        }
        overdue
    }

    /// How long to wait for the next answer before [`Attempts::tick`] has something to do.
    pub fn next_wait(&self, now: Instant, hedge_deadline: impl Fn(Target) -> Duration) -> Duration {
        self.sends
            .iter()
            .filter(|s| !s.finished && matches!(s.target, Target::Node(_)))
            .map(|s| {
                let due = if s.hedged {
                    self.policy.give_up
                } else {
                    hedge_deadline(s.target)
                };
                (s.sent + due).saturating_duration_since(now)
            })
            .min()
            .unwrap_or(Duration::from_millis(500))
            .max(Duration::from_micros(100))
    }

    /// Sends never answered (a hedged send whose other target answered first, sends in
    /// flight when the dispatch failed): their target and rows.
    pub fn unanswered(&self) -> impl Iterator<Item = (Target, usize)> + '_ {
        self.sends
            .iter()
            .filter(|s| !s.finished)
            .map(|s| (s.target, s.rows))
    }

    /// The outputs per group, once [`Attempts::is_done`].
    pub fn take_outputs(&mut self) -> Vec<O>
    where
        O: Default,
    {
        self.outputs
            .iter_mut()
            .map(|o| o.take().unwrap_or_default())
            .collect()
    }
}

#[cfg(test)]
mod tests;
