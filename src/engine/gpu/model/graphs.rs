//! Decode steps from CUDA graphs. A decode step (one row per sequence) launches some twenty
//! kernels and products per layer; at small batches the launches, not the GPU, set its
//! time. Each layer's part up to its routed experts (norms, attention, dense MLP or shared
//! experts, the router and the grouping of rows by expert) is captured once per step shape
//! as a graph, as is the output head, and a step replays them: one launch per layer. The
//! routed experts stay between the graphs: their group sizes come to the host, and they run
//! wherever the placement put them (another GPU, another node), so no graph can span them.
//!
//! A graph holds the addresses it was captured with, so a step it replays must find its
//! inputs and work buffers at those addresses: every graph lays its step's work buffers out
//! in one arena from the start ([`Scratch::in_arena`]), the same offsets at every replay,
//! and a replay uploads the step's inputs there before the first launch. The arena is sized
//! from the first, plain run of each shape (the most bytes it held at once); a shape that
//! needs more grows it, and the graphs captured in the smaller one are dropped.
//!
//! A shape is the rows and the block tables' width, rounded up to a power of two (the
//! attention kernels read the width as a parameter). A shape is run plainly once (sizing
//! it), captured on its second step, and replayed from then on. A capture that fails (a
//! driver that refuses it) turns graphs off for the model, with a log line; the step runs
//! plainly. A hybrid model's linear layers are captured too: where the step's sequences'
//! state pages lie is among the inputs, and each layer gathers, updates and scatters its
//! part of the states with kernels, as a plain step does.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaGraph, CudaStream, sys};

use super::cache::{DeviceCache, Scratch};
use super::routed::RoutedRows;
use super::{Experts, GpuModel, Inputs, Phases, StepRows};
use crate::compute::cuda::CudaError;
use crate::compute::cuda::experts::Buffer;
use crate::experts::{ExpertError, ExpertExecutor};

/// Decode steps of more rows than this run plainly: the launches matter at small batches.
const MAX_GRAPH_ROWS: usize = 256;

/// The narrowest block table a graph is captured with.
const MIN_GRAPH_STRIDE: usize = 16;

/// Step shapes captured at most: a new shape beyond them drops the one replayed longest ago
/// (each costs instantiation time and some GPU memory).
const MAX_SHAPES: usize = 128;

/// What a graph is captured for: rows, and the block tables' width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Shape {
    rows: usize,
    stride: usize,
}

/// A model's graphs, and what sizes them.
pub(super) struct Graphs {
    enabled: bool,
    /// The arena every graph's work buffers lie in.
    arena: Option<Buffer>,
    arena_bytes: usize,
    /// The most work-buffer bytes each shape held at once in its plain run.
    need: HashMap<Shape, usize>,
    captured: HashMap<Shape, Captured>,
    /// Replays so far: the clock of [`Captured::last_use`].
    uses: u64,
}

// SAFETY: the graphs' driver handles are used under the model's locks, by one thread at a
// time, as the model's stream is.
unsafe impl Send for Graphs {}

/// One shape's graphs: one per layer, then the head's.
struct Captured {
    layers: Vec<CudaGraph>,
    head: CudaGraph,
    /// Each MoE layer's routed rows in the arena, for the experts between the graphs.
    routed: Vec<Option<RoutedRows>>,
    /// Where the step's inputs lie ([`layout`]): a replay's must land at the same places.
    layout: Vec<u64>,
    logits: u64,
    /// When it was last replayed ([`Graphs::uses`]).
    last_use: u64,
}

/// Why a shape was not captured.
enum Failed {
    /// Its work buffers need this many bytes, more than the arena had.
    TooSmall(usize),
    Cuda(CudaError),
}

impl From<CudaError> for Failed {
    fn from(e: CudaError) -> Failed {
        Failed::Cuda(e)
    }
}

/// Ends a capture left open by a panic, so the stream serves on.
struct Capturing<'a> {
    stream: &'a Arc<CudaStream>,
    open: bool,
}

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        }
    }
}

/// Every address and size a step's graphs read their inputs at, and where the inputs end
/// (the work buffers begin).
fn layout(io: &Inputs, scratch: &Scratch) -> Vec<u64> {
    let s = &io.step;
    let mut layout = vec![
        io.rows as u64,
        io.x,
        io.normed,
        io.wanted as u64,
        io.wanted_rows,
        s.cos,
        s.sin,
        s.row_seq,
        s.row_pos,
        s.table.blocks,
        s.table.stride as u64,
        scratch.mark().bytes() as u64,
    ];
    if let Some((packed, pages)) = &s.states {
        layout.extend([
            packed.floats as u64,
            packed.seqs as u64,
            packed.rows as u64,
            packed.row_seq,
            packed.seq_first_row,
            packed.seq_len,
            pages.pages,
            pages.per_seq as u64,
            pages.page_floats as u64,
            pages.fresh,
        ]);
    }
    layout
}

