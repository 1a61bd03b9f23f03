//! The GPU executor: a resident dispatcher that replays CUDA graphs over the shared rings.
//!
//! - Libraries are loaded at run time (cudarc with dynamic loading, CUDA 13): one binary runs
//!   with or without a GPU; without a driver, a device or a library, [`probe`] and
//!   [`GpuExecutor::start`] return a [`GpuError`] naming what is missing.
//! - Kernels (`src/kernels.cu`, including the generated `include/bgs_ring.h`, `bgs_protocol.h`
//!   and `bgs_gpu.h`) are compiled by NVRTC for the device's architecture and linked with
//!   `libcudadevrt.a` by nvJitLink; the cubin is cached on disk.
//! - The ring region is registered with `cuMemHostRegister`; the GPU consumes requests and
//!   publishes completions with the Vyukov protocol of `docs/ring.md` at system scope.
//! - [`Dispatcher::DeviceLaunch`]: a device-launched scheduler graph polls the request ring,
//!   assigns each request to a free slot, launches that slot's work graph fire-and-forget and
//!   tail-relaunches itself before the 120-launch limit. [`Dispatcher::HostLaunch`]: a host
//!   thread does the same with `cuGraphLaunch`.
//!
//! `docs/gpu.md` describes the design and the measurements.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bgs_ring::RingRegion;

pub mod c_header;
pub mod compile;
pub mod device;
mod exec;
pub mod layout;
pub mod libs;
pub mod plan;
pub mod tool_checks;

/// How requests are noticed and launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatcher {
    /// A device-launched scheduler graph polls the ring and launches work graphs.
    DeviceLaunch,
    /// A host thread polls the ring and launches graphs from the host (for comparison).
    HostLaunch,
}

/// Called once, from the executor's monitor thread, when the executor fails at run time (a
/// CUDA error, a failed device-side launch, the scheduler gone). A transport can stop
/// accepting work from here. After a failure the executor answers every request still in
/// the ring with status Internal, so clients do not hang.
#[derive(Clone)]
pub struct ErrorHook(pub Arc<dyn Fn(&str) + Send + Sync>);

impl std::fmt::Debug for ErrorHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ErrorHook")
    }
}

/// How the transport learns that the GPU published a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompletionWake {
    /// Nobody wakes it: the transport polls the completion ring on a short timer while
    /// requests are outstanding.
    #[default]
    Poll,
    /// The completion notifier (docs/gpu.md): a host thread sleeps in `cuEventSynchronize`
    /// behind a device-side wait for the next completion and rings the transport's waker.
    Interrupt,
}

impl std::str::FromStr for CompletionWake {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "poll" => Ok(CompletionWake::Poll),
            "interrupt" => Ok(CompletionWake::Interrupt),
            other => Err(format!(
                "unknown completion wake mode {other:?} (expected poll or interrupt)"
            )),
        }
    }
}

/// The transport's waker: called (from the notifier thread) after the GPU published a
/// completion while the transport sleeps. The same interface the CPU executor rings.
#[derive(Clone)]
pub struct CompletionWaker(pub Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for CompletionWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompletionWaker")
    }
}

/// How the idle notifier sleeps when producers cannot wake the request ring's futex (the
/// kernel transport's BPF rings a doorbell descriptor instead): called with a timeout after
/// the notifier registered as a request-ring sleeper.
#[derive(Clone)]
pub struct IdleWait(pub Arc<dyn Fn(Duration) + Send + Sync>);

impl std::fmt::Debug for IdleWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IdleWait")
    }
}

/// Settings of the GPU executor.
#[derive(Debug, Clone)]
pub struct GpuExecutorConfig {
    /// Work-graph slots (requests executing at once), 1..=64.
    pub slots: usize,
    /// Dispatcher kind.
    pub dispatcher: Dispatcher,
    /// Device launch: resident schedulers, each owning a contiguous share of the slots and
    /// claiming from the same request ring (`BGS_GPU_SCHEDULERS` overrides). 0 (the default):
    /// one per 8 slots, at most 2 — on the H200 two were faster than one at 16 and 32 slots
    /// and four contended on the head CAS (docs/gpu.md).
    pub schedulers: usize,
    /// CUDA device ordinal.
    pub device: usize,
    /// Where CUDA libraries live (else `CUDA_HOME`, `/usr/local/cuda`, the loader's path).
    pub cuda_home: Option<PathBuf>,
    /// Kernel cache directory (else `$XDG_CACHE_HOME/bgs`, `~/.cache/bgs`).
    pub cache_dir: Option<PathBuf>,
    /// Nothing but this executor pushes into the region's completion ring (true for both
    /// transports: the kernel transport's BPF answers go to a side ring). The publish kernels
    /// then claim completion positions with device-memory atomics instead of a compare-and-swap
    /// on the host word (one PCIe round trip less per request). Set false if another producer
    /// shares the ring.
    pub sole_completion_producer: bool,
    /// Called when the executor fails at run time.
    pub on_error: Option<ErrorHook>,
    /// The kernel transport's GPU send table and io_uring ring (`--reply executor-sqe`): when
    /// set, the GPU puts replies on the wire itself (docs/gpu.md, "GPU-written SENDs") and
    /// hands the rest to the host's reply stage through the completion ring.
    pub tx: Option<bgs_ring::tx::TxDesc>,
    /// How the transport learns of completions (`bgs serve --gpu-completion-wake`). With
    /// [`CompletionWake::Interrupt`] and a `waker`, the executor runs the completion notifier;
    /// without a waker (executor-sqe replies) there is nobody to wake and it runs none.
    pub completion_wake: CompletionWake,
    /// The transport's waker (for the notifier).
    pub waker: Option<CompletionWaker>,
    /// How the idle notifier sleeps (else on the request ring's futex).
    pub idle_wait: Option<IdleWait>,
}

