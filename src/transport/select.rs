//! Which transport carries the peer links: `peer.transport` and whether UCX loads.

use std::sync::Arc;

use super::ucx::{Library, UcxTransport};
use super::{TcpTransport, Transport};
use crate::config::{PeerSection, PeerTransport};

/// The transport the node's peer links use, and a sentence saying which and why.
pub struct Chosen {
    pub transport: Arc<dyn Transport>,
    /// "ucx" or "tcp".
    pub name: &'static str,
    pub why: String,
}

/// Picks the transport `peer` asks for: UCX when it loads (`auto`, `ucx`), else TCP
/// (`auto`, `tcp`). Errs only for `ucx` without a usable UCX, saying what was tried.
pub fn choose(peer: &PeerSection) -> Result<Chosen, String> {
    let tcp = |why: String| Chosen {
        transport: Arc::new(TcpTransport::default()),
        name: "tcp",
        why,
    };
    if peer.transport == PeerTransport::Tcp {
        return Ok(tcp("peer.transport = \"tcp\"".into()));
    }
    let ucx = Library::load(peer.ucx_lib_path(), peer.ucx_system_search).and_then(|library| {
        let transport = UcxTransport::start(library.clone()).map_err(|e| {
            format!(
                "UCX {} ({}) loaded but cannot start: {e}",
                library.version_string(),
                library.file.display()
            )
        })?;
        Ok((library, transport))
    });
    match (ucx, peer.transport) {
        (Ok((library, transport)), mode) => Ok(Chosen {
            transport: Arc::new(transport.clone()),
            name: "ucx",
            why: format!(
                "peer.transport = \"{}\" and UCX {} loaded from {}; UCX_TLS={}; memory \
                 types {} ({}); each link moves to UCX after its handshake when the peer \
                 offers UCX too",
                if mode == PeerTransport::Ucx {
                    "ucx"
                } else {
                    "auto"
                },
                library.version_string(),
                library.file.display(),
                std::env::var("UCX_TLS").unwrap_or_else(|_| "(unset: UCX picks)".into()),
                transport.memory_types().names().join(", "),
                if transport.takes_cuda_memory() {
                    "this UCX can move GPU memory; GPU rows still travel through pinned host \
                     memory, as direct GPU memory is not wired yet"
                } else {
                    "no GPU memory: GPU rows travel through pinned host memory"
                }
            ),
        }),
        (Err(why), PeerTransport::Ucx) => Err(format!(
            "peer.transport = \"ucx\" but UCX is not usable: {why}. Install libucx0 (1.13 or \
             newer), point peer.ucx_lib_dir at a UCX, or set peer.transport = \"auto\" or \"tcp\""
        )),
        (Err(why), _) => Ok(tcp(format!(
            "peer.transport = \"auto\" and UCX is not usable, so TCP: {why}"
        ))),
    }
}
