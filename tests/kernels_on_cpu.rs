//! The logic of the CUDA kernels (kernels/moe.cu, kernels/dense.cu), checked on the CPU against the Rust code
//! they follow: the kernel source is compiled with g++ against kernels/emulated/cuda_on_cpu.h,
//! which runs each CUDA thread as an OS thread with real barriers and warp shuffles. This
//! does not test the GPU (tests/gpu_kernels.rs does, where there is one); it tests the kernels'
//! arithmetic, ordering, tie-breaking and indexing on every machine with g++.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use half::bf16;
use moe_node::compute::cpu::{Linear, SwiGlu, rms_norm};
use moe_node::compute::cuda::kernels::{DENSE, MOE, full_source};
use moe_node::compute::cuda::storage::{ExpertStorage, MatrixForm};
use moe_node::compute::quant::{QuantFormat, QuantLinear};
use moe_node::model::ExpertWeights;
use moe_node::model::config::GatingConfig;
use moe_node::model::config::RopeScaling;
use moe_node::model::dummy::{DummyFill, DummyWeights};
use moe_node::moe::{DispatchPlan, Routing, route};

mod common;
use common::{AttentionCase, RopeCase, assert_close, skipped, values};
#[path = "../benches/common/quantize.rs"]
#[allow(dead_code)]
mod quantize;

/// The harness built once for all tests, or why it could not be.
fn harness() -> Option<&'static Path> {
    static HARNESS: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = HARNESS.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernels_on_cpu");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        // Dynamic shared memory is the one construct plain C++ has no spelling for.
        let shim = |source: &str| {
            source.replace(
                "extern __shared__ float smem[];",
                "float* smem = reinterpret_cast<float*>(smem_.data());",
            )
        };
        // The prelude once (with moe.cu), then dense.cu alone.
        let moe = shim(&full_source(&MOE));
        let dense = shim(&format!("#line 1 \"dense.cu\"\n{}", DENSE.source));
        std::fs::write(dir.join("kernels.inc"), moe).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("dense.inc"), dense).map_err(|e| e.to_string())?;
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let emulated = root.join("tests/emulated");
        let header = root.join("kernels/emulated");
        let exe = dir.join("harness");
        let out = Command::new("g++")
            .args(["-std=c++20", "-O1", "-pthread", "-w"])
            .arg("-I")
            .arg(&dir)
            .arg("-I")
            .arg(&header)
            .arg(emulated.join("harness.cpp"))
            .arg("-o")
            .arg(&exe)
            .output()
            .map_err(|e| format!("g++ not available: {e}"))?;
        if !out.status.success() {
            panic!(
                "the kernels do not compile as C++:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(exe)
    });
    match built {
        Ok(exe) => Some(exe),
        // CI sets it (and installs g++): there, no compiler is a failure, not a skip.
        Err(e) if std::env::var_os("MOE_TEST_REQUIRE_GXX").is_some() => {
            panic!("MOE_TEST_REQUIRE_GXX is set: {e}")
        }
        Err(e) => {
            skipped(&format!(
                "the CUDA kernels' CPU emulation is not checked: {e}"
            ));
            None
        }
    }
}

/// Runs the harness in `mode` on `input`; returns each output line as numbers.
fn run(exe: &Path, mode: &str, input: &str) -> Vec<Vec<f64>> {
    let mut child = Command::new(exe)
        .arg(mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "harness {mode} failed");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split_whitespace().map(|v| v.parse().unwrap()).collect())
        .collect()
}

fn join<T: ToString>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join(" ")
}

