//! Executors take requests from the request ring, run an adapter in one of N slots and
//! publish completions into the completion ring.
//!
//! [`CpuExecutor`] is the embedded default: one resident thread per slot, each consuming the
//! (multi-consumer) request ring directly. It keeps the semantics the GPU executor has: a
//! request occupies one slot from the moment it is taken until its final completion is
//! published; completions of different slots may be published out of order (the transport
//! restores per-connection order from `conn_seq`); a full completion ring back-pressures the
//! slot rather than dropping anything.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use bgs_adapters::{Adapter, Emit, OneShotCpu};
use bgs_protocol::{Op, Status};
use bgs_ring::{OP_CANCEL, OP_REJECT, RingRegion, SLOT_WORDS};

/// Called after a completion is published while the completion consumer announced that it
/// sleeps (see `bgs_ring` sleep guards); the native transport passes an eventfd writer.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// A sleep used instead of the request ring's futex when the producers cannot wake a futex
/// (BPF programs ring a BPF ring buffer instead). Called with the slot already counted as a
/// sleeper and the ring re-checked empty; it returns after a wake-up or the timeout.
pub type ExternalWait = Arc<dyn Fn(Duration) + Send + Sync>;

/// Settings of the CPU executor.
#[derive(Clone)]
pub struct CpuExecutorConfig {
    /// Number of slots (resident worker threads).
    pub slots: usize,
    /// How long an idle slot spins re-checking the ring before it sleeps.
    pub idle_spin: Duration,
    /// Upper bound on one sleep.
    pub max_sleep: Duration,
    /// How an idle slot sleeps when producers cannot wake the ring's futex.
    pub external_wait: Option<ExternalWait>,
}

impl Default for CpuExecutorConfig {
    fn default() -> Self {
        CpuExecutorConfig {
            slots: std::thread::available_parallelism().map_or(2, |n| n.get()),
            idle_spin: Duration::from_micros(20),
            max_sleep: Duration::from_millis(1),
            external_wait: None,
        }
    }
}

/// Counters shared by all slots.
#[derive(Debug, Default)]
pub struct ExecutorStats {
    /// Requests taken from the ring.
    pub requests: AtomicU64,
    /// Completions published.
    pub completions: AtomicU64,
    /// Times a slot found the completion ring full and had to wait.
    pub completion_stalls: AtomicU64,
    /// Times a slot went to sleep on an empty ring.
    pub sleeps: AtomicU64,
}

/// The embedded CPU executor.
pub struct CpuExecutor {
    threads: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    region: Arc<RingRegion>,
    stats: Arc<ExecutorStats>,
}

impl std::fmt::Debug for CpuExecutorConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuExecutorConfig")
            .field("slots", &self.slots)
            .field("idle_spin", &self.idle_spin)
            .field("max_sleep", &self.max_sleep)
            .field("external_wait", &self.external_wait.is_some())
            .finish()
    }
}

