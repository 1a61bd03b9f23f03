//! What start-up builds on the device: every slot's graphs (captured library calls and our
//! kernels), the GPU's send ring when it writes SENDs, and the scheduler configuration.

use super::*;

/// Set up module, memory, libraries and graphs. Returns whether the cubin came from the cache.
pub(super) fn build(
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
pub(super) fn setup_tx(
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
pub(super) fn schedulers(cfg: &GpuExecutorConfig) -> usize {
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
pub(super) fn launch_lanes() -> bool {
    !std::env::var("BGS_GPU_LAUNCH_LANES").is_ok_and(|v| v == "0")
}

/// What the captured library calls need (plain handles, copied out of `Device` so captures
/// can borrow it mutably).
#[derive(Clone, Copy)]
pub(super) struct Lib {
    pub(super) blas: cublas::cublasHandle_t,
    pub(super) b_dev: u64,
    pub(super) workspace_dev: u64,
    pub(super) slots_dev: u64,
}

impl Lib {
    pub(super) fn io(&self, s: usize) -> (u64, u64) {
        let base = self.slots_dev + (s * size_of::<GpuSlot>()) as u64;
        (
            base + std::mem::offset_of!(GpuSlot, input) as u64,
            base + std::mem::offset_of!(GpuSlot, out) as u64,
        )
    }

    /// The caller's unchanged cuBLAS call, bound to slot `s`'s buffers and stream.
    pub(super) fn sgemm(&self, stream: cu::CUstream, s: usize) -> Result<(), GpuError> {
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
    pub(super) fn fft(&self, plan: cufft::cufftHandle, s: usize) -> Result<(), GpuError> {
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
