//! Safetensors checkpoints, one file or sharded behind `model.safetensors.index.json`,
//! memory-mapped and read tensor by tensor into f32; or a dummy checkpoint whose tensors are
//! made as they are read ([`super::dummy`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors};

use super::ModelError;
use super::dummy::{DummyFill, DummyWeights};

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where the shards of a checkpoint that are not on disk yet come from: the Hugging Face
/// hub or a mirror of it ([`crate::hub`]). A node of a cluster opens its checkpoint from
/// every shard's header and downloads a shard the first time it reads a tensor in it, so
/// that it fetches the dense weights and the experts it holds, and no others.
pub trait ShardSource: Send + Sync {
    /// Shard `file`'s header as the file begins: the 8-byte little-endian length, then the
    /// JSON.
    fn header(&self, file: &str) -> Result<Vec<u8>, String>;
    /// Makes shard `file` present in the model directory (downloads it, checksum checked).
    fn fetch(&self, file: &str) -> Result<(), String>;
}

/// One `.safetensors` file: its parsed header, and its bytes mapped once they are on disk.
struct Shard {
    path: PathBuf,
    /// Set when the file is mapped: at open for a file on disk, at the first read of one of
    /// its tensors for a shard that is downloaded then.
    map: OnceLock<Mmap>,
    /// Offset of the first data byte (8-byte length prefix plus the JSON header).
    data_start: usize,
    metadata: Metadata,
    /// The header as read before the download ([`ShardSource::header`]), which the
    /// downloaded file must begin with; `None` for a file that was on disk at open.
    remote_header: Option<Vec<u8>>,
    /// Held while the shard downloads: readers of its tensors wait for one download.
    fetching: Mutex<()>,
}

/// All tensors of a checkpoint, by name, without copying them out of the page cache.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Tensor name to the index of the shard that holds it.
    locations: HashMap<String, usize>,
    /// Prepended to every name the loader asks for: `language_model.` where the text model
    /// sits beside a vision tower (Kimi K2.5 and later), else empty.
    prefix: &'static str,
    /// Set for a dummy checkpoint: no files, every tensor made when it is read.
    dummy: Option<DummyWeights>,
    /// Where shards that were not on disk at open are downloaded from.
    remote: Option<Arc<dyn ShardSource>>,
}

/// Where a multimodal checkpoint keeps its text model.
const TEXT_MODEL_PREFIX: &str = "language_model.";

/// Where Qwen3.5's multimodal checkpoints keep the text model's `model.` tensors (`lm_head`
/// stays at the top level).
const NESTED_TEXT_MODEL: &str = "model.language_model.";

