//! DeepSeek-V4's learned compressor, as transformers' `DeepseekV4HCACompressor`,
//! `DeepseekV4CSACompressor` and the indexer's own: every `ratio` positions are pooled into
//! one entry, each channel a softmax over the window's positions of `gate + ape` (the learned
//! position bias) weighing the projected values, then RMS-normed (and roped by the caller at
//! the window's first position). The CSA kind pools overlapping windows: each position
//! projects two series, the first for the next window's entry and the second for its own, so
//! entry `w` pools the first series of window `w - 1` with the second of window `w` (the very
//! first entry its own second series only).
//!
//! A window's positions may arrive over several steps: what a sequence keeps between them is
//! [`PoolState`], the rows of the unfinished window and the first series of the last full one.

use crate::compute::cpu::rms_norm_in_place;

/// One compressor's weights-free shape and its learned position bias and norm.
pub struct Pool<'a> {
    pub ratio: usize,
    /// Width of an entry.
    pub width: usize,
    /// Two series per position (CSA) rather than one (HCA).
    pub overlapping: bool,
    /// `[ratio, series * width]`.
    pub ape: &'a [f32],
    pub norm: &'a [f32],
    pub eps: f32,
}

impl Pool<'_> {
    fn series(&self) -> usize {
        if self.overlapping { 2 } else { 1 }
    }
}

/// What a sequence keeps of one compressor.
#[derive(Debug, Clone, Default)]
pub struct PoolState {
    /// Projected values and gates of the unfinished window's positions, `[rows, series * width]`.
    buffer_kv: Vec<f32>,
    buffer_gate: Vec<f32>,
    /// The last full window's first series: values and gates with the position bias added,
    /// `[ratio, width]` each (overlapping pools only).
    overlap: Option<(Vec<f32>, Vec<f32>)>,
    /// Every entry so far, `[entries, width]`, normed and roped.
    pub entries: Vec<f32>,
}

impl PoolState {
    /// The state a step starts from: the unfinished window copied, the entries moved (they
    /// only grow: a step appends to them, and [`super::attention::LayerState::restore`] cuts
    /// them back to what they were where the step fails), so a step costs no copy of the
    /// sequence's entries.
    pub(super) fn begin_step(&mut self) -> PoolState {
        PoolState {
            buffer_kv: self.buffer_kv.clone(),
            buffer_gate: self.buffer_gate.clone(),
            overlap: self.overlap.clone(),
            entries: std::mem::take(&mut self.entries),
        }
    }

    /// Entries so far.
    pub fn len(&self, width: usize) -> usize {
        self.entries.len() / width.max(1)
    }

    /// Floats held besides the entries (for the accounting of memory).
    pub fn pending_floats(&self) -> usize {
        self.buffer_kv.len()
            + self.buffer_gate.len()
            + self.overlap.as_ref().map_or(0, |(k, g)| k.len() + g.len())
    }

    /// Takes the projected rows `kv` and `gate` (`[rows, series * width]`) of the next positions,
    /// pools every window they complete and appends its entry, roped by `rope(entry, first
    /// position of its window)`.
    pub fn push(
        &mut self,
        pool: &Pool,
        kv: &[f32],
        gate: &[f32],
        rope: &dyn Fn(&mut [f32], usize),
    ) {
        let row = pool.series() * pool.width;
        self.buffer_kv.extend_from_slice(kv);
        self.buffer_gate.extend_from_slice(gate);
        let window = pool.ratio * row;
        while self.buffer_kv.len() >= window && window > 0 {
            let kv: Vec<f32> = self.buffer_kv.drain(..window).collect();
            let gate: Vec<f32> = self.buffer_gate.drain(..window).collect();
            let mut entry = self.pool_window(pool, &kv, &gate);
            rms_norm_in_place(&mut entry, pool.norm, pool.eps);
            let position = self.len(pool.width) * pool.ratio;
            rope(&mut entry, position);
            self.entries.extend_from_slice(&entry);
        }
    }

