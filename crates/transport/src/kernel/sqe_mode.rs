//! `--reply executor-sqe`: the reply stage runs inside the executor and writes SEND SQEs into
//! an SQPOLL ring (or sends itself below `sqpoll_above`); this thread is the watchdog.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bgs_bpf::KernelRx;
use bgs_uring::Uring;

use super::config::{ADAPTIVE_WATCHDOG, IDLE_WAIT, KernelStats, WATCH_FIRST, WATCH_NET};
use super::driver::{StageDriver, StatsTimer, collect_stats};
use super::reply::ReplyStage;
use super::submit::{Direct, GpuPause, SqIo};
use super::{GpuTx, KernelTransport};

/// The stage's poll while requests are on the GPU or replies wait for a turn (the GPU cannot
/// wake it for either), and the completion watch's longest gap between looks.
const EXECUTING_POLL: Duration = Duration::from_micros(50);

/// Whether requests are still on the GPU: request-ring entries neither answered through the
/// stage nor sent by the GPU.
fn executing(driver: &StageDriver, g: &GpuTx) -> bool {
    driver.region.requests().produced() > driver.answered() + g.table.gpu_sends()
}

/// The stage's poll while a CPU executor's replies wait on something that needs a timely look
/// (`ReplyStage::busy`: a linger, a SEND in flight; most of those also end with a CQE, which
/// wakes the wait anyway).
const CPU_BUSY_POLL: Duration = Duration::from_micros(100);

/// How the stage sleeps with adaptive submission (`sqpoll_above` > 0), when it makes system
/// calls anyway: in epoll on our ring's descriptor (readable when CQEs wait: accepts, SENDs
/// that went to the ring) and
/// - for a CPU executor, on the eventfd it writes after publishing while we are announced
///   ([`KernelTransport::waker`]);
/// - for a GPU whose sends are paused, on BPF's doorbell, announced as a sleeper on the
///   request ring (BPF's completion watch rings when a reply is there) and on the side ring
///   (BPF rings for the markers and busy answers it publishes there).
///
/// Not the doorbell with a CPU executor: its slots sleep on it, and epoll re-checks a ring
/// buffer's readiness before it reports it, so records we drained would leave a woken slot
/// asleep until its 1 ms timeout (seen: p50 0.86 ms at 1,000 req/s). The side ring's markers
/// then wait for the 5 ms safety net, as in the reply loop. (With `sqpoll_above` 0 the stage
/// keeps sleeping on the completion ring's futex: no read/write-family system call anywhere,
/// the paper's path.)
struct StageWait {
    epoll: rustix::fd::OwnedFd,
}

/// epoll data of the doorbell and of the executor's eventfd (our ring's is 0).
const EP_DOORBELL: u64 = 1;
const EP_WAKER: u64 = 2;

impl StageWait {
    /// `waker`: a CPU executor's eventfd; None for a GPU (the doorbell instead).
    fn new(rx: &KernelRx, uring: &Uring, waker: Option<BorrowedFd<'_>>) -> io::Result<Self> {
        use rustix::event::epoll;
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        epoll::add(
            &ep,
            uring,
            epoll::EventData::new_u64(0),
            epoll::EventFlags::IN,
        )?;
        if waker.is_none() {
            epoll::add(
                &ep,
                rx.doorbell_fd(),
                epoll::EventData::new_u64(EP_DOORBELL),
                epoll::EventFlags::IN,
            )?;
        }
        if let Some(w) = waker {
            // Edge-triggered: every write is an edge, so nothing has to read the counter (one
            // system call a wake-up less; it cannot reach its limit of 2^64 - 2).
            epoll::add(
                &ep,
                w,
                epoll::EventData::new_u64(EP_WAKER),
                epoll::EventFlags::IN | epoll::EventFlags::ET,
            )?;
        }
        Ok(StageWait { epoll: ep })
    }

