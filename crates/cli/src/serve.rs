//! `bgs serve`: bind, start the executor, run the transport until SIGINT/SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bgs_executor::{CpuExecutor, CpuExecutorConfig};
use bgs_protocol::FramerConfig;
use bgs_ring::{RingConfig, RingRegion, SLOT_WORDS};
use bgs_transport::conn::ConnLimits;
use bgs_transport::{NativeConfig, NativeTransport};
use clap::{ArgMatches, ValueEnum};

use crate::args;

use crate::admin::{self, AdminHook};

/// Transports.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum TransportKind {
    /// One thread, timed epoll, nonblocking reads and writes.
    Native,
    /// eBPF frames and admits requests; replies leave through io_uring (needs root).
    Kernel,
}

/// Reply paths of the kernel transport.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum ReplyKind {
    /// A service thread reaps completions and submits SENDs through io_uring.
    Loop,
    /// SENDs are written as SQEs into SQPOLL ring memory; no system calls per request. With
    /// the GPU executor the GPU writes most of them itself, into an io_uring ring of its own.
    ExecutorSqe,
}

/// Executors.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum ExecutorKind {
    /// Embedded CPU executor (runs anywhere).
    Cpu,
    /// The GPU executor when a usable GPU is present, else the CPU executor.
    Auto,
    /// Resident GPU dispatcher.
    Gpu,
}

/// GPU dispatchers.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum DispatcherKind {
    /// A device-launched scheduler graph (no host thread on the request path).
    Device,
    /// A host thread polls the ring and launches graphs (for comparison).
    Host,
}

/// How the transport learns that the GPU published a completion.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum GpuWakeKind {
    /// The native transport looks for each completion when it is expected, learned from the
    /// completions (publish to reap), backing off to `--poll-us` when one is late
    /// (docs/cost.md, "Paced polling"). The kernel transport's reply loop leaves the looking
    /// to BPF: a timer armed when a request is published while the loop sleeps looks at the
    /// completion ring when the reply is expected (learned the same way, backing off to
    /// `--reply-timer-us`) and wakes the loop once it is there (docs/kernel.md, "The
    /// completion watch").
    Paced,
    /// The transport polls the completion ring on its short timer (`--poll-us`,
    /// `--reply-timer-us`) while requests are outstanding.
    Poll,
    /// The GPU executor's completion notifier wakes the transport: a host thread sleeps in
    /// `cuEventSynchronize` (interrupt-driven) behind a device-side wait for the next
    /// completion; the transport waits without its short timer (10 ms safety timeout).
    Interrupt,
}

/// The transports' safety timeout while the executor wakes them for every completion (the CPU
/// executor, the step loop's monitor, `--gpu-completion-wake interrupt`): long, since the
/// wake-up is what ends waits; its firings are counted (`wake_timeouts`).
const EXECUTOR_WAKE_TIMEOUT: Duration = Duration::from_millis(10);

enum Executor {
    Cpu(CpuExecutor),
    Gpu(bgs_executor_gpu::GpuExecutor),
    /// The generation step loop resident on the GPU (`--gpu-step-loop device`).
    GpuLoop(Box<bgs_model_gpu::GpuGenExecutor>),
}

/// Where the generation step loop runs with `--model --executor gpu`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepLoopKind {
    /// A host thread (the generation engine) plans each step and replays the model's graphs.
    Host,
    /// A resident dispatcher on the GPU plans, launches and publishes; the host only watches
    /// (docs/gpu-model.md, "The resident step loop"). Verified on an H200 with the native
    /// transport (binary protocol); the default stays `host` until the other paths ran there.
    Device,
}

/// The GPU executor's slots when `--slots` is not given. On the H200 (gemm8 x1, pipelined
/// over TCP, bench/results/20261201-gpu-slots-saturation) 16 slots served 296k req/s, 32
/// 452k, 64 521k; the executor, not the transport, set the ceiling below 64.
const DEFAULT_GPU_SLOTS: usize = bgs_executor_gpu::layout::MAX_SLOTS;

