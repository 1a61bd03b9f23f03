//! Synthetic checkpoints: complete Hugging Face directories with seeded random weights, in
//! the shapes of real models (Qwen2.5-0.5B, SmolLM2-135M) or tiny ones for tests.
//!
//! Weights are normal-ish (an Irwin-Hall sum of four uniforms from a splitmix64 stream per
//! tensor, seeded by the seed and the tensor's name): projections with std `1/sqrt(fan_in)`
//! so activations keep their scale through a layer, norms `1 ± 0.1`, biases std 0.1,
//! embeddings std 0.1 (small next to what a layer adds, so tied models do not echo).

use std::path::Path;

use half::{bf16, f16};
use serde_json::{Value, json};

use crate::chat::CHATML_TEMPLATE;
use crate::config::{Arch, ModelConfig};
use crate::tokenizer::{AddedToken, PreTokenizer, byte_level_bpe_json, synthetic_bpe};
use crate::weights::{LayerWeights, Tensor, Weights};

/// The synthetic model shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SynthArch {
    /// Qwen2.5-0.5B-Instruct's shapes; tokenizer from Qwen's real `tokenizer.json`.
    Qwen25_05b,
    /// SmolLM2-135M-Instruct's shapes; a synthesized 49,152-entry byte-level BPE.
    Smollm2_135m,
    /// 2 layers, hidden 64, Qwen2 (biases, tied embeddings).
    TinyQwen2,
    /// 2 layers, hidden 64, Llama (untied LM head).
    TinyLlama,
}

impl SynthArch {
    /// Every shape.
    pub const ALL: [SynthArch; 4] = [
        SynthArch::Qwen25_05b,
        SynthArch::Smollm2_135m,
        SynthArch::TinyQwen2,
        SynthArch::TinyLlama,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            SynthArch::Qwen25_05b => "qwen2.5-0.5b",
            SynthArch::Smollm2_135m => "smollm2-135m",
            SynthArch::TinyQwen2 => "tiny-qwen2",
            SynthArch::TinyLlama => "tiny-llama",
        }
    }
}

impl std::str::FromStr for SynthArch {
    type Err = SynthError;
    fn from_str(s: &str) -> Result<SynthArch, SynthError> {
        SynthArch::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                SynthError(format!(
                    "unknown synthetic arch {s:?} (known: qwen2.5-0.5b, smollm2-135m, tiny-qwen2, tiny-llama)"
                ))
            })
    }
}

/// Storage type of the written tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// bfloat16
    Bf16,
    /// IEEE half
    F16,
    /// f32
    F32,
}