    /// One wait. With a GPU whose sends are paused (`gpu`), as the reply loop's (`loop_mode`):
    /// announced as a request-ring sleeper, so BPF rings its doorbell for the next request or,
    /// with the completion `watch`, looks at the completion ring when the reply is expected and
    /// rings once it is there; and on the side ring. With a CPU executor (`gpu` None):
    /// announced as a completion-ring sleeper, so the executor writes our eventfd. `events`: the caller's buffer, kept across
    /// waits (an epoll event is not `Send`, so it cannot travel with this struct into the
    /// stage's thread).
    fn wait(
        &self,
        events: &mut Vec<rustix::event::epoll::Event>,
        driver: &mut StageDriver,
        uring: &Uring,
        gpu: Option<&GpuTx>,
        watch: bool,
    ) {
        let _side = gpu
            .is_some()
            .then(|| driver.side.completions().sleep_guard());
        let _requests = gpu
            .is_some()
            .then(|| driver.region.requests().sleep_guard());
        let _completions = gpu
            .is_none()
            .then(|| driver.region.completions().sleep_guard());
        let answered = driver.answered() + gpu.map_or(0, |g| g.table.gpu_sends());
        if watch {
            driver.rx.watch_answered(answered);
        }
        let idle = driver.region.completions().is_empty()
            && driver.side.completions().is_empty()
            && uring.cq().is_empty();
        let executing = driver.region.requests().produced() > answered;
        let watched = watch && executing && driver.rx.watch_scheduled();
        let busy = driver.stage.busy();
        let t = match () {
            _ if !idle => Duration::ZERO,
            _ if watched && !busy => WATCH_NET,
            _ if gpu.is_some() && (executing || busy) => EXECUTING_POLL,
            _ if busy => CPU_BUSY_POLL,
            // (A GPU took the arm above.) A CPU executor wakes us for every completion (a
            // stream's once per step): while requests execute the net can be as long as the
            // reply loop's then, 10 ms (with the 5 ms idle net it cost 200 wake-ups a second
            // for the whole life of a stream).
            _ if executing => WATCH_NET,
            _ => IDLE_WAIT,
        };
        // Waits whose timeout is a safety net: a look (GPU) or the executor's wake-up (CPU)
        // should have ended them.
        let net_began =
            ((gpu.is_none() || watch) && (t == WATCH_NET || t == IDLE_WAIT)).then(Instant::now);
        let ts = rustix::event::Timespec {
            tv_sec: t.as_secs() as _,
            tv_nsec: t.subsec_nanos() as _,
        };
        events.clear();
        let rung = match rustix::event::epoll::wait(
            &self.epoll,
            rustix::buffer::spare_capacity(events),
            Some(&ts),
        ) {
            Ok(_) => events.iter().any(|e| e.data.u64() == EP_DOORBELL),
            Err(_) => false,
        };
        if rung {
            // Consume the records so the doorbell descriptor stops being readable.
            driver.rx.drain_doorbell();
        }
        if net_began.is_some_and(|b| b.elapsed() >= t)
            && ((t == WATCH_NET && gpu.is_some()) || !driver.region.completions().is_empty())
        {
            driver.wake_timeouts += 1;
        }
    }
}