/// Most executor slots (`bgs_ring::MAX_STREAMS`; the GPU executor takes at most 64).
pub const MAX_SLOTS: usize = bgs_ring::MAX_STREAMS;
/// Most open connections.
pub const MAX_CONNECTIONS: usize = 65_536;
/// Most ring slots (request ring; completion ring: four times this).
pub const MAX_RING_SLOTS: u32 = 65_536;

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on: IP:PORT, HOST:PORT (resolved, IPv4 preferred) or :PORT (all IPv4
    /// interfaces, 0.0.0.0). Port 0 picks a free port; the chosen address is printed.
    #[arg(long, default_value = "127.0.0.1:7700", value_parser = args::listen_addr)]
    pub listen: SocketAddr,
    /// Transport.
    #[arg(long, value_enum, default_value = "native")]
    pub transport: TransportKind,
    /// Executor.
    #[arg(long, value_enum, default_value = "cpu")]
    pub executor: ExecutorKind,
    /// Executor slots (requests executing at once), 1..=512 (the GPU executor: 1..=64).
    /// Default: CPU count for the CPU executor, 64 for the GPU executor (the smallest count
    /// that serves 500,000 gemm8 req/s over TCP on an H200: docs/cost.md), 16 live sequences
    /// with `--model`.
    #[arg(long, value_parser = args::int(1usize, MAX_SLOTS))]
    pub slots: Option<usize>,
    /// Where the generation step loop runs (`--model --executor gpu` only): `host` (the
    /// generation engine on a host thread) or `device` (resident on the GPU).
    #[arg(long, value_enum, default_value = "host")]
    pub gpu_step_loop: StepLoopKind,
    /// With `--gpu-step-loop device`: check the loop's bookkeeping after every step and its
    /// lane-parallel walks against the plain C functions, stopping the loop on a difference
    /// (tests and diagnosis; each step pays a serial pass over the table).
    #[arg(long)]
    pub gpu_step_loop_check: bool,
    /// GPU dispatcher kind (GPU executor only: `--executor gpu` or `auto`).
    #[arg(long, value_enum, default_value = "device")]
    pub dispatcher: DispatcherKind,
    /// Directory holding the CUDA libraries (else CUDA_HOME, /usr/local/cuda, the loader's
    /// path). GPU executor only.
    #[arg(long)]
    pub cuda_home: Option<std::path::PathBuf>,
    /// GPU executor, device dispatcher: resident scheduler warps, each owning a share of the
    /// slots, 0..=64 (0: one per 8 slots, at most 2; never more than the slots).
    #[arg(long, default_value_t = 0, value_parser = args::int(0usize, 64))]
    pub gpu_schedulers: usize,
    /// GPU executor: how the transport learns of completions. `paced`: the native transport
    /// looks when each completion is expected (learned), at most `--poll-us` apart. `poll`: it
    /// polls on its short timer while requests are outstanding. `interrupt`: the completion
    /// notifier wakes it (native, or kernel `--reply loop`; docs/gpu.md, docs/cost.md).
    #[arg(long, value_enum, default_value = "paced")]
    pub gpu_completion_wake: GpuWakeKind,
    /// Floor mode: the native transport answers echo itself, without ring or executor (so it
    /// takes no executor, ring or kernel-transport flags).
    #[arg(long)]
    pub floor: bool,
    /// Largest payload in 32-bit words, 1..=256 (a ring slot's capacity). Default: 64, or
    /// 256 with `--model` (prompts are payloads of token ids).
    #[arg(long, value_parser = args::int(1u32, SLOT_WORDS as u32))]
    pub max_words: Option<u32>,
    /// Generation: the model and its engine's options.
    #[command(flatten)]
    pub generation: crate::llm::ModelArgs,
    /// With `--model`: the OpenAI-compatible API's address (HOST:PORT or :PORT), or `off`.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub api_listen: String,
    /// Most open connections, 1..=65536.
    #[arg(long, default_value_t = 4096, value_parser = args::int(1usize, MAX_CONNECTIONS))]
    pub max_connections: usize,
    /// Native transport: most requests in flight per connection, 1..=65536; reading pauses
    /// beyond it.
    #[arg(long, default_value_t = 64, value_parser = args::int(1usize, 65_536))]
    pub max_inflight: usize,
    /// Request ring slots, a power of two in 2..=65536; admission refuses with busy when it
    /// is full.
    #[arg(long, default_value_t = 4096, value_parser = args::pow2(2, MAX_RING_SLOTS))]
    pub ring_slots: u32,
    /// Pin the server (all its threads) to these CPUs (e.g. `0` or `0-1`; CPU numbers below
    /// 1024).
    #[arg(long)]
    pub cpus: Option<String>,
    /// Kernel transport reply path. `loop`: a service thread reaps completions and submits
    /// SENDs. `executor-sqe`: SENDs go into an SQPOLL ring without system calls, written by
    /// the reply stage's thread (CPU executor) or, with `--executor gpu` (or `auto` finding a
    /// GPU), by the GPU itself for plain binary replies, through a second SQPOLL ring that
    /// shares the first one's kernel thread; the stage sends the rest (HTTP, closing and
    /// busy replies, and replies that are not yet their connection's turn). With `--model`
    /// (either step loop) the stage sends every frame: streams are never GPU-sent.
    #[arg(long, value_enum, default_value = "loop")]
    pub reply: ReplyKind,
    /// Kernel transport, `--reply loop`: longest wait while replies are outstanding (us),
    /// 1..=1000000.
    #[arg(long, default_value_t = 60, value_parser = args::int(1u64, 1_000_000))]
    pub reply_timer_us: u64,
    /// Kernel transport, `--reply executor-sqe`: how often the watchdog checks whether the
    /// SQPOLL thread needs a wake-up (us), 1..=1000000. With adaptive submission
    /// (`--sqpoll-above` > 0) the stage wakes it itself and the watchdog, a safety net, runs
    /// every 100 ms.
    #[arg(long, default_value_t = 50, value_parser = args::int(1u64, 1_000_000))]
    pub watchdog_us: u64,
    /// Kernel transport, `--reply executor-sqe`: SQPOLL idle time before it sleeps (ms),
    /// 1..=60000. The SQPOLL kernel thread spins while awake and its time counts as the
    /// server's.
    #[arg(long, default_value_t = 10, value_parser = args::int(1u32, 60_000))]
    pub sqpoll_idle_ms: u32,
    /// Kernel transport, `--reply executor-sqe`: pin the SQPOLL thread to this CPU, 0..=1023
    /// (give it a core of its own: sharing one with the executor starves both).
    #[arg(long, value_parser = args::int(0u32, 1023))]
    pub sqpoll_cpu: Option<u32>,
    /// Kernel transport, `--reply executor-sqe`: replies per second above which the SQPOLL
    /// thread submits the stage's SENDs and, with the GPU executor, the GPU writes SENDs
    /// itself, 0..=10000000. Below it, while that thread sleeps, the stage sends with system
    /// calls itself (the GPU hands it every reply, and BPF's completion watch wakes it)
    /// instead of waking a thread that would spin through every gap (about a core at 1,000
    /// req/s). 0: always the SQPOLL ring (no socket system calls at any load; the paper's
    /// path).
    #[arg(long, default_value_t = bgs_transport::kernel::DEFAULT_SQPOLL_ABOVE, value_parser = args::int(0u32, 10_000_000))]
    pub sqpoll_above: u32,
    /// Completion ring slots, a power of two in 2..=262144. Default: twice the request ring
    /// (native), four times it but at least 16384 (kernel: BPF answers busy into it in
    /// bursts).
    #[arg(long, value_parser = args::pow2(2, 4 * MAX_RING_SLOTS))]
    pub completion_slots: Option<u32>,
    /// Print the transport's counters to stderr every this many seconds, 0 < S <= 86400 (they
    /// are always printed at shutdown).
    #[arg(long, value_parser = args::positive(86_400.0))]
    pub stats_every: Option<f64>,
    /// Native transport: longest epoll wait while requests are outstanding (us), 1..=1000000.
    #[arg(long, default_value_t = 100, value_parser = args::int(1u64, 1_000_000))]
    pub poll_us: u64,
    /// Native transport, streamed generation: hold a connection's token frames up to this
    /// many microseconds so that several steps' frames leave in one write, 0..=100000 (0:
    /// every frame at once). The first token, the final frame and one-shot replies never wait.
    /// Cuts the transport's CPU per request at the cost of up to this much token latency
    /// (docs/cost.md, "Streams: one write per token").
    #[arg(long, default_value_t = 0, value_parser = args::int(0u64, 100_000))]
    pub stream_coalesce_us: u64,
    /// Serve `/healthz`, `/readyz` and `/metrics` (Prometheus) over HTTP on this address
    /// (off by default; see docs/operations.md).
    #[arg(long)]
    pub admin_listen: Option<SocketAddr>,
    /// On SIGINT/SIGTERM, make `/readyz` answer 503 at once but keep serving this many
    /// seconds before stopping, so that a load balancer takes the server out first.
    #[arg(long, default_value_t = 0.0)]
    pub shutdown_grace: f64,
    /// Run as this user (and group: NAME[:GROUP], names or numeric ids; default group: the
    /// user's primary group) once the privileged steps are done: started as root, the server
    /// loads and attaches the BPF programs, binds its ports, sets up io_uring and starts the
    /// executor, then switches every thread to the user for good (no capability kept) before
    /// it reports ready. See docs/operations.md.
    #[arg(long, value_name = "NAME[:GROUP]")]
    pub user: Option<String>,
}

