use super::*;
use rand::{Rng, SeedableRng};

fn request(dtype: Dtype) -> ExpertRequest {
    let width = 5;
    let groups = vec![(3, 2), (17, 0), (895, 3)];
    let rows = (0..5 * width)
        .map(|i| (i as f32) * 0.371 - 3.3 + 1e-7 * i as f32)
        .collect();
    ExpertRequest {
        layer: 7,
        placement_version: 42,
        width: width as u32,
        dtype,
        groups,
        rows,
        trace: None,
    }
}

#[test]
fn request_round_trips_f32_bit_exact() {
    let mut original = request(Dtype::F32);
    original.rows[0] = f32::MIN_POSITIVE / 3.0;
    original.rows[1] = -0.0;
    original.rows[2] = f32::INFINITY;
    let bytes = encode_request(99, &original).expect("encode");
    assert_eq!(bytes.len(), HEADER_LEN + 3 * 8 + 25 * 4);
    let (header, body) = decode(&bytes, &WireLimits::default()).expect("decode");
    assert_eq!(header.request_id, 99);
    assert_eq!(header.kind, FrameKind::Request);
    let FrameBody::Request(decoded) = body else {
        panic!("not a request: {body:?}");
    };
    let bits = |rows: &[f32]| rows.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&decoded.rows), bits(&original.rows));
    assert_eq!(decoded.groups, original.groups);
    assert_eq!(decoded.layer, 7);
    assert_eq!(decoded.placement_version, 42);
}

#[test]
fn request_round_trips_bf16_as_half_rounds() {
    let original = request(Dtype::Bf16);
    let bytes = encode_request(1, &original).expect("encode");
    assert_eq!(bytes.len(), HEADER_LEN + 3 * 8 + 25 * 2);
    let (_, body) = decode(&bytes, &WireLimits::default()).expect("decode");
    let FrameBody::Request(decoded) = body else {
        panic!("not a request");
    };
    let expected: Vec<f32> = original
        .rows
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    assert_eq!(decoded.rows, expected);
    assert_eq!(decoded.dtype, Dtype::Bf16);
}

#[test]
fn reply_and_errors_round_trip() {
    let reply = ExpertReply {
        groups: vec![(1, 1)],
        rows: vec![1.5, -2.0],
    };
    let bytes = encode_reply(5, 3, 9, 2, Dtype::F32, &reply).expect("encode");
    let (header, body) = decode(&bytes, &WireLimits::default()).expect("decode");
    assert_eq!((header.request_id, header.layer, header.width), (5, 3, 2));
    assert_eq!(body, FrameBody::Reply(reply));
    let long = "é".repeat(MAX_ERROR_MESSAGE);
    for error in [
        RemoteError::NotHeld {
            layer: 1,
            expert: 2,
        },
        RemoteError::WrongPlacement { theirs: 3, ours: 4 },
        RemoteError::DeviceFailed("cuda out of memory".into()),
        RemoteError::Overloaded,
        RemoteError::Malformed(long.clone()),
    ] {
        let bytes = encode_error(77, &error);
        let (header, body) = decode(&bytes, &WireLimits::default()).expect("decode");
        assert_eq!(header.request_id, 77);
        match (body, &error) {
            (FrameBody::Error(RemoteError::Malformed(got)), RemoteError::Malformed(_)) => {
                assert!(long.starts_with(&got) && got.len() <= MAX_ERROR_MESSAGE);
            }
            (body, _) => assert_eq!(body, FrameBody::Error(error)),
        }
    }
}

#[test]
fn encoding_refuses_rows_that_do_not_match_the_groups() {
    let mut bad = request(Dtype::F32);
    bad.rows.pop();
    assert!(matches!(
        encode_request(1, &bad),
        Err(WireError::Malformed(_))
    ));
    let overflow = ExpertRequest {
        width: u32::MAX,
        groups: vec![(0, u32::MAX), (1, u32::MAX)],
        rows: vec![],
        ..request(Dtype::F32)
    };
    assert!(encode_request(1, &overflow).is_err());
    let zero_width = ExpertRequest {
        width: 0,
        groups: vec![(0, 1)],
        rows: vec![],
        ..request(Dtype::F32)
    };
    assert!(encode_request(1, &zero_width).is_err());
}

fn good_frame() -> Vec<u8> {
    encode_request(1, &request(Dtype::F32)).expect("encode")
}

