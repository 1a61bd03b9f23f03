//! llama.cpp GGUF files (versions 2 and 3, little-endian): a small parser, the loader for the
//! `llama` and `qwen2` architectures, and a writer (used by tests and tools to build files).
//!
//! Layout: magic `GGUF`, u32 version, u64 tensor count, u64 metadata count, metadata
//! key/values, tensor infos (name, dims innermost first, type, offset), then the tensor data
//! from the next multiple of `general.alignment` (default 32).

use std::collections::BTreeMap;
use std::path::Path;

use super::dequant::{GgmlType, dequantize, ggml_type_name};
use super::{Checkpoint, LoadError, check, unpermute_rows};
use crate::chat::ChatTemplate;
use crate::config::{Arch, ModelConfig};
use crate::tokenizer::{AddedToken, PreTokenizer, Tokenizer, byte_level_bpe_json};
use crate::weights::{LayerWeights, Tensor, Weights};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// type 0
    U8(u8),
    /// type 1
    I8(i8),
    /// type 2
    U16(u16),
    /// type 3
    I16(i16),
    /// type 4
    U32(u32),
    /// type 5
    I32(i32),
    /// type 6
    F32(f32),
    /// type 7
    Bool(bool),
    /// type 8
    Str(String),
    /// type 9 (element type, values)
    Array(Vec<MetaValue>),
    /// type 10
    U64(u64),
    /// type 11
    I64(i64),
    /// type 12
    F64(f64),
}

impl MetaValue {
    /// An integer value of any width (negative values and non-integers give `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A signed integer value of any width.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A float value (integers convert).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            // The shortest decimal that round-trips the f32 (1e-5 rather than
            // 9.99999974e-6): the value the converter was given, as `config.json` has it.
            MetaValue::F32(v) => v.to_string().parse().ok(),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// A string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A bool value.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// An array value.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => 0,
            MetaValue::I8(_) => 1,
            MetaValue::U16(_) => 2,
            MetaValue::I16(_) => 3,
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::Str(_) => 8,
            MetaValue::Array(_) => 9,
            MetaValue::U64(_) => 10,
            MetaValue::I64(_) => 11,
            MetaValue::F64(_) => 12,
        }
    }
}

/// One tensor's header entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name (`blk.0.attn_q.weight`, ...).
    pub name: String,
    /// Dimensions, innermost (contiguous) first.
    pub dims: Vec<u64>,
    /// GGML type id.
    pub ty: u32,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

/// A parsed GGUF header.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata by key.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset of the data section.
    pub data_offset: usize,
}

impl GgufHeader {
    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A tensor info by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
    file: &'a Path,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], LoadError> {
        match self.pos.checked_add(n).filter(|&e| e <= self.b.len()) {
            Some(end) => {
                let s = &self.b[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(LoadError::Truncated {
                file: self.file.display().to_string(),
                expected: format!(
                    "{what} ({n} bytes at offset {}, file has {} bytes)",
                    self.pos,
                    self.b.len()
                ),
            }),
        }
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N], LoadError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, LoadError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, LoadError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    fn len(&mut self, what: &str) -> Result<usize, LoadError> {
        let n = self.u64(what)?;
        // Every element takes at least one byte, so a count beyond the file is corrupt (or
        // truncated): reject it before allocating.
        let left = (self.b.len() - self.pos) as u64;
        if n > left {
            return Err(LoadError::Truncated {
                file: self.file.display().to_string(),
                expected: format!(
                    "{what}: {n} elements at offset {}, only {left} bytes left",
                    self.pos
                ),
            });
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, LoadError> {
        let n = self.len(what)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec())
            .map_err(|_| LoadError::invalid(self.file, format!("{what} is not UTF-8")))
    }

    fn value(&mut self, ty: u32, key: &str) -> Result<MetaValue, LoadError> {
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>(key)?[0]),
            1 => MetaValue::I8(self.arr::<1>(key)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr(key)?)),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr(key)?)),
            7 => MetaValue::Bool(self.arr::<1>(key)?[0] != 0),
            8 => MetaValue::Str(self.string(key)?),
            9 => {
                // Nested arrays (element type 9) recurse like any other element type.
                let et = self.u32(key)?;
                let n = self.len(key)?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(et, key)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr(key)?)),
            t => {
                return Err(LoadError::invalid(
                    self.file,
                    format!("metadata {key:?} has unknown value type {t}"),
                ));
            }
        })
    }
}