fn check_gate(gating: GatingConfig, experts: usize, k: usize, bias: bool, tokens: usize) {
    let Some(exe) = harness() else { return };
    let logits = values(tokens * experts, experts as u64 + k as u64);
    let bias_values = bias.then(|| {
        values(experts, 3)
            .iter()
            .map(|v| v * 0.1)
            .collect::<Vec<_>>()
    });
    let (scoring, n_group, topk_group, renorm, scale) = match gating {
        GatingConfig::Softmax { renormalize } => (0, 1, 1, renormalize, 1.0),
        GatingConfig::SigmoidGrouped {
            n_group,
            topk_group,
            normalize,
            routed_scaling_factor,
        } => (1, n_group, topk_group, normalize, routed_scaling_factor),
    };
    let mut input = format!(
        "{experts} {k} {scoring} {n_group} {topk_group} {} {scale} {} {tokens}\n{}\n",
        renorm as i32,
        bias as i32,
        join(&logits)
    );
    if let Some(b) = &bias_values {
        input += &join(b);
    }
    let out = run(exe, "gate", &input);
    let expected = route(&gating, &logits, experts, k, bias_values.as_deref());
    let ids: Vec<u32> = out[0].iter().map(|&v| v as u32).collect();
    assert_eq!(ids, expected.experts, "{gating:?}: experts chosen");
    assert_eq!(out[1].len(), expected.weights.len(), "{gating:?}: weights");
    for (got, want) in out[1].iter().zip(&expected.weights) {
        let want = *want as f64;
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1.0),
            "{gating:?}: weight {got} vs {want}"
        );
    }
}

#[test]
fn gating_softmax_renormalised_matches_the_cpu_router() {
    check_gate(GatingConfig::Softmax { renormalize: true }, 64, 8, false, 5);
}

#[test]
fn gating_softmax_raw_at_many_experts_matches_the_cpu_router() {
    check_gate(
        GatingConfig::Softmax { renormalize: false },
        384,
        8,
        false,
        3,
    );
}

#[test]
fn gating_sigmoid_grouped_with_bias_matches_the_cpu_router() {
    let gating = GatingConfig::SigmoidGrouped {
        n_group: 8,
        topk_group: 3,
        normalize: true,
        routed_scaling_factor: 2.5,
    };
    check_gate(gating, 64, 6, true, 5);
}

#[test]
fn gating_sigmoid_one_group_like_kimi_matches_the_cpu_router() {
    let gating = GatingConfig::SigmoidGrouped {
        n_group: 1,
        topk_group: 1,
        normalize: true,
        routed_scaling_factor: 2.827,
    };
    check_gate(gating, 896, 16, true, 2);
}

#[test]
fn permutation_and_combine_match_the_dispatch_plan() {
    let Some(exe) = harness() else { return };
    let (experts, tokens, k, width) = (16usize, 9usize, 4usize, 24usize);
    // k distinct experts per token, as gating gives.
    let mut ids = Vec::new();
    for t in 0..tokens {
        for j in 0..k {
            ids.push(((t * 5 + j * 3) % experts) as u32);
        }
    }
    let weights: Vec<f32> = values(tokens * k, 11)
        .iter()
        .map(|v| v.abs() + 0.1)
        .collect();
    let x = values(tokens * width, 12);
    let input = format!(
        "{experts} {tokens} {k} {width}\n{}\n{}\n{}\n",
        join(&ids),
        join(&weights),
        join(&x)
    );
    let out = run(exe, "permute", &input);

    let routing = Routing {
        top_k: k,
        experts: ids,
        weights,
    };
    let plan = DispatchPlan::new(&routing, experts);
    // The kernel's offsets list every expert; the plan's only those with rows.
    let offsets: Vec<usize> = out[0].iter().map(|&v| v as usize).collect();
    for (i, &e) in plan.experts.iter().enumerate() {
        assert_eq!(offsets[e as usize], plan.offsets[i], "offset of expert {e}");
        assert_eq!(
            offsets[e as usize + 1],
            plan.offsets[i + 1],
            "end of expert {e}"
        );
    }
    // An identity expert: the combine gives each token its rows weighted by its gate.
    let rounded: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    let mut expected = vec![0f32; tokens * width];
    plan.combine(&plan.gather(&rounded, width), width, &mut expected);
    assert_eq!(out[1].len(), expected.len(), "combined values");
    for (got, want) in out[1].iter().zip(&expected) {
        assert!(
            (got - *want as f64).abs() < 1e-5,
            "combined {got} vs {want}"
        );
    }
}