#[test]
fn every_header_rejection() {
    let limits = WireLimits::default();
    let mut bytes = good_frame();
    bytes[0] = b'X';
    assert!(matches!(
        decode(&bytes, &limits),
        Err(WireError::BadMagic(_))
    ));

    let mut bytes = good_frame();
    bytes[4] = 9;
    let error = decode(&bytes, &limits).expect_err("version");
    assert_eq!(error, WireError::BadVersion { theirs: 9, ours: 1 });
    assert!(error.to_string().contains("9") && error.to_string().contains("speaks 1"));

    let mut bytes = good_frame();
    bytes[5] = 0;
    assert_eq!(decode(&bytes, &limits), Err(WireError::BadKind(0)));

    let mut bytes = good_frame();
    bytes[6] = 1;
    assert!(matches!(
        decode(&bytes, &limits),
        Err(WireError::Malformed(_))
    ));

    let mut bytes = good_frame();
    bytes[36] = 3;
    assert_eq!(decode(&bytes, &limits), Err(WireError::BadDtype(3)));

    let mut bytes = good_frame();
    bytes[38] = 1;
    assert!(matches!(
        decode(&bytes, &limits),
        Err(WireError::Malformed(_))
    ));

    let mut bytes = good_frame();
    bytes[40..44].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        decode(&bytes, &limits),
        Err(WireError::TooLarge { .. })
    ));

    let small = WireLimits {
        max_payload: 16,
        ..limits
    };
    assert!(matches!(
        decode(&good_frame(), &small),
        Err(WireError::TooLarge { .. })
    ));

    let few_groups = WireLimits {
        max_groups: 2,
        ..limits
    };
    assert!(matches!(
        decode(&good_frame(), &few_groups),
        Err(WireError::TooManyGroups { .. })
    ));

    // Width 0 and a group count the payload cannot hold.
    let mut bytes = good_frame();
    bytes[32..36].copy_from_slice(&0u32.to_le_bytes());
    assert!(matches!(
        decode(&bytes, &limits),
        Err(WireError::Malformed(_))
    ));
    let mut bytes = good_frame();
    bytes[28..32].copy_from_slice(&60_000u32.to_le_bytes());
    assert!(matches!(
        decode(&bytes, &limits),
        Err(WireError::Malformed(_))
    ));
}

#[test]
fn payload_rejections() {
    let limits = WireLimits::default();
    // Rows that disagree with the payload length.
    let mut bytes = good_frame();
    bytes[HEADER_LEN + 4..HEADER_LEN + 8].copy_from_slice(&3u32.to_le_bytes());
    assert!(matches!(
        decode(&bytes, &limits),
        Err(WireError::Malformed(_))
    ));
    // Rows x width overflowing u64 must not panic.
    let mut bytes = good_frame();
    bytes[32..36].copy_from_slice(&u32::MAX.to_le_bytes());
    for group in 0..3 {
        let at = HEADER_LEN + group * 8 + 4;
        bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    }
    assert!(decode(&bytes, &limits).is_err());
    // Truncated and trailing bytes.
    let bytes = good_frame();
    assert!(matches!(
        decode(&bytes[..bytes.len() - 1], &limits),
        Err(WireError::Truncated { .. })
    ));
    assert!(matches!(
        decode(&bytes[..10], &limits),
        Err(WireError::Truncated { .. })
    ));
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(
        decode(&long, &limits),
        Err(WireError::Malformed(_))
    ));
    // Error frames: unknown code, bad UTF-8, trailing bytes.
    let mut bytes = encode_error(1, &RemoteError::Overloaded);
    bytes[HEADER_LEN] = 200;
    assert!(matches!(
        decode(&bytes, &limits),
        Err(WireError::Malformed(_))
    ));
    let mut bytes = encode_error(1, &RemoteError::DeviceFailed("ab".into()));
    bytes[HEADER_LEN + 5] = 0xff;
    assert!(matches!(
        decode(&bytes, &limits),
        Err(WireError::Malformed(_))
    ));
}

#[test]
fn bf16_conversions_match_the_half_crate_bit_for_bit() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let specials = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0xffff_ffff),
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x7f7f_ffff),
    ];
    let values: Vec<f32> = specials
        .into_iter()
        .chain((0..100_000).map(|_| f32::from_bits(rng.random())))
        .collect();
    let expected: Vec<u16> = values
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let all_bits: Vec<u16> = (0..=u16::MAX).collect();
    let widened: Vec<u32> = all_bits
        .iter()
        .map(|&bits| half::bf16::from_bits(bits).to_f32().to_bits())
        .collect();
    // Offset 0 takes the word loops, offset 1 the byte-pair loops.
    for offset in [0, 1] {
        let mut buffer = vec![0u8; offset + 2 * values.len()];
        encode_values(&values, Dtype::Bf16, &mut buffer[offset..]);
        for (i, pair) in buffer[offset..].chunks_exact(2).enumerate() {
            let got = u16::from_le_bytes([pair[0], pair[1]]);
            assert_eq!(got, expected[i], "{:#010x}", values[i].to_bits());
        }
        let mut buffer = vec![0u8; offset + 2 * all_bits.len()];
        for (pair, bits) in buffer[offset..].chunks_exact_mut(2).zip(&all_bits) {
            pair.copy_from_slice(&bits.to_le_bytes());
        }
        let mut out = vec![0.0f32; all_bits.len()];
        decode_values(&buffer[offset..], Dtype::Bf16, &mut out);
        for (bits, (value, want)) in all_bits.iter().zip(out.iter().zip(&widened)) {
            assert_eq!(value.to_bits(), *want, "{bits:#06x}");
        }
    }
}