impl std::fmt::Debug for CpuExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuExecutor")
            .field("slots", &self.threads.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl CpuExecutor {
    /// Start `cfg.slots` slot threads running the one-shot CPU adapter.
    pub fn start(
        region: Arc<RingRegion>,
        cfg: &CpuExecutorConfig,
        waker: Option<Waker>,
    ) -> std::io::Result<Self> {
        Self::start_with(region, cfg, waker, || Box::new(OneShotCpu::default()))
    }

    /// Start slot threads with adapters made by `make_adapter` (one per slot).
    pub fn start_with(
        region: Arc<RingRegion>,
        cfg: &CpuExecutorConfig,
        waker: Option<Waker>,
        make_adapter: impl Fn() -> Box<dyn Adapter>,
    ) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(ExecutorStats::default());
        let mut threads = Vec::new();
        for slot in 0..cfg.slots.max(1) {
            let worker = SlotWorker {
                region: region.clone(),
                stop: stop.clone(),
                stats: stats.clone(),
                waker: waker.clone(),
                adapter: make_adapter(),
                idle_spin: cfg.idle_spin,
                max_sleep: cfg.max_sleep,
                external_wait: cfg.external_wait.clone(),
            };
            let t = std::thread::Builder::new()
                .name(format!("bgs-slot-{slot}"))
                .spawn(move || worker.run());
            match t {
                Ok(t) => threads.push(t),
                Err(e) => {
                    stop.store(true, Ordering::Release);
                    return Err(e);
                }
            }
        }
        Ok(CpuExecutor {
            threads,
            stop,
            region,
            stats,
        })
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<ExecutorStats> {
        &self.stats
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.threads.len()
    }

    /// Stop all slots after their current request and join them.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake sleeping slots so they see the flag now rather than after `max_sleep`.
        self.region.requests().notify();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for CpuExecutor {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// A request copied out of its ring slot, so the slot is released before the work runs.
struct Job {
    conn: u64,
    conn_seq: u32,
    op: u16,
    request_id: u32,
    param: u32,
    route: u32,
    words: usize,
    payload: [u32; SLOT_WORDS],
}

struct SlotWorker {
    region: Arc<RingRegion>,
    stop: Arc<AtomicBool>,
    stats: Arc<ExecutorStats>,
    waker: Option<Waker>,
    adapter: Box<dyn Adapter>,
    idle_spin: Duration,
    max_sleep: Duration,
    external_wait: Option<ExternalWait>,
}

impl SlotWorker {
    fn run(mut self) {
        let mut job = Job {
            conn: 0,
            conn_seq: 0,
            op: 0,
            request_id: 0,
            param: 0,
            route: 0,
            words: 0,
            payload: [0; SLOT_WORDS],
        };
        while !self.stop.load(Ordering::Acquire) {
            if self.take(&mut job) {
                if job.op == OP_CANCEL {
                    // A connection ended. The one-shot adapters hold nothing per connection,
                    // and the marker is never answered (docs/ring.md).
                    continue;
                }
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                self.execute(&job);
                continue;
            }
            // Idle: spin briefly (a burst often has more requests right behind), then sleep
            // until a producer notifies or `max_sleep` passes.
            let spin_until = std::time::Instant::now() + self.idle_spin;
            let mut found = false;
            while std::time::Instant::now() < spin_until {
                if !self.region.requests().is_empty() {
                    found = true;
                    break;
                }
                std::hint::spin_loop();
            }
            if !found {
                self.stats.sleeps.fetch_add(1, Ordering::Relaxed);
                match &self.external_wait {
                    Some(wait) => {
                        let ring = self.region.requests();
                        let _guard = ring.sleep_guard();
                        if ring.is_empty() && !self.stop.load(Ordering::Acquire) {
                            wait(self.max_sleep);
                        }
                    }
                    None => {
                        self.region.requests().wait_nonempty(self.max_sleep);
                    }
                }
            }
        }
    }

    fn take(&self, job: &mut Job) -> bool {
        self.region
            .requests()
            .try_pop(|e| {
                let n = (e.words as usize).min(SLOT_WORDS);
                job.conn = e.conn;
                job.conn_seq = e.conn_seq;
                job.op = e.op;
                job.request_id = e.request_id;
                job.param = e.param;
                job.route = e.route;
                job.words = n;
                job.payload[..n].copy_from_slice(&e.payload[..n]);
            })
            .is_some()
    }

    fn execute(&mut self, job: &Job) {
        let mut sink = CompletionSink {
            region: &self.region,
            stop: &self.stop,
            stats: &self.stats,
            waker: self.waker.as_ref(),
            job,
            final_sent: false,
        };
        match Op::from_u16(job.op) {
            // A rejection the framer placed in the connection's order: answer it as is.
            None if job.op == OP_REJECT => {
                let status = u16::try_from(job.param)
                    .ok()
                    .and_then(Status::from_u16)
                    .unwrap_or(Status::Internal);
                sink.emit(status, true, 0, &[]);
            }
            Some(op) => self
                .adapter
                .run(op, job.param, &job.payload[..job.words], &mut sink),
            None => sink.emit(Status::UnknownOp, true, 0, &[]),
        }
        if !sink.final_sent {
            // Every accepted request is answered exactly once: an adapter that forgot its
            // final frame yields an internal error rather than a hung client.
            tracing::error!(op = job.op, "adapter returned without a final frame");
            sink.emit(Status::Internal, true, 0, &[]);
        }
    }
}

struct CompletionSink<'a> {
    region: &'a RingRegion,
    stop: &'a AtomicBool,
    stats: &'a ExecutorStats,
    waker: Option<&'a Waker>,
    job: &'a Job,
    final_sent: bool,
}

impl Emit for CompletionSink<'_> {
    fn emit(&mut self, status: Status, final_: bool, stream_seq: u32, words: &[u32]) {
        if self.final_sent {
            tracing::error!("adapter emitted after its final frame; dropped");
            return;
        }
        let n = words.len().min(SLOT_WORDS);
        let mut stalled = false;
        loop {
            let pushed = self.region.completions().try_push(|e| {
                e.conn = self.job.conn;
                e.conn_seq = self.job.conn_seq;
                e.status = status as u16;
                e.final_ = u16::from(final_);
                e.request_id = self.job.request_id;
                e.words = n as u32;
                e.stream_seq = stream_seq;
                e.route = self.job.route;
                e.payload[..n].copy_from_slice(&words[..n]);
            });
            if pushed.is_ok() {
                break;
            }
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if !stalled {
                stalled = true;
                self.stats.completion_stalls.fetch_add(1, Ordering::Relaxed);
            }
            // The consumer is behind: let it run.
            std::thread::sleep(Duration::from_micros(20));
        }
        self.stats.completions.fetch_add(1, Ordering::Relaxed);
        self.final_sent = final_;
        // Futex sleepers (other executors' consumers, tests) and an epoll sleeper (the native
        // transport, through its eventfd) are both told; each costs a load when nobody sleeps.
        // One fence and load when nobody sleeps (the common case under load); `notify`
        // re-checks only when someone does.
        let ring = self.region.completions();
        if ring.has_sleepers() {
            ring.notify();
            if let Some(w) = self.waker {
                w();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bgs_ring::RingConfig;
    use std::time::Instant;

    fn region() -> Arc<RingRegion> {
        Arc::new(
            RingRegion::new(RingConfig {
                request_slots: 8,
                completion_slots: 8,
            })
            .unwrap(),
        )
    }

    fn collect(region: &RingRegion, n: usize) -> Vec<(u32, u16, u32, Vec<u32>)> {
        let mut out = Vec::new();
        let end = Instant::now() + Duration::from_secs(10);
        while out.len() < n && Instant::now() < end {
            if let Some(c) = region.completions().try_pop(|e| {
                (
                    e.conn_seq,
                    e.status,
                    e.route,
                    e.payload[..e.words as usize].to_vec(),
                )
            }) {
                out.push(c);
            } else {
                region
                    .completions()
                    .wait_nonempty(Duration::from_millis(10));
            }
        }
        out.sort();
        out
    }

    #[test]
    fn executes_requests_and_passes_rejections_through() {
        let region = region();
        let exec = CpuExecutor::start(
            region.clone(),
            &CpuExecutorConfig {
                slots: 2,
                ..Default::default()
            },
            None,
        )
        .unwrap();
        region
            .requests()
            .try_push(|e| {
                e.conn = 5;
                e.conn_seq = 0;
                e.op = Op::Echo as u16;
                e.words = 2;
                e.route = bgs_ring::route::HTTP;
                e.payload[..2].copy_from_slice(&[9, 8]);
            })
            .unwrap();
        region
            .requests()
            .try_push(|e| {
                e.conn = 5;
                e.conn_seq = 1;
                e.op = OP_REJECT;
                e.param = Status::BadParam as u32;
                e.words = 0;
                e.route = bgs_ring::route::CLOSE;
            })
            .unwrap();
        region.requests().notify();
        let got = collect(&region, 2);
        assert_eq!(
            got,
            vec![
                (0, Status::Ok as u16, bgs_ring::route::HTTP, vec![9, 8]),
                (1, Status::BadParam as u16, bgs_ring::route::CLOSE, vec![]),
            ]
        );
        exec.shutdown();
    }
}
