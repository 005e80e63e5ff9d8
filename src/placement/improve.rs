//! Local search over a layer's layout of expert copies (moe-node's step beyond EPLB).
//!
//! Each round looks at the most loaded device and takes the one step, among these, that
//! leaves the lowest load on the devices it touches:
//! - add: a copy of one of its experts on a device with a free slot;
//! - move: one of its copies to a device with a free slot;
//! - swap: one of its copies for a lighter copy on another device;
//! - recount: a copy of another expert (one with copies to spare) is dropped and its slot
//!   takes a copy of one of this device's experts, shifting a copy from where it helps
//!   least to where it helps most (EPLB fixes the number of copies before it packs, so
//!   it cannot undo a count that packing then made awkward).
//!
//! A step is taken only when every device it touches ends below the most loaded device's
//! load: the sorted device loads then decrease, so the search ends, and its result is never
//! worse than where it started. Pinned copies (the layout serving now) never move.

use super::layout::Layout;

/// Rounds at most; each makes strict progress, this only bounds the time spent.
const MAX_ROUNDS: usize = 20_000;

/// How much lower than the maximum a step must leave the devices it touches (relative).
const MARGIN: f64 = 1e-9;

#[derive(Debug, Clone, Copy)]
enum Step {
    Add {
        expert: usize,
        to: usize,
    },
    Move {
        expert: usize,
        from: usize,
        to: usize,
    },
    Swap {
        expert: usize,
        from: usize,
        other: usize,
        to: usize,
    },
    Recount {
        expert: usize,
        dropped: usize,
        on: usize,
    },
}

/// Improves `layout` in place until no step lowers its most loaded device, or that device
/// carries no more than `layout.good_enough`.
pub(super) fn improve(layout: &mut Layout) {
    for _ in 0..MAX_ROUNDS {
        let Some(top) = most_loaded(layout) else {
            return;
        };
        let limit = layout.device_load[top] * (1.0 - MARGIN);
        if limit <= 0.0 || layout.device_load[top] <= layout.good_enough {
            return;
        }
        let Some((_, step)) = best_step(layout, top, limit) else {
            return;
        };
        apply(layout, step);
    }
}

fn most_loaded(layout: &Layout) -> Option<usize> {
    (0..layout.device_load.len()).max_by(|&a, &b| {
        layout.device_load[a]
            .total_cmp(&layout.device_load[b])
            .then(b.cmp(&a))
    })
}

/// The step that leaves the lowest maximum over the devices it touches, if that is below
/// `limit`.
fn best_step(layout: &Layout, top: usize, limit: f64) -> Option<(f64, Step)> {
    let mut best: Option<(f64, Step)> = None;
    let mut consider = |peak: f64, step: Step| {
        if peak < limit && best.is_none_or(|(b, _)| peak < b) {
            best = Some((peak, step));
        }
    };
    let devices = layout.device_load.len();
    let top_load = layout.device_load[top];
    for &expert in &layout.held[top] {
        let copies = layout.devices_of[expert].len() as f64;
        let load = layout.loads[expert];
        let share = load / copies;
        let share_if_added = load / (copies + 1.0);
        // Every holder of the expert carries this much less with one more copy.
        let relief = share - share_if_added;
        let pinned_here = layout.is_pinned(expert, top);
        for to in 0..devices {
            if to == top {
                continue;
            }
            let room = layout.has_room(to);
            if room && layout.may_take(expert, to, None) {
                let others = layout.devices_of[expert]
                    .iter()
                    .map(|&d| layout.device_load[d] - relief)
                    .fold(0.0, f64::max);
                consider(
                    others.max(layout.device_load[to] + share_if_added),
                    Step::Add { expert, to },
                );
            }
            if pinned_here || !layout.may_take(expert, to, Some(top)) {
                continue;
            }
            if room {
                consider(
                    (top_load - share).max(layout.device_load[to] + share),
                    Step::Move {
                        expert,
                        from: top,
                        to,
                    },
                );
            }
            for &other in &layout.held[to] {
                let other_share = layout.share(other);
                if other_share >= share
                    || layout.is_pinned(other, to)
                    || !layout.may_take(other, top, Some(to))
                {
                    continue;
                }
                consider(
                    (top_load - share + other_share)
                        .max(layout.device_load[to] - other_share + share),
                    Step::Swap {
                        expert,
                        from: top,
                        other,
                        to,
                    },
                );
            }
        }
        recounts(layout, expert, top, &mut consider);
    }
    best
}

/// Recount steps for `expert` (on the most loaded device `top`): drop a spare copy of
/// another expert on a device that may take `expert`, and put a copy of `expert` there.
fn recounts(layout: &Layout, expert: usize, top: usize, consider: &mut impl FnMut(f64, Step)) {
    let load = layout.loads[expert];
    let copies = layout.devices_of[expert].len() as f64;
    let relief = load / copies - load / (copies + 1.0);
    let added_share = load / (copies + 1.0);
    let after_relief = layout.devices_of[expert]
        .iter()
        .map(|&d| layout.device_load[d] - relief)
        .fold(0.0, f64::max);
    if after_relief >= layout.device_load[top] {
        return;
    }
    for (dropped, holders) in layout.devices_of.iter().enumerate() {
        if dropped == expert || holders.len() <= layout.min_copies {
            continue;
        }
        let d_load = layout.loads[dropped];
        let d_copies = holders.len() as f64;
        // Each remaining holder of `dropped` carries this much more.
        let burden = d_load / (d_copies - 1.0) - d_load / d_copies;
        for &on in holders {
            if on == top || layout.is_pinned(dropped, on) || !layout.may_take(expert, on, None) {
                continue;
            }
            let remaining: Vec<usize> = holders.iter().copied().filter(|&d| d != on).collect();
            if !layout.spread_ok(&remaining) {
                continue;
            }
            let mut peak = after_relief;
            for &d in &remaining {
                let mut l = layout.device_load[d] + burden;
                if layout.devices_of[expert].contains(&d) {
                    l -= relief;
                }
                peak = peak.max(l);
            }
            let on_load = layout.device_load[on] - d_load / d_copies + added_share;
            peak = peak.max(on_load);
            consider(
                peak,
                Step::Recount {
                    expert,
                    dropped,
                    on,
                },
            );
        }
    }
}

fn apply(layout: &mut Layout, step: Step) {
    layout.begin_step();
    match step {
        Step::Add { expert, to } => layout.add_copy(expert, to),
        Step::Move { expert, from, to } => layout.move_copy(expert, from, to),
        Step::Swap {
            expert,
            from,
            other,
            to,
        } => {
            layout.move_copy(expert, from, to);
            layout.move_copy(other, to, from);
        }
        Step::Recount {
            expert,
            dropped,
            on,
        } => {
            layout.remove_copy(dropped, on);
            layout.add_copy(expert, on);
        }
    }
}
