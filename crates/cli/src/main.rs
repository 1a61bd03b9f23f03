//! `bgs`: serve, load and demo for bpf-gpu-server.

mod affinity;
mod demo;
mod lab;
mod meta;
mod serve;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "bgs",
    version,
    about = "bpf-gpu-server: small models and short GPU kernels over TCP"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the server.
    Serve(serve::ServeArgs),
    /// Run the load generator against a server.
    Load(LoadArgs),
    /// Start a CPU-executor server on loopback, load it briefly, print a table.
    Demo(demo::DemoArgs),
    /// Run experiment files (paired blocks, CPU in every scope) and report on them.
    Lab(lab::LabArgs),
}

/// Request kinds the load generator sends.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum LoadOp {
    /// Echo (`--words` payload words).
    Echo,
    /// 8x8 f32 matrix product.
    Gemm8,
    /// 32-point complex FFT.
    Fft32,
    /// LLM generation: streamed tokens, replayed token by token (`--prompt-tokens`,
    /// `--max-tokens`, `--ignore-eos`, `--token-range`, `--prompts`).
    Generate,
}

impl LoadOp {
    fn op(self) -> bgs_protocol::Op {
        match self {
            LoadOp::Echo => bgs_protocol::Op::Echo,
            LoadOp::Gemm8 => bgs_protocol::Op::Gemm8,
            LoadOp::Fft32 => bgs_protocol::Op::Fft32,
            LoadOp::Generate => bgs_protocol::Op::Generate,
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    /// Server address.
    #[arg(long, default_value = "127.0.0.1:7700")]
    target: SocketAddr,
    /// Request kind.
    #[arg(long, value_enum, default_value = "gemm8")]
    op: LoadOp,
    /// Repeat count for gemm8/fft32 (1..=256).
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Payload words for echo.
    #[arg(long, default_value_t = 64)]
    words: u32,
    /// Offered rate, requests per second over all connections.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Persistent connections.
    #[arg(long, default_value_t = 128)]
    connections: usize,
    /// Measured duration in seconds (after warm-up).
    #[arg(long)]
    duration: Option<f64>,
    /// Measured request count (instead of, or as well as, a duration).
    #[arg(long)]
    requests: Option<u64>,
    /// Warm-up seconds, excluded from latency and throughput statistics.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Most requests in flight per connection.
    #[arg(long, default_value_t = 16)]
    pipeline: usize,
    /// Send requests as HTTP POSTs.
    #[arg(long)]
    http: bool,
    /// Seconds after which an unanswered request counts as timed out.
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
    /// Distinct payloads, or prompts for generate (each checked against its golden reply).
    #[arg(long, visible_alias = "prompts", default_value_t = 64)]
    distinct: usize,
    /// Generate: prompt tokens per request (1..=256).
    #[arg(long, default_value_t = 16)]
    prompt_tokens: u32,
    /// Generate: max new tokens per request (1..=4096).
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Generate: set flag bit 0, so generation runs to --max-tokens past EOS tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Generate: prompt token ids are drawn from 0..R (every served model has at least 256).
    #[arg(long, default_value_t = 256)]
    token_range: u32,
    /// Seed for payload generation.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Server PID for CPU accounting (found from the listening socket if omitted).
    #[arg(long)]
    server_pid: Option<u32>,
    /// Client I/O threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Write the report as JSON (with date, machine, command and git revision).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Pin the load generator to these CPUs (e.g. `1` or `2-3`).
    #[arg(long)]
    cpus: Option<String>,
    /// Exit with status 1 if any request failed (wrong, error, timed out, connection failed).
    #[arg(long)]
    strict: bool,
    /// Closed loop (as wrk): each connection sends its next request when the previous reply
    /// arrives, for --warmup then --duration seconds; finds saturation throughput (--rate,
    /// --pipeline and --threads are ignored; echo, gemm8 and fft32, binary frames).
    #[arg(long)]
    closed_loop: bool,
    /// Drive an external OpenAI-compatible completions endpoint instead of --target
    /// (`http://HOST:PORT[/v1/completions]`), with the generate flags (--prompt-tokens,
    /// --max-tokens, --ignore-eos, --prompts) and the same schedule; --server-pid accounts its
    /// CPU.
    #[arg(long, value_name = "URL")]
    openai: Option<String>,
    /// With --openai: the `model` field.
    #[arg(long, requires = "openai", default_value = "")]
    model: String,
    /// With --openai: ask for one JSON response instead of a server-sent event stream.
    #[arg(long, requires = "openai")]
    no_stream: bool,
}

impl LoadArgs {
    fn config(&self, progress: bool) -> Result<bgs_load::LoadConfig> {
        if self.duration.is_none() && self.requests.is_none() {
            bail!("give --duration SECONDS or --requests N");
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            bail!("--rate must be a positive number of requests per second");
        }
        if matches!(self.op, LoadOp::Gemm8 | LoadOp::Fft32)
            && !(1..=bgs_protocol::MAX_REPEAT).contains(&self.repeat)
        {
            bail!("--repeat must be 1..=256");
        }
        if self.connections == 0 || self.pipeline == 0 || self.threads == 0 {
            bail!("--connections, --pipeline and --threads must be at least 1");
        }
        let generate = bgs_load::GenerateConfig {
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
            ignore_eos: self.ignore_eos,
            token_range: self.token_range,
        };
        if self.op == LoadOp::Generate {
            if !(1..=bgs_load::MAX_PROMPT_TOKENS).contains(&self.prompt_tokens) {
                bail!(
                    "--prompt-tokens must be 1..={}",
                    bgs_load::MAX_PROMPT_TOKENS
                );
            }
            if !(1..=bgs_load::MAX_NEW_TOKENS).contains(&self.max_tokens) {
                bail!("--max-tokens must be 1..={}", bgs_load::MAX_NEW_TOKENS);
            }
            if self.token_range == 0 {
                bail!("--token-range must be at least 1");
            }
        }
        Ok(bgs_load::LoadConfig {
            target: self.target,
            op: self.op.op(),
            repeat: self.repeat,
            words: self.words,
            rate: self.rate,
            connections: self.connections,
            duration: self.duration.map(Duration::from_secs_f64),
            requests: self.requests,
            warmup: Duration::from_secs_f64(self.warmup),
            pipeline: self.pipeline,
            http: self.http,
            timeout: Duration::from_secs_f64(self.timeout),
            distinct_payloads: self.distinct.max(1),
            seed: self.seed,
            server_pid: self.server_pid,
            progress,
            threads: self.threads,
            generate,
        })
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BGS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve::run(&args),
        Command::Load(args) => load(&args),
        Command::Demo(args) => demo::run(&args),
        Command::Lab(args) => lab::run(&args),
    };
    if let Err(e) = result {
        eprintln!("bgs: error: {e:#}");
        std::process::exit(1);
    }
}

fn load(args: &LoadArgs) -> Result<()> {
    use std::io::IsTerminal;
    let cfg = args.config(std::io::stdout().is_terminal())?;
    if let Some(list) = &args.cpus {
        affinity::pin(list)?;
    }
    let report = if let Some(url) = &args.openai {
        let oa = bgs_load::OpenAiConfig {
            url: url.clone(),
            model: args.model.clone(),
            stream: !args.no_stream,
        };
        bgs_load::run_openai(&cfg, &oa)
    } else if args.closed_loop {
        bgs_load::run_closed(&cfg)
    } else {
        bgs_load::run(&cfg)
    }
    .context("load run failed")?;
    println!("{report}");
    if let Some(path) = &args.json {
        let doc = meta::with_metadata(serde_json::to_value(&report)?);
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if args.strict && report.failures > 0 {
        bail!("{} requests failed", report.failures);
    }
    Ok(())
}
