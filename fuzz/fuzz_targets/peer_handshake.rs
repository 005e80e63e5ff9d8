//! The peer handshake, both halves, against bytes from the other side: the server half reads
//! a client hello and proof, the client half a server hello and verdict. Whatever arrives,
//! the half returns an error or (for a transcript it could verify) an id; it never panics,
//! never waits for more than the input holds, and never accepts a peer without a valid MAC.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_node::transport::peer::{PeerAuth, PeerSecrets, client_handshake, server_handshake};
use tokio::io::AsyncWriteExt;

fuzz_target!(|data: &[u8]| {
    let Some((&side, incoming)) = data.split_first() else {
        return;
    };
    let auth = PeerAuth {
        node_id: "fuzz-node".into(),
        // Mid-rotation: an older secret is accepted too.
        secrets: PeerSecrets::new(vec![b"fuzz-secret".to_vec(), b"old-secret".to_vec()]),
        model_fingerprint: 0x5eed,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        // Our half writes less than 1 KiB; the buffer holds it all, so it never blocks.
        let (mut ours, mut theirs) = tokio::io::duplex(64 << 10);
        let incoming = &incoming[..incoming.len().min(32 << 10)];
        theirs.write_all(incoming).await.expect("write");
        theirs.shutdown().await.expect("shutdown");
        let result = if side & 1 == 0 {
            server_handshake(&mut ours, &auth).await
        } else {
            client_handshake(&mut ours, &auth).await
        };
        // The other side's proof covers our fresh random nonce: fuzzed bytes cannot match it.
        assert!(
            result.is_err(),
            "handshake accepted a forged transcript: {result:?}"
        );
    });
});
