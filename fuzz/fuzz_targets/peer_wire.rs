//! Peer data-plane frames, through both decoders: `wire::decode` (one whole frame) and the
//! streaming `peer::read_frame` the connections run (header first, then the payload as it
//! arrives). Neither may panic, and they must agree: a frame the stream reader accepts is
//! the frame `decode` reads from the same bytes, and a frame `decode` accepts is what the
//! stream reader returns.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moe_node::transport::peer::{PeerStats, read_frame};
use moe_node::transport::wire::{self, HEADER_LEN, WireLimits};

fuzz_target!(|data: &[u8]| {
    let Some((&setup, frames)) = data.split_first() else {
        return;
    };
    // Small limits now and then, so that the fuzzer meets them; the default otherwise.
    let limits = if setup & 1 == 0 {
        WireLimits::default()
    } else {
        WireLimits {
            max_payload: 1 << 16,
            max_groups: 256,
        }
    };
    // Read 1 to 16 bytes at a time: many boundaries inside small frames, values split
    // between two reads among them.
    let read_size = 1 + usize::from(setup >> 4);
    let stats = PeerStats::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");

    let whole = wire::decode(frames, &limits);
    let mut stream = tokio::io::BufReader::with_capacity(read_size, frames);
    let mut offset = 0;
    for index in 0..4 {
        let read = runtime.block_on(read_frame(&mut stream, &limits, &stats));
        match read {
            Ok(Some((header, body))) => {
                let end = offset + HEADER_LEN + header.payload_len as usize;
                let again = wire::decode(&frames[offset..end], &limits)
                    .expect("a frame the stream reader accepts decodes whole");
                assert_eq!(format!("{again:?}"), format!("{:?}", (header, &body)));
                if index == 0
                    && let Ok(first) = &whole
                {
                    assert_eq!(format!("{first:?}"), format!("{:?}", (header, &body)));
                }
                offset = end;
            }
            Ok(None) | Err(_) => {
                assert!(
                    index > 0 || whole.is_err(),
                    "decode accepts a frame the stream reader refuses: {read:?}"
                );
                break;
            }
        }
    }
});