/// Refuse flags that do nothing in the combination given, naming both (ranges are checked by
/// the parsers). `m` are the subcommand's matches, to tell given flags from defaults.
pub fn check_combinations(a: &ServeArgs, m: &ArgMatches) -> Result<()> {
    let any = |ids: &[&str]| args::first_given(m, ids);
    if a.floor {
        if a.transport == TransportKind::Kernel {
            bail!(
                "--floor is a mode of the native transport; it does nothing with --transport kernel"
            );
        }
        if let Some(f) = any(&[
            "executor",
            "slots",
            "dispatcher",
            "cuda_home",
            "gpu_schedulers",
            "gpu_completion_wake",
            "ring_slots",
            "completion_slots",
        ]) {
            bail!("{f} does nothing with --floor (floor mode has no ring and no executor)");
        }
    }
    if a.generation.model.is_none()
        && let Some(f) = any(&[
            "kv_block_size",
            "kv_blocks",
            "max_batched_tokens",
            "model_threads",
            "ignore_eos",
            "api_listen",
            "dtype",
            "batch_invariant",
            "gpu_fused_max_tokens",
            "gpu_tc_gemm_max_tokens",
            "gpu_tc_mid_max_tokens",
            "gpu_tc_large_min_tokens",
            "gpu_tc_large_split",
            "gpu_no_pdl",
        ])
    {
        bail!("{f} applies to generation; it does nothing without --model");
    }
    if a.generation.model.is_some() {
        if a.floor {
            bail!("--model does nothing with --floor (floor mode has no executor)");
        }
        // The generation engine's step loop runs on a host thread with either forward pass:
        // the GPU dispatcher's flags do nothing there.
        if let Some(f) = any(&["dispatcher", "gpu_schedulers"]) {
            bail!(
                "{f} applies to the GPU executor's one-shot dispatcher; it does nothing with --model"
            );
        }
        if a.executor != ExecutorKind::Gpu && args::given(m, "gpu_step_loop") {
            bail!("--gpu-step-loop applies to the GPU forward pass; it needs --executor gpu");
        }
        if a.executor == ExecutorKind::Gpu
            && let Some(f) = any(crate::llm::CPU_ONLY_MODEL_FLAGS)
        {
            bail!("{f} applies to the CPU forward pass; it does nothing with --executor gpu");
        }
        if a.executor == ExecutorKind::Cpu
            && let Some(f) = any(crate::llm::GPU_ONLY_MODEL_FLAGS)
        {
            bail!("{f} applies to the GPU forward pass; it does nothing with --executor cpu");
        }
        if let Some(n) = a.slots
            && n > crate::llm::MAX_SLOTS
        {
            bail!(
                "--slots {n} with --model: at most {} live sequences",
                crate::llm::MAX_SLOTS
            );
        }
    }
    if a.generation.model.is_none() && args::given(m, "gpu_step_loop") {
        bail!("--gpu-step-loop applies to generation; it does nothing without --model");
    }
    if a.gpu_step_loop_check && a.gpu_step_loop != StepLoopKind::Device {
        bail!("--gpu-step-loop-check checks the resident loop; it needs --gpu-step-loop device");
    }
    if a.executor == ExecutorKind::Cpu
        && let Some(f) = any(&[
            "dispatcher",
            "cuda_home",
            "gpu_schedulers",
            "gpu_completion_wake",
        ])
    {
        bail!("{f} applies to the GPU executor only; it does nothing with --executor cpu");
    }
    if a.dispatcher == DispatcherKind::Host && args::given(m, "gpu_schedulers") {
        bail!(
            "--gpu-schedulers applies to the device dispatcher; it does nothing with --dispatcher host"
        );
    }
    // With a model `--slots` counts live sequences (checked above, up to MAX_SLOTS); the
    // one-shot GPU executor's own limit applies only without one.
    if a.executor == ExecutorKind::Gpu
        && a.generation.model.is_none()
        && let Some(n) = a.slots
        && n > bgs_executor_gpu::layout::MAX_SLOTS
    {
        bail!(
            "--slots {n} is above the GPU executor's {} slots (--executor gpu)",
            bgs_executor_gpu::layout::MAX_SLOTS
        );
    }
    match a.transport {
        TransportKind::Native => {
            if let Some(f) = any(&[
                "reply",
                "reply_timer_us",
                "watchdog_us",
                "sqpoll_idle_ms",
                "sqpoll_cpu",
                "sqpoll_above",
            ]) {
                bail!(
                    "{f} applies to the kernel transport; it does nothing with --transport native"
                );
            }
        }
        TransportKind::Kernel => {
            if let Some(f) = any(&["poll_us", "max_inflight", "stream_coalesce_us"]) {
                bail!(
                    "{f} applies to the native transport; it does nothing with --transport kernel"
                );
            }
            match a.reply {
                ReplyKind::Loop => {
                    if let Some(f) = any(&[
                        "watchdog_us",
                        "sqpoll_idle_ms",
                        "sqpoll_cpu",
                        "sqpoll_above",
                    ]) {
                        bail!(
                            "{f} applies to --reply executor-sqe; it does nothing with --reply loop"
                        );
                    }
                }
                ReplyKind::ExecutorSqe => {
                    if a.gpu_completion_wake == GpuWakeKind::Interrupt {
                        bail!(
                            "--gpu-completion-wake interrupt wakes the reply loop; with --reply executor-sqe the reply stage runs inside the executor and has nothing to wake (use --reply loop)"
                        );
                    }
                    if args::given(m, "reply_timer_us") {
                        bail!(
                            "--reply-timer-us applies to --reply loop; it does nothing with --reply executor-sqe"
                        );
                    }
                }
            }
        }
    }
    if let Some(list) = &a.cpus {
        crate::affinity::parse_cpu_list(list).context("--cpus")?;
    }
    Ok(())
}