impl Graphs {
    pub(super) fn new() -> Graphs {
        Graphs {
            enabled: true,
            arena: None,
            arena_bytes: 0,
            need: HashMap::new(),
            captured: HashMap::new(),
            uses: 0,
        }
    }

    /// Graphs off, their memory freed.
    fn turn_off(&mut self) {
        self.enabled = false;
        self.captured.clear();
        self.arena = None;
        self.arena_bytes = 0;
    }

    /// Drops the shape replayed longest ago.
    fn evict_least_used(&mut self) {
        let oldest = self
            .captured
            .iter()
            .min_by_key(|(_, c)| c.last_use)
            .map(|(&shape, _)| shape);
        if let Some(shape) = oldest {
            self.captured.remove(&shape);
        }
    }

    /// Drops every graph: the KV pool they read is replaced.
    pub(super) fn forget(&mut self) {
        self.captured.clear();
    }

    /// The arena, grown to `bytes` at least (dropping the graphs of a smaller one).
    fn arena(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<(u64, usize), CudaError> {
        if self.arena.is_none() || self.arena_bytes < bytes {
            self.captured.clear();
            self.arena = None;
            // Room to grow: the next larger batch fits without another capture of all.
            let size = bytes.max(self.arena_bytes * 2);
            self.arena = Some(Buffer::new(stream, size)?);
            self.arena_bytes = size;
        }
        let base = self.arena.as_ref().map_or(0, |a| a.ptr);
        Ok((base, self.arena_bytes))
    }
}

impl GpuModel {
    /// Turns decode graphs on or off (on by default; `devices.cuda_graphs`).
    pub fn set_cuda_graphs(&self, on: bool) {
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        if on {
            graphs.enabled = true;
        } else {
            graphs.turn_off();
        }
    }

    /// Step shapes captured as graphs now, and the steps replayed from graphs so far.
    pub fn cuda_graphs(&self) -> (usize, u64) {
        let graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        (graphs.captured.len(), graphs.uses)
    }

    /// The shape of a step graphs may run: a decode step (one row per sequence) of at most
    /// [`MAX_GRAPH_ROWS`], of a model whose every MoE layer routes on this GPU, for an
    /// executor that takes rows there.
    pub(super) fn graph_shape(
        &self,
        step: &StepRows,
        caches: &[&mut DeviceCache],
        executor: Option<&dyn ExpertExecutor>,
    ) -> Option<Shape> {
        let graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let rows = step.segments.len();
        let routed_here = self
            .layers
            .iter()
            .enumerate()
            .all(|(l, layer)| !layer.moe || self.gates.get(l).is_some_and(Option::is_some));
        if !graphs.enabled
            || executor.is_none()
            || !routed_here
            || rows == 0
            || rows > MAX_GRAPH_ROWS
            || step.segments.iter().any(|s| s.rows.len() != 1)
        {
            return None;
        }
        let longest = caches.iter().map(|c| c.blocks().len()).max().unwrap_or(0);
        Some(Shape {
            rows,
            stride: longest.max(MIN_GRAPH_STRIDE).next_power_of_two(),
        })
    }

    /// A decode step of `shape`: replayed from its graphs, captured first where its size is
    /// known, else run plainly and sized.
    pub(super) fn forward_graphed<E: From<CudaError> + From<ExpertError>>(
        &self,
        shape: Shape,
        step: &StepRows,
        caches: &[&mut DeviceCache],
        experts: Experts<E>,
    ) -> Result<Vec<f32>, E> {
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        if !graphs.captured.contains_key(&shape) {
            let Some(need) = graphs.need.get(&shape).copied() else {
                drop(graphs);
                let (logits, peak) =
                    self.forward_plain(step, caches, experts, Some(shape.stride))?;
                let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
                graphs.need.insert(shape, peak);
                return Ok(logits);
            };
            if graphs.captured.len() >= MAX_SHAPES {
                graphs.evict_least_used();
            }
            match self.capture(&mut graphs, shape, need, step, caches) {
                Ok(captured) => {
                    graphs.captured.insert(shape, captured);
                }
                Err(Failed::TooSmall(bytes)) => {
                    // The plain run held less than the capture (it routed some layer on the
                    // host): captured at the next step of this shape, in a larger arena.
                    let need = bytes.max(need * 2);
                    graphs.need.insert(shape, need);
                    drop(graphs);
                    return Ok(self.forward_plain(step, caches, experts, None)?.0);
                }
                Err(Failed::Cuda(e)) => {
                    tracing::warn!(
                        gpu = self.gpu,
                        error = %e,
                        "capturing a decode step as CUDA graphs failed; decode steps run \
                         kernel by kernel from now on"
                    );
                    graphs.turn_off();
                    drop(graphs);
                    return Ok(self.forward_plain(step, caches, experts, None)?.0);
                }
            }
        }
        graphs.uses += 1;
        let uses = graphs.uses;
        let base = graphs.arena.as_ref().map_or(0, |a| a.ptr);
        let size = graphs.arena_bytes;
        let captured = graphs.captured.get_mut(&shape).expect("captured above");
        captured.last_use = uses;
        self.replay(captured, (base, size), shape, step, caches, experts)
    }

