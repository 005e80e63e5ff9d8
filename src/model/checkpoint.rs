//! Safetensors checkpoints, one file or sharded behind `model.safetensors.index.json`,
//! memory-mapped and read tensor by tensor into f32.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors};

use super::ModelError;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// One mapped `.safetensors` file and its parsed header.
struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Offset of the first data byte (8-byte length prefix plus the JSON header).
    data_start: usize,
    metadata: Metadata,
}

/// All tensors of a checkpoint, by name, without copying them out of the page cache.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name to the index of the shard that holds it.
    locations: HashMap<String, usize>,
}

impl Checkpoint {
    /// The model directory the checkpoint was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Opens `model.safetensors` in `dir`, or every shard the index file names.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        if index_path.exists() {
            Self::open_sharded(dir, &index_path)
        } else if single_path.exists() {
            let shard = Shard::open(&single_path)?;
            let locations = shard
                .metadata
                .tensors()
                .into_keys()
                .map(|name| (name, 0))
                .collect();
            Ok(Checkpoint {
                dir: dir.to_path_buf(),
                shards: vec![shard],
                locations,
            })
        } else {
            Err(ModelError::NoWeights {
                dir: dir.to_path_buf(),
            })
        }
    }

    fn open_sharded(dir: &Path, index_path: &Path) -> Result<Self, ModelError> {
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: HashMap<String, String>,
        }
        let text = std::fs::read_to_string(index_path).map_err(|source| ModelError::Io {
            path: index_path.to_path_buf(),
            source,
        })?;
        let index: Index = serde_json::from_str(&text).map_err(|e| ModelError::Corrupt {
            path: index_path.to_path_buf(),
            reason: format!("not a safetensors index: {e}"),
        })?;
        let mut file_names: Vec<&String> = index.weight_map.values().collect();
        file_names.sort();
        file_names.dedup();
        let mut shards = Vec::with_capacity(file_names.len());
        let mut shard_of_file = HashMap::new();
        for name in file_names {
            if name.contains('/') || name.contains("..") {
                return Err(ModelError::Corrupt {
                    path: index_path.to_path_buf(),
                    reason: format!("shard name `{name}` must be a plain file name"),
                });
            }
            let path = dir.join(name);
            if !path.exists() {
                return Err(ModelError::MissingShard {
                    index: index_path.to_path_buf(),
                    shard: path,
                });
            }
            shard_of_file.insert(name.clone(), shards.len());
            shards.push(Shard::open(&path)?);
        }
        let mut locations = HashMap::with_capacity(index.weight_map.len());
        for (tensor, file) in &index.weight_map {
            let shard = shard_of_file[file];
            if shards[shard].metadata.info(tensor).is_none() {
                return Err(ModelError::Corrupt {
                    path: shards[shard].path.clone(),
                    reason: format!(
                        "the index places tensor `{tensor}` here but the file lacks it"
                    ),
                });
            }
            locations.insert(tensor.clone(), shard);
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            locations,
        })
    }

    /// A fingerprint of the model: `config.json` and every tensor's name, dtype and shape.
    /// Nodes of a cluster must serve the same one. It does not read the weights (terabytes),
    /// so two checkpoints of the same architecture with different values look alike.
    pub fn fingerprint(&self) -> u64 {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        hash.update(std::fs::read(self.dir.join("config.json")).unwrap_or_default());
        let mut names: Vec<&String> = self.locations.keys().collect();
        names.sort_unstable();
        for name in names {
            hash.update(name.as_bytes());
            if let Some(info) = self.shards[self.locations[name]].metadata.info(name) {
                hash.update(format!("{:?}{:?}", info.dtype, info.shape).as_bytes());
            }
            hash.update([0]);
        }
        let digest = hash.finalize();
        u64::from_le_bytes(digest[..8].try_into().unwrap_or_default())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.locations.contains_key(name)
    }

    /// The storage dtype of tensor `name`, if present.
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        let shard = &self.shards[*self.locations.get(name)?];
        shard.metadata.info(name).map(|info| info.dtype)
    }

    /// Reads tensor `name`, checks that its shape is `shape`, and converts it to f32.
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (shard, dtype, bytes) = self.raw(name, shape)?;
        decode_f32(bytes, dtype).map_err(|reason| ModelError::Corrupt {
            path: shard.path.clone(),
            reason: format!("tensor `{name}`: {reason}"),
        })
    }

    /// Reads a bf16 tensor `name` of shape `shape` as it is stored, without widening it.
    pub fn read_bf16(&self, name: &str, shape: &[usize]) -> Result<Vec<bf16>, ModelError> {
        let (shard, dtype, bytes) = self.raw(name, shape)?;
        if dtype != Dtype::BF16 {
            return Err(ModelError::Corrupt {
                path: shard.path.clone(),
                reason: format!("tensor `{name}` is {dtype:?}, expected BF16"),
            });
        }
        Ok(bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]))
            .collect())
    }

    /// The shard, dtype and bytes of tensor `name`, after checking its shape.
    fn raw(&self, name: &str, shape: &[usize]) -> Result<(&Shard, Dtype, &[u8]), ModelError> {
        let shard_index = *self
            .locations
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                expected_shape: shape.to_vec(),
            })?;
        let shard = &self.shards[shard_index];
        let info = shard
            .metadata
            .info(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                expected_shape: shape.to_vec(),
            })?;
        if info.shape != shape {
            return Err(ModelError::TensorShape {
                path: shard.path.clone(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        let (begin, end) = info.data_offsets;
        let bytes = &shard.map[shard.data_start + begin..shard.data_start + end];
        Ok((shard, info.dtype, bytes))
    }
}

impl Shard {
    fn open(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the map is read-only and lives as long as the Shard. A checkpoint file
        // changed underneath a running server is outside what we defend against, as in every
        // mmap-based loader (safetensors' own docs map files the same way).
        let map = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&map).map_err(|e| ModelError::Corrupt {
                path: path.to_path_buf(),
                reason: format!("not a valid safetensors file ({e}); is it truncated?"),
            })?;
        Ok(Shard {
            path: path.to_path_buf(),
            map,
            data_start: 8 + header_len,
            metadata,
        })
    }
}

/// Converts little-endian tensor bytes of `dtype` into f32.
fn decode_f32(bytes: &[u8], dtype: Dtype) -> Result<Vec<f32>, String> {
    let words = |width: usize| bytes.chunks_exact(width);
    Ok(match dtype {
        Dtype::F32 => words(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => words(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => words(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "dtype {other:?} is not supported (bf16, f16, f32 are)"
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_each_float_dtype() {
        let f = 1.5f32;
        assert_eq!(decode_f32(&f.to_le_bytes(), Dtype::F32).unwrap(), vec![1.5]);
        let b = bf16::from_f32(-2.0).to_le_bytes();
        assert_eq!(decode_f32(&b, Dtype::BF16).unwrap(), vec![-2.0]);
        let h = f16::from_f32(0.25).to_le_bytes();
        assert_eq!(decode_f32(&h, Dtype::F16).unwrap(), vec![0.25]);
        assert!(decode_f32(&[0; 8], Dtype::I64).is_err());
    }
}
