//! Random models for the CPU forward-pass tests, oracle and benchmark.
#![allow(dead_code)]

use bgs_model::{Arch, LayerWeights, ModelConfig, Tensor, Weights};

/// A tiny model: hidden 64, 4 query heads, 2 KV heads, vocab 512.
pub fn tiny_config(arch: Arch, tied: bool, layers: usize) -> ModelConfig {
    ModelConfig {
        arch,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: layers,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 512,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: tied,
        attention_bias: arch == Arch::Qwen2,
        max_position_embeddings: 512,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

/// SmolLM2-135M's shape (Llama, tied embeddings).
pub fn smollm2_135m_config() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        hidden_size: 576,
        intermediate_size: 1536,
        num_layers: 30,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        vocab_size: 49152,
        rope_theta: 100_000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: true,
        attention_bias: false,
        max_position_embeddings: 8192,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

/// SplitMix64: a small deterministic generator (no dependency needed).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % n as u64) as u32
    }
}

fn tensor(rng: &mut Rng, shape: &[usize], scale: f32, offset: f32) -> Tensor {
    let n = shape.iter().product();
    let data = (0..n).map(|_| offset + scale * rng.uniform()).collect();
    Tensor::new(shape.to_vec(), data).unwrap()
}

/// Random weights whose activations stay O(1): projections uniform with std ~ 1/sqrt(in),
/// norms near 1, embeddings of scale 1 (so logits spread over a few units and greedy
/// choices are rarely near-ties).
pub fn random_weights(cfg: &ModelConfig, seed: u64) -> Weights {
    let mut rng = Rng::new(seed);
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.kv_dim());
    let proj = |rng: &mut Rng, out: usize, inp: usize| {
        tensor(rng, &[out, inp], 1.7 / (inp as f32).sqrt(), 0.0)
    };
    let embed = tensor(&mut rng, &[v, h], 1.0, 0.0);
    let layers = (0..cfg.num_layers)
        .map(|_| {
            let bias =
                |rng: &mut Rng, n: usize| cfg.attention_bias.then(|| tensor(rng, &[n], 0.3, 0.0));
            LayerWeights {
                input_norm: tensor(&mut rng, &[h], 0.2, 1.0),
                q_proj: proj(&mut rng, q, h),
                k_proj: proj(&mut rng, kv, h),
                v_proj: proj(&mut rng, kv, h),
                q_bias: bias(&mut rng, q),
                k_bias: bias(&mut rng, kv),
                v_bias: bias(&mut rng, kv),
                o_proj: proj(&mut rng, h, q),
                post_norm: tensor(&mut rng, &[h], 0.2, 1.0),
                gate_proj: proj(&mut rng, i, h),
                up_proj: proj(&mut rng, i, h),
                down_proj: proj(&mut rng, h, i),
            }
        })
        .collect();
    let final_norm = tensor(&mut rng, &[h], 0.2, 1.0);
    let lm_head = (!cfg.tie_word_embeddings).then(|| proj(&mut rng, v, h));
    Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    }
}

/// Random token ids below `vocab`.
pub fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab as u32)).collect()
}