pub fn run(args: &ServeArgs) -> Result<()> {
    // Resolve the user first: a bad name fails before anything starts.
    let user = args
        .user
        .as_deref()
        .map(crate::privdrop::resolve)
        .transpose()?;
    if let Some(t) = &user {
        crate::privdrop::check_root(t)?;
    }
    let user = user.as_ref();
    if let Some(list) = &args.cpus {
        crate::affinity::pin(list)?;
    }
    if !(args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0) {
        bail!(
            "--shutdown-grace must be a number of seconds, 0 or more (got {})",
            args.shutdown_grace
        );
    }
    let mut expected = match (args.transport, args.floor) {
        (TransportKind::Kernel, _) => vec![admin::BPF, admin::TRANSPORT, admin::EXECUTOR],
        (TransportKind::Native, true) => vec![admin::TRANSPORT],
        (TransportKind::Native, false) => vec![admin::TRANSPORT, admin::EXECUTOR],
    };
    if args.generation.model.is_some() {
        expected.push(admin::MODEL);
    }
    let admin = AdminHook::start(args.admin_listen, &expected)?;
    let gpu_cfg = bgs_executor_gpu::GpuExecutorConfig {
        slots: args.slots.unwrap_or(DEFAULT_GPU_SLOTS),
        dispatcher: match args.dispatcher {
            DispatcherKind::Device => bgs_executor_gpu::Dispatcher::DeviceLaunch,
            DispatcherKind::Host => bgs_executor_gpu::Dispatcher::HostLaunch,
        },
        cuda_home: args.cuda_home.clone(),
        schedulers: args.gpu_schedulers,
        completion_wake: match args.gpu_completion_wake {
            GpuWakeKind::Paced | GpuWakeKind::Poll => bgs_executor_gpu::CompletionWake::Poll,
            GpuWakeKind::Interrupt => bgs_executor_gpu::CompletionWake::Interrupt,
        },
        ..Default::default()
    };
    let executor_kind = match args.executor {
        _ if args.floor => ExecutorKind::Cpu,
        ExecutorKind::Cpu => ExecutorKind::Cpu,
        ExecutorKind::Gpu => ExecutorKind::Gpu,
        ExecutorKind::Auto => match bgs_executor_gpu::probe(&gpu_cfg) {
            Ok(info) => {
                tracing::info!("executor auto: using GPU {}", info.name);
                ExecutorKind::Gpu
            }
            Err(e) => {
                tracing::info!("executor auto: no usable GPU ({e}); using the CPU executor");
                ExecutorKind::Cpu
            }
        },
    };
    let framer = FramerConfig {
        max_words: max_words(args),
        ..FramerConfig::default()
    };
    // Load the model before the port accepts anything: a connection is served from the
    // first moment the port accepts.
    let model = match &args.generation.model {
        Some(_) => Some(crate::llm::load(
            &args.generation,
            args.slots.unwrap_or(crate::llm::DEFAULT_SLOTS),
            &model_device(args, executor_kind),
        )?),
        None => None,
    };
    // With a model, the CPU executor's engine thread runs the step loop whichever device runs
    // the forward pass: for the transports it is the CPU executor (it holds streams, needs
    // cancel markers and rings the transport's waker; the GPU sends no replies itself).
    let executor_kind = if model.is_some() {
        ExecutorKind::Cpu
    } else {
        executor_kind
    };
    if model.is_some() {
        admin.up(admin::MODEL);
    }
    match args.transport {
        TransportKind::Native => {
            serve_native(args, framer, executor_kind, &gpu_cfg, model, &admin, user)
        }
        TransportKind::Kernel => {
            serve_kernel(args, framer, executor_kind, &gpu_cfg, model, &admin, user)
        }
    }
}

