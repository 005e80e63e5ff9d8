//! Numeric building blocks of the forward pass. `cpu` always exists; a GPU backend will sit
//! beside it behind the same operations.

pub mod amx;
pub mod cpu;
pub mod cuda;
pub mod layout;
pub mod quant;
