//! The dispatch plan of one MoE layer: token rows grouped by expert so each expert runs one
//! matrix product per step, and the weighted combine that undoes the grouping.

use super::gating::Routing;

/// Token rows permuted so that the rows routed to each expert are contiguous.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchPlan {
    /// Experts that received at least one row, ascending.
    pub experts: Vec<u32>,
    /// `offsets[i]..offsets[i + 1]` are the grouped rows of `experts[i]`.
    pub offsets: Vec<usize>,
    /// For each grouped row, the token row it came from.
    pub source_rows: Vec<u32>,
    /// For each grouped row, the gate weight of that (token, expert) pair.
    pub weights: Vec<f32>,
}

impl DispatchPlan {
    /// Groups the routed (token, expert) pairs by expert with a counting sort; within an
    /// expert, rows keep token order.
    pub fn new(routing: &Routing, num_experts: usize) -> Self {
        let mut counts = vec![0usize; num_experts + 1];
        for &e in &routing.experts {
            counts[e as usize + 1] += 1;
        }
        for i in 0..num_experts {
            counts[i + 1] += counts[i];
        }
        let mut next = counts.clone();
        let pairs = routing.experts.len();
        let mut source_rows = vec![0u32; pairs];
        let mut weights = vec![0.0f32; pairs];
        for (pair, (&e, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
            let slot = next[e as usize];
            next[e as usize] += 1;
            source_rows[slot] = (pair / routing.top_k) as u32;
            weights[slot] = w;
        }
        let mut experts = Vec::new();
        let mut offsets = vec![0];
        for e in 0..num_experts {
            if counts[e + 1] > counts[e] {
                experts.push(e as u32);
                offsets.push(counts[e + 1]);
            }
        }
        DispatchPlan {
            experts,
            offsets,
            source_rows,
            weights,
        }
    }

    /// Number of grouped rows (tokens × top-k).
    pub fn len(&self) -> usize {
        self.source_rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.source_rows.is_empty()
    }

    /// Rows `[start, end)` of the grouped input that belong to the `i`-th active expert.
    pub fn group(&self, i: usize) -> std::ops::Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    /// Each active expert with its rows of `grouped` (`[len, width]`, in grouped order).
    pub fn groups<'a>(
        &'a self,
        grouped: &'a [f32],
        width: usize,
    ) -> impl Iterator<Item = (u32, &'a [f32])> + 'a {
        self.experts.iter().enumerate().map(move |(i, &e)| {
            let rows = self.group(i);
            (e, &grouped[rows.start * width..rows.end * width])
        })
    }

    /// Copies token rows of `hidden` (`[tokens, width]`) into grouped order.
    pub fn gather(&self, hidden: &[f32], width: usize) -> Vec<f32> {
        let mut grouped = Vec::with_capacity(self.len() * width);
        for &row in &self.source_rows {
            let row = row as usize;
            grouped.extend_from_slice(&hidden[row * width..(row + 1) * width]);
        }
        grouped
    }

    /// Adds each grouped expert output, times its gate weight, into its token row of `out`.
    /// Rows are added in ascending expert order, as transformers does.
    pub fn combine(&self, expert_out: &[f32], width: usize, out: &mut [f32]) {
        for (slot, (&row, &w)) in self.source_rows.iter().zip(&self.weights).enumerate() {
            let row = row as usize;
            let src = &expert_out[slot * width..(slot + 1) * width];
            for (o, s) in out[row * width..(row + 1) * width].iter_mut().zip(src) {
                *o += s * w;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_by_expert_and_combines_back() {
        // Two tokens, top-2: token 0 -> experts 2 (w .75), 0 (w .25); token 1 -> 2 (w .5), 1 (w .5).
        let routing = Routing {
            top_k: 2,
            experts: vec![2, 0, 2, 1],
            weights: vec![0.75, 0.25, 0.5, 0.5],
        };
        let plan = DispatchPlan::new(&routing, 4);
        assert_eq!(plan.experts, vec![0, 1, 2]);
        assert_eq!(plan.offsets, vec![0, 1, 2, 4]);
        assert_eq!(plan.source_rows, vec![0, 1, 0, 1]);
        assert_eq!(plan.weights, vec![0.25, 0.5, 0.75, 0.5]);

        let hidden = [1.0, 2.0, 10.0, 20.0];
        let grouped = plan.gather(&hidden, 2);
        assert_eq!(grouped, vec![1.0, 2.0, 10.0, 20.0, 1.0, 2.0, 10.0, 20.0]);
        // An "expert" that doubles its input: output = 2 * sum of weights * input = 2 * input.
        let doubled: Vec<f32> = grouped.iter().map(|v| v * 2.0).collect();
        let mut out = vec![0.0; 4];
        plan.combine(&doubled, 2, &mut out);
        assert_eq!(out, vec![2.0, 4.0, 20.0, 40.0]);
    }
}