fn stats_every(args: &ServeArgs) -> Result<Option<Duration>> {
    match args.stats_every {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => bail!("--stats-every must be a positive number of seconds (got {s})"),
    }
}

/// From here on SIGINT/SIGTERM stop the transport's `run` (through its pipe, after the
/// `--shutdown-grace` period) instead of killing the process. The returned flag is set by the
/// same signals at once, so that start-up steps after this point (starting the executor: GPU
/// initialisation takes seconds) can see a stop that arrived before `run` and stop there.
fn install_signals(
    shutdown: &bgs_transport::ShutdownHandle,
    admin: &AdminHook,
    args: &ServeArgs,
) -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    admin.install_signals(shutdown, Duration::from_secs_f64(args.shutdown_grace))?;
    Ok(stop)
}

/// A stop signal arrived during start-up: stop what was started and exit cleanly.
/// `--user`: every privileged step is done (ports bound, BPF attached, io_uring set up, the
/// executor started and its devices opened); switch to the user before reporting ready, so a
/// server that answers `/readyz` 200 no longer runs as root.
fn drop_privileges(user: Option<&crate::privdrop::Target>) -> Result<()> {
    if let Some(t) = user {
        crate::privdrop::drop_to(t)?;
        tracing::info!(uid = t.uid(), gid = t.gid(), "dropped privileges");
    }
    Ok(())
}

fn stopped_during_startup(stop: &AtomicBool, executor: &mut Option<Executor>) -> Result<bool> {
    if !stop.load(Ordering::Relaxed) {
        return Ok(false);
    }
    stop_executor(executor.take())?;
    eprintln!("bgs: stopped during start-up");
    Ok(true)
}

/// The executor is up: hand its counters to the admin endpoints.
fn admin_executor(admin: &AdminHook, executor: Option<&Executor>) {
    match executor {
        Some(Executor::Cpu(e)) => admin.sources(|s| {
            s.executor = Some(e.stats().clone());
            s.slots = Some(e.slot_usage());
            s.slot_count = Some(e.slots());
        }),
        Some(Executor::Gpu(e)) => admin.sources(|s| s.slot_count = Some(e.slots())),
        Some(Executor::GpuLoop(_)) | None => {}
    }
    admin.up(admin::EXECUTOR);
}

/// How the transport wakes and stops the executor.
struct TransportHooks {
    waker: Option<bgs_executor::Waker>,
    external_wait: Option<bgs_executor::ExternalWait>,
    shutdown: bgs_transport::ShutdownHandle,
}

fn start_executor(
    args: &ServeArgs,
    kind: ExecutorKind,
    gpu_cfg: &bgs_executor_gpu::GpuExecutorConfig,
    region: &Arc<RingRegion>,
    hooks: TransportHooks,
    model: Option<crate::llm::Loaded>,
) -> Result<Executor> {
    let TransportHooks {
        waker,
        external_wait,
        shutdown,
    } = hooks;
    if let Some(m) = model {
        let engine = match m.engine {
            crate::llm::LoadedEngine::Host(e) => e,
            crate::llm::LoadedEngine::Device(model, lcfg) => {
                // The GPU serves the rings alone; the host thread left only watches and wakes
                // the transport.
                let waker = waker.map(|w| w as Arc<dyn Fn() + Send + Sync>);
                return Ok(Executor::GpuLoop(Box::new(
                    bgs_model_gpu::GpuGenExecutor::start(*model, region.clone(), &lcfg, waker)
                        .context("--gpu-step-loop device")?,
                )));
            }
        };
        // One thread runs the generation engine: every live sequence in one batch per step
        // (one-shot ops are answered inline between steps).
        let ecfg = CpuExecutorConfig {
            external_wait,
            ..CpuExecutorConfig::default()
        };
        return Ok(Executor::Cpu(CpuExecutor::start_engines(
            region.clone(),
            &ecfg,
            waker,
            vec![engine],
        )?));
    }
    if kind == ExecutorKind::Gpu {
        // A CUDA error stops the server from accepting work instead of leaving it hanging.
        let mut cfg = gpu_cfg.clone();
        // The completion notifier (interrupt mode) rings the transport's waker and sleeps,
        // when idle, the way the transport lets executors sleep.
        cfg.waker = waker.map(bgs_executor_gpu::CompletionWaker);
        cfg.idle_wait = external_wait.map(bgs_executor_gpu::IdleWait);
        cfg.on_error = Some(bgs_executor_gpu::ErrorHook(Arc::new(move |msg: &str| {
            eprintln!("bgs: GPU executor failed: {msg}; shutting down");
            shutdown.shutdown();
        })));
        return Ok(Executor::Gpu(
            bgs_executor_gpu::GpuExecutor::start(region.clone(), &cfg).context("--executor gpu")?,
        ));
    }
    let mut ecfg = CpuExecutorConfig {
        external_wait,
        ..CpuExecutorConfig::default()
    };
    if let Some(n) = args.slots {
        ecfg.slots = n;
    }
    Ok(Executor::Cpu(CpuExecutor::start(
        region.clone(),
        &ecfg,
        waker,
    )?))
}

