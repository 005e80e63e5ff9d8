//! Placement versions over time: how a starting node gets the placement it serves under
//! ([`bootstrap`]), the placements a node hands out ([`board`]), and how a cluster moves
//! from one version to the next while it serves, copy then switch ([`follow`]), and how a
//! node rebalances its hot-expert copies live, on demand or every interval ([`rebalance`]).
//! The placements themselves are computed by the pure algorithms of `crate::placement`.

pub mod board;
pub mod bootstrap;
pub mod follow;
pub mod rebalance;
