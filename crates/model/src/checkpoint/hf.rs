//! Hugging Face model directories: `config.json`, `*.safetensors` (sharded with
//! `model.safetensors.index.json`), `generation_config.json`, `tokenizer.json`,
//! `tokenizer_config.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::{Checkpoint, LoadError, check};
use crate::chat::{ChatTemplate, template_from_tokenizer_config};
use crate::config::{Arch, ModelConfig};
use crate::tokenizer::Tokenizer;
use crate::weights::{LayerWeights, Tensor, Weights};

fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::BadJson {
        file: path.display().to_string(),
        message: e.to_string(),
    })
}

fn read_json_opt(path: &Path) -> Result<Option<Value>, LoadError> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// A token id field: a number or a list of numbers.
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

/// Parse `config.json` (plus `generation_config.json`, whose EOS ids take precedence).
pub fn parse_config(
    cfg: &Value,
    gen_cfg: Option<&Value>,
    file: &Path,
) -> Result<ModelConfig, LoadError> {
    let arch_name = cfg
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .ok_or_else(|| LoadError::invalid(file, "missing \"architectures\""))?;
    let arch = match arch_name {
        "Qwen2ForCausalLM" => Arch::Qwen2,
        "LlamaForCausalLM" => Arch::Llama,
        other => {
            return Err(LoadError::UnsupportedArch {
                file: file.display().to_string(),
                name: other.to_string(),
            });
        }
    };
    let int = |k: &str| -> Result<usize, LoadError> {
        cfg.get(k)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| LoadError::invalid(file, format!("missing integer \"{k}\"")))
    };
    let hidden = int("hidden_size")?;
    let heads = int("num_attention_heads")?;
    let head_dim = match cfg.get("head_dim").and_then(Value::as_u64) {
        Some(d) => d as usize,
        None => hidden / heads.max(1),
    };
    // transformers 5.x moves rope_theta into rope_parameters.
    let rope_theta = cfg
        .get("rope_theta")
        .or_else(|| cfg.get("rope_parameters").and_then(|r| r.get("rope_theta")))
        .and_then(Value::as_f64)
        .unwrap_or(10_000.0);
    let rms_norm_eps = cfg
        .get("rms_norm_eps")
        .and_then(Value::as_f64)
        .ok_or_else(|| LoadError::invalid(file, "missing number \"rms_norm_eps\""))?;
    let mut eos = ids(cfg.get("eos_token_id"));
    let mut bos = cfg
        .get("bos_token_id")
        .and_then(Value::as_u64)
        .map(|v| v as u32);
    if let Some(g) = gen_cfg {
        let geos = ids(g.get("eos_token_id"));
        if !geos.is_empty() {
            eos = geos;
        }
        if let Some(b) = g.get("bos_token_id").and_then(Value::as_u64) {
            bos = Some(b as u32);
        }
    }
    Ok(ModelConfig {
        arch,
        hidden_size: hidden,
        intermediate_size: int("intermediate_size")?,
        num_layers: int("num_hidden_layers")?,
        num_heads: heads,
        num_kv_heads: cfg
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map_or(heads, |v| v as usize),
        head_dim,
        vocab_size: int("vocab_size")?,
        rope_theta,
        rms_norm_eps,
        tie_word_embeddings: cfg
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        attention_bias: match arch {
            Arch::Qwen2 => true,
            Arch::Llama => cfg
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        },
        max_position_embeddings: int("max_position_embeddings")?,
        bos_token_id: bos,
        eos_token_ids: eos,
    })
}

/// The memory-mapped safetensors files of a directory and which one holds each tensor.
struct Shards {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    index: HashMap<String, usize>,
}

fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| LoadError::invalid(&index, "missing \"weight_map\""))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(Value::as_str)
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| LoadError::io(dir, e))? {
        let p = e.map_err(|e| LoadError::io(dir, e))?.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(LoadError::invalid(dir, "no *.safetensors files"));
    }
    Ok(files)
}

/// Check that a safetensors file holds its declared header and data, so a truncated file
/// gets a message that says what is missing rather than the parser's generic one.
fn check_complete(path: &Path, b: &[u8]) -> Result<(), LoadError> {
    let trunc = |expected: String| LoadError::Truncated {
        file: path.display().to_string(),
        expected,
    };
    if b.len() < 8 {
        return Err(trunc(format!(
            "8-byte header length, file has {} bytes",
            b.len()
        )));
    }
    let n = u64::from_le_bytes(b[..8].try_into().unwrap_or_default());
    let hdr_end = 8u64.saturating_add(n);
    if (b.len() as u64) < hdr_end {
        return Err(trunc(format!(
            "{n}-byte JSON header, file has {} bytes",
            b.len()
        )));
    }
    let header: Value =
        serde_json::from_slice(&b[8..hdr_end as usize]).map_err(|e| LoadError::BadJson {
            file: format!("{} (safetensors header)", path.display()),
            message: e.to_string(),
        })?;
    let data_end = header
        .as_object()
        .map(|m| {
            m.values()
                .filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64())
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0);
    let need = hdr_end + data_end;
    if (b.len() as u64) < need {
        return Err(trunc(format!(
            "{need} bytes (header and tensor data), file has {} bytes",
            b.len()
        )));
    }
    Ok(())
}