impl DType {
    /// Round `x` to this type (the value the loader will read back).
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::Bf16 => bf16::from_f32(x).to_f32(),
            DType::F16 => f16::from_f32(x).to_f32(),
            DType::F32 => x,
        }
    }

    fn safetensors(self) -> safetensors::Dtype {
        match self {
            DType::Bf16 => safetensors::Dtype::BF16,
            DType::F16 => safetensors::Dtype::F16,
            DType::F32 => safetensors::Dtype::F32,
        }
    }

    fn torch_name(self) -> &'static str {
        match self {
            DType::Bf16 => "bfloat16",
            DType::F16 => "float16",
            DType::F32 => "float32",
        }
    }

    fn encode(self, data: &[f32]) -> Vec<u8> {
        match self {
            DType::Bf16 => data
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            DType::F16 => data
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
            DType::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

impl std::str::FromStr for DType {
    type Err = SynthError;
    fn from_str(s: &str) -> Result<DType, SynthError> {
        match s {
            "bf16" | "bfloat16" => Ok(DType::Bf16),
            "fp16" | "f16" | "float16" => Ok(DType::F16),
            "f32" | "fp32" | "float32" => Ok(DType::F32),
            _ => Err(SynthError(format!(
                "unknown dtype {s:?} (known: bf16, fp16, f32)"
            ))),
        }
    }
}

/// Why a synthetic checkpoint could not be written.
#[derive(Debug, thiserror::Error)]
#[error("synth: {0}")]
pub struct SynthError(pub String);

/// Tiny models' special tokens (the last ids of the 512-entry vocabulary, so ids below 256
/// are byte tokens).
const TINY_SPECIALS: [(u32, &str); 3] = [
    (509, "<|endoftext|>"),
    (510, "<|im_start|>"),
    (511, "<|im_end|>"),
];

/// SmolLM2's special tokens, at the ids the real tokenizer gives them.
const SMOLLM2_SPECIALS: [&str; 17] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
];

/// The hyper-parameters of a synthetic shape.
pub fn synth_config(arch: SynthArch) -> ModelConfig {
    match arch {
        SynthArch::Qwen25_05b => ModelConfig {
            arch: Arch::Qwen2,
            hidden_size: 896,
            intermediate_size: 4864,
            num_layers: 24,
            num_heads: 14,
            num_kv_heads: 2,
            head_dim: 64,
            vocab_size: 151_936,
            rope_theta: 1e6,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: true,
            attention_bias: true,
            max_position_embeddings: 32_768,
            bos_token_id: Some(151_643),
            eos_token_ids: vec![151_645, 151_643],
        },
        SynthArch::Smollm2_135m => ModelConfig {
            arch: Arch::Llama,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            vocab_size: 49_152,
            rope_theta: 1e5,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: true,
            attention_bias: false,
            max_position_embeddings: 8192,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
        },
        SynthArch::TinyQwen2 | SynthArch::TinyLlama => {
            let qwen = arch == SynthArch::TinyQwen2;
            ModelConfig {
                arch: if qwen { Arch::Qwen2 } else { Arch::Llama },
                hidden_size: 64,
                intermediate_size: 128,
                num_layers: 2,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 16,
                vocab_size: 512,
                rope_theta: if qwen { 1e6 } else { 1e4 },
                rms_norm_eps: if qwen { 1e-6 } else { 1e-5 },
                tie_word_embeddings: qwen,
                attention_bias: qwen,
                max_position_embeddings: 8192,
                bos_token_id: if qwen { None } else { Some(510) },
                eos_token_ids: if qwen { vec![511, 509] } else { vec![511] },
            }
        }
    }
}

/// splitmix64: a tiny, well-mixed PRNG (no `rand` dependency needed).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Approximately standard normal: the sum of four 16-bit uniforms, centred and scaled
    /// (pure integer/float arithmetic, so identical on every platform).
    pub fn normal(&mut self) -> f32 {
        let r = self.next_u64();
        let s: u32 = (0..4).map(|k| ((r >> (16 * k)) & 0xffff) as u32).sum();
        // Each term is uniform on [0, 65535]: mean 32767.5, variance (65536^2 - 1)/12.
        let centred = s as f32 - 4.0 * 32_767.5;
        centred * (3.0f32.sqrt() / 65_536.0)
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// One tensor: `mean + std * normal`, rounded to `dtype`.
fn random_tensor(
    name: &str,
    shape: &[usize],
    seed: u64,
    mean: f32,
    std: f32,
    dtype: DType,
) -> Tensor {
    let mut rng = SplitMix64::new(seed ^ fnv1a(name));
    let n: usize = shape.iter().product();
    let data = (0..n)
        .map(|_| dtype.round(mean + std * rng.normal()))
        .collect();
    Tensor {
        shape: shape.to_vec(),
        data,
    }
}

/// The weights `synth` writes for `arch`, as the loader must read them back (already rounded
/// to `dtype`).
pub fn synth_weights(arch: SynthArch, seed: u64, dtype: DType) -> (ModelConfig, Weights) {
    synth_weights_for(synth_config(arch), seed, dtype)
}

/// Random weights of the shapes of any configuration `c` (tests of other head sizes and
/// layouts than the named shapes'), drawn like `synth_weights`'.
pub fn synth_weights_for(c: ModelConfig, seed: u64, dtype: DType) -> (ModelConfig, Weights) {
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let (q, kv) = (c.num_heads * c.head_dim, c.kv_dim());
    let mat = |name: &str, rows: usize, cols: usize| {
        random_tensor(
            name,
            &[rows, cols],
            seed,
            0.0,
            1.0 / (cols as f32).sqrt(),
            dtype,
        )
    };
    let norm = |name: &str| random_tensor(name, &[h], seed, 1.0, 0.1, dtype);
    let bias = |name: &str, len: usize| random_tensor(name, &[len], seed, 0.0, 0.1, dtype);
    // Large models: generate layers on two threads (each tensor has its own stream, so the
    // result does not depend on the split).
    let layer = |n: usize| {
        let p = |s: &str| format!("model.layers.{n}.{s}");
        LayerWeights {
            input_norm: norm(&p("input_layernorm.weight")),
            q_proj: mat(&p("self_attn.q_proj.weight"), q, h),
            k_proj: mat(&p("self_attn.k_proj.weight"), kv, h),
            v_proj: mat(&p("self_attn.v_proj.weight"), kv, h),
            q_bias: c
                .attention_bias
                .then(|| bias(&p("self_attn.q_proj.bias"), q)),
            k_bias: c
                .attention_bias
                .then(|| bias(&p("self_attn.k_proj.bias"), kv)),
            v_bias: c
                .attention_bias
                .then(|| bias(&p("self_attn.v_proj.bias"), kv)),
            o_proj: mat(&p("self_attn.o_proj.weight"), h, q),
            post_norm: norm(&p("post_attention_layernorm.weight")),
            gate_proj: mat(&p("mlp.gate_proj.weight"), i, h),
            up_proj: mat(&p("mlp.up_proj.weight"), i, h),
            down_proj: mat(&p("mlp.down_proj.weight"), h, i),
        }
    };
    let layers: Vec<LayerWeights> = std::thread::scope(|s| {
        let odd = s.spawn(|| (1..c.num_layers).step_by(2).map(layer).collect::<Vec<_>>());
        let even: Vec<_> = (0..c.num_layers).step_by(2).map(layer).collect();
        let odd = odd.join().expect("layer generation thread panicked");
        let mut all = Vec::with_capacity(c.num_layers);
        let (mut e, mut o) = (even.into_iter(), odd.into_iter());
        for n in 0..c.num_layers {
            all.extend(if n % 2 == 0 { e.next() } else { o.next() });
        }
        all
    });
    let w = Weights {
        // Small next to what a layer adds (as in trained models): with tied embeddings a
        // large embedding would make every token predict itself.
        embed: random_tensor("model.embed_tokens.weight", &[v, h], seed, 0.0, 0.1, dtype),
        layers,
        final_norm: norm("model.norm.weight"),
        lm_head: (!c.tie_word_embeddings).then(|| mat("lm_head.weight", v, h)),
    };
    (c, w)
}

/// Every tensor with its Hugging Face name.
pub fn named_tensors(w: &Weights) -> Vec<(String, &Tensor)> {
    let mut out = vec![("model.embed_tokens.weight".to_string(), &w.embed)];
    for (n, l) in w.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{n}.{s}");
        out.push((p("input_layernorm.weight"), &l.input_norm));
        out.push((p("self_attn.q_proj.weight"), &l.q_proj));
        out.push((p("self_attn.k_proj.weight"), &l.k_proj));
        out.push((p("self_attn.v_proj.weight"), &l.v_proj));
        for (s, b) in [
            ("self_attn.q_proj.bias", &l.q_bias),
            ("self_attn.k_proj.bias", &l.k_bias),
            ("self_attn.v_proj.bias", &l.v_bias),
        ] {
            if let Some(b) = b {
                out.push((p(s), b));
            }
        }
        out.push((p("self_attn.o_proj.weight"), &l.o_proj));
        out.push((p("post_attention_layernorm.weight"), &l.post_norm));
        out.push((p("mlp.gate_proj.weight"), &l.gate_proj));
        out.push((p("mlp.up_proj.weight"), &l.up_proj));
        out.push((p("mlp.down_proj.weight"), &l.down_proj));
    }
    out.push(("model.norm.weight".to_string(), &w.final_norm));
    if let Some(t) = &w.lm_head {
        out.push(("lm_head.weight".to_string(), t));
    }
    out
}

/// Write `config.json` for `c`.
pub fn config_json(c: &ModelConfig, dtype: DType) -> Value {
    let mut j = json!({
        "architectures": [c.arch.hf_name()],
        "model_type": match c.arch { Arch::Qwen2 => "qwen2", Arch::Llama => "llama" },
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": dtype.torch_name(),
        "eos_token_id": c.eos_token_ids.first(),
    });
    if c.arch == Arch::Llama {
        j["attention_bias"] = json!(c.attention_bias);
    }
    if let Some(b) = c.bos_token_id {
        j["bos_token_id"] = json!(b);
    }
    j
}

/// The Qwen2.5 instruct chat template (ChatML with a default system prompt and tool calls).
pub const QWEN25_CHAT_TEMPLATE: &str = include_str!("synth/qwen2.5_chat_template.jinja");

/// SmolLM2-Instruct's chat template (ChatML with a default system prompt).
pub const SMOLLM2_CHAT_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Qwen2.5's `tokenizer.json` from Qwen's (Qwen3-variant) file at `BGS_QWEN_TOKENIZER`: the
/// same BPE; only the first 22 added tokens (Qwen2.5's specials, ids 151643..=151664) kept.
pub fn qwen25_tokenizer_json() -> Result<String, SynthError> {
    let path = std::env::var_os("BGS_QWEN_TOKENIZER").ok_or_else(|| {
        SynthError(
            "qwen2.5-0.5b needs Qwen's tokenizer.json: set BGS_QWEN_TOKENIZER (eval \"$(scripts/fetch-models.sh)\")"
                .into(),
        )
    })?;
    let text = std::fs::read_to_string(&path)
        .map_err(|e| SynthError(format!("{}: {e}", Path::new(&path).display())))?;
    let mut j: Value = serde_json::from_str(&text)
        .map_err(|e| SynthError(format!("{}: bad JSON: {e}", Path::new(&path).display())))?;
    let added = j
        .get_mut("added_tokens")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| SynthError("Qwen tokenizer.json has no added_tokens".into()))?;
    added.truncate(22);
    let ok = added
        .first()
        .and_then(|t| t.get("id"))
        .and_then(Value::as_u64)
        == Some(151_643)
        && added
            .last()
            .and_then(|t| t.get("id"))
            .and_then(Value::as_u64)
            == Some(151_664);
    if !ok {
        return Err(SynthError(
            "Qwen tokenizer.json: added tokens are not ids 151643..=151664".into(),
        ));
    }
    serde_json::to_string(&j).map_err(|e| SynthError(e.to_string()))
}

