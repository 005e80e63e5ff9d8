//! Dense layers ([`Linear`], [`SwiGlu`]) and the product they run, which picks the kernel by
//! the weights' form and the number of input rows: the AMX tiles, the few-row kernels, or the
//! packed GEMM.

use super::decode::FEW_ROWS;
use super::element::WeightElement;
use super::gemm::{gemm_strided, matmul_widening};
use super::native_bf16;
use super::ops::silu_mul;
use super::tiles::{broadcast_tiles_take, few_rows_widened, matmul_few_rows};
use crate::compute::amx::{self, PackedInputs, TileWeights};

/// A dense row-major weight matrix `[out_features, in_features]` with an optional bias, as
/// `torch.nn.Linear` stores it.
#[derive(Debug, Clone)]
pub struct Linear<W: WeightElement = f32> {
    pub weight: Vec<W>,
    pub bias: Option<Vec<f32>>,
    pub out_features: usize,
    pub in_features: usize,
    /// Outputs clamped to `[min, max]` after the bias: gpt-oss clamps its experts' gate and
    /// up projections (`swiglu_limit`), folded into the SwiGLU block this way (see
    /// `crate::model::weights`).
    pub clamp: Option<[f32; 2]>,
}

impl<W: WeightElement> Linear<W> {
    pub fn without_bias(weight: Vec<W>, out_features: usize, in_features: usize) -> Self {
        Linear {
            weight,
            bias: None,
            out_features,
            in_features,
            clamp: None,
        }
    }

    /// `x [rows, in] -> [rows, out]`, using all cores when the product is large enough.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        self.forward_with(x, rows, true)
    }

    /// As [`Linear::forward`]; `parallel = false` keeps the work on this thread (the caller
    /// is already spreading work over the pool).
    pub fn forward_with(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
        self.forward_packed(x, rows, self.pack(x, rows).as_ref(), parallel)
    }

    /// `x` split and packed for the AMX tiles, where they take this product (bf16 weights,
    /// enough rows, `in_features` whole tiles): done once for products that share `x`.
    fn pack(&self, x: &[f32], rows: usize) -> Option<PackedInputs> {
        W::as_bf16(&self.weight)?;
        if !amx::takes_outputs(self.out_features) {
            return None;
        }
        if native_bf16::in_use() {
            // `"bf16"`: the tiles multiply the rounded inputs (their two lower parts zero).
            return PackedInputs::new(&native_bf16::rounded(x), rows, self.in_features);
        }
        PackedInputs::new(x, rows, self.in_features)
    }

    /// As [`Linear::forward_with`], with `x` already packed for the AMX tiles (`None`: not).
    fn forward_packed(
        &self,
        x: &[f32],
        rows: usize,
        packed: Option<&PackedInputs>,
        parallel: bool,
    ) -> Vec<f32> {
        let mut out = vec![0.0; rows * self.out_features];
        let on_tiles = match (packed, W::as_bf16(&self.weight)) {
            (Some(packed), Some(weight)) => {
                let n = self.out_features;
                amx::matmul_transposed(packed, TileWeights::Bf16(weight), n, &mut out, n, parallel)
            }
            _ => false,
        };
        if !on_tiles {
            matmul_transposed(
                x,
                rows,
                self.in_features,
                &self.weight,
                self.out_features,
                &mut out,
                parallel,
            );
        }
        if let Some(bias) = &self.bias {
            for row in out.chunks_exact_mut(self.out_features) {
                for (o, b) in row.iter_mut().zip(bias) {
                    *o += b;
                }
            }
        }
        if let Some([min, max]) = self.clamp {
            // `f32::clamp` keeps NaN, as torch's clamp does.
            out.iter_mut().for_each(|o| *o = o.clamp(min, max));
        }
        out
    }
}

/// The SwiGLU feed-forward block used by every supported family, dense or expert:
/// `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct SwiGlu<W: WeightElement = f32> {
    pub gate: Linear<W>,
    pub up: Linear<W>,
    pub down: Linear<W>,
}

impl<W: WeightElement> SwiGlu<W> {
    pub fn forward_with(&self, x: &[f32], rows: usize, parallel: bool) -> Vec<f32> {
        // gate and up read the same input: split and pack it once.
        let packed = self.gate.pack(x, rows);
        let mut gate = self.gate.forward_packed(x, rows, packed.as_ref(), parallel);
        let up = self.up.forward_packed(x, rows, packed.as_ref(), parallel);
        silu_mul(&mut gate, &up);
        self.down.forward_with(&gate, rows, parallel)
    }

    /// Bytes of weights this block reads per forward pass.
    pub fn weight_bytes(&self) -> usize {
        std::mem::size_of::<W>()
            * (self.gate.weight.len() + self.up.weight.len() + self.down.weight.len())
    }
}

/// `out [m, n] = x [m, k] · w [n, k]ᵀ`: the product `nn.Linear` computes.
pub fn matmul_transposed<W: WeightElement>(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[W],
    n: usize,
    out: &mut [f32],
    parallel: bool,
) {
    assert_eq!(x.len(), m * k, "lhs size");
    assert_eq!(w.len(), n * k, "rhs size");
    assert_eq!(out.len(), m * n, "output size");
    if m == 0 || n == 0 || k == 0 {
        out.fill(0.0);
        return;
    }
    // `devices.cpu_precision = "bf16"`: inputs rounded to bf16 for every product with bf16
    // weights, so that a row's result does not depend on the rows batched with it. The AMX
    // tiles, where they take the product, multiply the rounded inputs (faster than
    // `vdpbf16ps`, which runs at half the FMA rate on those Xeons); else native bf16 products
    // from `native_bf16::MIN_ROWS` rows; else the exact kernels below, on the rounded inputs.
    let rounded;
    let x = match W::as_bf16(w) {
        Some(weights) if native_bf16::in_use() => {
            rounded = native_bf16::rounded(x);
            if amx::takes_outputs(n)
                && let Some(packed) = PackedInputs::new(&rounded, m, k)
                && amx::matmul_transposed(&packed, TileWeights::Bf16(weights), n, out, n, parallel)
            {
                return;
            }
            if m >= native_bf16::MIN_ROWS
                && native_bf16::matmul_transposed(x, m, k, weights, n, out, parallel)
            {
                return;
            }
            &rounded[..]
        }
        _ => x,
    };
    if let Some(weights) = W::as_bf16(w)
        && amx::takes_outputs(n)
        && let Some(packed) = PackedInputs::new(x, m, k)
        && amx::matmul_transposed(&packed, TileWeights::Bf16(weights), n, out, n, parallel)
    {
        return;
    }
    if m <= FEW_ROWS || (!W::IS_F32 && (m <= few_rows_widened() || broadcast_tiles_take(m))) {
        matmul_few_rows(x, m, k, w, out, parallel);
        return;
    }
    if !W::IS_F32 {
        matmul_widening(x, m, k, n, out, parallel, |first, panel| {
            for (v, w) in panel.iter_mut().zip(&w[first * k..]) {
                *v = w.to_f32();
            }
        });
        return;
    }
    // rhs is wᵀ: element (kk, nn) lies at w[nn * k + kk].
    let w = W::widen(w);
    gemm_strided(
        x,
        m,
        k,
        (k as isize, 1),
        &w,
        n,
        (1, k as isize),
        out,
        parallel,
        false,
    );
}