/// Parse the header of a GGUF file held in `b`.
pub fn parse_header(b: &[u8], file: &Path) -> Result<GgufHeader, LoadError> {
    let mut r = Reader { b, pos: 0, file };
    if r.take(4, "magic")? != MAGIC {
        return Err(LoadError::invalid(file, "not a GGUF file (bad magic)"));
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(LoadError::invalid(
            file,
            format!("unsupported GGUF version {version} (supported: 2, 3)"),
        ));
    }
    let n_tensors = r.len("tensor count")?;
    let n_kv = r.len("metadata count")?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = r.string("metadata key")?;
        let ty = r.u32(&key)?;
        let v = r.value(ty, &key)?;
        metadata.insert(key, v);
    }
    let mut tensors = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string("tensor name")?;
        let nd = r.u32(&name)?;
        if nd > 4 {
            return Err(LoadError::invalid(
                file,
                format!("tensor {name} has {nd} dimensions (at most 4)"),
            ));
        }
        let dims = (0..nd)
            .map(|_| r.u64(&name))
            .collect::<Result<Vec<_>, _>>()?;
        let ty = r.u32(&name)?;
        let offset = r.u64(&name)?;
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
        });
    }
    let align = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v.as_u64().filter(|a| *a > 0).ok_or_else(|| {
            LoadError::invalid(file, "general.alignment is not a positive integer")
        })?,
    };
    let data_offset = (r.pos as u64).div_ceil(align) * align;
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        data_offset: data_offset as usize,
    })
}

/// Load a GGUF checkpoint.
pub fn load_file(path: &Path) -> Result<Checkpoint, LoadError> {
    let f = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
    // SAFETY: the file is mapped read-only and only read while the mapping lives; a
    // checkpoint being rewritten while it loads is outside what this loader defends against.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| LoadError::io(path, e))?;
    let h = parse_header(&map, path)?;
    let cfg = config_from(&h, path)?;
    let weights = weights_from(&h, &map, path, &cfg)?;
    check(path, &cfg, &weights)?;
    let tokenizer = tokenizer_from(&h, path)?;
    let chat_template = match h.get("tokenizer.chat_template").and_then(MetaValue::as_str) {
        Some(src) => {
            let tok = |key: &str| {
                h.get(key)
                    .and_then(MetaValue::as_u64)
                    .and_then(|id| tokenizer.id_token(id as u32))
                    .unwrap_or_default()
            };
            Some(
                ChatTemplate::new(
                    src,
                    &tok("tokenizer.ggml.bos_token_id"),
                    &tok("tokenizer.ggml.eos_token_id"),
                )
                .map_err(|e| LoadError::ChatTemplate {
                    file: path.display().to_string(),
                    message: e.0,
                })?,
            )
        }
        None => None,
    };
    let name = h
        .get("general.name")
        .and_then(MetaValue::as_str)
        .map(str::to_string)
        .or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_default();
    Ok(Checkpoint {
        name,
        config: cfg,
        weights,
        tokenizer,
        chat_template,
    })
}

