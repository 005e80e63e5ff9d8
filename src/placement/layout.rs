//! A layer's layout of expert copies: the devices it may use ([`LayerSlots`]), where each
//! expert's copies are ([`LayerReplicas`]), and the working state that EPLB builds and the
//! local search improves ([`Layout`]). Its own module so that both algorithms
//! (`replicate`, `improve`) build on it and neither imports the other's.

/// The devices one layer's experts may be placed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSlots {
    /// The node each device belongs to.
    pub node_of: Vec<u16>,
    /// How many experts of this layer each device may hold: its share plus its spare slots,
    /// as its memory permits.
    pub capacity: Vec<usize>,
}

impl LayerSlots {
    /// `devices_per_node` devices on each of `nodes` nodes, each holding `capacity`,
    /// numbered node by node (device index = node × devices_per_node + device).
    pub fn uniform(nodes: usize, devices_per_node: usize, capacity: usize) -> Self {
        LayerSlots {
            node_of: (0..nodes * devices_per_node)
                .map(|d| (d / devices_per_node.max(1)) as u16)
                .collect(),
            capacity: vec![capacity; nodes * devices_per_node],
        }
    }

    pub fn num_devices(&self) -> usize {
        self.node_of.len()
    }

    /// Nodes with at least one device that may hold an expert.
    pub(super) fn usable_nodes(&self) -> usize {
        let mut nodes: Vec<u16> = self
            .node_of
            .iter()
            .zip(&self.capacity)
            .filter(|(_, c)| **c > 0)
            .map(|(n, _)| *n)
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes.len()
    }
}

/// Where each expert's copies are: `devices_of[expert]` lists device indices of the
/// [`LayerSlots`] it was chosen for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerReplicas {
    pub devices_of: Vec<Vec<usize>>,
}

impl LayerReplicas {
    /// The load each device carries: each expert's load split evenly over its copies.
    pub fn device_loads(&self, loads: &[f64], num_devices: usize) -> Vec<f64> {
        let mut per_device = vec![0.0; num_devices];
        for (expert, devices) in self.devices_of.iter().enumerate() {
            let share = loads.get(expert).copied().unwrap_or(0.0) / devices.len().max(1) as f64;
            for &d in devices {
                if let Some(load) = per_device.get_mut(d) {
                    *load += share;
                }
            }
        }
        per_device
    }

    /// Most loaded device over the mean device load (1 is perfect balance; 0 when idle).
    pub fn imbalance(&self, loads: &[f64], num_devices: usize) -> f64 {
        imbalance(&self.device_loads(loads, num_devices))
    }

    /// Copies in all.
    pub fn copies(&self) -> usize {
        self.devices_of.iter().map(Vec::len).sum()
    }
}

/// Most loaded over mean (1 is perfect balance; 0 when nothing is loaded).
pub fn imbalance(device_loads: &[f64]) -> f64 {
    let total: f64 = device_loads.iter().sum();
    if device_loads.is_empty() || total <= 0.0 {
        return 0.0;
    }
    let max = device_loads.iter().copied().fold(0.0, f64::max);
    max / (total / device_loads.len() as f64)
}

/// One change to a layer's copies, as a live rebalance carries it out: a copy loaded onto a
/// device, or a copy released from one (devices as the [`LayerSlots`] number them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyChange {
    Load { expert: usize, device: usize },
    Release { expert: usize, device: usize },
}

/// The changes of one step of a search, which leaves the layout valid (every device within
/// its capacity, every expert with its copies), and the most loaded device over the mean
/// before it.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub changes: Vec<CopyChange>,
    pub imbalance_before: f64,
}

/// A layout being built or improved: copies per expert and per device, device loads, and
/// which copies may not move.
#[derive(Clone)]
pub(super) struct Layout<'a> {
    pub loads: &'a [f64],
    pub slots: &'a LayerSlots,
    /// An expert's first `min(copies, spread)` copies go to distinct nodes.
    pub spread: usize,
    /// Copies an expert keeps at least (search never removes below this).
    pub min_copies: usize,
    pub devices_of: Vec<Vec<usize>>,
    pub held: Vec<Vec<usize>>,
    /// `pinned[expert]`: devices whose copy of the expert must stay (the serving layout).
    pub pinned: Vec<Vec<usize>>,
    pub device_load: Vec<f64>,
    /// The search stops once the most loaded device carries at most this much.
    pub good_enough: f64,
    /// The steps taken since [`Layout::record`], when recording.
    pub steps: Option<Vec<Step>>,
}

impl<'a> Layout<'a> {
    pub(super) fn empty(loads: &'a [f64], slots: &'a LayerSlots, spread: usize) -> Self {
        Layout {
            loads,
            slots,
            spread,
            min_copies: 1,
            devices_of: vec![Vec::new(); loads.len()],
            held: vec![Vec::new(); slots.num_devices()],
            pinned: vec![Vec::new(); loads.len()],
            device_load: vec![0.0; slots.num_devices()],
            good_enough: 0.0,
            steps: None,
        }
    }