/// `tokenizer.json`, chat template and (bos, eos) token strings for `arch`.
fn tokenizer_files(
    arch: SynthArch,
) -> Result<(String, &'static str, &'static str, &'static str), SynthError> {
    let bpe = |vocab_size: usize, specials: &[(u32, &str)], pre| {
        let (vocab, merges) = synthetic_bpe(vocab_size, specials);
        let added: Vec<AddedToken> = specials
            .iter()
            .map(|&(id, s)| AddedToken {
                id,
                content: s.to_string(),
                special: true,
            })
            .collect();
        byte_level_bpe_json(&vocab, &merges, &added, pre, None).to_string()
    };
    Ok(match arch {
        SynthArch::Qwen25_05b => (
            qwen25_tokenizer_json()?,
            QWEN25_CHAT_TEMPLATE,
            "",
            "<|im_end|>",
        ),
        SynthArch::Smollm2_135m => {
            let specials: Vec<(u32, &str)> = SMOLLM2_SPECIALS
                .iter()
                .enumerate()
                .map(|(i, s)| (i as u32, *s))
                .collect();
            (
                bpe(49_152, &specials, PreTokenizer::SmolLm),
                SMOLLM2_CHAT_TEMPLATE,
                "<|im_start|>",
                "<|im_end|>",
            )
        }
        SynthArch::TinyQwen2 => (
            bpe(512, &TINY_SPECIALS, PreTokenizer::Qwen2),
            CHATML_TEMPLATE,
            "",
            "<|im_end|>",
        ),
        SynthArch::TinyLlama => (
            bpe(512, &TINY_SPECIALS, PreTokenizer::Gpt2),
            CHATML_TEMPLATE,
            "<|im_start|>",
            "<|im_end|>",
        ),
    })
}