fn config_from(h: &GgufHeader, file: &Path) -> Result<ModelConfig, LoadError> {
    let arch_name = h
        .get("general.architecture")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| LoadError::invalid(file, "missing metadata general.architecture"))?;
    let arch = match arch_name {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        other => {
            return Err(LoadError::UnsupportedArch {
                file: file.display().to_string(),
                name: other.to_string(),
            });
        }
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let int = |k: &str| -> Result<usize, LoadError> {
        let full = key(k);
        h.get(&full)
            .and_then(MetaValue::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| LoadError::invalid(file, format!("missing integer metadata {full}")))
    };
    let hidden = int("embedding_length")?;
    let heads = int("attention.head_count")?;
    let kv_heads = int("attention.head_count_kv").unwrap_or(heads);
    let head_dim = match int("attention.key_length") {
        Ok(d) => d,
        Err(_) if heads > 0 => hidden / heads,
        Err(e) => return Err(e),
    };
    let float = |k: &str, default: Option<f64>| -> Result<f64, LoadError> {
        let full = key(k);
        match h.get(&full).and_then(MetaValue::as_f64) {
            Some(v) => Ok(v),
            None => {
                default.ok_or_else(|| LoadError::invalid(file, format!("missing metadata {full}")))
            }
        }
    };
    let vocab_size = match h.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array) {
        Some(t) => t.len(),
        None => int("vocab_size")?,
    };
    let id = |k: &str| h.get(k).and_then(MetaValue::as_u64).map(|v| v as u32);
    let mut eos_token_ids: Vec<u32> = Vec::new();
    // llama.cpp ends generation on EOS and on the end-of-turn token (when they differ).
    for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(v) = id(k).filter(|v| !eos_token_ids.contains(v)) {
            eos_token_ids.push(v);
        }
    }
    Ok(ModelConfig {
        arch,
        hidden_size: hidden,
        intermediate_size: int("feed_forward_length")?,
        num_layers: int("block_count")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        vocab_size,
        rope_theta: float("rope.freq_base", Some(10_000.0))?,
        rms_norm_eps: float("attention.layer_norm_rms_epsilon", None)?,
        tie_word_embeddings: h.tensor("output.weight").is_none(),
        attention_bias: arch == Arch::Qwen2,
        max_position_embeddings: int("context_length")?,
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_ids,
    })
}

fn read_tensor(h: &GgufHeader, b: &[u8], file: &Path, name: &str) -> Result<Tensor, LoadError> {
    let fname = || file.display().to_string();
    let info = h.tensor(name).ok_or_else(|| LoadError::MissingTensor {
        file: fname(),
        name: name.to_string(),
    })?;
    let ty = GgmlType::from_id(info.ty).ok_or_else(|| LoadError::UnsupportedType {
        file: fname(),
        name: name.to_string(),
        dtype: ggml_type_name(info.ty),
    })?;
    let n = info
        .dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d as usize))
        .ok_or_else(|| LoadError::invalid(file, format!("tensor {name} is too large")))?;
    let bytes = ty.bytes_for(n).ok_or_else(|| {
        LoadError::invalid(
            file,
            format!("tensor {name}: {n} elements is not a whole number of {ty:?} blocks"),
        )
    })?;
    let start = h.data_offset as u64 + info.offset;
    let end = start + bytes as u64;
    if end > b.len() as u64 {
        return Err(LoadError::Truncated {
            file: fname(),
            expected: format!(
                "tensor {name} needs bytes {start}..{end}, file has {} bytes",
                b.len()
            ),
        });
    }
    let data = dequantize(ty, &b[start as usize..end as usize], n);
    // GGUF lists dims innermost first; Hugging Face shapes are outermost first.
    let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
    Ok(Tensor { shape, data })
}

fn weights_from(
    h: &GgufHeader,
    b: &[u8],
    file: &Path,
    cfg: &ModelConfig,
) -> Result<Weights, LoadError> {
    let t = |name: &str| read_tensor(h, b, file, name);
    // Undo llama.cpp's q/k permutation; only when the shape is the expected one (otherwise
    // the shape check reports the mismatch).
    let unperm = |mut x: Tensor, heads: usize| {
        if cfg.arch == Arch::Llama && x.shape.len() == 2 && x.shape[0] == heads * cfg.head_dim {
            x.data = unpermute_rows(&x.data, heads, x.shape[1]);
        }
        x
    };
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for n in 0..cfg.num_layers {
        let p = |s: &str| format!("blk.{n}.{s}");
        let bias = |s: &str| -> Result<Option<Tensor>, LoadError> {
            if cfg.attention_bias {
                t(&p(s)).map(Some)
            } else {
                Ok(None)
            }
        };
        layers.push(LayerWeights {
            input_norm: t(&p("attn_norm.weight"))?,
            q_proj: unperm(t(&p("attn_q.weight"))?, cfg.num_heads),
            k_proj: unperm(t(&p("attn_k.weight"))?, cfg.num_kv_heads),
            v_proj: t(&p("attn_v.weight"))?,
            q_bias: bias("attn_q.bias")?,
            k_bias: bias("attn_k.bias")?,
            v_bias: bias("attn_v.bias")?,
            o_proj: t(&p("attn_output.weight"))?,
            post_norm: t(&p("ffn_norm.weight"))?,
            gate_proj: t(&p("ffn_gate.weight"))?,
            up_proj: t(&p("ffn_up.weight"))?,
            down_proj: t(&p("ffn_down.weight"))?,
        });
    }
    Ok(Weights {
        embed: t("token_embd.weight")?,
        layers,
        final_norm: t("output_norm.weight")?,
        lm_head: if cfg.tie_word_embeddings {
            None
        } else {
            Some(t("output.weight")?)
        },
    })
}