impl Checkpoint {
    /// The model directory the checkpoint was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Opens `model.safetensors` in `dir`, or every shard the index file names.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        Self::open_with(dir, None)
    }

    /// As [`Checkpoint::open`]; a shard the index names that is not in `dir` is opened from
    /// its header in `remote` and downloaded when one of its tensors is first read.
    pub fn open_with(dir: &Path, remote: Option<Arc<dyn ShardSource>>) -> Result<Self, ModelError> {
        let index_path = dir.join(INDEX_FILE);
        let single_path = dir.join(SINGLE_FILE);
        if index_path.exists() {
            Self::open_sharded(dir, &index_path, remote)
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
                prefix: "",
                dummy: None,
                remote: None,
            }
            .with_text_model_prefix())
        } else {
            Err(ModelError::NoWeights {
                dir: dir.to_path_buf(),
            })
        }
    }

    fn open_sharded(
        dir: &Path,
        index_path: &Path,
        remote: Option<Arc<dyn ShardSource>>,
    ) -> Result<Self, ModelError> {
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
            let shard = match &remote {
                _ if path.exists() => Shard::open(&path)?,
                Some(remote) => {
                    let header = remote.header(name).map_err(|reason| ModelError::Fetch {
                        path: path.clone(),
                        what: "its header",
                        reason,
                    })?;
                    Shard::from_header(&path, header)?
                }
                None => {
                    return Err(ModelError::MissingShard {
                        index: index_path.to_path_buf(),
                        shard: path,
                    });
                }
            };
            shard_of_file.insert(name.clone(), shards.len());
            shards.push(shard);
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
            prefix: "",
            dummy: None,
            remote,
        }
        .with_text_model_prefix())
    }

    /// A checkpoint of random bf16 weights for the model `config.json` in `dir` describes
    /// (`--load-format dummy`): nothing is read from disk but the config.
    pub fn dummy(dir: &Path, weights: DummyWeights) -> Self {
        Checkpoint {
            dir: dir.to_path_buf(),
            shards: Vec::new(),
            locations: HashMap::new(),
            prefix: "",
            dummy: Some(weights),
            remote: None,
        }
    }

    /// Whether the weights are made up rather than read ([`Checkpoint::dummy`]).
    pub fn is_dummy(&self) -> bool {
        self.dummy.is_some()
    }

    /// How a dummy checkpoint makes tensor `name` of `shape` (`None`: not dummy, or no such
    /// tensor); reading it gives these values.
    pub fn dummy_fill(&self, name: &str, shape: &[usize]) -> Option<DummyFill> {
        let dummy = self.dummy.as_ref()?;
        dummy.has(name).then(|| dummy.fill(name, shape))
    }

    /// A checkpoint whose text model lies under `language_model.` (and no `model.` tensors
    /// beside it) is read through that prefix; everything else in it (the vision tower and its
    /// projector) is left unloaded, and the log says so.
    /// Qwen3.5's, whose text model's `model.` tensors lie under `model.language_model.`, is
    /// read through that instead.
    fn with_text_model_prefix(mut self) -> Self {
        let probe = "model.embed_tokens.weight";
        if self.locations.contains_key(probe) {
            return self;
        }
        if self
            .locations
            .contains_key(&format!("{TEXT_MODEL_PREFIX}{probe}"))
        {
            self.prefix = TEXT_MODEL_PREFIX;
        } else if self
            .locations
            .contains_key("model.language_model.embed_tokens.weight")
        {
            self.prefix = NESTED_TEXT_MODEL;
        } else {
            return self;
        }
        let text = |name: &str| match self.prefix {
            NESTED_TEXT_MODEL => {
                name.starts_with(NESTED_TEXT_MODEL) || name.starts_with("lm_head.")
            }
            prefix => name.starts_with(prefix),
        };
        let mut left: Vec<&str> = self
            .locations
            .keys()
            .filter(|name| !text(name))
            .map(|name| name.split('.').next().unwrap_or(name))
            .collect();
        let tensors = left.len();
        left.sort_unstable();
        left.dedup();
        tracing::info!(
            dir = %self.dir.display(),
            "serving the text model under `{}`; {tensors} other tensors ({}) are left unloaded",
            self.prefix,
            left.join(", ")
        );
        self
    }

    /// The name tensor `name` is stored under (the text-model prefix added).
    pub fn stored_name(&self, name: &str) -> String {
        match (self.prefix, name.strip_prefix("model.")) {
            (NESTED_TEXT_MODEL, Some(rest)) => format!("{NESTED_TEXT_MODEL}{rest}"),
            (NESTED_TEXT_MODEL, None) => name.to_string(),
            (prefix, _) => format!("{prefix}{name}"),
        }
    }

    fn location(&self, name: &str) -> Option<usize> {
        if self.prefix.is_empty() {
            self.locations.get(name).copied()
        } else {
            self.locations.get(&self.stored_name(name)).copied()
        }
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
        if let Some(dummy) = &self.dummy {
            // With the version of the values' formula: nodes that would make different values
            // from the same seed must not agree.
            hash.update(format!("dummy {} {dummy:?}", DummyWeights::FORMULA).as_bytes());
        }
        let digest = hash.finalize();
        u64::from_le_bytes(digest[..8].try_into().unwrap_or_default())
    }

    pub fn contains(&self, name: &str) -> bool {
        match &self.dummy {
            Some(dummy) => dummy.has(name),
            None => self.location(name).is_some(),
        }
    }

    /// The storage dtype of tensor `name`, if present.
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        if let Some(dummy) = &self.dummy {
            return dummy.has(name).then_some(Dtype::BF16);
        }
        let shard = &self.shards[self.location(name)?];
        shard
            .metadata
            .info(&self.stored_name(name))
            .map(|info| info.dtype)
    }

    /// The shape of tensor `name` as stored, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        // A dummy tensor takes the shape it is read with.
        let shard = &self.shards[self.location(name)?];
        shard
            .metadata
            .info(&self.stored_name(name))
            .map(|info| info.shape.clone())
    }

    /// Reads an FP8 e4m3 tensor `name` of shape `shape` as its bytes.
    pub fn read_fp8(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>, ModelError> {
        let (path, dtype, bytes) = self.raw(name, shape)?;
        if dtype != Dtype::F8_E4M3 {
            return Err(ModelError::Corrupt {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor `{}` is {dtype:?}; its scale says it is FP8, expected F8_E4M3",
                    self.stored_name(name)
                ),
            });
        }
        Ok(bytes.to_vec())
    }

    /// Reads a uint8 tensor `name` of shape `shape` as its bytes (MXFP4's blocks and scales).
    pub fn read_u8(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>, ModelError> {
        let (path, dtype, bytes) = self.raw(name, shape)?;
        self.expect_dtype(name, path, dtype, Dtype::U8)?;
        Ok(bytes.to_vec())
    }

    /// Reads tensor `name` of shape `shape` as its bytes when it is one of `dtypes` (packed
    /// and one-byte formats: MXFP4's e2m1 pairs, e8m0 exponents).
    pub fn read_bytes(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<Vec<u8>, ModelError> {
        let (path, dtype, bytes) = self.raw(name, shape)?;
        if !dtypes.contains(&dtype) {
            return Err(ModelError::Corrupt {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor `{}` is {dtype:?}, expected {dtypes:?}",
                    self.stored_name(name)
                ),
            });
        }
        Ok(bytes.to_vec())
    }

    /// Reads an int32 tensor `name` of shape `shape`, each word as its bits.
    pub fn read_i32_bits(&self, name: &str, shape: &[usize]) -> Result<Vec<u32>, ModelError> {
        let (path, dtype, bytes) = self.raw(name, shape)?;
        if dtype != Dtype::I32 {
            return Err(ModelError::Corrupt {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor `{}` is {dtype:?}, expected I32",
                    self.stored_name(name)
                ),
            });
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Reads a small integer tensor (int32 or int64) `name` of shape `shape` as i64 values.
    pub fn read_int(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, ModelError> {
        let (path, dtype, bytes) = self.raw(name, shape)?;
        match dtype {
            Dtype::I32 => Ok(bytes
                .chunks_exact(4)
                .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect()),
            Dtype::I64 => Ok(bytes
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
                .collect()),
            other => Err(ModelError::Corrupt {
                path: path.to_path_buf(),
                reason: format!(
                    "tensor `{}` is {other:?}, expected I32 or I64",
                    self.stored_name(name)
                ),
            }),
        }
    }

    /// Reads tensor `name`, checks that its shape is `shape`, and converts it to f32.
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (path, dtype, bytes) = self.raw(name, shape)?;
        self.widened(name, path, dtype, &bytes)
    }

    /// Reads a bf16 tensor `name` of shape `shape` as it is stored, without widening it.
    pub fn read_bf16(&self, name: &str, shape: &[usize]) -> Result<Vec<bf16>, ModelError> {
        let (path, dtype, bytes) = self.raw(name, shape)?;
        self.expect_dtype(name, path, dtype, Dtype::BF16)?;
        Ok(bf16_values(&bytes))
    }

    /// Reads block `index` along the first dimension of tensor `name` (whole shape `shape`)
    /// as f32, decoding only that block: one expert of a layer's fused experts.
    pub fn read_f32_at(
        &self,
        name: &str,
        shape: &[usize],
        index: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let (path, dtype, bytes) = self.raw_at(name, shape, index)?;
        self.widened(name, path, dtype, &bytes)
    }

    /// Reads block `index` along the first dimension of bf16 tensor `name` (whole shape
    /// `shape`) as it is stored.
    pub fn read_bf16_at(
        &self,
        name: &str,
        shape: &[usize],
        index: usize,
    ) -> Result<Vec<bf16>, ModelError> {
        let (path, dtype, bytes) = self.raw_at(name, shape, index)?;
        self.expect_dtype(name, path, dtype, Dtype::BF16)?;
        Ok(bf16_values(&bytes))
    }

    /// Reads block `index` along the first dimension of uint8 tensor `name` (whole shape
    /// `shape`) as its bytes.
    pub fn read_u8_at(
        &self,
        name: &str,
        shape: &[usize],
        index: usize,
    ) -> Result<Vec<u8>, ModelError> {
        let (path, dtype, bytes) = self.raw_at(name, shape, index)?;
        self.expect_dtype(name, path, dtype, Dtype::U8)?;
        Ok(bytes.into_owned())
    }

    /// A clear error naming tensor `name` where its `dtype` is not `expected`.
    fn expect_dtype(
        &self,
        name: &str,
        path: &Path,
        dtype: Dtype,
        expected: Dtype,
    ) -> Result<(), ModelError> {
        if dtype == expected {
            return Ok(());
        }
        Err(ModelError::Corrupt {
            path: path.to_path_buf(),
            reason: format!(
                "tensor `{}` is {dtype:?}, expected {expected:?}",
                self.stored_name(name)
            ),
        })
    }

    /// Tensor `name`'s `bytes` of `dtype` widened to f32.
    fn widened(
        &self,
        name: &str,
        path: &Path,
        dtype: Dtype,
        bytes: &[u8],
    ) -> Result<Vec<f32>, ModelError> {
        decode_f32(bytes, dtype).map_err(|reason| ModelError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("tensor `{}`: {reason}", self.stored_name(name)),
        })
    }

    /// The bytes of block `index` along the first dimension of tensor `name`, after checking
    /// the whole tensor's shape. A stored tensor is mapped, so the rest is never touched (a
    /// dummy one is made whole, so that each block keeps its own values).
    fn raw_at(
        &self,
        name: &str,
        shape: &[usize],
        index: usize,
    ) -> Result<(&Path, Dtype, Cow<'_, [u8]>), ModelError> {
        let (&first, _) = shape.split_first().ok_or_else(|| ModelError::Corrupt {
            path: self.dir.clone(),
            reason: format!(
                "tensor `{}` read in blocks has no dimensions",
                self.stored_name(name)
            ),
        })?;
        if index >= first {
            return Err(ModelError::Corrupt {
                path: self.dir.clone(),
                reason: format!(
                    "block {index} of tensor `{}` asked for; it has {first}",
                    self.stored_name(name)
                ),
            });
        }
        let (path, dtype, bytes) = self.raw(name, shape)?;
        let block = bytes.len() / first;
        Ok(match bytes {
            Cow::Borrowed(all) => (path, dtype, Cow::Borrowed(&all[index * block..][..block])),
            Cow::Owned(all) => (
                path,
                dtype,
                Cow::Owned(all[index * block..][..block].to_vec()),
            ),
        })
    }

    /// The file, dtype and bytes of tensor `name`, after checking its shape.
    fn raw(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(&Path, Dtype, Cow<'_, [u8]>), ModelError> {
        let missing = || ModelError::MissingTensor {
            name: self.stored_name(name),
            expected_shape: shape.to_vec(),
        };
        if let Some(dummy) = &self.dummy {
            if !dummy.has(name) {
                return Err(missing());
            }
            let bytes = dummy.bytes(name, shape);
            return Ok((&self.dir, Dtype::BF16, Cow::Owned(bytes)));
        }
        let shard = &self.shards[self.location(name).ok_or_else(missing)?];
        let info = shard
            .metadata
            .info(&self.stored_name(name))
            .ok_or_else(missing)?;
        if info.shape != shape {
            return Err(ModelError::TensorShape {
                path: shard.path.clone(),
                name: self.stored_name(name),
                expected: shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        let (begin, end) = info.data_offsets;
        let map = self.mapped(shard)?;
        let bytes = &map[shard.data_start + begin..shard.data_start + end];
        Ok((&shard.path, info.dtype, Cow::Borrowed(bytes)))
    }

    /// `shard`'s bytes, downloaded first when it was opened from its header.
    fn mapped<'a>(&self, shard: &'a Shard) -> Result<&'a Mmap, ModelError> {
        if let Some(map) = shard.map.get() {
            return Ok(map);
        }
        let _one_download = shard
            .fetching
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(map) = shard.map.get() {
            return Ok(map);
        }
        let file = shard
            .path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let corrupt = |reason: String| ModelError::Corrupt {
            path: shard.path.clone(),
            reason,
        };
        let fetch_error = |reason: String| ModelError::Fetch {
            path: shard.path.clone(),
            what: "the shard",
            reason,
        };
        let remote = self
            .remote
            .as_ref()
            .ok_or_else(|| fetch_error("it has no source".into()))?;
        remote.fetch(&file).map_err(fetch_error)?;
        let (map, _, _) = map_file(&shard.path)?;
        let expected = shard.remote_header.as_deref().unwrap_or_default();
        if map.get(..expected.len()) != Some(expected) {
            return Err(corrupt(
                "the downloaded file's header differs from the one read before the download".into(),
            ));
        }
        tracing::info!(shard = %shard.path.display(), "shard downloaded and mapped");
        Ok(shard.map.get_or_init(|| map))
    }
}

impl Shard {
    fn open(path: &Path) -> Result<Self, ModelError> {
        let (map, header_len, metadata) = map_file(path)?;
        Ok(Shard {
            path: path.to_path_buf(),
            map: OnceLock::from(map),
            data_start: 8 + header_len,
            metadata,
            remote_header: None,
            fetching: Mutex::new(()),
        })
    }

    /// A shard not on disk yet, from its `header` (the file's first bytes: length and JSON).
    fn from_header(path: &Path, header: Vec<u8>) -> Result<Self, ModelError> {
        let corrupt = |reason: String| ModelError::Corrupt {
            path: path.to_path_buf(),
            reason: format!("its header (read before the download) {reason}"),
        };
        let length = header
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| corrupt("is shorter than 8 bytes".into()))?;
        let json = usize::try_from(length)
            .ok()
            .and_then(|n| header.get(8..8usize.checked_add(n)?))
            .filter(|json| json.len() + 8 == header.len())
            .ok_or_else(|| corrupt(format!("does not hold the {length} bytes it announces")))?;
        let metadata: Metadata = serde_json::from_slice(json)
            .map_err(|e| corrupt(format!("is not a safetensors header: {e}")))?;
        Ok(Shard {
            path: path.to_path_buf(),
            map: OnceLock::new(),
            data_start: header.len(),
            metadata,
            remote_header: Some(header),
            fetching: Mutex::new(()),
        })
    }
}

/// `path` mapped, with its header's length and its parsed header.
fn map_file(path: &Path) -> Result<(Mmap, usize, Metadata), ModelError> {
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
    Ok((map, header_len, metadata))
}

/// Little-endian bf16 values as stored.
fn bf16_values(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|b| bf16::from_le_bytes([b[0], b[1]]))
        .collect()
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
        Dtype::F8_E4M3 => {
            return Err(
                "dtype F8_E4M3 here needs config.json's quantization_config to say `fp8` with \
                 its weight_block_size"
                    .into(),
            );
        }
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

    /// One block along the first dimension is read alone; a block past the end, a wrong
    /// whole shape or a wrong dtype is an error.
    #[test]
    fn reads_one_block_of_a_stacked_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<u8> = (0..12).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![3, 2, 2], &values);
        let bytes = safetensors::serialize([("stack", view.unwrap())], None).unwrap();
        std::fs::write(dir.path().join(SINGLE_FILE), bytes).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let block = ckpt.read_f32_at("stack", &[3, 2, 2], 1).unwrap();
        assert_eq!(block, vec![4.0, 5.0, 6.0, 7.0]);
        let past = ckpt.read_f32_at("stack", &[3, 2, 2], 3).unwrap_err();
        assert!(past.to_string().contains("block 3"), "{past}");
        let shape = ckpt.read_f32_at("stack", &[3, 4], 0).unwrap_err();
        assert!(matches!(shape, ModelError::TensorShape { .. }), "{shape}");
        let dtype = ckpt.read_bf16_at("stack", &[3, 2, 2], 0).unwrap_err();
        assert!(dtype.to_string().contains("expected BF16"), "{dtype}");
    }
}