/// The API's view of a loaded model: its text codec and name.
type ApiCodec = (Arc<dyn bgs_api::TextCodec>, String);

fn api_codec(model: Option<&crate::llm::Loaded>) -> Option<ApiCodec> {
    model.map(|m| {
        (
            m.codec.clone() as Arc<dyn bgs_api::TextCodec>,
            m.name.clone(),
        )
    })
}

/// The payload limit: `--max-words`, else 64, or a ring slot's 256 words with a model.
fn max_words(args: &ServeArgs) -> u32 {
    args.max_words
        .unwrap_or(if args.generation.model.is_some() {
            SLOT_WORDS as u32
        } else {
            bgs_protocol::wire::DEFAULT_MAX_WORDS
        })
}

/// With `--model` and `--api-listen` not `off`: the OpenAI-compatible API, sending each
/// request to the binary listener at `binary` (loopback when it listens on all interfaces).
fn start_api(
    args: &ServeArgs,
    binary: SocketAddr,
    codec: Option<ApiCodec>,
) -> Result<Option<bgs_api::ApiHandle>> {
    let (Some(model), Some(codec)) = (&args.generation.model, codec) else {
        return Ok(None);
    };
    if args.api_listen == "off" {
        return Ok(None);
    }
    let listen =
        args::listen_addr(&args.api_listen).map_err(|e| anyhow::anyhow!("--api-listen: {e}"))?;
    let mut backend = binary;
    if backend.ip().is_unspecified() {
        backend.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let (codec, name) = codec;
    let cfg = bgs_api::ApiConfig {
        model: name,
        backend,
        max_prompt_tokens: max_words(args) as usize,
        default_completion_tokens: 16,
        default_chat_tokens: 512,
    };
    let api = bgs_api::spawn(listen, cfg, codec, 2)
        .with_context(|| format!("starting the API on {listen} (--api-listen)"))?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "bgs: OpenAI-compatible API on http://{} (model {}, from {})",
        api.addr(),
        model.display(),
        backend
    )?;
    out.flush()?;
    Ok(Some(api))
}

/// Where the forward pass of `--model` runs: on the GPU with `--executor gpu` (or `auto`
/// finding one).
fn model_device(args: &ServeArgs, kind: ExecutorKind) -> crate::llm::ModelDevice {
    // The device step loop has run on an H200 with the native transport (binary and HTTP),
    // the kernel transport's reply loop and the OpenAI API (bench/results/
    // 20261201-gpu-step-loop-paths). With `--reply executor-sqe` the transport's reply stage
    // serves its streams as it serves the host engine's: the loop's monitor rings the
    // stage's eventfd and the completion ring's futex once per step that published frames.
    match kind {
        ExecutorKind::Gpu => crate::llm::ModelDevice::Gpu {
            device: 0,
            cuda_home: args.cuda_home.clone(),
            step_loop_on_device: args.gpu_step_loop == StepLoopKind::Device,
            step_loop_check: args.gpu_step_loop_check,
        },
        ExecutorKind::Cpu | ExecutorKind::Auto => crate::llm::ModelDevice::Cpu,
    }
}

fn announce(
    args: &ServeArgs,
    addr: SocketAddr,
    transport: &str,
    executor: Option<&Executor>,
    generation: Option<&str>,
) -> Result<()> {
    let what = match executor {
        Some(Executor::Cpu(_) | Executor::GpuLoop(_)) if args.generation.model.is_some() => {
            format!(
                "generation: {} live sequences, {}",
                args.slots.unwrap_or(crate::llm::DEFAULT_SLOTS),
                generation.unwrap_or("")
            )
        }
        Some(Executor::Cpu(e)) => format!("executor cpu, {} slots", e.slots()),
        Some(Executor::Gpu(e)) => format!("executor gpu, {} slots", e.slots()),
        Some(Executor::GpuLoop(_)) => "generation, step loop on the GPU".into(),
        None => "floor mode (echo answered by the transport)".into(),
    };
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "bgs: listening on {addr} (transport {transport}, {what})"
    )?;
    out.flush()?;
    Ok(())
}

fn stop_executor(executor: Option<Executor>) -> Result<()> {
    match executor {
        Some(Executor::Gpu(e)) => {
            let st = e
                .shutdown_with_stats()
                .context("stopping the GPU executor")?;
            if st.notifier_waits + st.notifier_idle_sleeps > 0 {
                eprintln!(
                    "bgs: GPU completion notifier: {} device waits, {} wakes, {} timed out, {} idle sleeps",
                    st.notifier_waits,
                    st.notifier_wakes,
                    st.notifier_timeouts,
                    st.notifier_idle_sleeps
                );
            }
        }
        Some(Executor::GpuLoop(e)) => {
            let (_model, st) = e.shutdown().context("stopping the GPU step loop")?;
            let per_step = |v: u64| v as f64 / st.steps.max(1) as f64;
            eprintln!(
                "bgs: GPU step loop: {} requests, {} admitted, {} refused, {} cancels, {} steps \
                 ({} tokens; per step: round {} us, planning {} us, packing {} us, graphs {} us, \
                 finishing {} us, publishing {} us), {} frames, \
                 {} credit stalls, per step: {:.1} running (left out: {:.1} for credit, {:.1} with \
                 a frame owed), {:.1} waiting, {:.1} ended with the final frame owed, {:.1} in \
                 the table; {} refused for want of a credit stream; {} completion-ring stalls, \
                 {} live, {} free KV blocks, {} monitor looks",
                st.requests,
                st.admitted,
                st.refused,
                st.cancels,
                st.steps,
                st.step_tokens,
                st.mean_round_ns / 1000,
                st.mean_plan_ns / 1000,
                st.mean_pack_ns / 1000,
                st.mean_step_ns / 1000,
                st.mean_finish_ns / 1000,
                st.mean_publish_ns / 1000,
                st.frames,
                st.credit_stalls,
                per_step(st.running_seen),
                per_step(st.credit_waits),
                per_step(st.pending_waits),
                per_step(st.waiting_seen),
                per_step(st.ended_seen),
                per_step(st.live_seen),
                st.refused_no_stream,
                st.ring_full,
                st.live,
                st.free_blocks,
                st.monitor_looks,
            );
        }
        Some(Executor::Cpu(e)) => {
            let es = e.stats().clone();
            e.shutdown();
            let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            eprintln!(
                "bgs: executor: {} requests, {} completions, {} completion-ring stalls, {} sleeps",
                n(&es.requests),
                n(&es.completions),
                n(&es.completion_stalls),
                n(&es.sleeps),
            );
        }
        None => {}
    }
    Ok(())
}