impl Default for GpuExecutorConfig {
    fn default() -> Self {
        GpuExecutorConfig {
            slots: 16,
            dispatcher: Dispatcher::DeviceLaunch,
            schedulers: 0,
            device: 0,
            cuda_home: None,
            cache_dir: None,
            on_error: None,
            sole_completion_producer: true,
            tx: None,
            completion_wake: CompletionWake::Poll,
            waker: None,
            idle_wait: None,
        }
    }
}

/// Why the GPU executor cannot run (or stopped).
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The NVIDIA driver library could not be loaded.
    #[error("no NVIDIA driver: {0}")]
    MissingDriver(String),
    /// The driver loaded but there is no usable device.
    #[error("no usable CUDA device: {0}")]
    NoDevice(String),
    /// A CUDA library is missing.
    #[error("missing {what}: {detail}")]
    MissingLibrary {
        /// Which library.
        what: String,
        /// Where it was looked for.
        detail: String,
    },
    /// A CUDA call failed; `name` is the CUDA error name (e.g. `CUDA_ERROR_ILLEGAL_ADDRESS`).
    #[error("{what} failed: {name}")]
    Cuda {
        /// The call.
        what: String,
        /// The error's name.
        name: String,
    },
    /// Kernel compilation or linking failed.
    #[error("kernel build failed: {0}")]
    Compile(String),
    /// Invalid settings.
    #[error("invalid GPU executor settings: {0}")]
    Config(String),
    /// The executor failed while running.
    #[error("GPU executor failed: {0}")]
    Failed(String),
}

/// What `probe` found.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Device name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Driver version (e.g. 13000).
    pub driver_version: i32,
    /// `CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED`: GPU atomics on host memory are
    /// atomic with respect to CPU atomics.
    pub host_native_atomics: bool,
    /// Where each library came from.
    pub libraries: Vec<(String, String)>,
    /// `libcudadevrt.a`.
    pub cudadevrt: PathBuf,
}

/// Check that a usable GPU and the CUDA libraries are present.
pub fn probe(cfg: &GpuExecutorConfig) -> Result<DeviceInfo, GpuError> {
    exec::probe(cfg)
}

/// Counters of a running executor.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GpuStats {
    /// Scheduler executions (device launch) so far, read at shutdown.
    pub scheduler_executions: u64,
    /// Requests launched (device scheduler or host thread).
    pub dispatched: u64,
    /// Device scheduler: head claims (one CAS each, claiming one or more requests).
    pub claims: u64,
    /// Device scheduler: launches retried because the slot's graph was still finishing.
    pub launch_retries: u64,
    /// Times a publish found the completion ring full.
    pub completion_full: u64,
    /// Repeat-chain launches that failed (those requests were answered Internal).
    pub chain_errors: u64,
    /// Completion notifier: device-side waits launched.
    pub notifier_waits: u64,
    /// Completion notifier: waits that ended with a new completion.
    pub notifier_wakes: u64,
    /// Completion notifier: times it rang the transport's waker (the transport slept with
    /// completions to reap).
    pub notifier_rings: u64,
    /// Completion notifier: waits that ended at their time bound with nothing new.
    pub notifier_timeouts: u64,
    /// Completion notifier: times it slept on the request ring (nothing outstanding).
    pub notifier_idle_sleeps: u64,
    /// Kernel cubin came from the cache.
    pub cache_hit: bool,
    /// Seconds spent in `start`.
    pub start_seconds: f64,
}

/// The running GPU executor.
#[derive(Debug)]
pub struct GpuExecutor {
    slots: usize,
    inner: exec::Running,
}

impl GpuExecutor {
    /// Start the dispatcher over `region`.
    pub fn start(region: Arc<RingRegion>, cfg: &GpuExecutorConfig) -> Result<Self, GpuError> {
        if cfg.slots == 0 || cfg.slots > layout::MAX_SLOTS {
            return Err(GpuError::Config(format!(
                "slots must be 1..={} (got {})",
                layout::MAX_SLOTS,
                cfg.slots
            )));
        }
        let inner = exec::Running::start(region, cfg)?;
        Ok(GpuExecutor {
            slots: cfg.slots,
            inner,
        })
    }

    /// Slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The device in use.
    pub fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }

    /// The run-time failure, if the executor has failed (it then answers Internal).
    pub fn error(&self) -> Option<String> {
        self.inner.error()
    }

    /// Counters so far (scheduler counters are read at shutdown).
    pub fn stats(&self) -> GpuStats {
        self.inner.stats()
    }

    /// Stop the dispatcher and release the device. Returns the run-time error, if any.
    pub fn shutdown(self) -> Result<(), GpuError> {
        self.inner.shutdown().map(|_| ())
    }

    /// [`GpuExecutor::shutdown`], returning the final counters.
    pub fn shutdown_with_stats(self) -> Result<GpuStats, GpuError> {
        self.inner.shutdown()
    }
}
