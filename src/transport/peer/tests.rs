use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::*;
use crate::transport::handshake::HandshakeError;
use crate::transport::wire::{
    self, Dtype, ExpertReply, ExpertRequest, FrameBody, WireError, WireLimits,
};

#[test]
fn warn_limiter_allows_once_per_address_per_interval() {
    let limiter = WarnLimiter::new(Duration::from_secs(60));
    let now = Instant::now();
    let a: IpAddr = "10.0.0.1".parse().expect("ip");
    let b: IpAddr = "10.0.0.2".parse().expect("ip");
    assert!(limiter.allow(a, now));
    assert!(!limiter.allow(a, now + Duration::from_secs(59)));
    assert!(limiter.allow(b, now));
    assert!(limiter.allow(a, now + Duration::from_secs(61)));
}

/// Frames read as the stream delivers them, whatever the size of its reads (values split
/// between two reads among them), are the frames encoded; a frame cut short is refused.
#[test]
fn frames_read_in_pieces_of_any_size_are_the_frames_sent() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    for dtype in [Dtype::Bf16, Dtype::F32] {
        let request = ExpertRequest {
            layer: 3,
            placement_version: 7,
            width: 5,
            dtype,
            groups: vec![(1, 2), (4, 1)],
            rows: (0..15).map(|i| i as f32 * 0.75 - 4.0).collect(),
        };
        let mut bytes = wire::encode_request(11, &request).expect("encode");
        let reply = ExpertReply {
            groups: vec![(4, 1)],
            rows: vec![2.5; 5],
        };
        let reply = wire::reply_frame(12, 3, 7, 5, dtype, reply).expect("reply");
        bytes.extend(reply.to_bytes());
        let stats = PeerStats::default();
        for read_size in [1, 2, 3, 7, 64, 4096] {
            let mut stream = tokio::io::BufReader::with_capacity(read_size, &bytes[..]);
            let limits = WireLimits::default();
            let read = |stream: &mut tokio::io::BufReader<&[u8]>| {
                runtime.block_on(read_frame(stream, &limits, &stats))
            };
            let Ok(Some((header, FrameBody::Request(got)))) = read(&mut stream) else {
                panic!("{dtype:?} in reads of {read_size}: no request");
            };
            // The rows are exact in bf16.
            assert_eq!((header.request_id, &got), (11, &request));
            let Ok(Some((header, FrameBody::Reply(got)))) = read(&mut stream) else {
                panic!("{dtype:?} in reads of {read_size}: no reply");
            };
            assert_eq!((header.request_id, got.rows), (12, vec![2.5; 5]));
            assert!(matches!(read(&mut stream), Ok(None)), "then the clean end");
            let cut = &bytes[..bytes.len() - 3];
            let mut stream = tokio::io::BufReader::with_capacity(read_size, cut);
            assert!(read(&mut stream).is_ok());
            assert!(read(&mut stream).is_err(), "a frame cut short is refused");
        }
    }
}

#[test]
fn stats_count_rejections_by_reason() {
    let stats = PeerStats::default();
    stats.reject_frame(&WireError::BadMagic(*b"GET "));
    stats.reject_frame(&WireError::TooLarge { len: 1, max: 0 });
    stats.handshake_failed(&HandshakeError::WrongSecret);
    stats.handshake_failed(&HandshakeError::Timeout(Duration::ZERO));
    let counters = &stats.frames_rejected;
    assert_eq!(counters.bad_magic.load(Ordering::Relaxed), 1);
    assert_eq!(counters.too_large.load(Ordering::Relaxed), 1);
    assert_eq!(counters.auth_failed.load(Ordering::Relaxed), 1);
    assert_eq!(stats.handshakes_failed.load(Ordering::Relaxed), 2);
}