/// The SwiGLU kernel's three activations (plain, gpt-oss's clamped, DeepSeek-V4's clamped)
/// against their definitions in f32, rounded to bf16; the inputs reach the clamps.
#[test]
fn swiglu_matches_each_activation_in_bf16() {
    let Some(exe) = harness() else { return };
    let (rows, inter) = (3usize, 40usize);
    let gate_up: Vec<f32> = values(rows * 2 * inter, 21)
        .iter()
        .map(|v| v * 6.0)
        .collect();
    let silu = |v: f32| v / (1.0 + (-v).exp());
    let (alpha, limit) = (1.702f32, 1.5f32);
    type Activation<'a> = &'a dyn Fn(f32, f32) -> f32;
    let activations: [(i32, Activation); 3] = [
        (0, &|g, u| silu(g) * u),
        (1, &|g, u| {
            let g0 = g.min(limit);
            (u.clamp(-limit, limit) + 1.0) * g0 / (1.0 + (-alpha * g0).exp())
        }),
        (2, &|g, u| silu(g.min(limit)) * u.clamp(-limit, limit)),
    ];
    for (mode, activation) in activations {
        let out = run(
            exe,
            "swiglu",
            &format!(
                "{rows} {inter} {mode} {alpha} {limit}\n{}\n",
                join(&gate_up)
            ),
        );
        let r = |v: f32| bf16::from_f32(v).to_f32();
        let mut clamped = 0;
        for row in 0..rows {
            for c in 0..inter {
                let g = r(gate_up[row * 2 * inter + c]);
                let u = r(gate_up[row * 2 * inter + inter + c]);
                clamped += usize::from(g > limit || u.abs() > limit);
                let want = bf16::from_f32(activation(g, u));
                let got = bf16::from_bits(out[0][row * inter + c] as u16);
                // expf may differ from Rust's exp in the last place of f32: one bf16 step.
                let steps = (got.to_bits() as i32 - want.to_bits() as i32).abs();
                assert!(
                    steps <= 1,
                    "mode {mode}: swiglu({g}, {u}) = {got}, want {want}"
                );
            }
        }
        assert!(clamped > 10, "the inputs reach the clamps");
    }
}

#[test]
fn bf16_rounding_matches_the_half_crate_and_widening_is_exact() {
    let Some(exe) = harness() else { return };
    let mut bits: Vec<u32> = values(200, 31)
        .iter()
        .map(|v| (v * 1e3).to_bits())
        .collect();
    bits.extend([
        0x3f80_8000, // a tie: rounds to even
        0x3f81_8000, // a tie: rounds up to even
        0x7f80_0000, // infinity
        0xff80_0000,
        0x7fc0_0000, // NaN
        0x7f80_0001, // signalling NaN: must stay NaN
        0x0000_0001, // subnormal
        0x7f7f_ffff, // largest finite: rounds to infinity
        0x8000_0000, // -0
    ]);
    let out = run(
        exe,
        "to_bf16",
        &format!("{}\n{}\n", bits.len(), join(&bits)),
    );
    assert_eq!(out[0].len(), bits.len(), "to_bf16 values");
    assert_eq!(out[1].len(), bits.len(), "to_f32 values");
    for (&b, &got) in bits.iter().zip(&out[0]) {
        let want = bf16::from_f32(f32::from_bits(b));
        let got = bf16::from_bits(got as u16);
        if want.is_nan() {
            assert!(got.is_nan(), "{b:#x}: NaN became {got}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{b:#x}");
        }
    }
    // to_f32 widens exactly: the bits of the bf16 in the top half.
    for (&bf, &back) in out[0].iter().zip(&out[1]) {
        assert_eq!(back as u32, (bf as u32) << 16, "to_f32 of {:#x}", bf as u32);
    }
}

fn close(got: &[f64], want: &[f32], tolerance: f32, what: &str) {
    let got: Vec<f32> = got.iter().map(|&v| v as f32).collect();
    assert_close(&got, want, tolerance, what);
}

#[test]
fn rms_norm_matches_the_cpu() {
    let Some(exe) = harness() else { return };
    let (rows, width, eps) = (3usize, 200usize, 1e-6f32);
    let x: Vec<f32> = values(rows * width, 41).iter().map(|v| v * 3.0).collect();
    let w: Vec<f32> = values(width, 42).iter().map(|v| 1.0 + v * 0.1).collect();
    let out = run(
        exe,
        "rms_norm",
        &format!(
            "{rows} {width} {width} {eps:e}\n{}\n{}\n",
            join(&x),
            join(&w)
        ),
    );
    close(&out[0], &rms_norm(&x, &w, eps), 1e-5, "rms_norm");
}

