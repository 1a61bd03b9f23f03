//! `bgs`: serve, load, demo, generate and model tools for bpf-gpu-server.

mod admin;
mod affinity;
mod args;
mod demo;
mod lab;
mod llm;
mod meta;
mod model;
mod privdrop;
mod serve;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "bgs",
    version,
    about = "bpf-gpu-server: small models and short GPU kernels over TCP",
    after_help = "Logging: BGS_LOG sets what is logged to stderr, in tracing-subscriber's \
                  EnvFilter syntax (default `info`; e.g. BGS_LOG=warn, \
                  BGS_LOG=debug, BGS_LOG=bgs_transport=debug). Colour codes only when \
                  stderr is a terminal."
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
    /// Synthesize or inspect model checkpoints.
    #[command(subcommand)]
    Model(model::ModelCommand),
    /// Complete one prompt with a model, in process, printing tokens as they are produced.
    Generate(llm::GenerateArgs),
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

/// Most offered load (requests per second) of `bgs load` and `bgs demo`.
pub const MAX_RATE: f64 = 10_000_000.0;
/// Longest measured duration or warm-up, seconds (one day).
pub const MAX_SECONDS: f64 = 86_400.0;
/// Most measured requests of one run.
pub const MAX_REQUESTS: u64 = 1_000_000_000;

#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    /// Server address: IP:PORT, HOST:PORT (resolved, IPv4 preferred) or :PORT (this host).
    #[arg(long, default_value = "127.0.0.1:7700", value_parser = args::target_addr)]
    target: SocketAddr,
    /// Request kind.
    #[arg(long, value_enum, default_value = "gemm8")]
    op: LoadOp,
    /// Repeat count for gemm8/fft32, 1..=256 (not for echo).
    #[arg(long, default_value_t = 1, value_parser = args::int(1u32, bgs_protocol::MAX_REPEAT))]
    repeat: u32,
    /// Payload words for echo, 0..=256 (echo only).
    #[arg(long, default_value_t = 64,
          value_parser = args::int(0u32, bgs_ring::SLOT_WORDS as u32))]
    words: u32,
    /// Offered rate, requests per second over all connections, 0 < R <= 10000000.
    #[arg(long, default_value_t = 1000.0, value_parser = args::positive(MAX_RATE))]
    rate: f64,
    /// Persistent connections, 1..=65536.
    #[arg(long, default_value_t = 128,
          value_parser = args::int(1usize, serve::MAX_CONNECTIONS))]
    connections: usize,
    /// Measured duration in seconds (after warm-up), 0 < S <= 86400.
    #[arg(long, value_parser = args::positive(MAX_SECONDS), conflicts_with = "requests")]
    duration: Option<f64>,
    /// Measured request count instead of a duration, 1..=1000000000.
    #[arg(long, value_parser = args::int(1u64, MAX_REQUESTS))]
    requests: Option<u64>,
    /// Warm-up seconds, excluded from latency and throughput statistics, 0..=86400.
    #[arg(long, default_value_t = 1.0, value_parser = args::non_negative(MAX_SECONDS))]
    warmup: f64,
    /// Most requests in flight per connection, 1..=4096.
    #[arg(long, default_value_t = 16, value_parser = args::int(1usize, 4096))]
    pipeline: usize,
    /// Send requests as HTTP POSTs.
    #[arg(long)]
    http: bool,
    /// Seconds after which an unanswered request counts as timed out, 0 < S <= 3600.
    #[arg(long, default_value_t = 10.0, value_parser = args::positive(3600.0))]
    timeout: f64,
    /// Distinct payloads, or prompts for generate (each checked against its golden reply),
    /// 1..=65536.
    #[arg(long, visible_alias = "prompts", default_value_t = 64,
          value_parser = args::int(1usize, 65_536))]
    distinct: usize,
    /// Generate: prompt tokens per request (1..=256).
    #[arg(long, default_value_t = 16,
          value_parser = args::int(1u32, bgs_load::MAX_PROMPT_TOKENS))]
    prompt_tokens: u32,
    /// Generate: max new tokens per request (1..=4096).
    #[arg(long, default_value_t = 64, value_parser = args::int(1u32, bgs_load::MAX_NEW_TOKENS))]
    max_tokens: u32,
    /// Generate: set flag bit 0, so generation runs to --max-tokens past EOS tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Generate: prompt token ids are drawn from 0..R (every served model has at least 256),
    /// 1..=4294967295.
    #[arg(long, default_value_t = 256, value_parser = args::int(1u32, u32::MAX))]
    token_range: u32,
    /// Seed for payload generation.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Server PID for CPU accounting (found from the listening socket if omitted).
    #[arg(long)]
    server_pid: Option<u32>,
    /// Client I/O threads, 1..=256 (at most one per connection is used).
    #[arg(long, default_value_t = 1, value_parser = args::int(1usize, 256))]
    threads: usize,
    /// Write the report as JSON (with date, machine, command and git revision). The file is
    /// opened (created) before the run, so an unwritable path fails at once.
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
    /// Refuse flags that do nothing with the op given, naming both (ranges are checked by
    /// the parsers).
    fn check_combinations(&self, m: &ArgMatches) -> Result<()> {
        let op = self.op.op().name();
        if self.op != LoadOp::Echo && args::given(m, "words") {
            bail!("--words applies to --op echo; it does nothing with --op {op} (fixed size)");
        }
        if matches!(self.op, LoadOp::Echo | LoadOp::Generate) && args::given(m, "repeat") {
            bail!("--repeat applies to gemm8 and fft32; it does nothing with --op {op}");
        }
        if self.op != LoadOp::Generate {
            for flag in ["prompt_tokens", "max_tokens", "ignore_eos", "token_range"] {
                if args::given(m, flag) {
                    bail!(
                        "--{} applies to --op generate; it does nothing with --op {op}",
                        flag.replace('_', "-")
                    );
                }
            }
        }
        if let Some(list) = &self.cpus {
            affinity::parse_cpu_list(list).context("--cpus")?;
        }
        Ok(())
    }

    fn config(&self, progress: bool) -> Result<bgs_load::LoadConfig> {
        if self.duration.is_none() && self.requests.is_none() {
            bail!("give --duration SECONDS or --requests N");
        }
        let generate = bgs_load::GenerateConfig {
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
            ignore_eos: self.ignore_eos,
            token_range: self.token_range,
        };
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
            distinct_payloads: self.distinct,
            seed: self.seed,
            server_pid: self.server_pid,
            progress,
            threads: self.threads,
            generate,
        })
    }
}

