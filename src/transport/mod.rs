//! How activations travel between nodes: the [`Transport`] seam (TCP, and an in-memory twin
//! for tests), the framed wire format, and the peer client and server that speak it.
