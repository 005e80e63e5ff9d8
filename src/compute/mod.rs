//! Numeric building blocks of the forward pass: CPU kernels, the GPU's (CUDA), and the
//! blocks they run. Nothing here knows about checkpoints or model families: `crate::model`
//! builds these blocks from a checkpoint, `crate::engine` runs them as a forward pass.

pub mod amx;
pub mod cpu;
pub mod cuda;
pub mod expert;
pub mod fill;
pub mod gate;
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