fn main() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BGS_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: logs redirected to a file or pipe stay plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // The subcommand's own matches tell flags given on the command line from defaults.
    let sub = matches
        .subcommand()
        .map(|(_, m)| m.clone())
        .unwrap_or_default();
    if matches!(cli.command, Command::Lab(_) | Command::Model(_)) {
        restore_sigpipe();
    }
    let result = match cli.command {
        Command::Serve(args) => {
            serve::check_combinations(&args, &sub).and_then(|()| serve::run(&args))
        }
        Command::Load(args) => args.check_combinations(&sub).and_then(|()| load(&args)),
        Command::Demo(args) => demo::run(&args),
        Command::Lab(args) => lab::run(&args),
        Command::Model(cmd) => model::run(&cmd),
        Command::Generate(args) => llm::generate(&args, &sub),
    };
    if let Err(e) = result {
        eprintln!("bgs: error: {e:#}");
        std::process::exit(1);
    }
}

/// Commands that only print (`lab`, `model`) end quietly when their reader goes away
/// (`bgs lab check FILE | head -1`), like any Unix filter, instead of panicking in `println!`.
/// The Rust runtime ignores SIGPIPE so that a write to a closed socket returns `EPIPE`; the
/// commands that talk to sockets (`serve`, `load`, `demo`, `generate`) keep it ignored.
fn restore_sigpipe() {
    // SAFETY: `signal` with `SIG_DFL` installs no handler (no code runs in signal context);
    // it is called on the main thread before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// `--json PATH`, opened before a run so that an unwritable path fails before the run, not
/// after it. A file this created is removed again if the run fails.
#[derive(Debug)]
pub struct JsonOut {
    path: PathBuf,
    file: Option<std::fs::File>,
    created: bool,
}

impl JsonOut {
    pub fn open(path: &std::path::Path) -> Result<Self> {
        let existed = path.exists();
        // Append mode checks writability without truncating an existing file before the run
        // has produced its replacement.
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("--json {}: cannot write there", path.display()))?;
        Ok(JsonOut {
            path: path.to_owned(),
            file: Some(file),
            created: !existed,
        })
    }

    /// Replace the file's contents with `doc`.
    pub fn write(mut self, doc: &serde_json::Value) -> Result<()> {
        use std::io::Write;
        let mut f = self.file.take().context("JSON file already written")?;
        f.set_len(0)
            .and_then(|()| f.write_all((serde_json::to_string_pretty(doc)? + "\n").as_bytes()))
            .with_context(|| format!("writing {}", self.path.display()))?;
        self.created = false;
        Ok(())
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl Drop for JsonOut {
    fn drop(&mut self) {
        if self.created {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn load(args: &LoadArgs) -> Result<()> {
    use std::io::IsTerminal;
    let cfg = args.config(std::io::stdout().is_terminal())?;
    let json = args.json.as_deref().map(JsonOut::open).transpose()?;
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
    if let Some(json) = json {
        let doc = meta::with_metadata(serde_json::to_value(&report)?);
        let path = json.path().display().to_string();
        json.write(&doc)?;
        println!("wrote {path}");
    }
    if args.strict && report.failures > 0 {
        bail!("{} requests failed", report.failures);
    }
    Ok(())
}
