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

/// Transports.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum TransportKind {
    /// One thread, timed epoll, nonblocking reads and writes.
    Native,
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
    /// Longest epoll wait while requests are outstanding, in microseconds.
    #[arg(long, default_value_t = 100)]
    pub poll_us: u64,
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
    if args.max_inflight == 0 || args.max_connections == 0 {
        bail!("--max-inflight and --max-connections must be at least 1");
    }
    if let Some(list) = &args.cpus {
        crate::affinity::pin(list)?;
    }
    if args.slots == Some(0) {
        bail!("--slots must be at least 1");
    }
    let gpu_cfg = bgs_executor_gpu::GpuExecutorConfig {
        slots: args.slots.unwrap_or(16),
        dispatcher: match args.dispatcher {
            DispatcherKind::Device => bgs_executor_gpu::Dispatcher::DeviceLaunch,
            DispatcherKind::Host => bgs_executor_gpu::Dispatcher::HostLaunch,
        },
        cuda_home: args.cuda_home.clone(),
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
    let cfg = NativeConfig {
        listen: args.listen,
        max_connections: args.max_connections,
        limits: ConnLimits {
            max_inflight: args.max_inflight,
            ..ConnLimits::default()
        },
        framer: FramerConfig {
            max_words: args.max_words,
            ..FramerConfig::default()
        },
        poll_interval: Duration::from_micros(args.poll_us),
        floor: args.floor,
        ..NativeConfig::default()
    };
    let region = if args.floor {
        None
    } else {
        // Completions can outnumber requests (streamed tokens); twice the request ring keeps
        // the executor from stalling on a transport that is busy writing.
        let ring = RingConfig {
            request_slots: args.ring_slots,
            completion_slots: args.ring_slots.saturating_mul(2),
        };
        Some(Arc::new(
            RingRegion::new(ring).context("creating the shared rings")?,
        ))
    };
    let transport = NativeTransport::bind(cfg, region.clone())
        .with_context(|| format!("binding {}", args.listen))?;
    let shutdown = transport.shutdown_handle();
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::low_level::pipe::register(sig, shutdown.signal_pipe()?)
            .context("installing signal handlers")?;
    }
    let executor = match &region {
        Some(region) if executor_kind == ExecutorKind::Cpu => {
            let mut ecfg = CpuExecutorConfig::default();
            if let Some(n) = args.slots {
                ecfg.slots = n;
            }
            Some(Executor::Cpu(CpuExecutor::start(
                region.clone(),
                &ecfg,
                Some(transport.waker()),
            )?))
        }
        Some(region) => Some(Executor::Gpu(
            bgs_executor_gpu::GpuExecutor::start(region.clone(), &gpu_cfg)
                .context("--executor gpu")?,
        )),
        None => None,
    };
    let addr = transport.local_addr();
    let what = match &executor {
        Some(Executor::Cpu(e)) => format!("executor cpu, {} slots", e.slots()),
        Some(Executor::Gpu(e)) => format!("executor gpu, {} slots", e.slots()),
        None => "floor mode (echo answered by the transport)".into(),
    };
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "bgs: listening on {addr} (transport native, {what})")?;
        out.flush()?;
    }
    let stats = transport.run().context("transport failed")?;
    if let Some(Executor::Gpu(e)) = executor {
        e.shutdown().context("stopping the GPU executor")?;
    } else if let Some(Executor::Cpu(e)) = executor {
        let es = e.stats().clone();
        e.shutdown();
        eprintln!(
            "bgs: executor: {} requests, {} completions, {} completion-ring stalls, {} sleeps",
            es.requests.load(std::sync::atomic::Ordering::Relaxed),
            es.completions.load(std::sync::atomic::Ordering::Relaxed),
            es.completion_stalls
                .load(std::sync::atomic::Ordering::Relaxed),
            es.sleeps.load(std::sync::atomic::Ordering::Relaxed),
        );
    }
    eprintln!("bgs: shut down\n{stats}");
    Ok(())
}
