//! Model tensors after loading: f32, row-major, Hugging Face shapes (`[out, in]` for
//! projections), whatever the checkpoint stored (bf16, fp16, f32, or GGUF quantized blocks
//! dequantized at load).

use crate::config::ModelConfig;

/// A dense f32 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Dimensions, outermost first (`[rows, cols]` for a matrix).
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values, row-major.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor of the given shape; `data.len()` must equal the shape's product.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Tensor, String> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(format!(
                "tensor of shape {shape:?} needs {n} values, got {}",
                data.len()
            ));
        }
        Ok(Tensor { shape, data })
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True for a tensor without values.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// One decoder layer. Hugging Face names in brackets (`model.layers.{i}.` prefix).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// `[hidden]` (`input_layernorm.weight`).
    pub input_norm: Tensor,
    /// `[num_heads * head_dim, hidden]` (`self_attn.q_proj.weight`).
    pub q_proj: Tensor,
    /// `[num_kv_heads * head_dim, hidden]` (`self_attn.k_proj.weight`).
    pub k_proj: Tensor,
    /// `[num_kv_heads * head_dim, hidden]` (`self_attn.v_proj.weight`).
    pub v_proj: Tensor,
    /// `[num_heads * head_dim]` (`self_attn.q_proj.bias`), Qwen2 only.
    pub q_bias: Option<Tensor>,
    /// `[num_kv_heads * head_dim]` (`self_attn.k_proj.bias`), Qwen2 only.
    pub k_bias: Option<Tensor>,
    /// `[num_kv_heads * head_dim]` (`self_attn.v_proj.bias`), Qwen2 only.
    pub v_bias: Option<Tensor>,
    /// `[hidden, num_heads * head_dim]` (`self_attn.o_proj.weight`).
    pub o_proj: Tensor,
    /// `[hidden]` (`post_attention_layernorm.weight`).
    pub post_norm: Tensor,
    /// `[intermediate, hidden]` (`mlp.gate_proj.weight`).
    pub gate_proj: Tensor,
    /// `[intermediate, hidden]` (`mlp.up_proj.weight`).
    pub up_proj: Tensor,
    /// `[hidden, intermediate]` (`mlp.down_proj.weight`).
    pub down_proj: Tensor,
}

/// All tensors of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    /// `[vocab, hidden]` (`model.embed_tokens.weight`).
    pub embed: Tensor,
    /// Decoder layers, in order.
    pub layers: Vec<LayerWeights>,
    /// `[hidden]` (`model.norm.weight`).
    pub final_norm: Tensor,
    /// `[vocab, hidden]` (`lm_head.weight`); `None` when tied to `embed`.
    pub lm_head: Option<Tensor>,
}

impl Weights {
    /// The LM head matrix (the embedding when tied).
    pub fn lm_head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Check every shape against `cfg`; the message names the tensor and both shapes.
    pub fn check_shapes(&self, cfg: &ModelConfig) -> Result<(), String> {
        fn want(name: &str, t: &Tensor, shape: &[usize]) -> Result<(), String> {
            if t.shape != shape {
                return Err(format!(
                    "shape mismatch for {name}: checkpoint has {:?}, config needs {shape:?}",
                    t.shape
                ));
            }
            Ok(())
        }
        let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.kv_dim());
        want("model.embed_tokens.weight", &self.embed, &[v, h])?;
        want("model.norm.weight", &self.final_norm, &[h])?;
        if let Some(t) = &self.lm_head {
            want("lm_head.weight", t, &[v, h])?;
        }
        if self.layers.len() != cfg.num_layers {
            return Err(format!(
                "checkpoint has {} layers, config needs {}",
                self.layers.len(),
                cfg.num_layers
            ));
        }
        for (n, l) in self.layers.iter().enumerate() {
            let p = |s: &str| format!("model.layers.{n}.{s}");
            want(&p("input_layernorm.weight"), &l.input_norm, &[h])?;
            want(&p("self_attn.q_proj.weight"), &l.q_proj, &[q, h])?;
            want(&p("self_attn.k_proj.weight"), &l.k_proj, &[kv, h])?;
            want(&p("self_attn.v_proj.weight"), &l.v_proj, &[kv, h])?;
            for (name, b, len) in [
                ("self_attn.q_proj.bias", &l.q_bias, q),
                ("self_attn.k_proj.bias", &l.k_bias, kv),
                ("self_attn.v_proj.bias", &l.v_bias, kv),
            ] {
                match (b, cfg.attention_bias) {
                    (Some(t), true) => want(&p(name), t, &[len])?,
                    (None, true) => return Err(format!("missing tensor {}", p(name))),
                    (Some(_), false) => {
                        return Err(format!("unexpected tensor {} for this arch", p(name)));
                    }
                    (None, false) => {}
                }
            }
            want(&p("self_attn.o_proj.weight"), &l.o_proj, &[h, q])?;
            want(&p("post_attention_layernorm.weight"), &l.post_norm, &[h])?;
            want(&p("mlp.gate_proj.weight"), &l.gate_proj, &[i, h])?;
            want(&p("mlp.up_proj.weight"), &l.up_proj, &[i, h])?;
            want(&p("mlp.down_proj.weight"), &l.down_proj, &[h, i])?;
        }
        Ok(())
    }
}