#[test]
fn rms_norm_of_the_first_columns_of_wider_rows_leaves_the_rest() {
    // MLA's latent: the first kv_lora_rank values of [latent | rotary key] rows.
    let Some(exe) = harness() else { return };
    let (rows, width, stride, eps) = (4usize, 48usize, 56usize, 1e-6f32);
    let x: Vec<f32> = values(rows * stride, 43);
    let w: Vec<f32> = values(width, 44).iter().map(|v| 1.0 + v * 0.1).collect();
    let out = run(
        exe,
        "rms_norm",
        &format!(
            "{rows} {width} {stride} {eps:e}\n{}\n{}\n",
            join(&x),
            join(&w)
        ),
    );
    let mut expected = x.clone();
    for row in expected.chunks_exact_mut(stride) {
        let normed = rms_norm(&row[..width], &w, eps);
        row[..width].copy_from_slice(&normed);
    }
    close(&out[0], &expected, 1e-5, "strided rms_norm");
}

/// Rows appended to paged caches land, rounded to bf16, in the pool rows their block tables
/// name, and nowhere else.
#[test]
fn store_rows_writes_each_row_where_its_block_table_says() {
    use moe_node::compute::cuda::dense::KV_BLOCK;
    let Some(exe) = harness() else { return };
    let width = 5;
    // Sequence 0 holds blocks [3, 0], sequence 1 block [2]; block 1 is free. Sequence 0
    // gets a prefill row at position 17 and one at 2, sequence 1 a decode row at 4.
    let table = [3i32, 0, 2, -1];
    let pool = values(4 * KV_BLOCK * width, 45);
    let (row_seq, row_pos) = ([0usize, 1, 0], [17usize, 4, 2]);
    let src = values(3 * width, 47);
    let input = format!(
        "{width} 4 2 2\n{}\n{}\n3\n{}\n{}\n{}\n",
        join(&pool),
        join(&table),
        join(&row_seq),
        join(&row_pos),
        join(&src)
    );
    let out = run(exe, "store_rows", &input);
    // The pool is bf16: what it held and what is stored, rounded.
    let mut expected: Vec<f32> = pool.iter().map(|&v| common::bf16_exact(v)).collect();
    let src: Vec<f32> = src.iter().map(|&v| common::bf16_exact(v)).collect();
    // Pool rows: (0, 17) block 0 row 1; (1, 4) block 2 row 4; (0, 2) block 3 row 2.
    for (r, pool_row) in [(0usize, 1), (1, 2 * KV_BLOCK + 4), (2, 3 * KV_BLOCK + 2)] {
        expected[pool_row * width..][..width].copy_from_slice(&src[r * width..][..width]);
    }
    close(&out[0], &expected, 0.0, "the pool");
}

#[test]
fn copy_rows_and_residual_adds_touch_only_what_they_should() {
    let Some(exe) = harness() else { return };
    // The first 3 values of rows 7 apart into rows 10 apart (MLA's rotary query, from the
    // projected queries into the tail of the attention query; the launcher offsets both).
    let (rows, src_stride, dst_stride, width) = (6usize, 7usize, 10usize, 3usize);
    let src = values(rows * src_stride, 48);
    let dst = values(rows * dst_stride, 49);
    let out = run(
        exe,
        "copy_rows",
        &format!(
            "{rows} {src_stride} {dst_stride} {width}\n{}\n{}\n",
            join(&src),
            join(&dst)
        ),
    );
    let mut expected = dst.clone();
    for r in 0..rows {
        expected[r * dst_stride..][..width].copy_from_slice(&src[r * src_stride..][..width]);
    }
    close(&out[0], &expected, 0.0, "copy_rows");

    let (n, bias_width) = (300usize, 12usize);
    let (x, y, bias) = (values(n, 50), values(n, 51), values(bias_width, 52));
    let out = run(
        exe,
        "add",
        &format!(
            "{n} {bias_width}\n{}\n{}\n{}\n",
            join(&x),
            join(&y),
            join(&bias)
        ),
    );
    let expected: Vec<f32> = (0..n).map(|i| x[i] + y[i] + bias[i % bias_width]).collect();
    close(&out[0], &expected, 1e-6, "add_rows then add_bias");
}