fn write(path: &Path, text: &str) -> Result<(), SynthError> {
    std::fs::write(path, text).map_err(|e| SynthError(format!("{}: {e}", path.display())))
}

/// Write a complete Hugging Face directory for `arch` into `out` (created if needed).
pub fn synth(arch: SynthArch, out: &Path, seed: u64, dtype: DType) -> Result<(), SynthError> {
    // The tokenizer first: it is the step that can fail for want of an input file.
    let (tokenizer, template, bos, eos) = tokenizer_files(arch)?;
    std::fs::create_dir_all(out).map_err(|e| SynthError(format!("{}: {e}", out.display())))?;
    let (cfg, w) = synth_weights(arch, seed, dtype);
    let pretty = |v: &Value| serde_json::to_string_pretty(v).unwrap_or_default() + "\n";
    write(&out.join("config.json"), &pretty(&config_json(&cfg, dtype)))?;
    let mut gen_cfg = json!({"eos_token_id": cfg.eos_token_ids, "do_sample": false});
    if let Some(b) = cfg.bos_token_id {
        gen_cfg["bos_token_id"] = json!(b);
    }
    write(&out.join("generation_config.json"), &pretty(&gen_cfg))?;
    write(&out.join("tokenizer.json"), &tokenizer)?;
    write(
        &out.join("tokenizer_config.json"),
        &pretty(&json!({
            "chat_template": template,
            "bos_token": if bos.is_empty() { Value::Null } else { json!(bos) },
            "eos_token": eos,
            "model_max_length": cfg.max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
        })),
    )?;
    let named = named_tensors(&w);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = named
        .iter()
        .map(|(n, t)| (n.clone(), t.shape.clone(), dtype.encode(&t.data)))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(dtype.safetensors(), s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| SynthError(format!("tensor {n}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let st = out.join("model.safetensors");
    safetensors::tensor::serialize_to_file(views, Some(meta), &st)
        .map_err(|e| SynthError(format!("{}: {e}", st.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_unit_scale() {
        let mut r = SplitMix64::new(7);
        let xs: Vec<f32> = (0..100_000).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / xs.len() as f32;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var - 1.0).abs() < 0.03, "var {var}");
    }

    #[test]
    fn configs_validate_and_seeds_differ() {
        for a in SynthArch::ALL {
            synth_config(a).validate().unwrap();
        }
        let (c, a) = synth_weights(SynthArch::TinyLlama, 1, DType::F32);
        let (_, b) = synth_weights(SynthArch::TinyLlama, 2, DType::F32);
        a.check_shapes(&c).unwrap();
        assert_ne!(a.embed, b.embed);
        assert_eq!(a, synth_weights(SynthArch::TinyLlama, 1, DType::F32).1);
    }

    #[test]
    fn activations_keep_their_scale() {
        // One projection of a unit-RMS vector keeps roughly unit RMS.
        let (c, w) = synth_weights(SynthArch::TinyQwen2, 3, DType::Bf16);
        let x: Vec<f32> = w.embed.data[..c.hidden_size].to_vec();
        let rms = |v: &[f32]| (v.iter().map(|a| a * a).sum::<f32>() / v.len() as f32).sqrt();
        let q = &w.layers[0].gate_proj;
        let y: Vec<f32> = (0..q.shape[0])
            .map(|r| {
                (0..q.shape[1])
                    .map(|k| q.data[r * q.shape[1] + k] * x[k])
                    .sum()
            })
            .collect();
        let ratio = rms(&y) / rms(&x);
        assert!((0.5..2.0).contains(&ratio), "ratio {ratio}");
    }
}