fn serve_native(
    args: &ServeArgs,
    framer: FramerConfig,
    executor_kind: ExecutorKind,
    gpu_cfg: &bgs_executor_gpu::GpuExecutorConfig,
    mut model: Option<crate::llm::Loaded>,
    admin: &AdminHook,
    user: Option<&crate::privdrop::Target>,
) -> Result<()> {
    let codec = api_codec(model.as_ref());
    let generation_on = model.as_ref().map(|m| m.forward.clone());
    let cfg = NativeConfig {
        listen: args.listen,
        max_connections: args.max_connections,
        limits: ConnLimits {
            max_inflight: args.max_inflight,
            ..ConnLimits::default()
        },
        framer,
        poll_interval: Duration::from_micros(args.poll_us),
        // Generation wakes the transport once per step that published frames (the CPU
        // executor's engine thread on either device, the GPU step loop's monitor), and the
        // GPU executor's completion notifier once per completion: the timed wait is only a
        // safety net for them. Polling every `--poll-us` while a stream is outstanding (for
        // seconds) cost 2.4x the transport CPU per request at the H200's 1.8 ms step
        // (`examples/stream_cost.rs`: 945 against 414 us). One-shot requests on the CPU
        // executor keep the short timed wait: they finish within it. (With the tiny test
        // model's 33 us steps on a one-CPU server the poll's batching is cheaper: docs/cost.md,
        // "Streams".)
        wake_timeout: (args.generation.model.is_some()
            || args.gpu_completion_wake == GpuWakeKind::Interrupt)
            .then_some(EXECUTOR_WAKE_TIMEOUT),
        floor: args.floor,
        stats_every: stats_every(args)?,
        // The GPU executor holds no streams (it skips cancel markers): markers would only
        // cost it a ring slot per closed connection.
        cancel_markers: executor_kind != ExecutorKind::Gpu,
        stream_coalesce: Duration::from_micros(args.stream_coalesce_us),
        // Only an executor that cannot wake the transport needs its looks paced: the one-shot
        // GPU executor without its notifier.
        pace_completions: executor_kind == ExecutorKind::Gpu
            && args.generation.model.is_none()
            && args.gpu_completion_wake == GpuWakeKind::Paced,
        ..NativeConfig::default()
    };
    let region = if args.floor {
        None
    } else {
        // Completions can outnumber requests (streamed tokens); twice the request ring keeps
        // the executor from stalling on a transport that is busy writing.
        let ring = RingConfig {
            request_slots: args.ring_slots,
            completion_slots: args
                .completion_slots
                .unwrap_or_else(|| args.ring_slots.saturating_mul(2)),
        };
        Some(Arc::new(
            RingRegion::new(ring).context("creating the shared rings")?,
        ))
    };
    let mut transport = NativeTransport::bind(cfg, region.clone())
        .with_context(|| format!("binding {}", args.listen))?;
    let stop = install_signals(&transport.shutdown_handle(), admin, args)?;
    admin.sources(|s| (s.rings, s.requests) = (region.clone(), Some(transport.enable_metrics())));
    admin.up(admin::TRANSPORT);
    let mut executor = match &region {
        Some(region) => Some(start_executor(
            args,
            executor_kind,
            gpu_cfg,
            region,
            TransportHooks {
                waker: Some(transport.waker()),
                external_wait: None,
                shutdown: transport.shutdown_handle(),
            },
            model.take(),
        )?),
        None => None,
    };
    if stopped_during_startup(&stop, &mut executor)? {
        return Ok(());
    }
    drop_privileges(user)?;
    admin_executor(admin, executor.as_ref());
    announce(
        args,
        transport.local_addr(),
        "native",
        executor.as_ref(),
        generation_on.as_deref(),
    )?;
    let api = start_api(args, transport.local_addr(), codec)?;
    let stats = transport.run().context("transport failed");
    admin.stopping();
    drop(api);
    let stats = stats?;
    stop_executor(executor)?;
    eprintln!("bgs: shut down\n{stats}");
    Ok(())
}

