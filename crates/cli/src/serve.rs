//! `bgs serve`: bind, start the executor, run the transport until SIGINT/SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bgs_executor::{CpuExecutor, CpuExecutorConfig};
use bgs_protocol::FramerConfig;
use bgs_ring::{RingConfig, RingRegion, SLOT_WORDS};
use bgs_transport::conn::ConnLimits;
use bgs_transport::{NativeConfig, NativeTransport};
use clap::ValueEnum;

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

enum Executor {
    Cpu(CpuExecutor),
    Gpu(bgs_executor_gpu::GpuExecutor),
}

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on (port 0 picks a free port; the chosen address is printed).
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: SocketAddr,
    /// Transport.
    #[arg(long, value_enum, default_value = "native")]
    pub transport: TransportKind,
    /// Executor.
    #[arg(long, value_enum, default_value = "cpu")]
    pub executor: ExecutorKind,
    /// Executor slots (requests executing at once). Default: CPU count for the CPU executor,
    /// 16 for the GPU executor.
    #[arg(long)]
    pub slots: Option<usize>,
    /// GPU dispatcher kind.
    #[arg(long, value_enum, default_value = "device")]
    pub dispatcher: DispatcherKind,
    /// Directory holding the CUDA libraries (else CUDA_HOME, /usr/local/cuda, the loader's path).
    #[arg(long)]
    pub cuda_home: Option<std::path::PathBuf>,
    /// GPU executor, device dispatcher: resident scheduler warps, each owning a share of the
    /// slots (0: one per 8 slots, at most 2).
    #[arg(long, default_value_t = 0)]
    pub gpu_schedulers: usize,
    /// Floor mode: the transport answers echo itself, without ring or executor.
    #[arg(long)]
    pub floor: bool,
    /// Largest payload in 32-bit words.
    #[arg(long, default_value_t = bgs_protocol::wire::DEFAULT_MAX_WORDS)]
    pub max_words: u32,
    /// Most open connections.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,
    /// Most requests in flight per connection; reading pauses beyond it.
    #[arg(long, default_value_t = 64)]
    pub max_inflight: usize,
    /// Request ring slots (power of two); admission refuses with busy when it is full.
    #[arg(long, default_value_t = 4096)]
    pub ring_slots: u32,
    /// Pin the server (all its threads) to these CPUs (e.g. `0` or `0-1`).
    #[arg(long)]
    pub cpus: Option<String>,
    /// Kernel transport reply path. `loop`: a service thread reaps completions and submits
    /// SENDs. `executor-sqe`: SENDs go into an SQPOLL ring without system calls, written by
    /// the reply stage's thread (CPU executor) or, with `--executor gpu` (or `auto` finding a
    /// GPU), by the GPU itself for plain binary replies, through a second SQPOLL ring that
    /// shares the first one's kernel thread; the stage sends the rest (HTTP, closing and
    /// busy replies, and replies that are not yet their connection's turn).
    #[arg(long, value_enum, default_value = "loop")]
    pub reply: ReplyKind,
    /// Kernel transport, `--reply loop`: longest wait while replies are outstanding (us).
    #[arg(long, default_value_t = 60)]
    pub reply_timer_us: u64,
    /// Kernel transport, `--reply executor-sqe`: how often the watchdog checks whether the
    /// SQPOLL thread needs a wake-up (us).
    #[arg(long, default_value_t = 50)]
    pub watchdog_us: u64,
    /// Kernel transport, `--reply executor-sqe`: SQPOLL idle time before it sleeps (ms).
    /// The SQPOLL kernel thread spins while awake and its time counts as the server's.
    #[arg(long, default_value_t = 10)]
    pub sqpoll_idle_ms: u32,
    /// Kernel transport, `--reply executor-sqe`: pin the SQPOLL thread to this CPU (give it
    /// a core of its own: sharing one with the executor starves both).
    #[arg(long)]
    pub sqpoll_cpu: Option<u32>,
    /// Completion ring slots (power of two). Default: twice the request ring (native), four
    /// times it but at least 16384 (kernel: BPF answers busy into it in bursts).
    #[arg(long)]
    pub completion_slots: Option<u32>,
    /// Print the transport's counters to stderr every this many seconds (they are always
    /// printed at shutdown).
    #[arg(long)]
    pub stats_every: Option<f64>,
    /// Longest epoll wait while requests are outstanding, in microseconds.
    #[arg(long, default_value_t = 100)]
    pub poll_us: u64,
    /// Serve `/healthz`, `/readyz` and `/metrics` (Prometheus) over HTTP on this address
    /// (off by default; see docs/operations.md).
    #[arg(long)]
    pub admin_listen: Option<SocketAddr>,
    /// On SIGINT/SIGTERM, make `/readyz` answer 503 at once but keep serving this many
    /// seconds before stopping, so that a load balancer takes the server out first.
    #[arg(long, default_value_t = 0.0)]
    pub shutdown_grace: f64,
}

