//! Peer frames as a link carries them after its handshake: sealed in records, read back
//! through the record reader and the frame reader with the server's bounds. The fuzzed bytes
//! are sealed with the link's key (so they open), written in writes of fuzzed sizes, and
//! now and then one byte of the sealed stream is flipped or a record is cut short. Nothing
//! may panic; untouched, the frames read are those `wire::decode` reads from the same bytes;
//! touched, no frame past the touched record is ever returned (the reader fails there).
#![no_main]

use std::sync::Arc;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use moe_node::transport::peer::seal::{OpenedReader, RECORD_HEADER, SealedWriter, TAG_LEN};
use moe_node::transport::peer::{PeerStats, read_frame};
use moe_node::transport::wire::{self, HEADER_LEN, WireLimits};
use tokio::io::AsyncWriteExt;

const KEY: [u8; 32] = [3; 32];

fuzz_target!(|data: &[u8]| {
    let Some((&setup, frames)) = data.split_first() else {
        return;
    };
    let limits = WireLimits {
        max_payload: 1 << 16,
        max_groups: 256,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    // Writes of 1 to 64 bytes: one record each.
    let write_size = 1 + usize::from(setup & 63);
    let mut sealed = runtime.block_on(async {
        let mut writer = SealedWriter::new(Vec::new(), &KEY);
        for chunk in frames.chunks(write_size) {
            writer.write_all(chunk).await.expect("write");
        }
        writer.flush().await.expect("flush");
        writer.into_inner()
    });
    // The first byte of the sealed stream touched, if any: one flipped, chosen by the data,
    // or the last one cut.
    let touched = if setup & 0x40 != 0 && !sealed.is_empty() {
        let at = if setup & 0x80 != 0 {
            sealed.len() - 1
        } else {
            usize::from(frames.first().copied().unwrap_or(0)) % sealed.len()
        };
        if at == sealed.len() - 1 && setup & 0x80 != 0 {
            sealed.truncate(at);
        } else {
            sealed[at] ^= 0x01;
        }
        Some(at)
    } else {
        None
    };
    // Every record but the last holds write_size bytes: the plaintext before the touched
    // record is all that may come out.
    let record = RECORD_HEADER + write_size + TAG_LEN;
    let trusted = touched.map_or(frames.len(), |at| at / record * write_size);
    let stats = Arc::new(PeerStats::default());
    let mut reader = OpenedReader::new(&sealed[..], &KEY, stats, Duration::from_secs(5));
    let mut offset = 0;
    for _ in 0..4 {
        match runtime.block_on(read_frame(&mut reader, &limits, &PeerStats::default())) {
            Ok(Some((header, body))) => {
                let end = offset + HEADER_LEN + header.payload_len as usize;
                assert!(end <= trusted, "a frame from a touched record");
                let again = wire::decode(&frames[offset..end], &limits)
                    .expect("a frame the reader accepts decodes whole");
                assert_eq!(format!("{again:?}"), format!("{:?}", (header, &body)));
                offset = end;
            }
            Ok(None) | Err(_) => break,
        }
    }
});