fn serve_kernel(
    args: &ServeArgs,
    framer: FramerConfig,
    executor_kind: ExecutorKind,
    gpu_cfg: &bgs_executor_gpu::GpuExecutorConfig,
    model: Option<crate::llm::Loaded>,
    admin: &AdminHook,
    user: Option<&crate::privdrop::Target>,
) -> Result<()> {
    use bgs_transport::kernel::{KernelConfig, KernelTransport, ReplyMode, RingOwner};
    let codec = api_codec(model.as_ref());
    let generation_on = model.as_ref().map(|m| m.forward.clone());
    // The GPU writes SEND SQEs itself (docs/kernel.md, "GPU-written SENDs"). Both dispatchers
    // publish through the same publish kernel, so `--dispatcher host` sends the same way; and
    // an executor that never sends leaves every reply to the stage, which the turn allows.
    let gpu_sends = executor_kind == ExecutorKind::Gpu && args.reply == ReplyKind::ExecutorSqe;
    let gpu_interrupt = executor_kind == ExecutorKind::Gpu
        && args.reply == ReplyKind::Loop
        && args.gpu_completion_wake == GpuWakeKind::Interrupt;
    let reply = match args.reply {
        ReplyKind::Loop => ReplyMode::Loop {
            timer: Duration::from_micros(args.reply_timer_us),
        },
        ReplyKind::ExecutorSqe => ReplyMode::ExecutorSqe {
            watchdog: Duration::from_micros(args.watchdog_us),
            sqpoll_idle_ms: args.sqpoll_idle_ms,
            sqpoll_cpu: args.sqpoll_cpu,
            sqpoll_above: args.sqpoll_above,
        },
    };
    let cfg = KernelConfig {
        listen: args.listen,
        reply,
        framer,
        // The CPU executor writes the loop's eventfd; so does the GPU executor's completion
        // notifier, for every completion (hence the long timeout instead of the timer).
        executor_wakes: executor_kind == ExecutorKind::Cpu || gpu_interrupt,
        // Generation wakes the loop once per step that published frames (the engine thread
        // on either device, the GPU step loop's monitor), so while streams are outstanding
        // the loop's timer is only a safety net, as for the native transport: polling every
        // `--reply-timer-us` for a stream's whole life cost the loop 555 us of CPU per
        // request in the paper workload on the H200, against native's 291 with the wake-up
        // (bench/results/20261201-gpu-step-loop-paths; `examples/stream_cost.rs
        // --transports native,kernel` measures both waits without a GPU).
        wake_timeout: (model.is_some() || gpu_interrupt).then_some(EXECUTOR_WAKE_TIMEOUT),
        completion_watch: executor_kind == ExecutorKind::Gpu
            && args.gpu_completion_wake == GpuWakeKind::Paced,
        stats_every: stats_every(args)?,
        max_connections: u32::try_from(args.max_connections).unwrap_or(u32::MAX),
        request_slots: args.ring_slots,
        // BPF answers busy into the completion ring as fast as segments arrive, in bursts
        // the reply stage drains a moment later: give it room for that regardless of how
        // small the request ring is (if both fill, the connection has to be reset).
        completion_slots: args
            .completion_slots
            .unwrap_or_else(|| args.ring_slots.saturating_mul(4).max(16384)),
        gpu_sends,
        limits: ConnLimits {
            max_inflight: args.max_inflight,
            ..ConnLimits::default()
        },
        // As for the native transport: the GPU executor holds no streams.
        cancel_markers: executor_kind != ExecutorKind::Gpu,
    };
    // With --user, the io_uring rings are created as that user (KernelTransport::bind_as).
    let ring_owner = user.map(|t| RingOwner {
        uid: t.uid(),
        gid: t.gid(),
    });
    let mut transport = match KernelTransport::bind_as(cfg, ring_owner) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            bail!(
                "binding {}: the address is already in use ({e})",
                args.listen
            )
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "starting the kernel transport on {} (it needs root, BPF and io_uring)",
                args.listen
            )));
        }
    };
    let stop = install_signals(&transport.shutdown_handle(), admin, args)?;
    let region = transport.region();
    admin.sources(|s| {
        s.rings = Some(region.clone());
        s.bpf = Some(transport.bpf_counters());
        s.open_connections = Some(transport.open_connections());
        s.requests = Some(transport.enable_metrics());
    });
    admin.up(admin::BPF);
    admin.up(admin::TRANSPORT);
    // The GPU holds raw addresses into the send table and its io_uring ring: they must live
    // until the executor has stopped, after `run` consumed the transport.
    let gpu_tx_owner = transport.gpu_tx_owner();
    let mut gpu_cfg = gpu_cfg.clone();
    gpu_cfg.tx = transport.gpu_tx();
    let mut executor = Some(start_executor(
        args,
        executor_kind,
        &gpu_cfg,
        &region,
        TransportHooks {
            waker: transport.waker(),
            external_wait: Some(transport.executor_wait()?),
            shutdown: transport.shutdown_handle(),
        },
        model,
    )?);
    if stopped_during_startup(&stop, &mut executor)? {
        return Ok(());
    }
    let executor = executor.context("the executor")?;
    drop_privileges(user)?;
    let mode = match args.reply {
        ReplyKind::Loop => "kernel, reply loop",
        ReplyKind::ExecutorSqe if gpu_sends => "kernel, reply executor-sqe, GPU-written sends",
        ReplyKind::ExecutorSqe => "kernel, reply executor-sqe",
    };
    admin_executor(admin, Some(&executor));
    announce(
        args,
        transport.local_addr(),
        mode,
        Some(&executor),
        generation_on.as_deref(),
    )?;
    let api = start_api(args, transport.local_addr(), codec)?;
    let stats = transport.run().context("transport failed");
    admin.stopping();
    drop(api);
    let stats = stats?;
    let stopped = stop_executor(Some(executor));
    if stopped.is_err() {
        // A GPU that did not stop may still touch the table and the ring: keep them mapped.
        std::mem::forget(gpu_tx_owner);
    } else {
        drop(gpu_tx_owner);
    }
    stopped?;
    eprintln!("bgs: shut down\n{stats}");
    Ok(())
}