pub fn run(args: &ServeArgs) -> Result<()> {
    if args.max_words as usize > SLOT_WORDS {
        bail!(
            "--max-words {} is above the ring slot capacity of {SLOT_WORDS} words",
            args.max_words
        );
    }
    if !args.ring_slots.is_power_of_two() || args.ring_slots < 2 {
        bail!(
            "--ring-slots must be a power of two, at least 2 (got {})",
            args.ring_slots
        );
    }
    if let Some(n) = args.completion_slots
        && (!n.is_power_of_two() || n < 2)
    {
        bail!("--completion-slots must be a power of two, at least 2 (got {n})");
    }
    if args.max_inflight == 0 || args.max_connections == 0 {
        bail!("--max-inflight and --max-connections must be at least 1");
    }
    if let Some(list) = &args.cpus {
        crate::affinity::pin(list)?;
    }
    if args.slots == Some(0) {
        bail!("--slots must be at least 1");
    }
    if !(args.shutdown_grace.is_finite() && args.shutdown_grace >= 0.0) {
        bail!(
            "--shutdown-grace must be a number of seconds, 0 or more (got {})",
            args.shutdown_grace
        );
    }
    let admin = AdminHook::start(
        args.admin_listen,
        match (args.transport, args.floor) {
            (TransportKind::Kernel, _) => &[admin::BPF, admin::TRANSPORT, admin::EXECUTOR],
            (TransportKind::Native, true) => &[admin::TRANSPORT],
            (TransportKind::Native, false) => &[admin::TRANSPORT, admin::EXECUTOR],
        },
    )?;
    let gpu_cfg = bgs_executor_gpu::GpuExecutorConfig {
        slots: args.slots.unwrap_or(16),
        dispatcher: match args.dispatcher {
            DispatcherKind::Device => bgs_executor_gpu::Dispatcher::DeviceLaunch,
            DispatcherKind::Host => bgs_executor_gpu::Dispatcher::HostLaunch,
        },
        cuda_home: args.cuda_home.clone(),
        schedulers: args.gpu_schedulers,
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
        max_words: args.max_words,
        ..FramerConfig::default()
    };
    match args.transport {
        TransportKind::Native => serve_native(args, framer, executor_kind, &gpu_cfg, &admin),
        TransportKind::Kernel => serve_kernel(args, framer, executor_kind, &gpu_cfg, &admin),
    }
}

fn stats_every(args: &ServeArgs) -> Result<Option<Duration>> {
    match args.stats_every {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => bail!("--stats-every must be a positive number of seconds (got {s})"),
    }
}

fn install_signals(
    shutdown: &bgs_transport::ShutdownHandle,
    admin: &AdminHook,
    args: &ServeArgs,
) -> Result<()> {
    admin.install_signals(shutdown, Duration::from_secs_f64(args.shutdown_grace))
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
        None => {}
    }
    admin.up(admin::EXECUTOR);
}

