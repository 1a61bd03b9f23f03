//! CUDA driver-level state and helpers: initialization and the kernel module, the `Device`
//! (context, functions, streams, device and mapped host buffers), allocation, graph capture
//! and kernel launch, and the error names kernels report.

use super::*;

pub(super) fn ck_blas(r: cublas::cublasStatus_t, what: &str) -> Result<(), GpuError> {
    if r == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            what: what.to_string(),
            name: format!("{r:?}"),
        })
    }
}

pub(super) fn ck_fft(r: cufft::cufftResult, what: &str) -> Result<(), GpuError> {
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
pub(super) fn cuda_rt_error_name(e: u32) -> String {
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

pub(super) fn where_name(w: u32) -> &'static str {
    match w {
        1 => "scheduler launching a work graph",
        2 => "scheduler tail-relaunching itself",
        3 => "slot launching its repeat chain",
        4 => "slot launching its publish graph",
        _ => "device",
    }
}

/// Driver, device and libraries, ready to use.
pub(super) struct Env {
    pub(super) dev: cu::CUdevice,
    pub(super) info: DeviceInfo,
    pub(super) nvjitlink: String,
}

pub(super) fn init(cfg: &GpuExecutorConfig) -> Result<Env, GpuError> {
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
pub(super) fn kernels(env: &Env, cfg: &GpuExecutorConfig) -> Result<(Vec<u8>, bool), GpuError> {
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
pub(super) struct Device {
    pub(super) ctx: cu::CUcontext,
    pub(super) dev: cu::CUdevice,
    pub(super) module: cu::CUmodule,
    pub(super) region_host: *mut c_void,
    pub(super) region_dev: u64,
    pub(super) ctl_host: *mut Ctl,
    pub(super) ctl_dev: u64,
    /// Host mode: mapped host memory; device mode: null.
    pub(super) slot_ctl_host: *mut SlotCtl,
    pub(super) slot_ctl_dev: u64,
    pub(super) slot_ctl_is_device: bool,
    pub(super) slots_dev: u64,
    pub(super) sched_dev: u64,
    pub(super) b_dev: u64,
    pub(super) workspace_dev: u64,
    pub(super) blas: cublas::cublasHandle_t,
    pub(super) ffts: Vec<cufft::cufftHandle>,
    pub(super) streams: Vec<cu::CUstream>,
    /// One stream per device scheduler.
    pub(super) sched_streams: Vec<cu::CUstream>,
    pub(super) graphs: Vec<cu::CUgraph>,
    pub(super) execs: Vec<cu::CUgraphExec>,
    /// Per slot: start, publish, chain[compute][k].
    pub(super) start: Vec<cu::CUgraphExec>,
    pub(super) publish: Vec<cu::CUgraphExec>,
    pub(super) chain: Vec<[[cu::CUgraphExec; REPEAT_BITS]; 2]>,
    /// Per slot: fused work graphs (start → 2^k library calls → publish; `FUSED_NONE`: start →
    /// publish).
    pub(super) fused: Vec<[cu::CUgraphExec; FUSED]>,
    /// Device copy of `fused` for the scheduler.
    pub(super) fused_dev: u64,
    /// One graph per device scheduler (each relaunches itself).
    pub(super) sched_execs: Vec<cu::CUgraphExec>,
    /// Device schedulers; scheduler k owns a contiguous share of the slots and its `Sched` is
    /// the k-th at `sched_dev`.
    pub(super) nsched: usize,
    /// GPU-written SENDs: host memory registered for them (send table, io_uring rings, SQEs).
    pub(super) tx_registered: Vec<*mut c_void>,
    /// `struct bgs_gpu_tx` in device memory (0: no GPU sends).
    pub(super) tx_dev: u64,
    /// The stream of the resident CQ reaper.
    pub(super) tx_stream: cu::CUstream,
    /// Completion notifier: its stream and blocking-sync event (null when not running).
    pub(super) notify_stream: cu::CUstream,
    pub(super) notify_event: cu::CUevent,
    /// `bgs_completion_wait`.
    pub(super) f_wait: cu::CUfunction,
    /// The device-memory completion claim counter (`Sched::tail_hint` of scheduler 0).
    pub(super) tail_hint_dev: u64,
}

// SAFETY: the handles are plain driver/library handles and pointers to pinned or device memory;
// the driver API is thread-safe once the context is current on the calling thread, which every
// thread using `Device` ensures (`make_current`). Mutation happens only in start and shutdown.
unsafe impl Send for Device {}
// SAFETY: see `Send`; shared use is read-only plus atomic accesses to the mapped words.
unsafe impl Sync for Device {}

impl Device {
    pub(super) fn make_current(&self) -> Result<(), GpuError> {
        // SAFETY: `ctx` is the retained primary context, alive until `free`.
        ck(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    pub(super) fn ctl_u32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is the offset of a u32 field of the mapped `Ctl` (4-aligned); the GPU
        // accesses these words only with system-scope atomics/volatile accesses.
        unsafe { AtomicU32::from_ptr((self.ctl_host as *mut u8).add(off).cast()) }
    }

    pub(super) fn ctl_u64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: as `ctl_u32`, for an 8-aligned u64 field.
        unsafe { AtomicU64::from_ptr((self.ctl_host as *mut u8).add(off).cast()) }
    }

    pub(super) fn request_stop(&self) {
        self.ctl_u32(std::mem::offset_of!(Ctl, stop))
            .store(1, Ordering::SeqCst);
    }

    pub(super) fn slot_busy(&self, j: usize) -> &AtomicU32 {
        debug_assert!(!self.slot_ctl_is_device);
        // SAFETY: host mode: `slot_ctl_host` is an array of `nslots` mapped `SlotCtl`; `j` is
        // below `nslots` (callers index from the slot table).
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.slot_ctl_host.add(j)).busy)) }
    }

    pub(super) fn launch(&self, g: cu::CUgraphExec, s: cu::CUstream) -> Result<(), GpuError> {
        // SAFETY: `g` and `s` are live handles created in `start`.
        ck(unsafe { cu::cuGraphLaunch(g, s) }, "cuGraphLaunch")
    }

    /// Wait for a stream, at most `timeout`. Ok(true): done; Ok(false): timed out.
    pub(super) fn wait_stream(&self, s: cu::CUstream, timeout: Duration) -> Result<bool, GpuError> {
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
    pub(super) fn completion_wait(&self, seen: u64) -> Result<(), GpuError> {
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
    pub(super) fn free(&mut self) {
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

pub(super) fn get_function(module: cu::CUmodule, name: &str) -> Result<cu::CUfunction, GpuError> {
    let c = CString::new(name).map_err(|e| GpuError::Compile(e.to_string()))?;
    let mut f: cu::CUfunction = std::ptr::null_mut();
    ck(
        // SAFETY: `module` is a loaded module; `c` is NUL-terminated; out-pointer valid.
        unsafe { cu::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
        &format!("cuModuleGetFunction({name})"),
    )?;
    Ok(f)
}

pub(super) fn dev_alloc(bytes: usize, what: &str) -> Result<u64, GpuError> {
    let mut p: cu::CUdeviceptr = 0;
    // SAFETY: a context is current; out-pointer valid.
    unsafe {
        ck(cu::cuMemAlloc_v2(&mut p, bytes), what)?;
        ck(cu::cuMemsetD8_v2(p, 0, bytes), what)?;
    }
    Ok(p)
}

pub(super) fn host_alloc(bytes: usize, what: &str) -> Result<(*mut c_void, u64), GpuError> {
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
pub(super) fn capture(
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

pub(super) fn launch_kernel(
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
