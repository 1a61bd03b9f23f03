//! Checkpoint loading: one entry point, [`load`], for Hugging Face directories and GGUF files.
//!
//! Both loaders produce the same [`Checkpoint`]: f32 weights in Hugging Face layout (GGUF
//! quantized blocks are dequantized and llama.cpp's q/k row permutation is undone), a
//! tokenizer and, when the checkpoint has one, a chat template.

pub mod dequant;
pub mod gguf;
pub mod hf;

use std::path::Path;

use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::tokenizer::Tokenizer;
use crate::weights::Weights;

/// A loaded model: everything the engine needs to serve it.
#[derive(Debug)]
pub struct Checkpoint {
    /// Human-readable name (the directory name, or GGUF `general.name`).
    pub name: String,
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Tensors (f32, Hugging Face layout), shapes checked against `config`.
    pub weights: Weights,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, when the checkpoint ships one.
    pub chat_template: Option<ChatTemplate>,
}

/// Why a checkpoint could not be loaded. Each variant names the file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The architecture is neither Qwen2 nor Llama.
    #[error(
        "{file}: unsupported architecture {name:?} (supported: Qwen2ForCausalLM, LlamaForCausalLM; GGUF qwen2, llama)"
    )]
    UnsupportedArch {
        /// The file that names it.
        file: String,
        /// The architecture name found.
        name: String,
    },
    /// A tensor is stored in a type this loader does not convert.
    #[error("{file}: tensor {name} has unsupported type {dtype}")]
    UnsupportedType {
        /// The checkpoint file.
        file: String,
        /// The tensor.
        name: String,
        /// The type found.
        dtype: String,
    },
    /// A tensor the architecture needs is absent.
    #[error("{file}: missing tensor {name}")]
    MissingTensor {
        /// The checkpoint (file or directory).
        file: String,
        /// The tensor's name.
        name: String,
    },
    /// A tensor's shape (or the layer count) disagrees with the config.
    #[error("{file}: {detail}")]
    Shape {
        /// The checkpoint (file or directory).
        file: String,
        /// Which tensor and both shapes (from [`Weights::check_shapes`]).
        detail: String,
    },
    /// A file ends before the data it declares.
    #[error("{file}: truncated: {expected}")]
    Truncated {
        /// The file.
        file: String,
        /// What was expected there.
        expected: String,
    },
    /// A JSON file does not parse.
    #[error("{file}: bad JSON: {message}")]
    BadJson {
        /// The file.
        file: String,
        /// The parser's message.
        message: String,
    },
    /// A value is missing or out of range (config keys, GGUF header fields, ...).
    #[error("{file}: {message}")]
    Invalid {
        /// The file.
        file: String,
        /// What is wrong.
        message: String,
    },
    /// The tokenizer could not be built.
    #[error("{file}: tokenizer: {message}")]
    Tokenizer {
        /// The file it came from.
        file: String,
        /// The tokenizer library's message.
        message: String,
    },
    /// The chat template does not compile.
    #[error("{file}: chat template: {message}")]
    ChatTemplate {
        /// The file it came from.
        file: String,
        /// The template engine's message.
        message: String,
    },
    /// Reading a file failed.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl LoadError {
    pub(crate) fn io(file: &Path, source: std::io::Error) -> LoadError {
        LoadError::Io {
            file: file.display().to_string(),
            source,
        }
    }

    pub(crate) fn invalid(file: &Path, message: impl Into<String>) -> LoadError {
        LoadError::Invalid {
            file: file.display().to_string(),
            message: message.into(),
        }
    }
}

/// Load a checkpoint: a directory is read as a Hugging Face model directory, a `.gguf` file as
/// a llama.cpp GGUF file.
pub fn load(path: &Path) -> Result<Checkpoint, LoadError> {
    let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
    if meta.is_dir() {
        hf::load_dir(path)
    } else if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        gguf::load_file(path)
    } else {
        Err(LoadError::invalid(
            path,
            "not a checkpoint: expected a Hugging Face directory or a .gguf file",
        ))
    }
}

/// Check the assembled weights against the config and wrap the message.
pub(crate) fn check(file: &Path, cfg: &ModelConfig, w: &Weights) -> Result<(), LoadError> {
    cfg.validate()
        .map_err(|m| LoadError::invalid(file, format!("bad config: {m}")))?;
    w.check_shapes(cfg).map_err(|detail| {
        let file = file.display().to_string();
        match detail.strip_prefix("missing tensor ") {
            Some(name) => LoadError::MissingTensor {
                file,
                name: name.to_string(),
            },
            None => LoadError::Shape { file, detail },
        }
    })
}

/// Undo llama.cpp's q/k row permutation for one projection (`rows = heads * head_dim`).
///
/// `convert_hf_to_gguf.py` (`LlamaModel.permute`) reshapes the Hugging Face rows of each head
/// as `[2, head_dim/2]` and swaps those axes: GGUF row `h*hd + 2*i + j` holds Hugging Face row
/// `h*hd + j*hd/2 + i` (pairs become adjacent for the interleaved RoPE). This maps them back.
pub fn unpermute_rows(data: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    permute_impl(data, heads, cols, false)
}

/// llama.cpp's permutation (Hugging Face → GGUF row order); the inverse of [`unpermute_rows`].
pub fn permute_rows(data: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    permute_impl(data, heads, cols, true)
}

fn permute_impl(data: &[f32], heads: usize, cols: usize, to_gguf: bool) -> Vec<f32> {
    let rows = data.len() / cols.max(1);
    let hd = rows / heads.max(1);
    let half = hd / 2;
    let mut out = vec![0.0f32; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let gguf_row = h * hd + 2 * i + j;
                let hf_row = h * hd + j * half + i;
                let (src, dst) = if to_gguf {
                    (hf_row, gguf_row)
                } else {
                    (gguf_row, hf_row)
                };
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}
