//! Driver-level implementation of the GPU executor. This module: the running executor (state
//! shared with its threads, start-up, shutdown, counters). `driver`: CUDA initialization, the
//! `Device` and the driver-call helpers; `build`: the slots' graphs and the GPU's send ring;
//! `threads`: the failure monitor, the completion notifier and the host-launch dispatcher.

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

mod build;
mod driver;
mod threads;
use build::*;
pub(crate) use driver::probe;
use driver::*;
use threads::{EVENT_FLAGS, NOTIFY_BUDGET_NS, host_dispatcher, monitor, notifier, notifier_waker};

const DEVICE_LAUNCH_FLAG: u64 = 4; // CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH
const STREAM_NON_BLOCKING: u32 = 1;
const HOST_FLAGS: u32 = cu::CU_MEMHOSTALLOC_PORTABLE | cu::CU_MEMHOSTALLOC_DEVICEMAP;
const REGISTER_FLAGS: u32 = cu::CU_MEMHOSTREGISTER_PORTABLE | cu::CU_MEMHOSTREGISTER_DEVICEMAP;
const CUBLAS_WORKSPACE: usize = 1 << 20;
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

use crate::device::check as ck;

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

#[cfg(test)]
mod tests {
    use super::threads::notifier_loop;
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