    /// One full window's entry (before the norm), updating the overlap.
    fn pool_window(&mut self, pool: &Pool, kv: &[f32], gate: &[f32]) -> Vec<f32> {
        let (ratio, width) = (pool.ratio, pool.width);
        let row = pool.series() * width;
        // The series this window's own entry pools: the second where there are two.
        let own = if pool.overlapping { width } else { 0 };
        let mut entry = vec![0.0; width];
        let mut logits = Vec::with_capacity(2 * ratio);
        let mut values = Vec::with_capacity(2 * ratio);
        for (c, out) in entry.iter_mut().enumerate() {
            logits.clear();
            values.clear();
            if let Some((prior_kv, prior_gate)) = &self.overlap {
                for r in 0..ratio {
                    logits.push(prior_gate[r * width + c]);
                    values.push(prior_kv[r * width + c]);
                }
            }
            for r in 0..ratio {
                let i = r * row + own + c;
                logits.push(gate[i] + pool.ape[i]);
                values.push(kv[i]);
            }
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let weights: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f32 = weights.iter().sum();
            *out = weights.iter().zip(&values).map(|(w, v)| w / sum * v).sum();
        }
        if pool.overlapping {
            let mut prior_kv = Vec::with_capacity(ratio * width);
            let mut prior_gate = Vec::with_capacity(ratio * width);
            for r in 0..ratio {
                let first = r * row..r * row + width;
                prior_kv.extend_from_slice(&kv[first.clone()]);
                prior_gate.extend(first.map(|i| gate[i] + pool.ape[i]));
            }
            self.overlap = Some((prior_kv, prior_gate));
        }
        entry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_rope(_: &mut [f32], _: usize) {}

    /// Windows of 2 positions, entries of 2 channels. Channel 0 weighs values 1 and 3 by
    /// softmax(0, ln 3) = (1/4, 3/4): 2.5; channel 1 values 2 and 0 by (1/2, 1/2): 1. RMS of
    /// (2.5, 1) is sqrt(3.625), so the entry is (2.5, 1) / 1.90394. A third position waits
    /// for its window; the fourth completes it.
    #[test]
    fn a_window_pools_by_the_softmax_of_its_gates_by_hand() {
        let ape = [0.0; 4];
        let norm = [1.0, 1.0];
        let pool = Pool {
            ratio: 2,
            width: 2,
            overlapping: false,
            ape: &ape,
            norm: &norm,
            eps: 0.0,
        };
        let mut state = PoolState::default();
        let kv = [1.0, 2.0, 3.0, 0.0, 5.0, 5.0];
        let gate = [0.0, 0.0, 3f32.ln(), 0.0, 0.0, 0.0];
        let seen = std::cell::RefCell::new(Vec::new());
        let rope = |_: &mut [f32], position: usize| seen.borrow_mut().push(position);
        state.push(&pool, &kv, &gate, &rope);
        let rms = 3.625f32.sqrt();
        assert_eq!(state.len(2), 1);
        assert!(
            (state.entries[0] - 2.5 / rms).abs() < 1e-6,
            "{:?}",
            state.entries
        );
        assert!(
            (state.entries[1] - 1.0 / rms).abs() < 1e-6,
            "{:?}",
            state.entries
        );
        assert_eq!(state.pending_floats(), 4);
        state.push(&pool, &[5.0, 5.0], &[0.0, 0.0], &rope);
        assert_eq!(state.len(2), 2);
        // Equal values pool to themselves; normed to 1.
        assert!((state.entries[2] - 1.0).abs() < 1e-6);
        assert_eq!(
            *seen.borrow(),
            vec![0, 2],
            "roped at each window's first position"
        );
    }

    /// Overlapping windows of 2 positions, entries of 1 channel (two series per position:
    /// [first, second]). Entry 0 pools window 0's second series only: values 2 and 4 with
    /// gates 0 and 0 -> 3. Entry 1 pools window 0's first series (values 1, 3; gates 0 + ape
    /// (0.5, 0), 0) with window 1's second (values 6, 8; gates ln 2 + ape 0, 0): softmax of
    /// (0.5, 0, ln 2 + 0, 0) -> weights e^0.5, 1, 2, 1 over their sum. The norm with weight 2
    /// and one channel gives 2 * sign.
    #[test]
    fn overlapping_windows_pool_the_previous_first_series_by_hand() {
        let ape = [0.5, 0.0, 0.0, 0.0];
        let norm = [1.0];
        let pool = Pool {
            ratio: 2,
            width: 1,
            overlapping: true,
            ape: &ape,
            norm: &norm,
            eps: 0.0,
        };
        let mut state = PoolState::default();
        let mut entries_before_norm = Vec::new();
        let kv = [1.0, 2.0, 3.0, 4.0];
        let gate = [0.0; 4];
        let pooled = state.pool_window(&pool, &kv, &gate);
        entries_before_norm.push(pooled[0]);
        let kv = [7.0, 6.0, 9.0, 8.0];
        let gate = [0.0, 2f32.ln(), 0.0, 0.0];
        let pooled = state.pool_window(&pool, &kv, &gate);
        entries_before_norm.push(pooled[0]);
        assert!((entries_before_norm[0] - 3.0).abs() < 1e-6);
        let w = [0.5f32.exp(), 1.0, 2.0, 1.0];
        let sum: f32 = w.iter().sum();
        let expected = (w[0] * 1.0 + w[1] * 3.0 + w[2] * 6.0 + w[3] * 8.0) / sum;
        assert!(
            (entries_before_norm[1] - expected).abs() < 1e-5,
            "{entries_before_norm:?} vs {expected}"
        );
        // Through `push`: the same entries, normed (one channel: its sign).
        let mut state = PoolState::default();
        state.push(
            &pool,
            &[1.0, 2.0, 3.0, 4.0, 7.0, 6.0, 9.0, 8.0],
            &[0.0, 0.0, 0.0, 0.0, 0.0, 2f32.ln(), 0.0, 0.0],
            &no_rope,
        );
        assert_eq!(state.entries, vec![1.0, 1.0]);
    }
}
