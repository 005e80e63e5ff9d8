//! Numeric building blocks of the forward pass: CPU kernels, the GPU's (CUDA), and the
//! blocks they run. Nothing here knows about checkpoints or model families: `crate::model`
//! builds these blocks from a checkpoint, `crate::engine` runs them as a forward pass.
//!
//! The CPU kernels are three folders whose files form layers (`layers.rs` lists them and
//! tests that no file imports from its own layer or above): how weights are held and what
//! parallel products share (`cpu::{element, parallel, simd}`); the f32/bf16/FP8 kernels
//! (`cpu::{decode, gemm, tiles, ops}`); the quantized formats' stored forms and INT4 kernels
//! (`quant::{e4m3, format, int4_rows}`); the AMX tiles (`amx`); then the layers that choose
//! among all of them (`cpu::linear`, `quant::linear`) and the folders' `mod.rs`, which
//! re-export what the rest of the crate uses.

pub mod amx;
pub mod cpu;
pub mod cuda;
pub mod expert;
pub mod fill;
pub mod gate;
#[cfg(test)]
mod layers;
pub mod layout;
pub mod quant;

/// Says, in a unit test, that it did not check what it is for: a `SKIPPED:` line written
/// to stderr directly, which the test harness does not capture (`eprintln!` is captured,
/// so a skip would read as a plain `ok`).
#[cfg(test)]
pub(crate) fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}
