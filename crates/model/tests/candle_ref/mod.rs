//! candle-transformers' Qwen2 and Llama over the same weights as our CPU model: the oracle of
//! `oracle_candle.rs` and the reference of the `generate_vs_candle` benchmark.
#![allow(dead_code)] // Each user takes a different subset.

use std::collections::HashMap;

use bgs_model::{Arch, ModelConfig, Tensor, Weights};
use candle_core::{DType, Device, Tensor as CTensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, qwen2};

fn ctensor(t: &Tensor) -> CTensor {
    CTensor::from_vec(t.data.clone(), t.shape.clone(), &Device::Cpu).unwrap()
}

/// The weights under their Hugging Face names.
pub fn hf_tensors(w: &Weights) -> HashMap<String, CTensor> {
    let mut m = HashMap::new();
    m.insert("model.embed_tokens.weight".into(), ctensor(&w.embed));
    m.insert("model.norm.weight".into(), ctensor(&w.final_norm));
    if let Some(t) = &w.lm_head {
        m.insert("lm_head.weight".into(), ctensor(t));
    }
    for (i, l) in w.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let mut put = |s: &str, t: &Tensor| {
            m.insert(p(s), ctensor(t));
        };
        put("input_layernorm.weight", &l.input_norm);
        put("self_attn.q_proj.weight", &l.q_proj);
        put("self_attn.k_proj.weight", &l.k_proj);
        put("self_attn.v_proj.weight", &l.v_proj);
        put("self_attn.o_proj.weight", &l.o_proj);
        put("post_attention_layernorm.weight", &l.post_norm);
        put("mlp.gate_proj.weight", &l.gate_proj);
        put("mlp.up_proj.weight", &l.up_proj);
        put("mlp.down_proj.weight", &l.down_proj);
        for (s, b) in [
            ("self_attn.q_proj.bias", &l.q_bias),
            ("self_attn.k_proj.bias", &l.k_bias),
            ("self_attn.v_proj.bias", &l.v_bias),
        ] {
            if let Some(b) = b {
                put(s, b);
            }
        }
    }
    m
}

pub enum Oracle {
    Qwen2(qwen2::ModelForCausalLM),
    Llama(llama::Llama, llama::Cache),
}

impl Oracle {
    pub fn new(cfg: &ModelConfig, w: &Weights) -> Oracle {
        assert_eq!(
            cfg.head_dim * cfg.num_heads,
            cfg.hidden_size,
            "candle derives head_dim from hidden_size / num_heads"
        );
        let vb = VarBuilder::from_tensors(hf_tensors(w), DType::F32, &Device::Cpu);
        match cfg.arch {
            Arch::Qwen2 => {
                assert!(cfg.attention_bias, "candle's qwen2 always has q/k/v biases");
                let c = qwen2::Config {
                    vocab_size: cfg.vocab_size,
                    hidden_size: cfg.hidden_size,
                    intermediate_size: cfg.intermediate_size,
                    num_hidden_layers: cfg.num_layers,
                    num_attention_heads: cfg.num_heads,
                    num_key_value_heads: cfg.num_kv_heads,
                    max_position_embeddings: cfg.max_position_embeddings,
                    sliding_window: cfg.max_position_embeddings,
                    max_window_layers: cfg.num_layers,
                    tie_word_embeddings: cfg.tie_word_embeddings,
                    rope_theta: cfg.rope_theta,
                    rms_norm_eps: cfg.rms_norm_eps,
                    use_sliding_window: false,
                    hidden_act: candle_nn::Activation::Silu,
                };
                Oracle::Qwen2(qwen2::ModelForCausalLM::new(&c, vb).unwrap())
            }
            Arch::Llama => {
                assert!(!cfg.attention_bias, "candle's llama has no q/k/v biases");
                let c = llama::Config {
                    hidden_size: cfg.hidden_size,
                    intermediate_size: cfg.intermediate_size,
                    vocab_size: cfg.vocab_size,
                    num_hidden_layers: cfg.num_layers,
                    num_attention_heads: cfg.num_heads,
                    num_key_value_heads: cfg.num_kv_heads,
                    use_flash_attn: false,
                    rms_norm_eps: cfg.rms_norm_eps,
                    rope_theta: cfg.rope_theta as f32,
                    bos_token_id: cfg.bos_token_id,
                    eos_token_id: None,
                    rope_scaling: None,
                    max_position_embeddings: cfg.max_position_embeddings,
                    tie_word_embeddings: cfg.tie_word_embeddings,
                };
                let cache = llama::Cache::new(true, DType::F32, &c, &Device::Cpu).unwrap();
                Oracle::Llama(llama::Llama::load(vb, &c).unwrap(), cache)
            }
        }
    }

    /// Feed `tokens` at `pos` (after what was fed before); the last position's logits.
    pub fn forward(&mut self, tokens: &[u32], pos: usize) -> Vec<f32> {
        let input = CTensor::new(tokens, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let out = match self {
            Oracle::Qwen2(m) => m.forward(&input, pos).unwrap(),
            Oracle::Llama(m, cache) => m.forward(&input, pos, cache).unwrap(),
        };
        out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

impl Oracle {
    /// A batch of equal-length sequences at the same position: `tokens` is `batch` rows of
    /// `len` ids; returns each row's last-position logits.
    pub fn forward_batch(&mut self, tokens: &[u32], batch: usize, pos: usize) -> Vec<Vec<f32>> {
        let len = tokens.len() / batch;
        let input = CTensor::from_vec(tokens.to_vec(), (batch, len), &Device::Cpu).unwrap();
        let out = match self {
            Oracle::Qwen2(m) => m.forward(&input, pos).unwrap(),
            Oracle::Llama(m, cache) => m.forward(&input, pos, cache).unwrap(),
        };
        out.to_dtype(DType::F32)
            .unwrap()
            .reshape((batch, ()))
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
    }
}
