//! `bgs model`: write synthetic checkpoints and inspect checkpoints.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use bgs_model::synth::{DType, SynthArch};

/// `bgs model` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum ModelCommand {
    /// Write a synthetic Hugging Face checkpoint directory (seeded random weights).
    Synth(SynthArgs),
    /// Load a checkpoint (HF directory or .gguf file) and print a summary.
    Inspect(InspectArgs),
}

/// `bgs model synth` arguments.
#[derive(clap::Args, Debug)]
pub struct SynthArgs {
    /// Shape: qwen2.5-0.5b, smollm2-135m, tiny-qwen2 or tiny-llama.
    #[arg(long)]
    arch: String,
    /// Output directory (created).
    #[arg(long)]
    out: PathBuf,
    /// PRNG seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stored dtype: bf16, fp16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
}

/// `bgs model inspect` arguments.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// A Hugging Face model directory or a .gguf file.
    path: PathBuf,
}

/// Run a `bgs model` subcommand.
pub fn run(cmd: &ModelCommand) -> Result<()> {
    match cmd {
        ModelCommand::Synth(a) => {
            let arch: SynthArch = a.arch.parse()?;
            let dtype: DType = a.dtype.parse()?;
            let t = Instant::now();
            bgs_model::synth(arch, &a.out, a.seed, dtype)?;
            println!(
                "wrote {} ({}, seed {}, {:?}) in {:.1} s",
                a.out.display(),
                arch.name(),
                a.seed,
                dtype,
                t.elapsed().as_secs_f64()
            );
            Ok(())
        }
        ModelCommand::Inspect(a) => inspect(a),
    }
}

fn inspect(a: &InspectArgs) -> Result<()> {
    let t = Instant::now();
    let ck = bgs_model::load(&a.path).with_context(|| format!("loading {}", a.path.display()))?;
    let c = &ck.config;
    let w = &ck.weights;
    let mut params = w.embed.len() + w.final_norm.len() + w.lm_head.as_ref().map_or(0, |t| t.len());
    for l in &w.layers {
        params += [
            &l.input_norm,
            &l.q_proj,
            &l.k_proj,
            &l.v_proj,
            &l.o_proj,
            &l.post_norm,
            &l.gate_proj,
            &l.up_proj,
            &l.down_proj,
        ]
        .iter()
        .map(|t| t.len())
        .sum::<usize>();
        params += [&l.q_bias, &l.k_bias, &l.v_bias]
            .iter()
            .filter_map(|b| b.as_ref().map(|t| t.len()))
            .sum::<usize>();
    }
    println!("name:            {}", ck.name);
    println!(
        "arch:            {} ({})",
        c.arch.hf_name(),
        c.arch.gguf_name()
    );
    println!(
        "shape:           {} layers, hidden {}, intermediate {}, heads {} (kv {}), head_dim {}",
        c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    );
    println!(
        "embedding:       {:?}, lm_head {}",
        w.embed.shape,
        if c.tie_word_embeddings {
            "tied"
        } else {
            "separate"
        }
    );
    println!("attention bias:  {}", c.attention_bias);
    println!(
        "rope theta:      {}, rms eps {}",
        c.rope_theta, c.rms_norm_eps
    );
    println!("max positions:   {}", c.max_position_embeddings);
    println!("parameters:      {params} ({:.1} M)", params as f64 / 1e6);
    println!(
        "vocab:           model {}, tokenizer {}",
        c.vocab_size,
        ck.tokenizer.vocab_size()
    );
    let name = |id: u32| ck.tokenizer.id_token(id).unwrap_or_else(|| "?".into());
    println!(
        "bos:             {:?}",
        c.bos_token_id.map(|id| format!("{id} {}", name(id)))
    );
    let eos: Vec<String> = c
        .eos_token_ids
        .iter()
        .map(|&id| format!("{id} {}", name(id)))
        .collect();
    println!("eos:             {}", eos.join(", "));
    println!(
        "chat template:   {}",
        if ck.chat_template.is_some() {
            "yes"
        } else {
            "no"
        }
    );
    println!("loaded in        {:.2} s", t.elapsed().as_secs_f64());
    Ok(())
}
