use super::*;

fn kimi() -> ExpertShape {
    ExpertShape {
        hidden: 7168,
        intermediate: 2048,
        num_experts: 384,
        max_rows: 512 * 8,
        host_io: true,
        storage: ExpertStorage::Bf16,
        activation: Default::default(),
        biases: false,
    }
}

#[test]
fn memory_needed_counts_weights_work_area_and_reserve() {
    let shape = kimi();
    let one_expert = 3 * 7168 * 2048 * 2;
    assert_eq!(
        shape.bytes_needed(2) - shape.bytes_needed(1),
        one_expert,
        "each expert adds its three bf16 matrices"
    );
    // bf16 rows, f32 rows in and out, pointer arrays and group sizes, cuBLAS reserve.
    let work = 4096 * (7168 + 3 * 2048 + 7168) * 2
        + 4096 * 2 * 7168 * 4
        + 8 * 384 * 8
        + 384 * 4
        + BLAS_RESERVE;
    assert_eq!(shape.bytes_needed(0), work);
}

#[test]
fn quantized_experts_take_their_stored_bytes_and_a_widening_scratch() {
    let bf16 = kimi();
    let one_bf16 = bf16.bytes_needed(1) - bf16.bytes_needed(0);
    let fp8 = ExpertShape {
        storage: ExpertStorage::Fp8 {
            block_rows: 128,
            block_cols: 128,
        },
        ..kimi()
    };
    let int4 = ExpertShape {
        storage: ExpertStorage::Int4 {
            group: 32,
            scales_bf16: true,
        },
        ..kimi()
    };
    let weights = 3 * 7168 * 2048;
    // FP8: a byte a weight and an f32 per 128 x 128 block: gate and up 16 x 56 blocks
    // each, down 56 x 16 (every part a multiple of 256 bytes here).
    assert_eq!(
        fp8.bytes_needed(2) - fp8.bytes_needed(1),
        weights + 4 * (2 * 16 * 56 + 56 * 16)
    );
    // INT4: half a byte a weight and a bf16 per 32 weights.
    assert_eq!(
        int4.bytes_needed(2) - int4.bytes_needed(1),
        weights / 2 + weights / 32 * 2
    );
    assert!(fp8.slot_bytes() * 2 < one_bf16 + one_bf16 / 50);
    assert!(int4.slot_bytes() * 3 < one_bf16);
    // Widening for the grouped GEMM: 12 Kimi K2 experts in bf16 (1 GiB at most).
    assert_eq!(bf16.scratch_experts(), 0);
    assert_eq!(fp8.scratch_experts(), 12);
    assert_eq!(fp8.bytes_needed(0) - bf16.bytes_needed(0), 12 * weights * 2);
}

#[test]
fn experts_that_do_not_fit_are_refused_with_the_figures() {
    let shape = kimi();
    // 384 experts of a Kimi K2 layer are 33.8 GB: they fit an H200's 140 GB, but 8
    // layers' worth do not.
    let free = 140usize << 30;
    assert!(check_fit(0, &shape, 384, free, 0.9).is_ok());
    let err = check_fit(3, &shape, 8 * 384, free, 0.9)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("GPU 3: the 3072 experts placed on it need"),
        "{err}"
    );
    assert!(err.contains("MiB may be used (143360 MiB free"), "{err}");
}