fn start_executor(
    args: &ServeArgs,
    kind: ExecutorKind,
    gpu_cfg: &bgs_executor_gpu::GpuExecutorConfig,
    region: &Arc<RingRegion>,
    waker: Option<bgs_executor::Waker>,
    external_wait: Option<bgs_executor::ExternalWait>,
    shutdown: bgs_transport::ShutdownHandle,
) -> Result<Executor> {
    if kind == ExecutorKind::Gpu {
        // A CUDA error stops the server from accepting work instead of leaving it hanging.
        let mut cfg = gpu_cfg.clone();
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

fn announce(addr: SocketAddr, transport: &str, executor: Option<&Executor>) -> Result<()> {
    let what = match executor {
        Some(Executor::Cpu(e)) => format!("executor cpu, {} slots", e.slots()),
        Some(Executor::Gpu(e)) => format!("executor gpu, {} slots", e.slots()),
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
        Some(Executor::Gpu(e)) => e.shutdown().context("stopping the GPU executor")?,
        Some(Executor::Cpu(e)) => {
            let es = e.stats().clone();
            e.shutdown();
            let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
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
    admin: &AdminHook,
) -> Result<()> {
    let cfg = NativeConfig {
        listen: args.listen,
        max_connections: args.max_connections,
        limits: ConnLimits {
            max_inflight: args.max_inflight,
            ..ConnLimits::default()
        },
        framer,
        poll_interval: Duration::from_micros(args.poll_us),
        floor: args.floor,
        stats_every: stats_every(args)?,
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
    install_signals(&transport.shutdown_handle(), admin, args)?;
    admin.sources(|s| (s.rings, s.requests) = (region.clone(), Some(transport.enable_metrics())));
    admin.up(admin::TRANSPORT);
    let executor = match &region {
        Some(region) => Some(start_executor(
            args,
            executor_kind,
            gpu_cfg,
            region,
            Some(transport.waker()),
            None,
            transport.shutdown_handle(),
        )?),
        None => None,
    };
    admin_executor(admin, executor.as_ref());
    announce(transport.local_addr(), "native", executor.as_ref())?;
    let stats = transport.run().context("transport failed");
    admin.stopping();
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
    admin: &AdminHook,
) -> Result<()> {
    use bgs_transport::kernel::{KernelConfig, KernelTransport, ReplyMode};
    if args.floor {
        bail!("--floor is a mode of the native transport");
    }
    // The GPU writes SEND SQEs itself (docs/kernel.md, "GPU-written SENDs"). Both dispatchers
    // publish through the same publish kernel, so `--dispatcher host` sends the same way; and
    // an executor that never sends leaves every reply to the stage, which the turn allows.
    let gpu_sends = executor_kind == ExecutorKind::Gpu && args.reply == ReplyKind::ExecutorSqe;
    let reply = match args.reply {
        ReplyKind::Loop => ReplyMode::Loop {
            timer: Duration::from_micros(args.reply_timer_us),
        },
        ReplyKind::ExecutorSqe => ReplyMode::ExecutorSqe {
            watchdog: Duration::from_micros(args.watchdog_us),
            sqpoll_idle_ms: args.sqpoll_idle_ms,
            sqpoll_cpu: args.sqpoll_cpu,
        },
    };
    let cfg = KernelConfig {
        listen: args.listen,
        reply,
        framer,
        executor_wakes: executor_kind == ExecutorKind::Cpu,
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
    };
    let transport = KernelTransport::bind(cfg).with_context(|| {
        format!(
            "starting the kernel transport on {} (it needs root, BPF and io_uring)",
            args.listen
        )
    })?;
    install_signals(&transport.shutdown_handle(), admin, args)?;
    let region = transport.region();
    admin.sources(|s| {
        s.rings = Some(region.clone());
        s.bpf = Some(transport.bpf_counters());
        s.open_connections = Some(transport.open_connections());
    });
    admin.up(admin::BPF);
    admin.up(admin::TRANSPORT);
    // The GPU holds raw addresses into the send table and its io_uring ring: they must live
    // until the executor has stopped, after `run` consumed the transport.
    let gpu_tx_owner = transport.gpu_tx_owner();
    let mut gpu_cfg = gpu_cfg.clone();
    gpu_cfg.tx = transport.gpu_tx();
    let executor = start_executor(
        args,
        executor_kind,
        &gpu_cfg,
        &region,
        transport.waker(),
        Some(transport.executor_wait()?),
        transport.shutdown_handle(),
    )?;
    let mode = match args.reply {
        ReplyKind::Loop => "kernel, reply loop",
        ReplyKind::ExecutorSqe if gpu_sends => "kernel, reply executor-sqe, GPU-written sends",
        ReplyKind::ExecutorSqe => "kernel, reply executor-sqe",
    };
    admin_executor(admin, Some(&executor));
    announce(transport.local_addr(), mode, Some(&executor))?;
    let stats = transport.run().context("transport failed");
    admin.stopping();
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
