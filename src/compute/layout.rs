//! How a step's batch is laid out, as every backend's forward pass reads it: which rows
//! belong to which sequence, and each row's rotary angles. Plain data below the engine, so
//! the backends (`cpu`, `cuda`) take it without importing the engine that builds it.

use std::ops::Range;

/// The rows of one sequence within a step's batch and the position of its first row.
#[derive(Debug, Clone)]
pub struct Segment {
    pub rows: Range<usize>,
    pub start_position: usize,
}

/// cos and sin of every rotary frequency at one position.
#[derive(Debug, Clone)]
pub struct RopeAngles {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}
