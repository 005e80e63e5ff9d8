//! Numeric building blocks of the forward pass. `cpu` always exists; a GPU backend will sit
//! beside it behind the same operations.

pub mod amx;
pub mod cpu;
pub mod cuda;
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