fn tokenizer_from(h: &GgufHeader, file: &Path) -> Result<Tokenizer, LoadError> {
    let err = |message: String| LoadError::Tokenizer {
        file: file.display().to_string(),
        message,
    };
    let model = h.get("tokenizer.ggml.model").and_then(MetaValue::as_str);
    if model != Some("gpt2") {
        return Err(err(format!(
            "unsupported tokenizer.ggml.model {model:?} (supported: \"gpt2\", byte-level BPE)"
        )));
    }
    let strings = |key: &str| -> Result<Vec<String>, LoadError> {
        let a = h
            .get(key)
            .and_then(MetaValue::as_array)
            .ok_or_else(|| err(format!("missing array {key}")))?;
        a.iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| err(format!("{key} holds non-strings")))
    };
    let vocab = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    // Token types: 3 = control (special), 4 = user-defined (matched whole, not special).
    let mut added = Vec::new();
    if let Some(types) = h
        .get("tokenizer.ggml.token_type")
        .and_then(MetaValue::as_array)
    {
        for (id, (ty, s)) in types.iter().zip(&vocab).enumerate() {
            match ty.as_i64() {
                Some(3) | Some(4) => added.push(AddedToken {
                    id: id as u32,
                    content: s.clone(),
                    special: ty.as_i64() == Some(3),
                }),
                _ => {}
            }
        }
    }
    let pre = PreTokenizer::from_gguf(h.get("tokenizer.ggml.pre").and_then(MetaValue::as_str));
    let add_bos = h
        .get("tokenizer.ggml.add_bos_token")
        .and_then(MetaValue::as_bool)
        .unwrap_or(false);
    let bos = h
        .get("tokenizer.ggml.bos_token_id")
        .and_then(MetaValue::as_u64)
        .map(|v| v as u32)
        .filter(|_| add_bos);
    let json = byte_level_bpe_json(&vocab, &merges, &added, pre, bos);
    Tokenizer::from_json(&json.to_string()).map_err(|e| err(e.0))
}

/// Builds GGUF (v3) files: metadata, then tensors already encoded in their GGML type.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Add a metadata key.
    pub fn meta(&mut self, key: &str, v: MetaValue) -> &mut Self {
        self.metadata.push((key.to_string(), v));
        self
    }

    /// Add a tensor: `dims` innermost first, `data` already in `ty`'s encoding.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    /// Add an f32 tensor given in Hugging Face shape (outermost first).
    pub fn tensor_f32(&mut self, name: &str, t: &Tensor) -> &mut Self {
        let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        let data = t.data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensor(name, &dims, GgmlType::F32.id(), data)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        fn string(out: &mut Vec<u8>, s: &str) {
            out.extend_from_slice(&(s.len() as u64).to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        fn value(out: &mut Vec<u8>, v: &MetaValue) {
            match v {
                MetaValue::U8(x) => out.push(*x),
                MetaValue::I8(x) => out.push(*x as u8),
                MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
                MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
                MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
                MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
                MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
                MetaValue::Bool(x) => out.push(u8::from(*x)),
                MetaValue::Str(s) => string(out, s),
                MetaValue::Array(a) => {
                    let et = a.first().map_or(4, MetaValue::type_id);
                    out.extend_from_slice(&et.to_le_bytes());
                    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
                    for x in a {
                        value(out, x);
                    }
                }
                MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
                MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
                MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
            }
        }
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            string(&mut out, k);
            out.extend_from_slice(&v.type_id().to_le_bytes());
            value(&mut out, v);
        }
        let align = self
            .metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .filter(|&a| a > 0)
            .unwrap_or(DEFAULT_ALIGNMENT) as usize;
        let mut offset = 0usize;
        for (name, dims, ty, data) in &self.tensors {
            string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + data.len()).div_ceil(align) * align;
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            out.resize(out.len().div_ceil(align) * align, 0);
        }
        out
    }
}
