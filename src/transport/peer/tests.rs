use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::frames::write_rows_frame;
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
            trace: None,
        };
        let mut bytes = wire::encode_request(11, &request).expect("encode");
        let reply = ExpertReply {
            groups: vec![(4, 1)],
            rows: vec![2.5; 5],
        };
        let reply = wire::reply_frame(12, 3, 7, 5, dtype, reply.into()).expect("reply");
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

/// Bytes written, and the length of each write.
#[derive(Default)]
struct Recorded {
    bytes: Vec<u8>,
    writes: Vec<usize>,
}

impl tokio::io::AsyncWrite for Recorded {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        bytes: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.bytes.extend_from_slice(bytes);
        this.writes.push(bytes.len());
        std::task::Poll::Ready(Ok(bytes.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// A reply whose rows are the serving node's outputs in parts (small, empty, large, a range
/// of a shared buffer) is written as the frame of the same rows in one buffer, whatever the
/// size of the writer's buffer; a large f32 part goes to the stream from where it is, in one
/// write, not through the buffer.
#[test]
fn a_reply_in_parts_is_written_as_its_whole_frame() {
    use crate::transport::wire::{ExpertOutput, GroupRows, Rows};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let width = 4;
    let sizes = [1usize, 0, 40, 3];
    let parts: Vec<Vec<f32>> = sizes
        .iter()
        .scan(0.0f32, |next, &rows| {
            let part: Vec<f32> = (0..rows * width).map(|i| *next + i as f32 * 0.5).collect();
            *next += 1000.0;
            Some(part)
        })
        .collect();
    let groups: Vec<(u32, u32)> = sizes
        .iter()
        .enumerate()
        .map(|(e, &r)| (e as u32, r as u32))
        .collect();
    let whole: Vec<f32> = parts.concat();
    let shared = std::sync::Arc::new(parts[3].clone());
    let rows = Rows::parts(vec![
        GroupRows::Own(parts[0].clone()),
        GroupRows::Own(parts[1].clone()),
        GroupRows::Own(parts[2].clone()),
        GroupRows::Shared(shared.clone(), 0..shared.len()),
    ]);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let expected = wire::encode_reply(
            5,
            2,
            9,
            width as u32,
            dtype,
            &ExpertReply {
                groups: groups.clone(),
                rows: whole.clone(),
            },
        )
        .expect("encode");
        for scratch_len in [64, 100, 256, 4096] {
            let output = ExpertOutput {
                groups: groups.clone(),
                rows: rows.clone(),
            };
            let frame = wire::reply_frame(5, 2, 9, width as u32, dtype, output).expect("frame");
            assert_eq!(frame.to_bytes(), expected);
            let mut out = Recorded::default();
            let mut scratch = vec![0u8; scratch_len];
            runtime
                .block_on(write_rows_frame(&mut out, &frame, &mut scratch))
                .expect("write");
            assert_eq!(out.bytes, expected, "{dtype:?}, buffer of {scratch_len}");
            let large = parts[2].len() * 4;
            let direct = dtype == Dtype::F32 && large >= scratch_len / 2;
            assert_eq!(
                out.writes.contains(&large),
                direct,
                "{dtype:?}, buffer of {scratch_len}: {:?}",
                out.writes
            );
        }
    }
}
