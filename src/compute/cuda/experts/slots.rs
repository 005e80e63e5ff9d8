//! A GPU's expert slots: an expert's bytes in the device's form, written at load
//! ([`GpuExperts::upload`]), and experts taken and let go of while serving, as a CPU slot
//! does when the cluster moves to a new placement (copy, then switch, then release): new
//! experts go into slots let go of before, else into a new buffer sized for them; experts let
//! go of leave their slot for the next ones. The device actor does this between two runs, so
//! no kernel reads a slot while it is written.

use super::{Buffer, GpuExperts};
use crate::compute::cuda::CudaError;
use crate::compute::cuda::storage::ExpertStorage;
use crate::compute::expert::ExpertWeights;
use cudarc::driver::result;

impl GpuExperts {
    /// Writes one expert's weights in the device's form ([`ExpertStorage::pack`]): bf16
    /// weights as they are (f32 rounded), quantized ones as stored.
    pub fn upload(
        &mut self,
        layer: usize,
        expert: u32,
        weights: &ExpertWeights,
    ) -> Result<(), CudaError> {
        let slot = self.slot_of(weights).map_err(|reason| {
            CudaError::Unsupported(format!("expert {expert} of layer {layer}: {reason}"))
        })?;
        self.upload_slot(layer, expert, &slot)
    }

    /// The bytes of `weights`' slot in this device's form, or why it cannot hold them
    /// (another form, or another activation than its experts').
    fn slot_of(&self, weights: &ExpertWeights) -> Result<Vec<u8>, String> {
        let activation = ExpertStorage::activation_of(weights)?;
        if activation != self.shape.activation {
            return Err(format!(
                "its activation is {activation:?}, this GPU's experts' {:?}",
                self.shape.activation
            ));
        }
        let (h, i) = (self.shape.hidden, self.shape.intermediate);
        let mut slot = self.shape.storage.pack(weights, h, i)?;
        match (ExpertStorage::biases_of(weights), self.shape.biases) {
            (None, false) => {}
            (Some(biases), true) => {
                slot.resize(self.shape.slot_bytes(), 0);
                let at = self.shape.bias_offset();
                for (chunk, b) in slot[at..].chunks_exact_mut(4).zip(biases) {
                    chunk.copy_from_slice(&b.to_le_bytes());
                }
            }
            (_, held) => {
                return Err(format!(
                    "this GPU's experts {} biases, and this one {}",
                    if held { "have" } else { "have no" },
                    if held { "has none" } else { "has" }
                ));
            }
        }
        Ok(slot)
    }

    /// Writes one expert's slot, as [`ExpertStorage::pack`] makes it.
    pub fn upload_slot(&mut self, layer: usize, expert: u32, slot: &[u8]) -> Result<(), CudaError> {
        let ptr = self
            .expert_ptr(layer, expert)
            .expect("upload of an expert not placed on this device");
        assert_eq!(slot.len(), self.shape.slot_bytes(), "one slot's bytes");
        // SAFETY: the copy fills this expert's slot of the weight buffer; the host bytes
        // outlive it (synchronised below).
        unsafe { result::memcpy_htod_async(ptr, slot, self.stream.cu_stream())? };
        self.stream.synchronize()?;
        Ok(())
    }

    /// Takes `experts` (those not held yet), each in the device's form: every one is packed
    /// first, so an expert the form cannot hold refuses the whole share before any memory
    /// is touched; new memory is checked against `memory_fraction` of what is free. An
    /// expert is found by the runs only once its slot is written. Returns the experts held.
    pub fn take(
        &mut self,
        experts: &[((usize, u32), &ExpertWeights)],
        memory_fraction: f64,
    ) -> Result<usize, CudaError> {
        let mut packed = Vec::new();
        for &(key, weights) in experts {
            if self.index.contains_key(&key) || packed.iter().any(|(k, _)| *k == key) {
                continue;
            }
            let slot = self.slot_of(weights).map_err(|reason| {
                CudaError::Unsupported(format!(
                    "expert {} of layer {}: {reason} (this GPU holds {})",
                    key.1,
                    key.0,
                    self.shape.storage.describe()
                ))
            })?;
            packed.push((key, slot));
        }
        let extra = packed.len().saturating_sub(self.free_slots.len());
        if extra > 0 {
            let (free, _) = self.ctx.mem_get_info()?;
            // Only the slots are new: the work area was sized at load.
            let bytes = extra * self.shape.slot_bytes();
            let usable = (free as f64 * memory_fraction) as usize;
            if bytes > usable {
                return Err(CudaError::DoesNotFit {
                    gpu: self.gpu.ordinal,
                    experts: extra,
                    need_mib: bytes.div_ceil(1 << 20),
                    usable_mib: usable >> 20,
                    free_mib: free >> 20,
                });
            }
            let buffer = Buffer::new(&self.stream, bytes)?;
            self.free_slots
                .extend((0..extra).map(|n| buffer.ptr + (n * self.shape.slot_bytes()) as u64));
            self.weights.push(buffer);
        }
        for (key, slot) in packed {
            let ptr = self
                .free_slots
                .pop()
                .expect("a free slot for each expert taken");
            // SAFETY: the copy fills one slot; `slot` outlives it (synchronised below).
            let copied =
                unsafe { result::memcpy_htod_async(ptr, &slot[..], self.stream.cu_stream()) }
                    .and_then(|()| self.stream.synchronize());
            if let Err(e) = copied {
                self.free_slots.push(ptr);
                return Err(e.into());
            }
            self.index.insert(key, ptr);
        }
        Ok(self.index.len())
    }

    /// Lets go of every expert `keep` does not name; returns the experts held.
    pub fn release(&mut self, keep: impl Fn(&(usize, u32)) -> bool) -> usize {
        let gone: Vec<(usize, u32)> = self.index.keys().filter(|k| !keep(k)).copied().collect();
        for key in gone {
            if let Some(ptr) = self.index.remove(&key) {
                self.free_slots.push(ptr);
            }
        }
        self.index.len()
    }

    /// Bytes of GPU memory the experts' slots take, held or free.
    pub fn slot_bytes_allocated(&self) -> usize {
        (self.index.len() + self.free_slots.len()) * self.shape.slot_bytes()
    }
}
