//! The executor's host threads besides the device itself: the failure monitor, the completion
//! notifier (`--gpu-completion-wake interrupt`) and the host-launch dispatcher
//! (`--dispatcher host`).

use super::*;

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
pub(super) const NOTIFY_BUDGET_NS: u64 = 2_000_000;

/// Longest sleep of the idle notifier on the request ring: a producer's wake-up ends it
/// early; the bound covers a doorbell the kernel transport's BPF rang while another thread
/// drained it, and shutdown with an external wait.
const NOTIFIER_IDLE: Duration = Duration::from_millis(20);

/// `CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING`: `cuEventSynchronize` sleeps until the
/// GPU's interrupt instead of spinning.
pub(super) const EVENT_FLAGS: u32 = 0x1 | 0x2;

/// Watch for device-side failures; after one, answer the ring with Internal until shutdown.
pub(super) fn monitor(sh: &Shared) {
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
pub(super) fn notifier_waker(cfg: &GpuExecutorConfig) -> Option<CompletionWaker> {
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
pub(super) fn notifier(sh: &Shared) {
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
pub(super) fn notifier_loop(
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
pub(super) fn host_dispatcher(sh: &Shared) {
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
