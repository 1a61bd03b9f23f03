//! Driver-level implementation: device set-up, graphs, dispatchers, monitor, shutdown.

use std::ffi::{CString, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bgs_protocol::Status;
use bgs_ring::{OP_CANCEL, RequestEntry, RingRegion, SLOT_WORDS};
use cudarc::cublas::sys as cublas;
use cudarc::cufft::sys as cufft;
use cudarc::driver::sys as cu;

use crate::compile;
use crate::layout::{
    Ctl, FUSED, FUSED_NONE, GpuSlot, MAX_SLOTS, REPEAT_BITS, STAGED, Sched, SlotCtl, Tx,
};
use crate::libs;
use crate::plan::{self, Compute, SlotTable};
use crate::{
    CompletionWake, CompletionWaker, DeviceInfo, Dispatcher, ErrorHook, GpuError,
    GpuExecutorConfig, GpuStats, IdleWait,
};

const DEVICE_LAUNCH_FLAG: u64 = 4; // CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH
const STREAM_NON_BLOCKING: u32 = 1;
const HOST_FLAGS: u32 = cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP;
const REGISTER_FLAGS: u32 = cu::CU_MEMHOSTREGISTER_PORTABLE | cu::CU_MEMHOSTREGISTER_DEVICEMAP;
const CUBLAS_WORKSPACE: usize = 1 << 20;
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the monitor looks for device-side failures. Failures are rare and answering the
/// remaining requests with Internal 100 ms later is prompt next to any client's timeout. Each
/// look is a wake-up, and on the H200 host a wake-up costs the monitor ~24 us of CPU whatever
/// it then does: 2.4 ms a second at 10 ms looks, 2.4 us per request at 1,000 req/s, 6-7% of a
/// one-shot request's server CPU (bench/results/20261202-lab-cost-kernel-vs-native-gpu-watch-
/// fast: unchanged when the stream query below went from every tenth look to every hundredth,
/// so the wake-up, not the query, is the cost; at 0.5 ms it woke 2,000 times a second,
/// docs/cost.md). Shutdown and failures on other threads unpark it at once, and in interrupt
/// mode the notifier sees a sticky context error in its `cuEventSynchronize` too.
const MONITOR_PERIOD: Duration = Duration::from_millis(100);
/// The monitor queries the scheduler's stream (a driver call) on every this many looks (once
/// a second); the error word (mapped host memory) it reads on every look. A context that
/// failed without the device scheduler noticing (it sets the error word on every abnormal end,
/// seen within 100 ms) is then noticed within a second, which is rare enough not to matter.
const STREAM_QUERY_EVERY: u32 = 10;
/// Longest device-side wait of the completion notifier: the kernel then returns so that the
/// host re-checks (shutdown, requests that were answered some other way) and relaunches.
const NOTIFY_BUDGET_NS: u64 = 2_000_000;
/// Longest sleep of the idle notifier on the request ring: a producer's wake-up ends it
/// early; the bound covers a doorbell the kernel transport's BPF rang while another thread
/// drained it, and shutdown with an external wait.
const NOTIFIER_IDLE: Duration = Duration::from_millis(20);
/// `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING`: `cuEventSynchronize` sleeps until the
/// GPU's interrupt instead of spinning.
const EVENT_FLAGS: u32 = 0x1 | 0x2;

use crate::device::check as ck;

fn ck_blas(r: cublas::cublasStatus_t, what: &str) -> Result<(), GpuError> {
    if r == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            what: what.to_string(),
            name: format!("{r:?}"),
        })
    }
}

fn ck_fft(r: cufft::cufftResult, what: &str) -> Result<(), GpuError> {
    if r == cufft::cufftResult::CUFFT_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            what: what.to_string(),
            name: format!("{r:?}"),
        })
    }
}

/// Name of a device-runtime `cudaError_t` reported by a kernel.
fn cuda_rt_error_name(e: u32) -> String {
    let name = match e {
        1 => "cudaErrorInvalidValue",
        2 => "cudaErrorMemoryAllocation",
        3 => "cudaErrorInitializationError",
        98 => "cudaErrorInvalidDeviceFunction",
        200 => "cudaErrorInvalidKernelImage",
        201 => "cudaErrorDeviceUninitialized",
        400 => "cudaErrorInvalidResourceHandle",
        700 => "cudaErrorIllegalAddress",
        701 => "cudaErrorLaunchOutOfResources",
        702 => "cudaErrorLaunchTimeout",
        719 => "cudaErrorLaunchFailure",
        801 => "cudaErrorNotSupported",
        900 => "cudaErrorStreamCaptureUnsupported",
        910 => "cudaErrorGraphExecUpdateFailure",
        _ => return format!("cudaError {e}"),
    };
    format!("{name} ({e})")
}

fn where_name(w: u32) -> &'static str {
    match w {
        1 => "scheduler launching a work graph",
        2 => "scheduler tail-relaunching itself",
        3 => "slot launching its repeat chain",
        4 => "slot launching its publish graph",
        _ => "device",
    }
}

/// Driver, device and libraries, ready to use.
struct Env {
    dev: cu::CUdevice,
    info: DeviceInfo,
    nvjitlink: String,
}

fn init(cfg: &GpuExecutorConfig) -> Result<Env, GpuError> {
    let d = crate::device::open(cfg.device)?;
    let (dirs, libraries) = crate::device::load_libraries(
        cfg.cuda_home.as_deref(),
        &[
            libs::CUBLASLT,
            libs::CUBLAS,
            libs::CUFFT,
            libs::NVRTC_BUILTINS,
            libs::NVRTC,
            libs::NVJITLINK,
        ],
    )?;
    let cudadevrt = libs::find_cudadevrt(&dirs, &libraries[4].1)?;
    let nvjitlink = libraries[5].1.clone();
    Ok(Env {
        dev: d.dev,
        info: DeviceInfo {
            name: d.name,
            compute_capability: d.compute_capability,
            driver_version: d.driver_version,
            host_native_atomics: d.host_native_atomics,
            libraries,
            cudadevrt,
        },
        nvjitlink,
    })
}

pub(crate) fn probe(cfg: &GpuExecutorConfig) -> Result<DeviceInfo, GpuError> {
    init(cfg).map(|e| e.info)
}

/// Build (or load from the cache) the linked cubin.
fn kernels(env: &Env, cfg: &GpuExecutorConfig) -> Result<(Vec<u8>, bool), GpuError> {
    let (major, minor) = env.info.compute_capability;
    let arch = format!("sm_{major}{minor}");
    let options = compile::nvrtc_options(major, minor);
    let versions = format!(
        "driver {} nvrtc {}",
        env.info.driver_version,
        compile::nvrtc_version()?
    );
    let key = compile::cache_key(&options, &env.info.name, &arch, &versions);
    let dir = compile::cache_dir(cfg.cache_dir.as_deref());
    if let Some(c) = dir.as_deref().and_then(|d| compile::cache_read(d, &key)) {
        return Ok((c, true));
    }
    let obj = compile::nvrtc_compile(&options)?;
    let linked = compile::nvjitlink(&env.nvjitlink, &arch, &obj, &env.info.cudadevrt)?;
    if let Some(d) = dir.as_deref() {
        compile::cache_write(d, &key, &linked);
    }
    Ok((linked, false))
}

/// Raw CUDA handles and memory, owned by the executor.
struct Device {
    ctx: cu::CUcontext,
    dev: cu::CUdevice,
    module: cu::CUmodule,
    region_host: *mut c_void,
    region_dev: u64,
    ctl_host: *mut Ctl,
    ctl_dev: u64,
    /// Host mode: mapped host memory; device mode: null.
    slot_ctl_host: *mut SlotCtl,
    slot_ctl_dev: u64,
    slot_ctl_is_device: bool,
    slots_dev: u64,
    sched_dev: u64,
    b_dev: u64,
    workspace_dev: u64,
    blas: cublas::cublasHandle_t,
    ffts: Vec<cufft::cufftHandle>,
    streams: Vec<cu::CUstream>,
    /// One stream per device scheduler.
    sched_streams: Vec<cu::CUstream>,
    graphs: Vec<cu::CUgraph>,
    execs: Vec<cu::CUgraphExec>,
    /// Per slot: start, publish, chain[compute][k].
    start: Vec<cu::CUgraphExec>,
    publish: Vec<cu::CUgraphExec>,
    chain: Vec<[[cu::CUgraphExec; REPEAT_BITS]; 2]>,
    /// Per slot: fused work graphs (start → 2^k library calls → publish; `FUSED_NONE`: start →
    /// publish).
    fused: Vec<[cu::CUgraphExec; FUSED]>,
    /// Device copy of `fused` for the scheduler.
    fused_dev: u64,
    /// One graph per device scheduler (each relaunches itself).
    sched_execs: Vec<cu::CUgraphExec>,
    /// Device schedulers; scheduler k owns a contiguous share of the slots and its `Sched` is
    /// the k-th at `sched_dev`.
    nsched: usize,
    /// GPU-written SENDs: host memory registered for them (send table, io_uring rings, SQEs).
    tx_registered: Vec<*mut c_void>,
    /// `struct bgs_gpu_tx` in device memory (0: no GPU sends).
    tx_dev: u64,
    /// The stream of the resident CQ reaper.
    tx_stream: cu::CUstream,
    /// Completion notifier: its stream and blocking-sync event (null when not running).
    notify_stream: cu::CUstream,
    notify_event: cu::CUevent,
    /// `bgs_completion_wait`.
    f_wait: cu::CUfunction,
    /// The device-memory completion claim counter (`Sched::tail_hint` of scheduler 0).
    tail_hint_dev: u64,
}

