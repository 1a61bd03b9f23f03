//! Decoder-only language models for the generation engine.
//!
//! - [`config`]: the architecture hyper-parameters every other module reads.
//! - [`weights`]: the model's tensors, dequantized to f32 in Hugging Face layout.
//!
//! Loading (Hugging Face directories and GGUF files), tokenizers, chat templates, synthetic
//! checkpoints and the CPU forward pass build on these two.

pub mod config;
pub mod cpu;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use cpu::{CpuModel, KvConfig, StepItem};
pub use weights::{LayerWeights, Tensor, Weights};

pub mod chat;
pub mod checkpoint;
pub mod synth;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use checkpoint::{Checkpoint, LoadError, load};
pub use synth::{DType, SynthArch, synth};
pub use tokenizer::Tokenizer;