fn check_rope(interleaved: bool, scaling: RopeScaling) {
    let Some(exe) = harness() else { return };
    let case = RopeCase::new(interleaved, scaling);
    let out = run(
        exe,
        "rope",
        &format!(
            "{} {} {} {} {} {}\n{}\n{}\n{}\n",
            case.rows,
            case.heads,
            case.head_width,
            case.offset,
            case.rope_dim,
            interleaved as i32,
            join(&case.x),
            join(&case.cos),
            join(&case.sin)
        ),
    );
    close(&out[0], &case.expected(), 1e-6, "rope");
}

#[test]
fn rope_rotate_half_matches_the_cpu() {
    check_rope(false, RopeScaling::None);
}

#[test]
fn rope_interleaved_with_yarn_matches_the_cpu() {
    check_rope(true, common::yarn());
}

fn check_attention(mla: bool, window: usize) {
    check_attention_case(AttentionCase::new(mla, window), mla);
}

fn check_attention_case(c: AttentionCase, mla: bool) {
    check_attention_kernel(&c, mla, None);
    if !mla {
        // The prefill kernel, in tiles of 2 rows (the case's prefill rows make a tile of 2 and
        // one of 1) and of 16 (one of 3).
        for rows in [2, 16] {
            check_attention_kernel(&c, mla, Some(rows));
        }
    } else {
        // The kernel of heads that share their keys, in groups of 1, 3 (one of 3, one of 1)
        // and all 4 heads.
        for heads in [1, 3, 4] {
            check_attention_kernel(&c, mla, Some(heads));
        }
    }
}

/// The per-row kernel, or the prefill kernel in tiles of `group` rows (GQA), or the kernel
/// of heads sharing their keys in groups of `group` heads (MLA).
fn check_attention_kernel(c: &AttentionCase, mla: bool, group: Option<usize>) {
    let Some(exe) = harness() else { return };
    let shape = &c.shape;
    let keys = common::paged(&c.keys, shape.kv_stride);
    let mut input = format!(
        "{} {:e} {} {} {} {}\n{}\n",
        join(&shape.kernel_ints()),
        shape.scale,
        mla as i32,
        c.keys.len(),
        keys.blocks,
        keys.table_stride,
        join(&keys.pool)
    );
    if !mla {
        input += &format!(
            "{}\n",
            join(&common::paged(&c.values, shape.kv_stride).pool)
        );
    }
    input += &format!("{}\n", join(&keys.table));
    let seqs: Vec<usize> = c.rows.iter().map(|r| r.0).collect();
    let positions: Vec<usize> = c.rows.iter().map(|r| r.1).collect();
    input += &format!(
        "{}\n{}\n{}\n{}\n",
        c.rows.len(),
        join(&seqs),
        join(&positions),
        join(&c.q)
    );
    let mode = match group {
        Some(n) => {
            input += &format!("{n}\n");
            if mla { "attend_heads" } else { "attend_tiles" }
        }
        None => "attend",
    };
    let out = run(exe, mode, &input);
    close(&out[0], &c.expected(), 1e-5, mode);
}

#[test]
fn attention_gqa_over_a_long_cache_and_a_prefill_chunk_matches_the_cpu() {
    check_attention(false, 0);
}

#[test]
fn attention_gqa_in_a_sliding_window_matches_the_cpu() {
    check_attention(false, 4);
}

/// Llama 4's chunked layers: each row sees its own chunk of 8 positions.
#[test]
fn attention_gqa_in_chunks_matches_the_cpu() {
    let mut c = AttentionCase::new(false, 0);
    c.shape.chunk = Some(8);
    check_attention_case(c, false);
}

#[test]
fn attention_mla_absorbed_matches_the_cpu() {
    check_attention(true, 0);
}