// SAFETY: the handles are plain driver/library handles and pointers to pinned or device memory;
// the driver API is thread-safe once the context is current on the calling thread, which every
// thread using `Device` ensures (`make_current`). Mutation happens only in start and shutdown.
unsafe impl Send for Device {}
// SAFETY: see `Send`; shared use is read-only plus atomic accesses to the mapped words.
unsafe impl Sync for Device {}

impl Device {
    fn make_current(&self) -> Result<(), GpuError> {
        // SAFETY: `ctx` is the retained primary context, alive until `free`.
        ck(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    fn ctl_u32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is the offset of a u32 field of the mapped `Ctl` (4-aligned); the GPU
        // accesses these words only with system-scope atomics/volatile accesses.
        unsafe { AtomicU32::from_ptr((self.ctl_host as *mut u8).add(off).cast()) }
    }

    fn ctl_u64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: as `ctl_u32`, for an 8-aligned u64 field.
        unsafe { AtomicU64::from_ptr((self.ctl_host as *mut u8).add(off).cast()) }
    }

    fn request_stop(&self) {
        self.ctl_u32(std::mem::offset_of!(Ctl, stop))
            .store(1, Ordering::SeqCst);
    }

    fn slot_busy(&self, j: usize) -> &AtomicU32 {
        debug_assert!(!self.slot_ctl_is_device);
        // SAFETY: host mode: `slot_ctl_host` is an array of `nslots` mapped `SlotCtl`; `j` is
        // below `nslots` (callers index from the slot table).
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.slot_ctl_host.add(j)).busy)) }
    }

    fn launch(&self, g: cu::CUgraphExec, s: cu::CUstream) -> Result<(), GpuError> {
        // SAFETY: `g` and `s` are live handles created in `start`.
        ck(unsafe { cu::cuGraphLaunch(g, s) }, "cuGraphLaunch")
    }

    /// Wait for a stream, at most `timeout`. Ok(true): done; Ok(false): timed out.
    fn wait_stream(&self, s: cu::CUstream, timeout: Duration) -> Result<bool, GpuError> {
        let end = Instant::now() + timeout;
        loop {
            // SAFETY: `s` is a live stream.
            let r = unsafe { cu::cuStreamQuery(s) };
            if r == cu::CUresult::CUDA_SUCCESS {
                return Ok(true);
            }
            if r != cu::CUresult::CUDA_ERROR_NOT_READY {
                return ck(r, "cuStreamQuery").map(|()| false);
            }
            if Instant::now() >= end {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Launch the notifier's device-side wait for the completion at position `seen` (bounded
    /// by `NOTIFY_BUDGET_NS`) and sleep until it returns: the event is blocking-sync, so the
    /// calling thread waits for the GPU's interrupt without spinning.
    fn completion_wait(&self, seen: u64) -> Result<(), GpuError> {
        let (mut a0, mut a1, mut a2, mut a3, mut a4) = (
            self.region_dev,
            self.ctl_dev,
            self.tail_hint_dev,
            seen,
            NOTIFY_BUDGET_NS,
        );
        let mut args = [
            (&mut a0 as *mut u64).cast::<c_void>(),
            (&mut a1 as *mut u64).cast(),
            (&mut a2 as *mut u64).cast(),
            (&mut a3 as *mut u64).cast(),
            (&mut a4 as *mut u64).cast(),
        ];
        launch_kernel(self.f_wait, 1, self.notify_stream, &mut args)?;
        // SAFETY: event and stream were created in `build` and live until `free`, which runs
        // after the notifier thread (the only user) is joined.
        unsafe {
            ck(
                cu::cuEventRecord(self.notify_event, self.notify_stream),
                "cuEventRecord",
            )?;
            ck(
                cu::cuEventSynchronize(self.notify_event),
                "cuEventSynchronize",
            )
        }
    }

    /// Release everything (best effort: errors are ignored, the context may be dead).
    fn free(&mut self) {
        // SAFETY: every handle below was created in `start` (or is null/empty) and is released
        // exactly once: `free` clears what it releases. The GPU no longer runs our work.
        unsafe {
            let _ = cu::cuCtxSetCurrent(self.ctx);
            for e in self.execs.drain(..) {
                let _ = cu::cuGraphExecDestroy(e);
            }
            for g in self.graphs.drain(..) {
                let _ = cu::cuGraphDestroy(g);
            }
            for p in self.ffts.drain(..) {
                let _ = cufft::cufftDestroy(p);
            }
            if !self.blas.is_null() {
                let _ = cublas::cublasDestroy_v2(self.blas);
                self.blas = std::ptr::null_mut();
            }
            for s in self.streams.drain(..) {
                let _ = cu::cuStreamDestroy_v2(s);
            }
            for s in self.sched_streams.drain(..) {
                let _ = cu::cuStreamDestroy_v2(s);
            }
            if !self.tx_stream.is_null() {
                let _ = cu::cuStreamDestroy_v2(self.tx_stream);
                self.tx_stream = std::ptr::null_mut();
            }
            if !self.notify_event.is_null() {
                let _ = cu::cuEventDestroy_v2(self.notify_event);
                self.notify_event = std::ptr::null_mut();
            }
            if !self.notify_stream.is_null() {
                let _ = cu::cuStreamDestroy_v2(self.notify_stream);
                self.notify_stream = std::ptr::null_mut();
            }
            for p in self.tx_registered.drain(..) {
                let _ = cu::cuMemHostUnregister(p);
            }
            for d in [
                &mut self.slots_dev,
                &mut self.sched_dev,
                &mut self.b_dev,
                &mut self.workspace_dev,
                &mut self.fused_dev,
                &mut self.tx_dev,
            ] {
                if *d != 0 {
                    let _ = cu::cuMemFree_v2(*d);
                    *d = 0;
                }
            }
            if self.slot_ctl_is_device && self.slot_ctl_dev != 0 {
                let _ = cu::cuMemFree_v2(self.slot_ctl_dev);
            }
            self.slot_ctl_dev = 0;
            if !self.slot_ctl_host.is_null() {
                let _ = cu::cuMemFreeHost(self.slot_ctl_host.cast());
                self.slot_ctl_host = std::ptr::null_mut();
            }
            if !self.ctl_host.is_null() {
                let _ = cu::cuMemFreeHost(self.ctl_host.cast());
                self.ctl_host = std::ptr::null_mut();
            }
            if !self.region_host.is_null() {
                let _ = cu::cuMemHostUnregister(self.region_host);
                self.region_host = std::ptr::null_mut();
            }
            if !self.module.is_null() {
                let _ = cu::cuModuleUnload(self.module);
                self.module = std::ptr::null_mut();
            }
            if !self.ctx.is_null() {
                let _ = cu::cuDevicePrimaryCtxRelease_v2(self.dev);
                self.ctx = std::ptr::null_mut();
            }
        }
    }
}

fn get_function(module: cu::CUmodule, name: &str) -> Result<cu::CUfunction, GpuError> {
    let c = CString::new(name).map_err(|e| GpuError::Compile(e.to_string()))?;
    let mut f: cu::CUfunction = std::ptr::null_mut();
    ck(
        // SAFETY: `module` is a loaded module; `c` is NUL-terminated; out-pointer valid.
        unsafe { cu::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
        &format!("cuModuleGetFunction({name})"),
    )?;
    Ok(f)
}

fn dev_alloc(bytes: usize, what: &str) -> Result<u64, GpuError> {
    let mut p: cu::CUdeviceptr = 0;
    // SAFETY: a context is current; out-pointer valid.
    unsafe {
        ck(cu::cuMemAlloc_v2(&mut p, bytes), what)?;
        ck(cu::cuMemsetD8_v2(p, 0, bytes), what)?;
    }
    Ok(p)
}

fn host_alloc(bytes: usize, what: &str) -> Result<(*mut c_void, u64), GpuError> {
    let mut p: *mut c_void = std::ptr::null_mut();
    let mut d: cu::CUdeviceptr = 0;
    // SAFETY: a context is current; out-pointers valid; the allocation is `bytes` long and
    // zeroed before anyone reads it.
    unsafe {
        ck(cu::cuMemHostAlloc(&mut p, bytes, HOST_FLAGS), what)?;
        std::ptr::write_bytes(p.cast::<u8>(), 0, bytes);
        ck(cu::cuMemHostGetDevicePointer_v2(&mut d, p, 0), what)?;
    }
    Ok((p, d))
}

/// Capture whatever `body` enqueues on `stream` into a graph and instantiate it for device
/// launch, uploaded.
fn capture(
    d: &mut Device,
    stream: cu::CUstream,
    what: &str,
    body: impl FnOnce() -> Result<(), GpuError>,
) -> Result<cu::CUgraphExec, GpuError> {
    let mut g: cu::CUgraph = std::ptr::null_mut();
    ck(
        // SAFETY: `stream` is a live stream of the current context.
        unsafe {
            cu::cuStreamBeginCapture_v2(
                stream,
                cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        },
        "cuStreamBeginCapture",
    )?;
    let body_result = body();
    // SAFETY: ends the capture begun above; out-pointer valid.
    let end = ck(
        unsafe { cu::cuStreamEndCapture(stream, &mut g) },
        "cuStreamEndCapture",
    );
    body_result?;
    end?;
    d.graphs.push(g);
    let mut e: cu::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `g` is the captured graph; out-pointer valid; `stream` live.
    unsafe {
        ck(
            cu::cuGraphInstantiateWithFlags(&mut e, g, DEVICE_LAUNCH_FLAG),
            &format!("cuGraphInstantiateWithFlags(DEVICE_LAUNCH) of {what}"),
        )?;
        d.execs.push(e);
        ck(
            cu::cuGraphUpload(e, stream),
            &format!("cuGraphUpload of {what}"),
        )?;
    }
    Ok(e)
}

fn launch_kernel(
    f: cu::CUfunction,
    block: u32,
    stream: cu::CUstream,
    args: &mut [*mut c_void],
) -> Result<(), GpuError> {
    // SAFETY: `f` is a kernel of the loaded module whose parameters are exactly the values
    // `args` points to (all device pointers / u64); `stream` is live.
    ck(
        unsafe {
            cu::cuLaunchKernel(
                f,
                1,
                1,
                1,
                block,
                1,
                1,
                0,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        "cuLaunchKernel",
    )
}

/// State shared with the monitor and the host dispatcher.
struct Shared {
    device: Device,
    region: Arc<RingRegion>,
    nslots: usize,
    mode: Dispatcher,
    stopping: AtomicBool,
    failed: AtomicBool,
    error: Mutex<Option<String>>,
    on_error: Option<ErrorHook>,
    host_dispatched: AtomicU64,
    /// The completion notifier's waker and idle wait (see `notifier`).
    waker: Option<CompletionWaker>,
    idle_wait: Option<IdleWait>,
    notifier: NotifierCounters,
    /// The monitor thread, unparked at shutdown and on failure.
    monitor_thread: std::sync::OnceLock<std::thread::Thread>,
}

/// Counters of the completion notifier.
#[derive(Default)]
struct NotifierCounters {
    waits: AtomicU64,
    wakes: AtomicU64,
    rings: AtomicU64,
    timeouts: AtomicU64,
    idle_sleeps: AtomicU64,
}

impl Shared {
    fn fail(&self, msg: String) {
        let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_none() {
            tracing::error!("GPU executor failed: {msg}");
            *e = Some(msg.clone());
            drop(e);
            self.failed.store(true, Ordering::SeqCst);
            self.device.request_stop();
            if let Some(t) = self.monitor_thread.get() {
                t.unpark();
            }
            if let Some(h) = &self.on_error {
                (h.0)(&msg);
            }
        }
    }

    /// Answer one request with Internal (after a failure); false if the ring was empty.
    fn answer_internal(&self) -> bool {
        let mut meta = None;
        let popped = self.region.requests().try_pop(|e| {
            // OP_CANCEL entries are never answered, not even after a failure.
            if e.op != OP_CANCEL {
                meta = Some((
                    e.conn,
                    e.conn_seq,
                    e.request_id,
                    e.route,
                    e.op,
                    e.publish_ns,
                ));
            }
        });
        if popped.is_none() {
            return false;
        }
        let Some((conn, conn_seq, request_id, route, op, publish_ns)) = meta else {
            return true;
        };
        loop {
            let r = self.region.completions().try_push(|c| {
                c.conn = conn;
                c.conn_seq = conn_seq;
                c.status = Status::Internal as u16;
                c.final_ = 1;
                c.request_id = request_id;
                c.words = 0;
                c.stream_seq = 0;
                c.route = route;
                c.stream = 0;
                c.op = u32::from(op);
                c.publish_ns = publish_ns;
            });
            if r.is_ok() || self.stopping.load(Ordering::Acquire) {
                break;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        self.region.completions().notify();
        true
    }
}

/// The running executor.
pub(crate) struct Running {
    shared: Arc<Shared>,
    info: DeviceInfo,
    monitor: Option<JoinHandle<()>>,
    host: Option<JoinHandle<()>>,
    notifier: Option<JoinHandle<()>>,
    cache_hit: bool,
    start_seconds: f64,
    done: bool,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("device", &self.info.name)
            .field("slots", &self.shared.nslots)
            .field("mode", &self.shared.mode)
            .finish()
    }
}

impl Running {
    pub(crate) fn start(
        region: Arc<RingRegion>,
        cfg: &GpuExecutorConfig,
    ) -> Result<Self, GpuError> {
        let t0 = Instant::now();
        let env = init(cfg)?;
        let mut d = Device {
            ctx: std::ptr::null_mut(),
            dev: env.dev,
            module: std::ptr::null_mut(),
            region_host: std::ptr::null_mut(),
            region_dev: 0,
            ctl_host: std::ptr::null_mut(),
            ctl_dev: 0,
            slot_ctl_host: std::ptr::null_mut(),
            slot_ctl_dev: 0,
            slot_ctl_is_device: cfg.dispatcher == Dispatcher::DeviceLaunch,
            slots_dev: 0,
            sched_dev: 0,
            b_dev: 0,
            workspace_dev: 0,
            blas: std::ptr::null_mut(),
            ffts: Vec::new(),
            streams: Vec::new(),
            sched_streams: Vec::new(),
            graphs: Vec::new(),
            execs: Vec::new(),
            start: Vec::new(),
            publish: Vec::new(),
            chain: Vec::new(),
            fused: Vec::new(),
            fused_dev: 0,
            sched_execs: Vec::new(),
            nsched: 1,
            tx_registered: Vec::new(),
            tx_dev: 0,
            tx_stream: std::ptr::null_mut(),
            notify_stream: std::ptr::null_mut(),
            notify_event: std::ptr::null_mut(),
            f_wait: std::ptr::null_mut(),
            tail_hint_dev: 0,
        };
        let built = build(&mut d, &env, &region, cfg);
        let cache_hit = match built {
            Ok(hit) => hit,
            Err(e) => {
                d.free();
                return Err(e);
            }
        };
        let shared = Arc::new(Shared {
            device: d,
            region,
            nslots: cfg.slots,
            mode: cfg.dispatcher,
            stopping: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            on_error: cfg.on_error.clone(),
            host_dispatched: AtomicU64::new(0),
            waker: notifier_waker(cfg),
            idle_wait: cfg.idle_wait.clone(),
            notifier: NotifierCounters::default(),
            monitor_thread: std::sync::OnceLock::new(),
        });
        // Go: the scheduler graph (device launch) or the host dispatcher thread.
        let mut host = None;
        match cfg.dispatcher {
            Dispatcher::DeviceLaunch => {
                let dd = &shared.device;
                let launched = dd
                    .sched_execs
                    .iter()
                    .zip(&dd.sched_streams)
                    .try_for_each(|(&e, &st)| dd.launch(e, st));
                if let Err(e) = launched {
                    let mut s = Arc::try_unwrap(shared).ok().expect("not shared yet");
                    s.device.free();
                    return Err(e);
                }
            }
            Dispatcher::HostLaunch => {
                let s = shared.clone();
                host = Some(
                    std::thread::Builder::new()
                        .name("bgs-gpu-host".into())
                        .spawn(move || host_dispatcher(&s))
                        .map_err(|e| {
                            GpuError::Failed(format!("spawning the host dispatcher: {e}"))
                        })?,
                );
            }
        }
        let s = shared.clone();
        let monitor = std::thread::Builder::new()
            .name("bgs-gpu-monitor".into())
            .spawn(move || monitor(&s))
            .map_err(|e| GpuError::Failed(format!("spawning the monitor: {e}")))?;
        let _ = shared.monitor_thread.set(monitor.thread().clone());
        let notifier = match shared.waker {
            Some(_) => {
                let s = shared.clone();
                Some(
                    std::thread::Builder::new()
                        .name("bgs-gpu-notify".into())
                        .spawn(move || notifier(&s))
                        .map_err(|e| {
                            GpuError::Failed(format!("spawning the completion notifier: {e}"))
                        })?,
                )
            }
            None => None,
        };
        let start_seconds = t0.elapsed().as_secs_f64();
        tracing::info!(
            "GPU executor on {} (sm_{}{}), {} slots, {:?}, kernels {}, started in {:.2} s, host-native atomics {}",
            env.info.name,
            env.info.compute_capability.0,
            env.info.compute_capability.1,
            cfg.slots,
            cfg.dispatcher,
            if cache_hit { "from cache" } else { "compiled" },
            start_seconds,
            env.info.host_native_atomics
        );
        Ok(Running {
            shared,
            info: env.info,
            monitor: Some(monitor),
            host,
            notifier,
            cache_hit,
            start_seconds,
            done: false,
        })
    }

    pub(crate) fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub(crate) fn error(&self) -> Option<String> {
        self.shared
            .error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(crate) fn stats(&self) -> GpuStats {
        let d = &self.shared.device;
        GpuStats {
            scheduler_executions: 0,
            dispatched: self.shared.host_dispatched.load(Ordering::Relaxed),
            claims: 0,
            launch_retries: 0,
            completion_full: d
                .ctl_u64(std::mem::offset_of!(Ctl, full_spins))
                .load(Ordering::Relaxed),
            chain_errors: d
                .ctl_u64(std::mem::offset_of!(Ctl, chain_errors))
                .load(Ordering::Relaxed),
            notifier_waits: self.shared.notifier.waits.load(Ordering::Relaxed),
            notifier_wakes: self.shared.notifier.wakes.load(Ordering::Relaxed),
            notifier_rings: self.shared.notifier.rings.load(Ordering::Relaxed),
            notifier_timeouts: self.shared.notifier.timeouts.load(Ordering::Relaxed),
            notifier_idle_sleeps: self.shared.notifier.idle_sleeps.load(Ordering::Relaxed),
            cache_hit: self.cache_hit,
            start_seconds: self.start_seconds,
        }
    }

    fn stop(&mut self) -> Result<GpuStats, GpuError> {
        self.done = true;
        let sh = &self.shared;
        let mut stats = self.stats();
        sh.device.request_stop();
        // The notifier's wait kernel returns at `stop`; an idle notifier is woken here (or
        // by its bounded sleep with an external wait). Joined before anything is freed.
        if let Some(h) = self.notifier.take() {
            sh.region.requests().notify();
            let _ = h.join();
            stats.notifier_waits = sh.notifier.waits.load(Ordering::Relaxed);
            stats.notifier_wakes = sh.notifier.wakes.load(Ordering::Relaxed);
            stats.notifier_rings = sh.notifier.rings.load(Ordering::Relaxed);
            stats.notifier_timeouts = sh.notifier.timeouts.load(Ordering::Relaxed);
            stats.notifier_idle_sleeps = sh.notifier.idle_sleeps.load(Ordering::Relaxed);
        }
        let _ = sh.device.make_current();
        let mut stuck = false;
        match sh.mode {
            Dispatcher::DeviceLaunch => {
                for &st in &sh.device.sched_streams {
                    match sh.device.wait_stream(st, STOP_TIMEOUT) {
                        Ok(true) => {}
                        Ok(false) => {
                            stuck = true;
                            sh.fail(format!(
                                "the scheduler did not stop within {} s",
                                STOP_TIMEOUT.as_secs()
                            ));
                        }
                        Err(e) => sh.fail(e.to_string()),
                    }
                }
            }
            Dispatcher::HostLaunch => {
                sh.stopping.store(true, Ordering::SeqCst);
                if let Some(h) = self.host.take() {
                    let _ = h.join();
                }
            }
        }
        for &s in &sh.device.streams {
            match sh.device.wait_stream(s, STOP_TIMEOUT) {
                Ok(true) => {}
                Ok(false) => {
                    stuck = true;
                    sh.fail("a slot's work did not finish at shutdown".into());
                }
                Err(e) => sh.fail(e.to_string()),
            }
        }
        if !sh.device.tx_stream.is_null() {
            // The reaper returns once it sees `stop` (it checks every 64 idle polls).
            match sh.device.wait_stream(sh.device.tx_stream, STOP_TIMEOUT) {
                Ok(true) => {}
                Ok(false) => {
                    stuck = true;
                    sh.fail("the GPU send reaper did not stop at shutdown".into());
                }
                Err(e) => sh.fail(e.to_string()),
            }
        }
        sh.stopping.store(true, Ordering::SeqCst);
        if let Some(m) = self.monitor.take() {
            m.thread().unpark();
            let _ = m.join();
        }
        if sh.mode == Dispatcher::DeviceLaunch && !stuck {
            stats.dispatched = 0;
            for k in 0..sh.device.nsched {
                let mut s = [0u8; size_of::<Sched>()];
                let src = sh.device.sched_dev + (k * size_of::<Sched>()) as u64;
                // SAFETY: `sched_dev` holds `nsched` `Sched`s; `s` has the size of one; the
                // schedulers have exited.
                let r = unsafe { cu::cuMemcpyDtoH_v2(s.as_mut_ptr().cast(), src, s.len()) };
                if r != cu::CUresult::CUDA_SUCCESS {
                    continue;
                }
                let rd =
                    |off: usize| u64::from_ne_bytes(s[off..off + 8].try_into().unwrap_or_default());
                let rd32 = |off: usize| {
                    u64::from(u32::from_ne_bytes(
                        s[off..off + 4].try_into().unwrap_or_default(),
                    ))
                };
                stats.scheduler_executions += rd(std::mem::offset_of!(Sched, executions));
                stats.dispatched += rd(std::mem::offset_of!(Sched, dispatched));
                stats.claims += rd32(std::mem::offset_of!(Sched, batches));
                stats.launch_retries += rd32(std::mem::offset_of!(Sched, retries));
            }
        }
        stats.completion_full = sh
            .device
            .ctl_u64(std::mem::offset_of!(Ctl, full_spins))
            .load(Ordering::Relaxed);
        if stuck {
            // Work may still run on the device: leak rather than free memory it uses.
            tracing::error!("GPU executor: device work still running; leaking its resources");
        } else if let Some(s) = Arc::get_mut(&mut self.shared) {
            s.device.free();
        }
        match self.error() {
            Some(e) => Err(GpuError::Failed(e)),
            None => Ok(stats),
        }
    }

    pub(crate) fn shutdown(mut self) -> Result<GpuStats, GpuError> {
        self.stop()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.stop();
        }
    }
}

/// Set up module, memory, libraries and graphs. Returns whether the cubin came from the cache.
fn build(
    d: &mut Device,
    env: &Env,
    region: &Arc<RingRegion>,
    cfg: &GpuExecutorConfig,
) -> Result<bool, GpuError> {
    let n = cfg.slots;
    // SAFETY: initialized driver, valid device; out-pointer valid.
    unsafe {
        ck(
            cu::cuDevicePrimaryCtxRetain(&mut d.ctx, d.dev),
            "cuDevicePrimaryCtxRetain",
        )?;
    }
    d.make_current()?;
    let (cubin, cache_hit) = kernels(env, cfg)?;
    ck(
        // SAFETY: `cubin` is a complete linked cubin for this device; out-pointer valid.
        unsafe { cu::cuModuleLoadData(&mut d.module, cubin.as_ptr().cast()) },
        "cuModuleLoadData",
    )?;
    let f_sched = get_function(d.module, "bgs_scheduler")?;
    let f_start = get_function(d.module, "bgs_slot_start")?;
    let f_publish = get_function(d.module, "bgs_slot_publish")?;
    let f_probe = get_function(d.module, "bgs_layout_probe")?;
    let f_reaper = get_function(d.module, "bgs_tx_reaper")?;
    d.f_wait = get_function(d.module, "bgs_completion_wait")?;

    // Layout self-check: the kernels' compiler must lay out the structs as Rust does.
    {
        let want = crate::c_header::layout_table();
        let n = want.len();
        let probe = dev_alloc(n * 8, "probe buffer")?;
        let mut arg = probe;
        let mut args = [(&mut arg as *mut u64).cast::<c_void>()];
        launch_kernel(f_probe, 1, std::ptr::null_mut(), &mut args)?;
        let mut got = vec![0u64; n];
        // SAFETY: `probe` holds n u64 (BGS_GPU_LAYOUT_LEN, generated from the same table);
        // `got` has that size; a context is current.
        unsafe {
            ck(cu::cuCtxSynchronize(), "layout probe")?;
            ck(
                cu::cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), probe, n * 8),
                "layout probe",
            )?;
            let _ = cu::cuMemFree_v2(probe);
        }
        if let Some(((what, rust), dev)) = want.iter().zip(&got).find(|((_, w), g)| w != *g) {
            return Err(GpuError::Compile(format!(
                "layout mismatch between the kernels and Rust: {what} is {dev} on the device, \
                 {rust} in Rust"
            )));
        }
    }

    // The rings: register the region (plain memory or a BPF map's mapping).
    // SAFETY: the region is `len` bytes of page-aligned host memory that `region` keeps alive
    // for the executor's lifetime (Shared holds the Arc); unregistered in `free`.
    unsafe {
        ck(
            cu::cuMemHostRegister_v2(region.as_ptr().cast(), region.len(), REGISTER_FLAGS),
            "cuMemHostRegister(ring region)",
        )?;
    }
    d.region_host = region.as_ptr().cast();
    ck(
        // SAFETY: the region was registered with DEVICEMAP above.
        unsafe { cu::cuMemHostGetDevicePointer_v2(&mut d.region_dev, d.region_host, 0) },
        "cuMemHostGetDevicePointer(ring region)",
    )?;
    // GPU-written SENDs: the send table and the GPU's io_uring ring, registered like the rings.
    if let Some(desc) = cfg.tx {
        d.tx_dev = setup_tx(d, region, &desc)?;
    }
    let (ctl, ctl_dev) = host_alloc(size_of::<Ctl>(), "cuMemHostAlloc(control)")?;
    d.ctl_host = ctl.cast();
    d.ctl_dev = ctl_dev;
    let sc_bytes = n * size_of::<SlotCtl>();
    if d.slot_ctl_is_device {
        d.slot_ctl_dev = dev_alloc(sc_bytes, "cuMemAlloc(slot control)")?;
    } else {
        let (p, dp) = host_alloc(sc_bytes, "cuMemHostAlloc(slot control)")?;
        d.slot_ctl_host = p.cast();
        d.slot_ctl_dev = dp;
    }
    d.slots_dev = dev_alloc(n * size_of::<GpuSlot>(), "cuMemAlloc(slots)")?;
    d.nsched = match cfg.dispatcher {
        Dispatcher::DeviceLaunch => schedulers(cfg),
        Dispatcher::HostLaunch => 1,
    };
    d.sched_dev = dev_alloc(d.nsched * size_of::<Sched>(), "cuMemAlloc(schedulers)")?;
    d.b_dev = dev_alloc(64 * 4, "cuMemAlloc(B)")?;
    d.workspace_dev = dev_alloc(n * CUBLAS_WORKSPACE, "cuMemAlloc(cuBLAS workspace)")?;
    let b = bgs_protocol::wire::gemm8_b();
    ck(
        // SAFETY: `b_dev` has 256 bytes; `b` is 64 f32.
        unsafe { cu::cuMemcpyHtoD_v2(d.b_dev, b.as_ptr().cast(), 256) },
        "cuMemcpyHtoD(B)",
    )?;

    // Streams, cuBLAS, cuFFT.
    for _ in 0..n {
        let mut s: cu::CUstream = std::ptr::null_mut();
        ck(
            // SAFETY: a context is current; out-pointer valid.
            unsafe { cu::cuStreamCreate(&mut s, STREAM_NON_BLOCKING) },
            "cuStreamCreate",
        )?;
        d.streams.push(s);
    }
    for _ in 0..d.nsched {
        let mut st: cu::CUstream = std::ptr::null_mut();
        ck(
            // SAFETY: as above.
            unsafe { cu::cuStreamCreate(&mut st, STREAM_NON_BLOCKING) },
            "cuStreamCreate",
        )?;
        d.sched_streams.push(st);
    }
    // SAFETY: cuBLAS is loaded; out-pointer valid; the handle is destroyed in `free`.
    unsafe {
        ck_blas(cublas::cublasCreate_v2(&mut d.blas), "cublasCreate")?;
        ck_blas(
            cublas::cublasSetMathMode(d.blas, cublas::cublasMath_t::CUBLAS_DEFAULT_MATH),
            "cublasSetMathMode",
        )?;
    }
    for s in 0..n {
        let mut p: cufft::cufftHandle = 0;
        // SAFETY: cuFFT is loaded; out-pointer valid; destroyed in `free`.
        unsafe {
            ck_fft(
                cufft::cufftPlan1d(&mut p, 32, cufft::cufftType::CUFFT_C2C, 1),
                "cufftPlan1d(32, C2C)",
            )?;
        }
        d.ffts.push(p);
        // SAFETY: plan and stream are live.
        unsafe {
            ck_fft(
                cufft::cufftSetStream(p, d.streams[s].cast()),
                "cufftSetStream",
            )?;
        }
    }

    let slot_size = size_of::<GpuSlot>() as u64;
    let sc_size = size_of::<SlotCtl>() as u64;
    let lib = Lib {
        blas: d.blas,
        b_dev: d.b_dev,
        workspace_dev: d.workspace_dev,
        slots_dev: d.slots_dev,
    };
    // Warm up outside capture (lazy library initialization must not happen while capturing).
    for s in 0..n {
        lib.sgemm(d.streams[s], s)?;
        lib.fft(d.ffts[s], s)?;
    }
    // SAFETY: a context is current.
    ck(unsafe { cu::cuCtxSynchronize() }, "warm-up")?;

    // The completion-tail hint the publish kernels share (device memory, in the `Sched`).
    let tail_hint_dev = d.sched_dev + std::mem::offset_of!(Sched, tail_hint) as u64;
    d.tail_hint_dev = tail_hint_dev;
    if notifier_waker(cfg).is_some() {
        // SAFETY: a context is current; out-pointers valid; both destroyed in `free`.
        unsafe {
            ck(
                cu::cuStreamCreate(&mut d.notify_stream, STREAM_NON_BLOCKING),
                "cuStreamCreate(notifier)",
            )?;
            ck(
                cu::cuEventCreate(&mut d.notify_event, EVENT_FLAGS),
                "cuEventCreate(CU_EVENT_BLOCKING_SYNC)",
            )?;
        }
    }
    let tail_now = {
        let off = std::mem::offset_of!(bgs_ring::RegionHeader, completion_tail);
        // SAFETY: the region starts with its `RegionHeader` (8-aligned, page-aligned base);
        // `completion_tail` is a u64 counter that producers update atomically.
        unsafe { AtomicU64::from_ptr(region.as_ptr().add(off).cast()) }.load(Ordering::Acquire)
    };

    // Per-slot graphs.
    for s in 0..n {
        let stream = d.streams[s];
        let plan_fft = d.ffts[s];
        let ring = d.region_dev;
        let ctl = d.ctl_dev;
        let scp = d.slot_ctl_dev + s as u64 * sc_size;
        let slot = d.slots_dev + s as u64 * slot_size;
        let start_kernel = |fused: u32| -> Result<(), GpuError> {
            let (mut a0, mut a1, mut a2, mut a3, mut a4) = (ring, ctl, scp, slot, fused);
            let mut args = [
                (&mut a0 as *mut u64).cast::<c_void>(),
                (&mut a1 as *mut u64).cast(),
                (&mut a2 as *mut u64).cast(),
                (&mut a3 as *mut u64).cast(),
                (&mut a4 as *mut u32).cast(),
            ];
            launch_kernel(f_start, 256, stream, &mut args)
        };
        let publish_kernel = || -> Result<(), GpuError> {
            let (mut a0, mut a1, mut a2, mut a3) = (ring, ctl, scp, slot);
            let mut args = [
                (&mut a0 as *mut u64).cast::<c_void>(),
                (&mut a1 as *mut u64).cast(),
                (&mut a2 as *mut u64).cast(),
                (&mut a3 as *mut u64).cast(),
            ];
            launch_kernel(f_publish, 256, stream, &mut args)
        };
        let compute = |c: Compute, times: u32| -> Result<(), GpuError> {
            for _ in 0..times {
                match c {
                    Compute::Gemm => lib.sgemm(stream, s)?,
                    Compute::Fft => lib.fft(plan_fft, s)?,
                }
            }
            Ok(())
        };
        let start = capture(d, stream, "slot start", || start_kernel(0))?;
        let publish = capture(d, stream, "slot publish", publish_kernel)?;
        let mut chain = [[std::ptr::null_mut(); REPEAT_BITS]; 2];
        let mut fused = [std::ptr::null_mut(); FUSED];
        for c in [Compute::Gemm, Compute::Fft] {
            for k in 0..REPEAT_BITS {
                chain[c.index()][k] = capture(d, stream, "a compute graph", || compute(c, 1 << k))?;
                fused[c.index() * REPEAT_BITS + k] =
                    capture(d, stream, "a fused work graph", || {
                        start_kernel(1)?;
                        compute(c, 1 << k)?;
                        publish_kernel()
                    })?;
            }
        }
        fused[FUSED_NONE] = capture(d, stream, "the no-compute work graph", || {
            start_kernel(1)?;
            publish_kernel()
        })?;
        // The slot's header: chain mode, graph handles, tail hint.
        let mut hdr = [0u8; 256];
        let put = |hdr: &mut [u8; 256], off: usize, v: u64| {
            hdr[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        };
        let device_chain = u32::from(cfg.dispatcher == Dispatcher::DeviceLaunch);
        let dc = std::mem::offset_of!(GpuSlot, device_chain);
        hdr[dc..dc + 4].copy_from_slice(&device_chain.to_ne_bytes());
        for (ci, row) in chain.iter().enumerate() {
            for (k, e) in row.iter().enumerate() {
                put(
                    &mut hdr,
                    std::mem::offset_of!(GpuSlot, chain) + (ci * REPEAT_BITS + k) * 8,
                    *e as u64,
                );
            }
        }
        put(
            &mut hdr,
            std::mem::offset_of!(GpuSlot, publish),
            publish as u64,
        );
        put(
            &mut hdr,
            std::mem::offset_of!(GpuSlot, tail_hint),
            tail_hint_dev,
        );
        put(&mut hdr, std::mem::offset_of!(GpuSlot, tx), d.tx_dev);
        let sp = std::mem::offset_of!(GpuSlot, sole_producer);
        hdr[sp..sp + 4].copy_from_slice(&u32::from(cfg.sole_completion_producer).to_ne_bytes());
        ck(
            // SAFETY: the slot's first 256 bytes are its header; `hdr` has 256 bytes.
            unsafe {
                cu::cuMemcpyHtoD_v2(d.slots_dev + s as u64 * slot_size, hdr.as_ptr().cast(), 256)
            },
            "cuMemcpyHtoD(slot header)",
        )?;
        d.start.push(start);
        d.publish.push(publish);
        d.chain.push(chain);
        d.fused.push(fused);
    }

    // The fused graph table (the scheduler picks from it).
    let table: Vec<u64> = d.fused.iter().flatten().map(|e| *e as u64).collect();
    d.fused_dev = dev_alloc(table.len() * 8, "cuMemAlloc(fused graph table)")?;
    ck(
        // SAFETY: `fused_dev` has `table.len()` u64; `table` is that long.
        unsafe { cu::cuMemcpyHtoD_v2(d.fused_dev, table.as_ptr().cast(), table.len() * 8) },
        "cuMemcpyHtoD(fused graph table)",
    )?;

    // Scheduler k owns slots [k * n / K, (k + 1) * n / K): its `Sched` points at the first of
    // them (slot control, start graphs, fused rows) and numbers them from 0, so the kernel is
    // the same for one scheduler or several. All publish kernels share scheduler 0's tail hint.
    let sched_size = size_of::<Sched>();
    for k in 0..d.nsched {
        let first = k * n / d.nsched;
        let end = (k + 1) * n / d.nsched;
        let mut sched = Sched {
            ring: d.region_dev,
            ctl: d.ctl_dev,
            slot_ctl: d.slot_ctl_dev + (first as u64) * sc_size,
            self_exec: 0,
            nslots: (end - first) as u32,
            budget: plan::LAUNCH_BUDGET,
            next: 0,
            retries: 0,
            work: [0; MAX_SLOTS],
            executions: 0,
            dispatched: 0,
            fused: d.fused_dev + (first * FUSED * 8) as u64,
            tail_hint: tail_now,
            lanes: u32::from(launch_lanes()),
            batches: 0,
        };
        for (j, e) in d.start[first..end].iter().enumerate() {
            sched.work[j] = *e as u64;
        }
        let sched_at = d.sched_dev + (k * sched_size) as u64;
        if cfg.dispatcher == Dispatcher::DeviceLaunch {
            let mut sched_arg = sched_at;
            let sstream = d.sched_streams[k];
            let exec = capture(d, sstream, "scheduler", || {
                let mut args = [(&mut sched_arg as *mut u64).cast::<c_void>()];
                launch_kernel(f_sched, 32, sstream, &mut args)
            })?;
            d.sched_execs.push(exec);
            sched.self_exec = exec as u64;
        }
        ck(
            // SAFETY: `sched_at` holds a `Sched`; `sched` is a live value of that type.
            unsafe { cu::cuMemcpyHtoD_v2(sched_at, (&sched as *const Sched).cast(), sched_size) },
            "cuMemcpyHtoD(scheduler)",
        )?;
    }
    // SAFETY: a context is current.
    ck(unsafe { cu::cuCtxSynchronize() }, "graph upload")?;
    if d.tx_dev != 0 {
        ck(
            // SAFETY: a context is current; out-pointer valid; destroyed in `free`.
            unsafe { cu::cuStreamCreate(&mut d.tx_stream, STREAM_NON_BLOCKING) },
            "cuStreamCreate",
        )?;
        let (mut a0, mut a1) = (d.tx_dev, d.ctl_dev);
        let mut args = [
            (&mut a0 as *mut u64).cast::<c_void>(),
            (&mut a1 as *mut u64).cast(),
        ];
        launch_kernel(f_reaper, 32, d.tx_stream, &mut args)?;
    }
    Ok(cache_hit)
}

/// Register the send table and the GPU's io_uring ring memory and build `struct bgs_gpu_tx`.
/// Returns its device address.
fn setup_tx(
    d: &mut Device,
    region: &Arc<RingRegion>,
    desc: &bgs_ring::tx::TxDesc,
) -> Result<u64, GpuError> {
    let mut register = |p: *mut u8, len: usize, what: &str| -> Result<u64, GpuError> {
        ck(
            // SAFETY: `p`/`len` describe page-aligned host memory owned by the transport,
            // which outlives the executor (the caller stops the executor first); unregistered
            // in `free`.
            unsafe { cu::cuMemHostRegister_v2(p.cast(), len, REGISTER_FLAGS) },
            &format!("cuMemHostRegister({what})"),
        )?;
        d.tx_registered.push(p.cast());
        let mut dp: u64 = 0;
        ck(
            // SAFETY: registered with DEVICEMAP just above.
            unsafe { cu::cuMemHostGetDevicePointer_v2(&mut dp, p.cast(), 0) },
            &format!("cuMemHostGetDevicePointer({what})"),
        )?;
        Ok(dp)
    };
    let table = register(desc.table, desc.table_len, "GPU send table")?;
    let rings = register(desc.rings, desc.rings_len, "io_uring rings")?;
    let sqes = register(desc.sqes, desc.sqes_len, "io_uring SQEs")?;
    // SAFETY: `sq_tail` is the offset of the ring's u32 SQ tail inside `rings` (the transport
    // filled the descriptor from the ring's own layout); nobody else produces on this ring.
    let tail = unsafe { AtomicU32::from_ptr(desc.rings.add(desc.sq_tail as usize).cast()) }
        .load(Ordering::Acquire);
    let futex_off = std::mem::offset_of!(bgs_ring::RegionHeader, completion_doorbell);
    let tx = Tx {
        table,
        table_host: desc.table as u64,
        rings,
        sqes,
        futex_host: region.as_ptr() as u64 + futex_off as u64,
        sq_mask: desc.sq_entries - 1,
        sq_entries: desc.sq_entries,
        cq_mask: desc.cq_entries - 1,
        off_sq_head: desc.sq_head,
        off_sq_tail: desc.sq_tail,
        off_cq_head: desc.cq_head,
        off_cq_tail: desc.cq_tail,
        off_cqes: desc.cqes,
        reserve: tail,
        committed: tail,
        ..Tx::default()
    };
    if !desc.sq_entries.is_power_of_two() || !desc.cq_entries.is_power_of_two() {
        return Err(GpuError::Failed(
            "the GPU's io_uring ring sizes must be powers of two".into(),
        ));
    }
    let dev = dev_alloc(size_of::<Tx>(), "cuMemAlloc(GPU send state)")?;
    ck(
        // SAFETY: `dev` has room for a `Tx`; `tx` is a live value of that type.
        unsafe { cu::cuMemcpyHtoD_v2(dev, (&tx as *const Tx).cast(), size_of::<Tx>()) },
        "cuMemcpyHtoD(GPU send state)",
    )?;
    Ok(dev)
}

/// Device schedulers: `BGS_GPU_SCHEDULERS` when set, else `cfg.schedulers`; 0 picks
/// [`plan::auto_schedulers`]; at most one per slot.
fn schedulers(cfg: &GpuExecutorConfig) -> usize {
    let k = std::env::var("BGS_GPU_SCHEDULERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(cfg.schedulers);
    plan::scheduler_count(k, cfg.slots)
}

/// Whether every scheduler lane launches its own request's graph (parallel device launches,
/// the default) or lane 0 launches the whole claimed batch in order (`BGS_GPU_LAUNCH_LANES=0`).
/// Measured on the H200 (bench/results/20261130-gpu-lanes): parallel launches reach 339–356k
/// requests/s at 16 slots against 314–318k in order; in v2, while the publish kernels still
/// contended on a host CAS, they had been slower.
fn launch_lanes() -> bool {
    !std::env::var("BGS_GPU_LAUNCH_LANES").is_ok_and(|v| v == "0")
}

/// What the captured library calls need (plain handles, copied out of `Device` so captures
/// can borrow it mutably).
#[derive(Clone, Copy)]
struct Lib {
    blas: cublas::cublasHandle_t,
    b_dev: u64,
    workspace_dev: u64,
    slots_dev: u64,
}

impl Lib {
    fn io(&self, s: usize) -> (u64, u64) {
        let base = self.slots_dev + (s * size_of::<GpuSlot>()) as u64;
        (
            base + std::mem::offset_of!(GpuSlot, input) as u64,
            base + std::mem::offset_of!(GpuSlot, out) as u64,
        )
    }

    /// The caller's unchanged cuBLAS call, bound to slot `s`'s buffers and stream.
    fn sgemm(&self, stream: cu::CUstream, s: usize) -> Result<(), GpuError> {
        let (a, c) = self.io(s);
        let alpha = 1.0f32;
        let beta = 0.0f32;
        // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: pass B first.
        // SAFETY: handle, stream and workspace are live; pointers are 64-float device buffers.
        unsafe {
            ck_blas(
                cublas::cublasSetStream_v2(self.blas, stream.cast()),
                "cublasSetStream",
            )?;
            ck_blas(
                cublas::cublasSetWorkspace_v2(
                    self.blas,
                    (self.workspace_dev + (s * CUBLAS_WORKSPACE) as u64) as *mut c_void,
                    CUBLAS_WORKSPACE,
                ),
                "cublasSetWorkspace",
            )?;
            ck_blas(
                cublas::cublasSgemm_v2(
                    self.blas,
                    cublas::cublasOperation_t::CUBLAS_OP_N,
                    cublas::cublasOperation_t::CUBLAS_OP_N,
                    8,
                    8,
                    8,
                    &alpha,
                    self.b_dev as *const f32,
                    8,
                    a as *const f32,
                    8,
                    &beta,
                    c as *mut f32,
                    8,
                ),
                "cublasSgemm",
            )
        }
    }

    /// The caller's unchanged cuFFT call (the slot's plan is bound to the slot's stream).
    fn fft(&self, plan: cufft::cufftHandle, s: usize) -> Result<(), GpuError> {
        let (x, y) = self.io(s);
        // SAFETY: the plan is bound to the slot's stream; x and y hold 32 complex64 each.
        unsafe {
            ck_fft(
                cufft::cufftExecC2C(
                    plan,
                    x as *mut cufft::cufftComplex,
                    y as *mut cufft::cufftComplex,
                    -1, // CUFFT_FORWARD
                ),
                "cufftExecC2C",
            )
        }
    }
}

/// Watch for device-side failures; after one, answer the ring with Internal until shutdown.
fn monitor(sh: &Shared) {
    if let Err(e) = sh.device.make_current() {
        sh.fail(e.to_string());
    }
    let d = &sh.device;
    let mut warned = false;
    let mut looks = 0u32;
    while !sh.stopping.load(Ordering::Acquire) && !sh.failed.load(Ordering::Acquire) {
        std::thread::park_timeout(MONITOR_PERIOD);
        if sh.stopping.load(Ordering::Acquire) {
            break;
        }
        looks = looks.wrapping_add(1);
        let err = d
            .ctl_u32(std::mem::offset_of!(Ctl, error))
            .load(Ordering::Acquire);
        if err != 0 {
            let w = d
                .ctl_u32(std::mem::offset_of!(Ctl, error_where))
                .load(Ordering::Acquire);
            sh.fail(format!(
                "device-side graph launch failed: {} ({})",
                cuda_rt_error_name(err),
                where_name(w)
            ));
            break;
        }
        if !looks.is_multiple_of(STREAM_QUERY_EVERY) {
            continue;
        }
        let stream = match sh.mode {
            Dispatcher::DeviceLaunch => d.sched_streams[0],
            Dispatcher::HostLaunch => d.streams[0],
        };
        // SAFETY: `stream` is live until `free`, which runs after this thread is joined.
        let r = unsafe { cu::cuStreamQuery(stream) };
        match r {
            cu::CUresult::CUDA_ERROR_NOT_READY => {}
            cu::CUresult::CUDA_SUCCESS => {
                // Device launch: the scheduler's stream completes only when the scheduler
                // stopped; every abnormal exit also records an error (checked above), so this
                // is only worth a warning.
                if sh.mode == Dispatcher::DeviceLaunch
                    && !warned
                    && d.ctl_u32(std::mem::offset_of!(Ctl, stop))
                        .load(Ordering::Acquire)
                        == 0
                {
                    warned = true;
                    tracing::warn!("the device scheduler's stream is idle although not stopped");
                }
            }
            other => {
                sh.fail(format!("the GPU reported {other:?}"));
                break;
            }
        }
    }
    if sh.failed.load(Ordering::Acquire) {
        // Give in-flight device work a moment to settle, then answer the rest with Internal
        // so that no client hangs.
        std::thread::sleep(Duration::from_millis(20));
        while !sh.stopping.load(Ordering::Acquire) {
            if !sh.answer_internal() {
                sh.region.requests().wait_nonempty(Duration::from_millis(1));
            }
        }
    }
}

/// The waker the notifier rings: only in interrupt mode, and only when the transport gave one
/// (executor-sqe replies run inside the executor and need no wake).
fn notifier_waker(cfg: &GpuExecutorConfig) -> Option<CompletionWaker> {
    match cfg.completion_wake {
        CompletionWake::Interrupt => cfg.waker.clone(),
        CompletionWake::Poll => None,
    }
}

/// The completion notifier: wakes the transport when the GPU publishes a completion, without
/// a host thread spinning or the transport polling on a timer (docs/gpu.md).
///
/// While requests are outstanding (more requests produced than completions), it launches
/// `bgs_completion_wait` for the position after the last completion it saw and sleeps in
/// `cuEventSynchronize` on a blocking-sync event; when that returns with a new completion
/// published, it rings the transport's waker if the transport sleeps with completions to reap
/// (one wake carries every completion published so far). When nothing is outstanding it sleeps on the request ring
/// like an idle executor, so an idle server launches nothing. It relies on every request
/// getting exactly one completion in the ring, which holds for the GPU executor (it serves
/// no streams, and the transports publish no cancel markers for it); anything else only
/// costs bounded waits that time out (`notifier_timeouts`).
fn notifier(sh: &Shared) {
    let Some(waker) = sh.waker.clone() else {
        return;
    };
    if let Err(e) = sh.device.make_current() {
        sh.fail(e.to_string());
        return;
    }
    let d = &sh.device;
    let stop = || {
        sh.stopping.load(Ordering::Acquire)
            || sh.failed.load(Ordering::Acquire)
            || d.ctl_u32(std::mem::offset_of!(Ctl, stop))
                .load(Ordering::Acquire)
                != 0
    };
    let r = notifier_loop(
        &sh.region,
        &waker,
        sh.idle_wait.as_ref(),
        &stop,
        &sh.notifier,
        |seen| d.completion_wait(seen),
    );
    if let Err(e) = r {
        sh.fail(format!("completion notifier: {e}"));
    }
}

/// The notifier's host logic, with the device-side wait passed in (`device_wait(seen)`
/// returns once the completion at position `seen` is published, or after a bounded time), so
/// that it can be tested without a GPU.
fn notifier_loop(
    region: &RingRegion,
    waker: &CompletionWaker,
    idle_wait: Option<&IdleWait>,
    stop: &dyn Fn() -> bool,
    c: &NotifierCounters,
    mut device_wait: impl FnMut(u64) -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let outstanding = || region.requests().produced() > region.completions().produced();
    while !stop() {
        let seen = region.completions().produced();
        // Wake a sleeping transport that has completions to reap: the one the last wait
        // returned for, and any published since (below `seen`: the next wait only watches
        // positions from `seen` on). A transport that registers as a sleeper after this
        // check re-checks the ring itself before it sleeps.
        if !region.completions().is_empty() && region.completions().has_sleepers() {
            c.rings.fetch_add(1, Ordering::Relaxed);
            (waker.0)();
        }
        if region.requests().produced() <= seen {
            c.idle_sleeps.fetch_add(1, Ordering::Relaxed);
            match idle_wait {
                Some(w) => {
                    // Registered as a request-ring sleeper, the kernel transport's BPF rings
                    // its doorbell for the next request; re-check after registering.
                    let _guard = region.requests().sleep_guard();
                    if !outstanding() && !stop() {
                        (w.0)(NOTIFIER_IDLE);
                    }
                }
                None => {
                    region
                        .requests()
                        .wait_until(NOTIFIER_IDLE, || outstanding() || stop());
                }
            }
            continue;
        }
        c.waits.fetch_add(1, Ordering::Relaxed);
        device_wait(seen)?;
        if region.completions().produced() > seen {
            c.wakes.fetch_add(1, Ordering::Relaxed);
        } else {
            c.timeouts.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// The host-launch dispatcher: pop, stage, launch the slot's graphs on its stream.
fn host_dispatcher(sh: &Shared) {
    if let Err(e) = sh.device.make_current() {
        sh.fail(e.to_string());
        return;
    }
    let d = &sh.device;
    let mut table = SlotTable::new(sh.nslots);
    let mut idle_since = Instant::now();
    while !sh.stopping.load(Ordering::Acquire) && !sh.failed.load(Ordering::Acquire) {
        let Some(j) = table.acquire(|j| d.slot_busy(j).load(Ordering::Acquire) != 0) else {
            std::hint::spin_loop();
            continue;
        };
        // SAFETY: host mode: `slot_ctl_host` has `nslots` entries and `j < nslots`; the slot
        // is free (busy == 0), so the device does not read `staged` now.
        let staged: *mut RequestEntry =
            unsafe { std::ptr::addr_of_mut!((*d.slot_ctl_host.add(j)).staged) };
        let got = sh.region.requests().try_pop(|e| {
            let n = (e.words as usize).min(SLOT_WORDS);
            // SAFETY: `staged` is a valid, exclusive RequestEntry slot (see above); the header
            // and the first `n` payload words are copied.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (e as *const RequestEntry).cast::<u8>(),
                    staged.cast::<u8>(),
                    std::mem::offset_of!(RequestEntry, payload) + 4 * n,
                );
            }
            plan::plan(e.op, e.param, e.words)
        });
        let Some(p) = got else {
            table.release(j);
            if idle_since.elapsed() > Duration::from_micros(50) {
                sh.region
                    .requests()
                    .wait_nonempty(Duration::from_micros(500));
            } else {
                std::hint::spin_loop();
            }
            continue;
        };
        idle_since = Instant::now();
        let Some(p) = p else {
            // An OP_CANCEL entry, consumed and never answered (the slot stays free).
            table.release(j);
            continue;
        };
        // SAFETY: as above; the device reads pos/busy only after the launches below.
        unsafe {
            std::ptr::addr_of_mut!((*d.slot_ctl_host.add(j)).pos).write_volatile(STAGED);
        }
        d.slot_busy(j).store(1, Ordering::Release);
        let s = d.streams[j];
        // One launch (the fused graph) unless the repeat count is not a power of two.
        let r = match plan::fused_index(&p) {
            Some(f) => d.launch(d.fused[j][f], s),
            None => {
                let mut r = d.launch(d.start[j], s);
                if let Some((c, reps)) = p.compute {
                    for k in plan::repeat_chain(reps) {
                        if r.is_ok() {
                            r = d.launch(d.chain[j][c.index()][k], s);
                        }
                    }
                }
                if r.is_ok() {
                    r = d.launch(d.publish[j], s);
                }
                r
            }
        };
        if let Err(e) = r {
            sh.fail(e.to_string());
            break;
        }
        sh.host_dispatched.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bgs_ring::RingConfig;
    use std::sync::mpsc;

    /// The notifier's host loop against a fake GPU (answers each request after a delay) and a
    /// fake transport that sleeps with a long timeout: every completion reaches the transport
    /// through the waker (no timeout ends a wait), and once nothing is outstanding the
    /// notifier sleeps instead of launching device waits.
    #[test]
    fn notifier_wakes_the_transport_for_every_completion_and_idles_without_waits() {
        const N: u32 = 40;
        let region = Arc::new(
            RingRegion::new(RingConfig {
                request_slots: 64,
                completion_slots: 64,
            })
            .unwrap(),
        );
        let stop = Arc::new(AtomicBool::new(false));
        // The fake GPU: answers each request 2 ms after taking it.
        let gpu = {
            let (region, stop) = (region.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let Some(id) = region.requests().try_pop(|e| e.request_id) else {
                        std::thread::sleep(Duration::from_micros(200));
                        continue;
                    };
                    std::thread::sleep(Duration::from_millis(2));
                    region
                        .completions()
                        .try_push(|c| {
                            c.request_id = id;
                            c.final_ = 1;
                            c.words = 0;
                        })
                        .unwrap();
                }
            })
        };
        // The waker: a channel the fake transport sleeps on.
        let (tx, rx) = mpsc::sync_channel::<()>(1024);
        let waker = CompletionWaker(Arc::new(move || {
            let _ = tx.try_send(());
        }));
        let counters = Arc::new(NotifierCounters::default());
        let notifier = {
            let (region, stop, counters) = (region.clone(), stop.clone(), counters.clone());
            std::thread::spawn(move || {
                // The device-side wait, simulated on the host: return once position `seen` is
                // published, or after 2 ms.
                let wait = |seen: u64| {
                    let end = Instant::now() + Duration::from_millis(2);
                    while region.completions().produced() <= seen && Instant::now() < end {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                    Ok(())
                };
                let s = || stop.load(Ordering::Acquire);
                notifier_loop(&region, &waker, None, &s, &counters, wait).unwrap();
            })
        };
        // The fake transport: publishes requests in small batches, then sleeps like the native
        // transport (sleep guard, re-check, wait) until it has reaped every answer.
        let mut reaped = 0u32;
        let mut timeouts = 0u32;
        let mut sent = 0u32;
        while reaped < N {
            if sent < N && sent - reaped < 4 {
                region
                    .requests()
                    .try_push(|e| {
                        e.request_id = sent;
                        e.words = 0;
                    })
                    .unwrap();
                region.requests().notify();
                sent += 1;
                continue;
            }
            while region.completions().try_pop(|c| c.request_id).is_some() {
                reaped += 1;
            }
            if reaped == N {
                break;
            }
            let guard = region.completions().sleep_guard();
            if region.completions().is_empty() {
                // Far longer than the test: only the waker ends this wait in time.
                if rx.recv_timeout(Duration::from_secs(10)).is_err() {
                    timeouts += 1;
                }
            }
            drop(guard);
        }
        assert_eq!(timeouts, 0, "a completion was found only by a timeout");
        let rings = counters.rings.load(Ordering::Relaxed);
        assert!(rings >= 1 && rings <= u64::from(N) * 2, "{rings} rings");
        // Idle: wait until the notifier has gone to sleep, then check that it launches no
        // device waits while nothing is outstanding.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !region.requests().has_sleepers() {
            assert!(Instant::now() < deadline, "the idle notifier never slept");
            std::thread::sleep(Duration::from_millis(1));
        }
        let waits = counters.waits.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(counters.waits.load(Ordering::Relaxed), waits);
        assert!(counters.wakes.load(Ordering::Relaxed) >= 1);
        // A request after the idle sleep wakes it through the request ring's futex.
        region
            .requests()
            .try_push(|e| {
                e.request_id = 999;
                e.words = 0;
            })
            .unwrap();
        region.requests().notify();
        let deadline = Instant::now() + Duration::from_secs(10);
        while region.completions().try_pop(|c| c.request_id).is_none() {
            assert!(
                Instant::now() < deadline,
                "the last request was not answered"
            );
            let _ = rx.recv_timeout(Duration::from_millis(100));
        }
        assert!(counters.waits.load(Ordering::Relaxed) > waits);
        stop.store(true, Ordering::Release);
        region.requests().notify();
        notifier.join().unwrap();
        gpu.join().unwrap();
    }
}
