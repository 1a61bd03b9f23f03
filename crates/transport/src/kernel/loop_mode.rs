//! `--reply loop`: a service thread runs the reply stage and sleeps in `io_uring_enter`
//! between events; with an executor that cannot wake it, BPF's completion watch (or its timer)
//! tells it when replies are there.

use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::KernelTransport;
use super::config::{IDLE_WAIT, KernelStats, WATCH_FIRST, WATCH_NET};
use super::driver::{StageDriver, StatsTimer};
use super::submit::SqIo;

impl KernelTransport {
    /// `--reply loop`: this thread runs the stage and waits in `io_uring_enter` for a CQE (a
    /// send completing, an accept, the executor's eventfd, BPF's doorbell) or the timer.
    pub(super) fn run_loop(self, timer: Duration) -> io::Result<KernelStats> {
        let mut driver = StageDriver::new(
            self.rx.clone(),
            self.listener.as_raw_fd(),
            Some(self.waker_fd.as_raw_fd()),
            Some(self.shutdown_rx.as_raw_fd()),
        );
        if !self.cfg.executor_wakes {
            driver.watch = Some((self.rx.doorbell_fd().as_raw_fd(), false));
        }
        // The BPF completion watch: only for an executor that cannot wake us (it replaces the
        // doorbell at each request and the timer while that request executes).
        let completion_watch = self.cfg.completion_watch && !self.cfg.executor_wakes;
        if completion_watch {
            self.rx
                .start_completion_watch(WATCH_FIRST.min(timer), timer.max(WATCH_FIRST));
        }
        driver.stage.set_limits(self.cfg.limits);
        driver.stage.set_cancel_markers(self.cfg.cancel_markers);
        if let Some(m) = &self.metrics {
            driver.stage.set_metrics(m.clone());
        }
        let region = self.rx.region();
        let mut wakeups = 0u64;
        let mut last_sweep = Instant::now();
        let mut stats_timer = StatsTimer::new(self.cfg.stats_every);
        loop {
            let mut io = SqIo::ring(&self.uring, &self.rx, &region);
            driver.pass(&self.uring, &mut io);
            if driver.stop_requested {
                // The connections still open end with the transport: cancel their streams.
                driver.stage.end_all();
                driver.stage.publish_cancels(&mut io);
                driver.finish(&self.uring);
                break;
            }
            if std::mem::take(&mut driver.watch_fired) {
                // Consume the records so the doorbell descriptor stops being readable.
                self.rx.drain_doorbell();
            }
            let now = Instant::now();
            if now.duration_since(last_sweep) > Duration::from_millis(5) {
                driver.stage.sweep(now);
                last_sweep = now;
            }
            if stats_timer.due(now) {
                eprintln!("bgs: stats\n{}", self.stats(&driver, wakeups));
            }
            // Announce the sleep, then re-check: a completion published after the check
            // makes its executor write the eventfd, whose READ completion ends the wait.
            let guard = driver.region.completions().sleep_guard();
            // Without executor wake-ups, also count as a request-ring sleeper: BPF then rings
            // its doorbell for the next request, and we start polling at the short timer.
            let request_guard = driver
                .watch
                .is_some()
                .then(|| driver.region.requests().sleep_guard());
            let idle = driver.region.completions().is_empty()
                && driver.side.completions().is_empty()
                && self.uring.cq().is_empty();
            // While requests are in the executor, or sends, shutdowns or accepts are pending,
            // wake at least every `timer` (a GPU executor cannot write the eventfd: this timer
            // is its completion latency); otherwise a longer timer still catches markers BPF
            // published (it cannot write the eventfd either).
            let executing = driver.region.requests().produced() > driver.answered();
            // With the completion watch: a look BPF has scheduled keeps looking while we are
            // announced and requests are unanswered, and rings when a reply is there; read
            // after the announcement above (`KernelRx::watch_scheduled`).
            // The answered count is kept current even while idle: a look that fires then
            // stops at once instead of looking on for a reply already taken.
            if completion_watch {
                self.rx.watch_answered(driver.answered());
            }
            let watched = completion_watch && executing && self.rx.watch_scheduled();
            // With an executor that wakes us for every completion, requests that are only
            // executing need no timer: the wake ends the wait (the long timeout is a net).
            let woken = self.cfg.executor_wakes && !driver.stage.busy();
            let t = match self.cfg.wake_timeout {
                Some(w) if executing && woken => w,
                _ if watched && !driver.stage.busy() => WATCH_NET,
                _ if executing || driver.stage.busy() => timer,
                _ => IDLE_WAIT,
            };
            let wake_wait =
                (executing && woken && self.cfg.wake_timeout.is_some()) || t == WATCH_NET;
            // Waits whose timeout is a safety net (counted when it ends them): with the watch
            // that includes the idle wait, since a request that came while we slept idle
            // should have been rung by its look. `enter` answers a wait its timeout ended like
            // any other (and, when it also submitted, reports the submissions), so the clock
            // says which ran their full time; it is read only for these waits.
            let net_began = (wake_wait || (completion_watch && t == IDLE_WAIT)).then(Instant::now);
            match self.uring.enter(io.queued, u32::from(idle), Some(t)) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            if net_began.is_some_and(|b| b.elapsed() >= t)
                && (wake_wait || !driver.region.completions().is_empty())
            {
                driver.wake_timeouts += 1;
            }
            drop(request_guard);
            drop(guard);
            wakeups += 1;
        }
        Ok(self.stats(&driver, wakeups))
    }
}