impl Shards {
    fn open(dir: &Path) -> Result<Shards, LoadError> {
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for path in safetensors_files(dir)? {
            let f = std::fs::File::open(&path).map_err(|e| LoadError::io(&path, e))?;
            // SAFETY: mapped read-only and only read while the mapping lives; a checkpoint
            // rewritten while it loads is outside what this loader defends against.
            let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| LoadError::io(&path, e))?;
            check_complete(&path, &map)?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| LoadError::invalid(&path, format!("bad safetensors file: {e}")))?;
            for name in st.names() {
                index.insert(name.to_string(), maps.len());
            }
            maps.push((path, map));
        }
        Ok(Shards { maps, index })
    }

    fn get(&self, dir: &Path, name: &str) -> Result<Tensor, LoadError> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor {
                file: dir.display().to_string(),
                name: name.to_string(),
            })?;
        let (path, map) = &self.maps[i];
        let st = SafeTensors::deserialize(map)
            .map_err(|e| LoadError::invalid(path, format!("bad safetensors file: {e}")))?;
        let view = st
            .tensor(name)
            .map_err(|e| LoadError::invalid(path, format!("tensor {name}: {e}")))?;
        let b = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(LoadError::UnsupportedType {
                    file: path.display().to_string(),
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        Ok(Tensor {
            shape: view.shape().to_vec(),
            data,
        })
    }
}

/// Read the weights of a directory for `cfg`.
fn read_weights(dir: &Path, cfg: &ModelConfig) -> Result<Weights, LoadError> {
    let s = Shards::open(dir)?;
    let t = |name: &str| s.get(dir, name);
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for n in 0..cfg.num_layers {
        let p = |x: &str| format!("model.layers.{n}.{x}");
        let bias = |x: &str| -> Result<Option<Tensor>, LoadError> {
            if cfg.attention_bias {
                t(&p(x)).map(Some)
            } else {
                Ok(None)
            }
        };
        layers.push(LayerWeights {
            input_norm: t(&p("input_layernorm.weight"))?,
            q_proj: t(&p("self_attn.q_proj.weight"))?,
            k_proj: t(&p("self_attn.k_proj.weight"))?,
            v_proj: t(&p("self_attn.v_proj.weight"))?,
            q_bias: bias("self_attn.q_proj.bias")?,
            k_bias: bias("self_attn.k_proj.bias")?,
            v_bias: bias("self_attn.v_proj.bias")?,
            o_proj: t(&p("self_attn.o_proj.weight"))?,
            post_norm: t(&p("post_attention_layernorm.weight"))?,
            gate_proj: t(&p("mlp.gate_proj.weight"))?,
            up_proj: t(&p("mlp.up_proj.weight"))?,
            down_proj: t(&p("mlp.down_proj.weight"))?,
        });
    }
    // Tied checkpoints sometimes still store lm_head.weight (a copy of the embedding); the
    // config decides.
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(t("lm_head.weight")?)
    };
    Ok(Weights {
        embed: t("model.embed_tokens.weight")?,
        layers,
        final_norm: t("model.norm.weight")?,
        lm_head,
    })
}

/// Load a Hugging Face model directory.
pub fn load_dir(dir: &Path) -> Result<Checkpoint, LoadError> {
    let cfg_path = dir.join("config.json");
    let cfg_json = read_json(&cfg_path)?;
    let gen_cfg = read_json_opt(&dir.join("generation_config.json"))?;
    let cfg = parse_config(&cfg_json, gen_cfg.as_ref(), &cfg_path)?;
    cfg.validate()
        .map_err(|m| LoadError::invalid(&cfg_path, format!("bad config: {m}")))?;
    let weights = read_weights(dir, &cfg)?;
    check(dir, &cfg, &weights)?;

    let tok_path = dir.join("tokenizer.json");
    let tok_text = std::fs::read_to_string(&tok_path).map_err(|e| LoadError::io(&tok_path, e))?;
    // Parse as JSON first so a syntax error is reported as bad JSON naming the file.
    serde_json::from_str::<serde::de::IgnoredAny>(&tok_text).map_err(|e| LoadError::BadJson {
        file: tok_path.display().to_string(),
        message: e.to_string(),
    })?;
    let tokenizer = Tokenizer::from_json(&tok_text).map_err(|e| LoadError::Tokenizer {
        file: tok_path.display().to_string(),
        message: e.0,
    })?;

    let tc_path = dir.join("tokenizer_config.json");
    let chat_template = match read_json_opt(&tc_path)? {
        Some(tc) => match template_from_tokenizer_config(&tc) {
            Some(src) => {
                let special = |k: &str| -> String {
                    match tc.get(k) {
                        Some(Value::String(s)) => s.clone(),
                        Some(v) => v
                            .get("content")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                        None => String::new(),
                    }
                };
                Some(
                    ChatTemplate::new(&src, &special("bos_token"), &special("eos_token")).map_err(
                        |e| LoadError::ChatTemplate {
                            file: tc_path.display().to_string(),
                            message: e.0,
                        },
                    )?,
                )
            }
            None => None,
        },
        None => None,
    };
    // Newer checkpoints keep the template in its own file.
    let chat_template = match chat_template {
        Some(t) => Some(t),
        None => {
            let jinja = dir.join("chat_template.jinja");
            if jinja.exists() {
                let src = std::fs::read_to_string(&jinja).map_err(|e| LoadError::io(&jinja, e))?;
                Some(
                    ChatTemplate::new(&src, "", "").map_err(|e| LoadError::ChatTemplate {
                        file: jinja.display().to_string(),
                        message: e.0,
                    })?,
                )
            } else {
                None
            }
        }
    };
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string());
    Ok(Checkpoint {
        name,
        config: cfg,
        weights,
        tokenizer,
        chat_template,
    })
}