#[test]
fn f32_values_round_trip_at_every_alignment() {
    let values: Vec<f32> = (0..1001).map(|i| i as f32 * -0.37).collect();
    for offset in 0..4 {
        let mut buffer = vec![0u8; offset + 4 * values.len()];
        encode_values(&values, Dtype::F32, &mut buffer[offset..]);
        for (chunk, value) in buffer[offset..].chunks_exact(4).zip(&values) {
            assert_eq!(chunk, value.to_le_bytes());
        }
        let mut out = vec![0.0f32; values.len()];
        decode_values(&buffer[offset..], Dtype::F32, &mut out);
        assert_eq!(out, values);
    }
}

#[test]
fn a_rows_frame_is_the_encoded_frame() {
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let original = request(dtype);
        let whole = encode_request(4, &original).expect("encode");
        let frame = request_frame(4, original).expect("frame");
        assert_eq!(frame.len(), whole.len());
        assert_eq!(frame.to_bytes(), whole);
    }
}

#[test]
fn random_garbage_and_truncations_never_panic() {
    let limits = WireLimits::default();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let frames = [
        good_frame(),
        encode_request(2, &request(Dtype::Bf16)).expect("encode"),
        encode_error(3, &RemoteError::DeviceFailed("x".into())),
    ];
    for frame in &frames {
        for cut in 0..frame.len() {
            assert!(decode(&frame[..cut], &limits).is_err());
        }
    }
    for _ in 0..20_000 {
        let frame = &frames[rng.random_range(0..frames.len())];
        let mut bytes = frame.clone();
        for _ in 0..rng.random_range(1..4) {
            let at = rng.random_range(0..bytes.len());
            bytes[at] = rng.random();
        }
        let _ = decode(&bytes, &limits);
        let len = rng.random_range(0..200);
        let garbage: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let _ = decode(&garbage, &limits);
    }
}

/// A request encoded from its head and its rows in parts (as the peer client sends the
/// dispatcher's groups) is the frame of the whole request, byte for byte; rows that do not
/// match the groups are refused there too.
#[test]
fn a_request_encoded_from_parts_is_the_whole_requests_frame() {
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let whole = request(dtype);
        let head = RequestHead {
            layer: whole.layer,
            placement_version: whole.placement_version,
            width: whole.width,
            dtype,
            groups: whole.groups.clone(),
            trace: None,
        };
        let width = whole.width as usize;
        let (first, rest) = whole.rows.split_at(whole.groups[0].1 as usize * width);
        let mut bytes = request_head_prefix(9, &head, whole.rows.len()).expect("prefix");
        for part in [first, rest] {
            encode_values_append(part, dtype, &mut bytes);
        }
        assert_eq!(
            bytes,
            encode_request(9, &whole).expect("encode"),
            "{dtype:?}"
        );
        assert!(request_head_prefix(9, &head, whole.rows.len() - 1).is_err());
    }
}

#[test]
fn a_traced_request_carries_its_context_between_groups_and_rows() {
    let trace = TraceContext {
        trace_id: [7; 16],
        span_id: [9; 8],
        flags: 1,
    };
    let original = ExpertRequest {
        trace: Some(trace),
        ..request(Dtype::Bf16)
    };
    let bytes = encode_request(5, &original).expect("encode");
    assert_eq!(bytes.len(), HEADER_LEN + 3 * 8 + TRACE_LEN + 25 * 2);
    assert_eq!(&bytes[6..8], &1u16.to_le_bytes(), "the traced flag");
    let (header, body) = decode(&bytes, &WireLimits::default()).expect("decode");
    assert!(header.traced);
    let FrameBody::Request(decoded) = body else {
        panic!("not a request: {body:?}");
    };
    assert_eq!(decoded.trace, Some(trace));
    assert_eq!(decoded.groups, original.groups);
    assert_eq!(decoded.rows.len(), original.rows.len());
    // The same request from parts is the same frame.
    let head = RequestHead {
        layer: original.layer,
        placement_version: original.placement_version,
        width: original.width,
        dtype: original.dtype,
        groups: original.groups.clone(),
        trace: Some(trace),
    };
    let mut parts = request_head_prefix(5, &head, original.rows.len()).unwrap();
    encode_values_append(&original.rows, original.dtype, &mut parts);
    assert_eq!(parts, bytes);

    // A zero trace id is refused; so is the flag on a reply.
    let mut zero = bytes.clone();
    let at = HEADER_LEN + 3 * 8;
    zero[at..at + 16].fill(0);
    assert!(decode(&zero, &WireLimits::default()).is_err());
    let reply = encode_reply(
        5,
        7,
        42,
        5,
        Dtype::F32,
        &ExpertReply {
            groups: vec![(3, 1)],
            rows: vec![0.5; 5],
        },
    )
    .unwrap();
    let mut flagged = reply.clone();
    flagged[6] = 1;
    assert!(decode(&reply, &WireLimits::default()).is_ok());
    assert!(decode(&flagged, &WireLimits::default()).is_err());
    // Cut anywhere, a traced frame is an error, never a panic.
    for end in 0..bytes.len() {
        assert!(decode(&bytes[..end], &WireLimits::default()).is_err());
    }
}