#[test]
fn grouped_gemv_matches_the_products_in_bf16() {
    let Some(exe) = harness() else { return };
    // Three experts with 1, 8 and 3 rows; m not a multiple of the warps per block.
    let (m, k) = (37usize, 64usize);
    let rows = [1usize, 8, 3];
    let r = |v: f32| bf16::from_f32(v).to_f32();
    let mut input = format!("{} {m} {k}\n", rows.len());
    let mut expected = Vec::new();
    for (g, &n) in rows.iter().enumerate() {
        let a: Vec<f32> = values(m * k, 90 + g as u64).iter().map(|&v| r(v)).collect();
        let b: Vec<f32> = values(n * k, 95 + g as u64).iter().map(|&v| r(v)).collect();
        input += &format!("{n}\n{}\n{}\n", join(&a), join(&b));
        let mut c = Vec::new();
        for j in 0..n {
            for row in 0..m {
                let dot: f32 = (0..k).map(|i| a[row * k + i] * b[j * k + i]).sum();
                c.push(bf16::from_f32(dot));
            }
        }
        expected.push(c);
    }
    let out = run(exe, "gemv", &input);
    assert_eq!(out.len(), expected.len(), "gemv groups");
    for (g, (got, want)) in out.iter().zip(&expected).enumerate() {
        assert_eq!(got.len(), want.len(), "group {g}");
        for (i, (&got, want)) in got.iter().zip(want).enumerate() {
            // Summation order differs from the CPU's: one bf16 step at most.
            let steps = (got as i32 - want.to_bits() as i32).abs();
            assert!(
                steps <= 1,
                "group {g} value {i}: {got} vs {}",
                want.to_bits()
            );
        }
    }
}

/// The device's dummy weights (`--load-format dummy` on a GPU) are the host's, bit for bit,
/// across more than one of the host's chunks.
#[test]
fn dummy_weights_made_by_the_kernel_equal_the_hosts() {
    let Some(exe) = harness() else { return };
    let dummy = DummyWeights::new(11, false);
    let name = "model.layers.2.mlp.experts.5.down_proj.weight";
    let shape = [72, 1000];
    let DummyFill::Uniform { stream, half_width } = dummy.fill(name, &shape) else {
        panic!("a matrix is uniform");
    };
    let n = shape[0] * shape[1];
    let out = run(
        exe,
        "fill_dummy",
        &format!("{n} {stream} {}\n", half_width.to_bits()),
    );
    let host: Vec<f64> = dummy
        .bytes(name, &shape)
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]) as f64)
        .collect();
    assert_eq!(out[0].len(), n);
    assert!(out[0] == host, "the kernel's values differ from the host's");
}

/// An expert of hidden size `h` and intermediate size `i` in a quantized form: random
/// weights quantized as the published tools do, with FP8 blocks or INT4 groups as given.
/// `f32_scales` makes the INT4 scales f32 values that bf16 cannot hold.
fn quantized_expert(h: usize, i: usize, seed: u64, form: &str, size: [usize; 2]) -> ExpertWeights {
    let linear = |rows: usize, cols: usize, seed: u64| {
        let scale = (cols as f32).powf(-0.5);
        Linear::without_bias(
            values(rows * cols, seed)
                .iter()
                .map(|v| v * scale)
                .collect(),
            rows,
            cols,
        )
    };
    let block = SwiGlu {
        gate: linear(i, h, seed),
        up: linear(i, h, seed + 1),
        down: linear(h, i, seed + 2),
    };
    let int4_f32 = |l: &Linear| {
        let q = quantize::to_int4_groups(l, size[0]);
        let QuantFormat::Int4 { packed, scales, .. } = &q.format else {
            unreachable!()
        };
        let scales = (0..scales.len())
            .map(|n| scales.get(n) * (1.0 + (n % 5) as f32 / 4096.0))
            .collect();
        QuantLinear::int4(
            packed.clone(),
            scales,
            q.out_features,
            q.in_features,
            size[0],
        )
        .unwrap()
    };
    ExpertWeights::Quantized(match form {
        "fp8" => quantize::quantize(&block, |l| quantize::to_fp8_blocks(l, size)),
        "int4" => quantize::quantize(&block, |l| quantize::to_int4_groups(l, size[0])),
        "int4_f32" => quantize::quantize(&block, int4_f32),
        _ => unreachable!(),
    })
}

/// The harness's header for one of a slot's matrices: its form's numbers and where it lies.
fn slot_header(
    form: MatrixForm,
    matrix_at: usize,
    groups: usize,
    m: usize,
    k: usize,
    slot: usize,
) -> String {
    let (kind, offset, p) = match form {
        MatrixForm::Bf16 => (0, 0, [0, 0, 0]),
        MatrixForm::Fp8 {
            scale_offset,
            block_rows,
            block_cols,
            split,
        } => (1, scale_offset, [block_rows, block_cols, split]),
        MatrixForm::Int4 {
            scale_offset,
            group,
            scales_bf16,
        } => (2, scale_offset, [group, scales_bf16, 0]),
    };
    format!(
        "{kind} {offset} {} {} {} {matrix_at} {groups} {m} {k} {slot}\n",
        p[0], p[1], p[2]
    )
}