    pub(super) fn from_replicas(
        loads: &'a [f64],
        slots: &'a LayerSlots,
        spread: usize,
        replicas: &LayerReplicas,
        pin: bool,
    ) -> Self {
        let mut layout = Layout::empty(loads, slots, spread);
        for (expert, devices) in replicas.devices_of.iter().enumerate() {
            for &d in devices {
                if d < slots.num_devices() && !layout.devices_of[expert].contains(&d) {
                    layout.devices_of[expert].push(d);
                    layout.held[d].push(expert);
                }
            }
            if pin {
                layout.pinned[expert] = layout.devices_of[expert].clone();
            }
        }
        layout.recompute_loads();
        layout
    }

    pub fn into_replicas(self) -> LayerReplicas {
        LayerReplicas {
            devices_of: self.devices_of,
        }
    }

    pub fn recompute_loads(&mut self) {
        self.device_load = vec![0.0; self.slots.num_devices()];
        for expert in 0..self.devices_of.len() {
            let share = self.share(expert);
            for &d in &self.devices_of[expert] {
                self.device_load[d] += share;
            }
        }
    }

    /// Load one copy of `expert` carries now.
    pub fn share(&self, expert: usize) -> f64 {
        self.loads[expert] / self.devices_of[expert].len().max(1) as f64
    }

    pub fn has_room(&self, device: usize) -> bool {
        self.held[device].len() < self.slots.capacity[device]
    }

    /// Whether `devices` (one expert's copies) keep its first copies on distinct nodes.
    pub fn spread_ok(&self, devices: &[usize]) -> bool {
        self.spread <= 1 || self.spread_ok_iter(devices.iter().copied())
    }

    /// [`Layout::spread_ok`] over an iterator (copies are few: quadratic, no allocation).
    fn spread_ok_iter(&self, devices: impl Iterator<Item = usize> + Clone) -> bool {
        let node = |d: usize| self.slots.node_of[d];
        let mut count = 0;
        let mut distinct = 0;
        for (i, d) in devices.clone().enumerate() {
            count += 1;
            if !devices.clone().take(i).any(|e| node(e) == node(d)) {
                distinct += 1;
            }
        }
        distinct >= count.min(self.spread)
    }

    /// Whether `device` may take a copy of `expert` in addition to the ones it has (less
    /// the copy on `leaving`, if it moves away).
    pub fn may_take(&self, expert: usize, device: usize, leaving: Option<usize>) -> bool {
        let current = &self.devices_of[expert];
        if leaving != Some(device) && current.contains(&device) {
            return false;
        }
        if self.spread <= 1 {
            return true;
        }
        let after = current
            .iter()
            .copied()
            .filter(move |&d| Some(d) != leaving)
            .chain(std::iter::once(device));
        self.spread_ok_iter(after)
    }

    pub fn is_pinned(&self, expert: usize, device: usize) -> bool {
        self.pinned[expert].contains(&device)
    }

    /// From here on, every change is recorded as part of a step ([`Layout::begin_step`]).
    pub fn record(&mut self) {
        self.steps = Some(Vec::new());
    }

    /// Starts a step: the changes until the next one leave the layout valid together.
    pub fn begin_step(&mut self) {
        let imbalance_before = imbalance(&self.device_load);
        if let Some(steps) = self.steps.as_mut() {
            if steps.last().is_some_and(|s| s.changes.is_empty()) {
                steps.pop();
            }
            steps.push(Step {
                changes: Vec::new(),
                imbalance_before,
            });
        }
    }

    fn note(&mut self, change: CopyChange) {
        if let Some(step) = self.steps.as_mut().and_then(|s| s.last_mut()) {
            step.changes.push(change);
        }
    }

    /// The most loaded device's load.
    pub fn peak(&self) -> f64 {
        self.device_load.iter().copied().fold(0.0, f64::max)
    }

    /// Adds a copy of `expert` on `device` (the expert's other copies carry less).
    pub fn add_copy(&mut self, expert: usize, device: usize) {
        self.note(CopyChange::Load { expert, device });
        let before = self.share(expert);
        for &d in &self.devices_of[expert] {
            self.device_load[d] -= before;
        }
        self.devices_of[expert].push(device);
        self.held[device].push(expert);
        let after = self.share(expert);
        for &d in &self.devices_of[expert] {
            self.device_load[d] += after;
        }
    }

    /// Removes the copy of `expert` on `device` (its other copies carry more).
    pub fn remove_copy(&mut self, expert: usize, device: usize) {
        self.note(CopyChange::Release { expert, device });
        let before = self.share(expert);
        for &d in &self.devices_of[expert] {
            self.device_load[d] -= before;
        }
        self.devices_of[expert].retain(|&d| d != device);
        self.held[device].retain(|&e| e != expert);
        let after = self.share(expert);
        for &d in &self.devices_of[expert] {
            self.device_load[d] += after;
        }
        self.device_load[device] = self.device_load[device].max(0.0);
    }

    /// Moves the copy of `expert` on `from` to `to`.
    pub fn move_copy(&mut self, expert: usize, from: usize, to: usize) {
        // Copy, then release.
        self.note(CopyChange::Load { expert, device: to });
        self.note(CopyChange::Release {
            expert,
            device: from,
        });
        let share = self.share(expert);
        for d in self.devices_of[expert].iter_mut() {
            if *d == from {
                *d = to;
            }
        }
        self.held[from].retain(|&e| e != expert);
        self.held[to].push(expert);
        self.device_load[from] -= share;
        self.device_load[to] += share;
    }
}
