//! Architecture hyper-parameters.

/// The decoder families served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `Qwen2ForCausalLM` (GGUF `qwen2`): biases on the q/k/v projections.
    Qwen2,
    /// `LlamaForCausalLM` (GGUF `llama`): no projection biases.
    Llama,
}

impl Arch {
    /// The Hugging Face `architectures[0]` name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Llama => "LlamaForCausalLM",
        }
    }

    /// The GGUF `general.architecture` value.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Llama => "llama",
        }
    }
}

/// Hyper-parameters of one model, as read from `config.json` or GGUF metadata.
///
/// RoPE is always the Hugging Face "rotate half" form (pairs `i` and `i + head_dim/2`); loaders
/// that read checkpoints stored for the interleaved form (llama.cpp's `llama` GGUF files
/// permute the q/k rows) undo that permutation at load so the forward pass has one form.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Architecture family.
    pub arch: Arch,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate/up projections.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention: `num_heads` is a multiple of it).
    pub num_kv_heads: usize,
    /// Dimension of one head (`hidden_size / num_heads` for every model served today).
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// The LM head is the embedding matrix (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// q/k/v projections have biases (Qwen2).
    pub attention_bias: bool,
    /// Longest position the model was trained for (prompt + generated tokens are capped here).
    pub max_position_embeddings: usize,
    /// Beginning-of-sequence token, when the model has one.
    pub bos_token_id: Option<u32>,
    /// Token ids that end generation (from `generation_config.json` / GGUF metadata).
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Query heads per key/value head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads.max(1)
    }

    /// Width of the key (and value) projection output.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Check the relations the forward pass relies on; the message names the broken one.
    pub fn validate(&self) -> Result<(), String> {
        let c = self;
        let nonzero = [
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("num_hidden_layers", c.num_layers),
            ("num_attention_heads", c.num_heads),
            ("num_key_value_heads", c.num_kv_heads),
            ("head_dim", c.head_dim),
            ("vocab_size", c.vocab_size),
        ];
        for (name, v) in nonzero {
            if v == 0 {
                return Err(format!("{name} is 0"));
            }
        }
        if !c.num_heads.is_multiple_of(c.num_kv_heads) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                c.num_heads, c.num_kv_heads
            ));
        }
        if !c.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} is odd (RoPE needs pairs)", c.head_dim));
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(c.rope_theta) || !positive(c.rms_norm_eps) {
            return Err("rope_theta and rms_norm_eps must be positive".into());
        }
        if c.vocab_size > u32::MAX as usize {
            return Err(format!(
                "vocab_size {} does not fit token ids",
                c.vocab_size
            ));
        }
        Ok(())
    }
}
