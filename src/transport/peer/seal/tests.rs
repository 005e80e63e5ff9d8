use std::sync::atomic::Ordering;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

const KEY: [u8; KEY_LEN] = [7; KEY_LEN];
const DEADLINE: Duration = Duration::from_secs(5);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime")
}

/// The sealed bytes of `writes`, each written (and flushed) in turn.
fn sealed(writes: &[Vec<u8>]) -> Vec<u8> {
    runtime().block_on(async {
        let mut writer = SealedWriter::new(Vec::new(), &KEY);
        for bytes in writes {
            writer.write_all(bytes).await.expect("write");
            writer.flush().await.expect("flush");
        }
        writer.inner
    })
}

/// Splits sealed bytes into their records.
fn records(mut bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let len = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) as usize;
        let end = RECORD_HEADER + len + TAG_LEN;
        out.push(bytes[..end].to_vec());
        bytes = &bytes[end..];
    }
    out
}

/// What a reader makes of `bytes`: the plaintext, or the error's kind and what was counted.
fn open(bytes: Vec<u8>, key: &[u8; KEY_LEN]) -> (Result<Vec<u8>, std::io::ErrorKind>, u64, u64) {
    let stats = Arc::new(PeerStats::default());
    let result = runtime().block_on(async {
        let mut reader = OpenedReader::new(&bytes[..], key, stats.clone(), DEADLINE);
        let mut plain = Vec::new();
        reader
            .read_to_end(&mut plain)
            .await
            .map(|_| plain)
            .map_err(|error| error.kind())
    });
    let rejected = &stats.frames_rejected;
    (
        result,
        rejected.integrity.load(Ordering::Relaxed),
        rejected.malformed.load(Ordering::Relaxed),
    )
}

fn payloads() -> Vec<Vec<u8>> {
    vec![
        b"first frame".to_vec(),
        (0..RECORD_MAX + 1000).map(|i| (i % 251) as u8).collect(),
        vec![9; 3],
        (0..3 * RECORD_MAX).map(|i| (i % 13) as u8).collect(),
    ]
}

#[test]
fn records_open_to_what_was_written_whatever_their_sizes() {
    let writes = payloads();
    let bytes = sealed(&writes);
    // A large write is cut into records of at most RECORD_MAX bytes, sealed each.
    assert_eq!(records(&bytes).len(), 1 + 2 + 1 + 3);
    assert!(
        !bytes.windows(11).any(|w| w == b"first frame"),
        "plaintext on the wire"
    );
    let (plain, integrity, malformed) = open(bytes, &KEY);
    assert_eq!(plain.expect("opens"), writes.concat());
    assert_eq!((integrity, malformed), (0, 0));
}

#[test]
fn altered_replayed_reordered_dropped_or_foreign_records_are_refused() {
    let records = records(&sealed(&payloads()));
    let mut altered = records.clone();
    altered[1][RECORD_HEADER + 100] ^= 0x80;
    let mut altered_tag = records.clone();
    let last = altered_tag[0].len() - 1;
    altered_tag[0][last] ^= 1;
    let mut replayed = records.clone();
    replayed.insert(2, records[1].clone());
    let mut reordered = records.clone();
    reordered.swap(1, 2);
    let mut dropped = records.clone();
    dropped.remove(1);
    for (what, records) in [
        ("altered", altered),
        ("altered tag", altered_tag),
        ("replayed", replayed),
        ("reordered", reordered),
        ("dropped", dropped),
    ] {
        let (result, integrity, _) = open(records.concat(), &KEY);
        assert_eq!(result, Err(std::io::ErrorKind::InvalidData), "{what}");
        assert_eq!(integrity, 1, "{what} counted");
    }
    let (result, integrity, _) = open(records.concat(), &[8; KEY_LEN]);
    assert_eq!(
        result,
        Err(std::io::ErrorKind::InvalidData),
        "another link's key"
    );
    assert_eq!(integrity, 1);
}

#[test]
fn cut_or_malformed_records_are_refused() {
    let bytes = sealed(&payloads());
    let (result, _, malformed) = open(bytes[..bytes.len() - 5].to_vec(), &KEY);
    assert_eq!(result, Err(std::io::ErrorKind::UnexpectedEof), "cut");
    assert_eq!(malformed, 1);
    for header in [0u32, RECORD_MAX as u32 + 1, u32::MAX] {
        let mut bad = header.to_le_bytes().to_vec();
        bad.extend_from_slice(&[0; 64]);
        let (result, _, malformed) = open(bad, &KEY);
        assert_eq!(
            result,
            Err(std::io::ErrorKind::InvalidData),
            "length {header}"
        );
        assert_eq!(malformed, 1);
    }
    // Nothing at all is a clean end.
    assert_eq!(open(Vec::new(), &KEY).0, Ok(Vec::new()));
}

#[test]
fn a_record_stopped_half_way_fails_at_the_deadline() {
    let bytes = sealed(&[vec![1; 1000]]);
    let stats = Arc::new(PeerStats::default());
    let result = runtime().block_on(async {
        let (mut near, far) = tokio::io::duplex(64 << 10);
        near.write_all(&bytes[..500]).await.expect("write");
        let deadline = Duration::from_millis(100);
        let mut reader = OpenedReader::new(far, &KEY, stats.clone(), deadline);
        let mut plain = [0u8; 10];
        let started = std::time::Instant::now();
        let result = reader.read(&mut plain).await.map_err(|error| error.kind());
        (result, started.elapsed(), near)
    });
    assert_eq!(result.0, Err(std::io::ErrorKind::TimedOut));
    assert!(result.1 < Duration::from_secs(2), "{:?}", result.1);
    assert_eq!(stats.frames_rejected.stalled.load(Ordering::Relaxed), 1);
}