/// Quantized experts as a GPU holds them ([`ExpertStorage::pack`]'s slots), read by the
/// kernels that decode them: the widening for the grouped GEMM gives the host's bf16 of
/// every dequantized weight, bit for bit, and the grouped GEMV the products of the
/// dequantized weights. FP8 blocks that leave partial ones at the edges and whose columns
/// are not a multiple of the kernels' eight; INT4 groups of 32 and of 12, bf16 and f32
/// scales.
#[test]
fn quantized_slots_widen_and_multiply_as_the_host_dequantizes() {
    let Some(exe) = harness() else { return };
    let (h, i) = (72usize, 40usize);
    let cases: [(&str, [usize; 2]); 5] = [
        ("fp8", [16, 20]),
        ("fp8", [128, 128]),
        ("int4", [32, 0]),
        ("int4", [12, 0]),
        ("int4_f32", [32, 0]),
    ];
    for (form, size) in cases {
        let experts: Vec<ExpertWeights> = (0..3)
            .map(|e| quantized_expert(h, i, 40 + 5 * e, form, size))
            .collect();
        let (storage, widened) = ExpertStorage::of(&experts[0], h, i);
        assert!(
            widened.is_none() && storage.is_quantized(),
            "{form}: {storage:?}"
        );
        let layout = storage.layout(h, i);
        let slots: Vec<Vec<u8>> = experts
            .iter()
            .map(|e| storage.pack(e, h, i).unwrap())
            .collect();
        let forms = storage.forms(h, i);
        // gate|up [2I, H] at the slot's start, down [H, I] after it.
        for (which, (form_of, at, m, k)) in [(forms[0], 0, 2 * i, h), (forms[1], layout.down, h, i)]
            .into_iter()
            .enumerate()
        {
            let dequantized: Vec<Vec<f32>> = experts
                .iter()
                .map(|e| {
                    let ExpertWeights::Quantized(b) = e else {
                        unreachable!()
                    };
                    match which {
                        0 => [b.gate.widen(), b.up.widen()].concat(),
                        _ => b.down.widen(),
                    }
                })
                .collect();
            let header = slot_header(form_of, at, slots.len(), m, k, layout.bytes);
            let mut input = header.clone();
            for slot in &slots {
                input += &join(slot);
                input += "\n";
            }
            let widened = run(exe, "widen_slot", &input);
            assert_eq!(widened.len(), slots.len(), "one matrix per slot");
            for (g, (got, want)) in widened.iter().zip(&dequantized).enumerate() {
                let want: Vec<f64> = want
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_bits() as f64)
                    .collect();
                assert!(
                    *got == want,
                    "{form} {size:?}, matrix {which}, expert {g}: widened weights differ"
                );
            }

            // One, five and eight input rows.
            let rows = [1usize, 5, 8];
            let mut input = header;
            let mut expected = Vec::new();
            for (g, slot) in slots.iter().enumerate() {
                let x: Vec<f32> = values(rows[g] * k, 70 + g as u64)
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_f32())
                    .collect();
                input += &format!("{}\n{}\n{}\n", join(slot), rows[g], join(&x));
                // The device computes with each weight rounded to bf16, as it widens them.
                let w: Vec<f32> = dequantized[g]
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_f32())
                    .collect();
                expected.push(
                    (0..rows[g] * m)
                        .map(|n| {
                            let (j, r) = (n / m, n % m);
                            (0..k)
                                .map(|c| w[r * k + c] as f64 * x[j * k + c] as f64)
                                .sum::<f64>()
                        })
                        .collect::<Vec<f64>>(),
                );
            }
            let out = run(exe, "gemv_slot", &input);
            assert_eq!(out.len(), expected.len(), "one product per slot");
            for (g, (got, want)) in out.iter().zip(&expected).enumerate() {
                assert_eq!(got.len(), want.len());
                let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
                for (n, (&got, &want)) in got.iter().zip(want).enumerate() {
                    let got = bf16::from_bits(got as u16).to_f32() as f64;
                    // The bf16 rounding of the output, and f32 sums in another order.
                    assert!(
                        (got - want).abs() <= want.abs() / 128.0 + scale * 1e-5,
                        "{form} {size:?}, matrix {which}, expert {g}, value {n}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