impl KernelTransport {
    /// `--reply executor-sqe`: the executor's reply thread runs the stage without system
    /// calls (SQEs land in SQPOLL ring memory); this thread is the watchdog. With
    /// `gpu_sends` the stage shares each connection's turn with the GPU, and the watchdog also
    /// wakes the SQPOLL thread for the GPU's ring.
    pub(super) fn run_executor_sqe(
        self,
        watchdog: Duration,
        sqpoll_above: u32,
    ) -> io::Result<KernelStats> {
        let stop = Arc::new(AtomicBool::new(false));
        let wakeups = Arc::new(AtomicU64::new(0));
        let uring = self.uring.clone();
        let rx = self.rx.clone();
        let listener_fd = self.listener.as_raw_fd();
        let stop2 = stop.clone();
        let wakeups2 = wakeups.clone();
        let stats_every = self.cfg.stats_every;
        let gpu = self.gpu.clone();
        let (limits, cancel_markers) = (self.cfg.limits, self.cfg.cancel_markers);
        let metrics = self.metrics.clone();
        // With a GPU paused below the rate (`submit` module docs), BPF's completion watch
        // wakes the stage when the reply is there, as it wakes the reply loop.
        let completion_watch = gpu.is_some()
            && sqpoll_above > 0
            && self.cfg.completion_watch
            && !self.cfg.executor_wakes;
        if completion_watch {
            self.rx.start_completion_watch(WATCH_FIRST, EXECUTING_POLL);
        }
        // With adaptive submission the stage sleeps in epoll (`StageWait`): a CPU executor's
        // eventfd, BPF's doorbell, our ring; for a GPU only while its sends are paused. Made
        // here, before the watchdog's epoll, so that a running transport's descriptors are all
        // open once that one is (tests count them).
        let stage_wait = if sqpoll_above > 0 {
            let waker = gpu.is_none().then(|| self.waker_fd.as_fd());
            Some(StageWait::new(&self.rx, &self.uring, waker)?)
        } else {
            None
        };
        let stage_thread = std::thread::Builder::new()
            .name("bgs-exec-sqe".into())
            .spawn(move || {
                let io_region = rx.region();
                let mut driver = StageDriver::new(rx.clone(), listener_fd, None, None);
                if let Some(g) = &gpu {
                    driver.stage = ReplyStage::with_turns(g.table.clone());
                }
                driver.stage.set_limits(limits);
                driver.stage.set_cancel_markers(cancel_markers);
                if let Some(m) = metrics {
                    driver.stage.set_metrics(m);
                }
                let mut last_sweep = Instant::now();
                let mut stats_timer = StatsTimer::new(stats_every);
                // Adaptive submission (`submit` module docs): the stage's own system calls
                // while replies come slowly; with a GPU that writes SENDs, its sends paused
                // for as long.
                let mut direct = (sqpoll_above > 0).then(|| Direct::new(sqpoll_above));
                let mut pause = gpu
                    .as_ref()
                    .filter(|_| direct.is_some())
                    .map(|g| GpuPause::new(g.table.clone()));
                let mut done = Vec::new();
                let mut events = Vec::with_capacity(2);
                while !stop2.load(Ordering::Acquire) {
                    let now = Instant::now();
                    if let Some(d) = &mut direct {
                        d.begin(&uring, now);
                        if let (Some(p), Some(g)) = (&mut pause, &gpu)
                            && let Err(e) = p.update(d, &g.ring)
                        {
                            tracing::warn!("waking the SQPOLL thread for the GPU failed: {e}");
                        }
                    }
                    let mut io = SqIo {
                        direct: direct.as_mut(),
                        ..SqIo::ring(&uring, &rx, &io_region)
                    };
                    let mut did = driver.pass(&uring, &mut io);
                    // Operations performed directly completed at once: hand their results to
                    // the stage as if they were CQEs, and flush what they made ready (the rest
                    // of a short send, the next replies of a connection).
                    while let Some(d) = io.direct.as_deref_mut() {
                        d.swap_done(&mut done);
                        if done.is_empty() {
                            break;
                        }
                        did = true;
                        for (user_data, res) in done.drain(..) {
                            driver.stage.on_cqe(user_data, res);
                        }
                        driver.stage.flush(&mut io);
                    }
                    if let Some(d) = io.direct {
                        // SQEs left for a sleeping SQPOLL thread: ours, and the GPU's.
                        let ours = d.end(&uring);
                        let gpus = match (&pause, &gpu) {
                            (Some(p), Some(g)) => p.end(d, &g.ring),
                            _ => Ok(false),
                        };
                        for woke in [ours, gpus] {
                            match woke {
                                Ok(true) => {
                                    wakeups2.fetch_add(1, Ordering::Relaxed);
                                }
                                Ok(false) => {}
                                Err(e) => tracing::warn!("waking the SQPOLL thread failed: {e}"),
                            }
                        }
                    }
                    if now.duration_since(last_sweep) > Duration::from_millis(5) {
                        driver.stage.sweep(now);
                        last_sweep = now;
                    }
                    if stats_timer.due(now) {
                        driver.direct = direct.as_ref().map(|d| d.counts);
                        let w = wakeups2.load(Ordering::Relaxed);
                        eprintln!(
                            "bgs: stats\n{}",
                            collect_stats(&rx, &driver, w, gpu.as_deref())
                        );
                    }
                    if did {
                        continue;
                    }
                    if let Some(w) = &stage_wait {
                        match &gpu {
                            None => {
                                w.wait(&mut events, &mut driver, &uring, None, false);
                                continue;
                            }
                            Some(g) if pause.as_ref().is_some_and(GpuPause::paused) => {
                                w.wait(&mut events, &mut driver, &uring, Some(g), completion_watch);
                                continue;
                            }
                            Some(_) => {}
                        }
                    }
                    // Sleep on the completion ring's (private) futex (`--sqpoll-above 0`, or a
                    // GPU that sends): CPU executors wake it, a GPU queues a private
                    // FUTEX_WAKE on its ring, which the SQPOLL thread (our address space) runs.
                    // CQEs are picked up at the timeout.
                    let t = match &gpu {
                        None if driver.stage.busy() => Duration::from_micros(100),
                        None => Duration::from_millis(2),
                        Some(g) => {
                            // The GPU cannot wake us when it passes a turn, and its own
                            // SENDs are finals we never see: poll soon while replies wait
                            // for a turn or requests are still on the GPU.
                            if driver.stage.busy() || executing(&driver, g) {
                                EXECUTING_POLL
                            } else {
                                Duration::from_millis(2)
                            }
                        }
                    };
                    driver.region.completions().wait_nonempty(t);
                }
                // The connections still open end with the transport: cancel their streams.
                driver.stage.end_all();
                driver
                    .stage
                    .publish_cancels(&mut SqIo::ring(&uring, &rx, &io_region));
                driver.finish(&uring);
                driver.direct = direct.as_ref().map(|d| d.counts);
                driver
            })?;
        let region = self.rx.region();
        // The watchdog sleeps in epoll on the shutdown pipe, so a stop is seen at once and
        // costs no read per round.
        let epoll = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)?;
        rustix::event::epoll::add(
            &epoll,
            &self.shutdown_rx,
            rustix::event::epoll::EventData::new_u64(0),
            rustix::event::epoll::EventFlags::IN,
        )?;
        let gpu = self.gpu.clone();
        let adaptive = sqpoll_above > 0;
        // With adaptive submission the stage wakes the SQPOLL thread itself after queueing
        // (`Direct::end`, and `GpuPause::end` for the GPU's ring), so the watchdog is only a
        // safety net and need not cost 20,000 wake-ups a second.
        let watchdog = if adaptive {
            watchdog.max(ADAPTIVE_WATCHDOG)
        } else {
            watchdog
        };
        let ts = rustix::event::Timespec {
            tv_sec: watchdog.as_secs() as _,
            tv_nsec: watchdog.subsec_nanos() as _,
        };
        let mut events = Vec::with_capacity(1);
        loop {
            // The only thing this thread does: the stage (the executor) cannot make system
            // calls, so someone must wake the SQPOLL thread once it went to sleep. The GPU's
            // ring shares that thread (one wake serves both) unless ATTACH_WQ was refused.
            // With adaptive submission the stage wakes the thread itself when it queues
            // operations for it; woken with nothing to do, it would only spin again until its
            // idle time passes. So only SQEs left waiting count (a safety net).
            let host_sleeps =
                self.uring.needs_wakeup() && (!adaptive || self.uring.sq_unconsumed() > 0);
            // While the GPU's sends are paused its ring is idle and its SQPOLL thread should
            // sleep: only SQEs left waiting count, as for ours.
            let (gpu_sleeps, shared) = gpu.as_ref().map_or((false, true), |g| {
                (
                    g.ring.needs_wakeup() && (!adaptive || g.ring.sq_unconsumed() > 0),
                    g.shared_sqpoll,
                )
            });
            if host_sleeps || (gpu_sleeps && shared) {
                self.uring.wake_sqpoll()?;
                wakeups.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(g) = &gpu
                && gpu_sleeps
                && !shared
            {
                g.ring.wake_sqpoll()?;
                wakeups.fetch_add(1, Ordering::Relaxed);
            }
            events.clear();
            match rustix::event::epoll::wait(
                &epoll,
                rustix::buffer::spare_capacity(&mut events),
                Some(&ts),
            ) {
                Ok(n) if n > 0 => break,
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        stop.store(true, Ordering::Release);
        region.completions().notify();
        let driver = stage_thread
            .join()
            .map_err(|_| io::Error::other("reply stage thread panicked"))?;
        Ok(self.stats(&driver, wakeups.load(Ordering::Relaxed)))
    }
}