    /// `shape`'s graphs, captured with the inputs of `step` (uploaded, not run).
    fn capture(
        &self,
        graphs: &mut Graphs,
        shape: Shape,
        need: usize,
        step: &StepRows,
        caches: &[&mut DeviceCache],
    ) -> Result<Captured, Failed> {
        let (base, size) = graphs.arena(&self.stream, need)?;
        let mut scratch = Scratch::in_arena(&self.stream, base, size);
        let captured = self.capture_in(&mut scratch, shape, step, caches);
        if captured.is_err() && scratch.peak() > size {
            return Err(Failed::TooSmall(scratch.peak()));
        }
        let captured = captured?;
        tracing::debug!(
            gpu = self.gpu,
            ?shape,
            arena_bytes = size,
            "decode step captured as CUDA graphs"
        );
        Ok(captured)
    }

    fn capture_in(
        &self,
        scratch: &mut Scratch,
        shape: Shape,
        step: &StepRows,
        caches: &[&mut DeviceCache],
    ) -> Result<Captured, CudaError> {
        let io = self.inputs(scratch, step, caches, Some(shape.stride))?;
        let layout = layout(&io, scratch);
        let layer_start = scratch.mark();
        let mut phases = Phases::off();
        let (mut layers, mut routed) = (Vec::new(), Vec::new());
        for (l, layer) in self.layers.iter().enumerate() {
            let gate = self.gates.get(l).and_then(Option::as_ref);
            let (graph, rows) =
                self.captured(|| self.before_experts(l, layer, &io, scratch, &mut phases, gate))?;
            layers.push(graph);
            routed.push(rows);
            scratch.release(layer_start);
        }
        let (head, logits) = self.captured(|| self.head(&io, scratch))?;
        Ok(Captured {
            layers,
            head,
            routed,
            layout,
            logits,
            last_use: 0,
        })
    }

    /// What `work` queues on the stream, as a graph (the capture ended whatever happens,
    /// a panic included).
    fn captured<T>(
        &self,
        work: impl FnOnce() -> Result<T, CudaError>,
    ) -> Result<(CudaGraph, T), CudaError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let mut capturing = Capturing {
            stream: &self.stream,
            open: true,
        };
        let out = work();
        capturing.open = false;
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let out = out?;
        let graph = graph?.ok_or_else(|| CudaError::Unsupported("an empty graph".into()))?;
        Ok((graph, out))
    }

    /// A decode step from `captured`: the inputs uploaded into the arena, each layer's graph
    /// launched and its routed experts run, then the head's.
    fn replay<E: From<CudaError> + From<ExpertError>>(
        &self,
        captured: &Captured,
        (base, size): (u64, usize),
        shape: Shape,
        step: &StepRows,
        caches: &[&mut DeviceCache],
        mut experts: Experts<E>,
    ) -> Result<Vec<f32>, E> {
        let mut phases = Phases::new();
        let mut scratch = Scratch::in_arena(&self.stream, base, size);
        let io = self.inputs(&mut scratch, step, caches, Some(shape.stride))?;
        if layout(&io, &scratch) != captured.layout {
            return Err(CudaError::Unsupported(
                "a decode step's inputs did not land where its graphs read them".into(),
            )
            .into());
        }
        phases.end(0, &self.stream)?;
        // Work buffers of the experts' host path, where it is taken.
        let mut host = Scratch::new(&self.stream);
        let none = host.mark();
        for (l, graph) in captured.layers.iter().enumerate() {
            graph.launch().map_err(CudaError::from)?;
            phases.end(1, &self.stream)?;
            let grouped = captured.routed[l].as_ref();
            self.after_experts(l, grouped, &io, &mut experts, &mut host)?;
            phases.end(3, &self.stream)?;
            host.release(none);
        }
        captured.head.launch().map_err(CudaError::from)?;
        let out = self.logits_to_host(captured.logits, io.wanted)?;
        phases.end(4, &self.stream)?;
        phases.log(io.rows, caches.len());
        Ok(out)
    }
}
