//! Admin endpoints of `bgs serve` (`--admin-listen ADDR`): liveness, readiness and metrics.
//!
//! - `GET /healthz`: 200 `ok` while the process is alive (the HTTP thread answers).
//! - `GET /readyz`: 200 `ready` once every component the server declared with
//!   [`Admin::expect`] reported [`Admin::up`]; 503 with a one-line reason before that
//!   (`starting: waiting for executor, transport`) and once shutdown began
//!   ([`Admin::stopping`]).
//! - `GET /metrics`: the OpenMetrics text format (which Prometheus scrapes; written by
//!   `prometheus-client`).
//!
//! Nothing here runs on the request path. The server hands over its counters ([`Sources`]:
//! atomics, ring indices, a BPF map reader) and a scrape reads them; the only per-request
//! work is the transport's [`RequestMetrics::observe`]. The HTTP server is axum on a
//! one-thread tokio runtime of its own, so it never competes with the transport for more than
//! one thread, and only while a probe or scrape is being answered.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use bgs_executor::{ExecutorStats, SlotUsage};
use bgs_protocol::{Op, Status};
use bgs_ring::RingRegion;
use bgs_transport::RequestMetrics;
use bgs_transport::stats::DURATION_BOUNDS_NS;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// Reads BPF's counters (a map lookup), from any thread.
pub type BpfReader = Arc<dyn Fn() -> bgs_bpf::KernelCounters + Send + Sync>;

/// The server's counters a scrape reads. Each is set once the part that owns it exists.
#[derive(Default)]
pub struct Sources {
    /// Answered requests and durations (both transports), open connections (native
    /// transport; the kernel transport's come from `open_connections`).
    pub requests: Option<Arc<RequestMetrics>>,
    /// The shared rings (occupancy).
    pub rings: Option<Arc<RingRegion>>,
    /// CPU executor counters.
    pub executor: Option<Arc<ExecutorStats>>,
    /// CPU executor slot use.
    pub slots: Option<SlotUsage>,
    /// Executor slots configured (any executor).
    pub slot_count: Option<usize>,
    /// BPF counters (kernel transport).
    pub bpf: Option<BpfReader>,
    /// Open connections, where the transport has no [`RequestMetrics`] (kernel transport).
    pub open_connections: Option<Arc<dyn Fn() -> usize + Send + Sync>>,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources")
            .field("requests", &self.requests.is_some())
            .field("rings", &self.rings.is_some())
            .field("executor", &self.executor.is_some())
            .field("slots", &self.slots)
            .field("slot_count", &self.slot_count)
            .field("bpf", &self.bpf.is_some())
            .field("open_connections", &self.open_connections.is_some())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Readiness {
    /// Components declared and not yet up, in declaration order.
    waiting: Vec<&'static str>,
    /// Components declared so far (a component reported up before it was expected counts).
    up: Vec<&'static str>,
}

#[derive(Debug, Default)]
struct Inner {
    ready: Mutex<Readiness>,
    /// Shutdown began. An atomic so that a signal handler can set it
    /// ([`Admin::stopping_flag`]).
    stopping: Arc<AtomicBool>,
    sources: Mutex<Sources>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves plain data behind; keep serving it.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Readiness and metric sources of one server; cheap to clone and share.
#[derive(Debug, Clone, Default)]
pub struct Admin {
    inner: Arc<Inner>,
}

impl Admin {
    /// Nothing expected yet: `/readyz` says `starting: nothing declared yet` until
    /// [`expect`](Self::expect) names the components.
    pub fn new() -> Self {
        Admin::default()
    }

    /// Declare components that must be up before the server is ready.
    pub fn expect(&self, components: &[&'static str]) {
        let mut r = lock(&self.inner.ready);
        for c in components {
            if !r.waiting.contains(c) && !r.up.contains(c) {
                r.waiting.push(c);
            }
        }
    }

    /// A component is up.
    pub fn up(&self, component: &'static str) {
        let mut r = lock(&self.inner.ready);
        r.waiting.retain(|c| *c != component);
        if !r.up.contains(&component) {
            r.up.push(component);
        }
    }

    /// Shutdown began: not ready from now on.
    pub fn stopping(&self) {
        self.inner.stopping.store(true, Ordering::Relaxed);
    }

    /// The flag [`stopping`](Self::stopping) sets, for a signal handler to set directly
    /// (`signal_hook::flag::register`).
    pub fn stopping_flag(&self) -> Arc<AtomicBool> {
        self.inner.stopping.clone()
    }

    /// `Ok` when ready, else the one-line reason.
    pub fn readiness(&self) -> Result<(), String> {
        let r = lock(&self.inner.ready);
        if self.inner.stopping.load(Ordering::Relaxed) {
            Err("shutting down".into())
        } else if !r.waiting.is_empty() {
            Err(format!("starting: waiting for {}", r.waiting.join(", ")))
        } else if r.up.is_empty() {
            Err("starting: nothing declared yet".into())
        } else {
            Ok(())
        }
    }

    /// Change the metric sources (e.g. `a.sources(|s| s.rings = Some(region))`).
    pub fn sources(&self, f: impl FnOnce(&mut Sources)) {
        f(&mut lock(&self.inner.sources));
    }

    /// The metrics in the OpenMetrics text format, as `/metrics` serves them.
    pub fn render_metrics(&self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Scrape(self.clone())));
        let mut out = String::new();
        // Writing into a String cannot fail; a collector error would be a bug in this crate.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
            tracing::error!("encoding metrics failed: {e}");
        }
        out
    }

    /// Serve the endpoints on `listen` from a thread of their own. Returns once the listener
    /// is bound.
    pub fn spawn(&self, listen: SocketAddr) -> std::io::Result<AdminServer> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let listener = rt.block_on(tokio::net::TcpListener::bind(listen))?;
        let addr = listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let app = router(self.clone());
        let thread = std::thread::Builder::new()
            .name("bgs-admin".into())
            .spawn(move || {
                let r = rt.block_on(async move {
                    axum::serve(listener, app)
                        .with_graceful_shutdown(async move {
                            let _ = stop_rx.await;
                        })
                        .await
                });
                if let Err(e) = r {
                    tracing::error!("admin server failed: {e}");
                }
            })?;
        Ok(AdminServer {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }
}

fn router(admin: Admin) -> axum::Router {
    let ready = admin.clone();
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.clone();
                async move {
                    match ready.readiness() {
                        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let admin = admin.clone();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        admin.render_metrics(),
                    )
                        .into_response()
                }
            }),
        )
}

/// The running admin HTTP server.
#[derive(Debug)]
pub struct AdminServer {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AdminServer {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop serving and join the thread.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for AdminServer {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Metric label of a wire status (the protocol's documented names, lower snake case).
pub fn status_label(s: u16) -> &'static str {
    match Status::from_u16(s) {
        Some(Status::Ok) => "ok",
        Some(Status::Token) => "token",
        Some(Status::EndOfStream) => "end_of_stream",
        Some(Status::BadMagic) => "bad_magic",
        Some(Status::BadVersion) => "bad_version",
        Some(Status::UnknownOp) => "unknown_op",
        Some(Status::PayloadTooLarge) => "payload_too_large",
        Some(Status::BadParam) => "bad_param",
        Some(Status::Busy) => "busy",
        Some(Status::Internal) => "internal",
        Some(Status::BadFlags) => "bad_flags",
        Some(Status::Cancelled) => "cancelled",
        None => "other",
    }
}

/// Metric label of a wire op (`None`: an op number without a name).
pub fn op_label(op: Option<u16>) -> &'static str {
    op.and_then(Op::from_u16).map_or("other", Op::name)
}

/// The collector: reads every source at scrape time.
#[derive(Debug)]
struct Scrape(Admin);

type Labels = Vec<(&'static str, String)>;

fn counter(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    values: &[(Labels, u64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    if let [(labels, v)] = values
        && labels.is_empty()
    {
        return ConstCounter::new(*v).encode(m);
    }
    for (labels, v) in values {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauge(enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: i64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)
}

fn one(v: u64) -> Vec<(Labels, u64)> {
    vec![(Vec::new(), v)]
}

fn as_i64(v: usize) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let ready = self.0.readiness().is_ok();
        gauge(
            &mut enc,
            "bgs_ready",
            "1 while /readyz answers 200",
            i64::from(ready),
        )?;
        if let Some(cpu) = process_cpu_seconds() {
            let c = ConstCounter::new(cpu);
            c.encode(enc.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time of the whole process (all threads), seconds",
                None,
                c.metric_type(),
            )?)?;
        }
        if let Some(rss) = process_resident_bytes() {
            gauge(
                &mut enc,
                "process_resident_memory_bytes",
                "Resident memory of the process, bytes",
                as_i64(rss),
            )?;
        }
        let s = lock(&self.0.inner.sources);
        if let Some(m) = &s.requests {
            // The kernel transport counts open connections from the sockhash instead.
            encode_requests(&mut enc, &m.snapshot(), s.open_connections.is_none())?;
        }
        if let Some(r) = &s.rings {
            encode_rings(&mut enc, r)?;
        }
        if let Some(n) = s.slot_count {
            gauge(
                &mut enc,
                "bgs_executor_slots",
                "Executor slots (CPU executor: threads; GPU executor: slots)",
                as_i64(n),
            )?;
        }
        if let Some(u) = &s.slots {
            gauge(
                &mut enc,
                "bgs_executor_busy_slots",
                "CPU executor threads holding a request that still owes its final reply",
                as_i64(u.busy_slots()),
            )?;
            gauge(
                &mut enc,
                "bgs_executor_live_requests",
                "Requests (one-shot or streams) in the CPU executor that still owe a final reply",
                as_i64(u.live()),
            )?;
        }
        if let Some(e) = &s.executor {
            encode_executor(&mut enc, e)?;
        }
        if let Some(open) = &s.open_connections {
            gauge(
                &mut enc,
                "bgs_connections_open",
                "Client connections open now",
                as_i64(open()),
            )?;
        }
        if let Some(read) = &s.bpf {
            encode_bpf(&mut enc, &read())?;
        }
        Ok(())
    }
}

fn encode_requests(
    enc: &mut DescriptorEncoder<'_>,
    snap: &bgs_transport::stats::RequestSnapshot,
    with_connections: bool,
) -> std::fmt::Result {
    let answered: Vec<(Labels, u64)> = snap
        .answered
        .iter()
        .map(|&(op, status, n)| {
            (
                vec![
                    ("op", op_label(op).to_string()),
                    ("status", status_label(status).to_string()),
                ],
                n,
            )
        })
        .collect();
    counter(
        enc,
        "bgs_requests",
        "Requests answered (final reply queued for sending), by op and reply status",
        &answered,
    )?;
    if with_connections {
        gauge(
            enc,
            "bgs_connections_open",
            "Client connections open now",
            i64::try_from(snap.conns_open).unwrap_or(i64::MAX),
        )?;
    }
    let mut buckets: Vec<(f64, u64)> = DURATION_BOUNDS_NS
        .iter()
        .map(|&ns| ns as f64 / 1e9)
        .zip(snap.buckets.iter().copied())
        .collect();
    // prometheus-client writes f64::MAX as the +Inf bucket.
    buckets.push((f64::MAX, snap.buckets.last().copied().unwrap_or(0)));
    // `_count` is the sum of the buckets read, so `_count` and `+Inf` always agree.
    let count: u64 = snap.buckets.iter().sum();
    let m = enc.encode_descriptor(
        "bgs_request_duration_seconds",
        "Time from a request's arrival (bytes read) to its final reply being queued for sending",
        None,
        MetricType::Histogram,
    )?;
    let mut m = m;
    m.encode_histogram::<NoLabelSet>(snap.sum_ns as f64 / 1e9, count, &buckets, None)
}

fn encode_rings(enc: &mut DescriptorEncoder<'_>, r: &RingRegion) -> std::fmt::Result {
    let (req, comp) = (r.requests(), r.completions());
    gauge(
        enc,
        "bgs_request_ring_occupancy",
        "Entries in the request ring (tail - head): published, not yet taken by the executor",
        as_i64(req.len()),
    )?;
    gauge(
        enc,
        "bgs_request_ring_capacity",
        "Request ring slots",
        as_i64(req.capacity()),
    )?;
    gauge(
        enc,
        "bgs_completion_ring_occupancy",
        "Entries in the completion ring (tail - head): published, not yet reaped by the transport",
        as_i64(comp.len()),
    )?;
    gauge(
        enc,
        "bgs_completion_ring_capacity",
        "Completion ring slots",
        as_i64(comp.capacity()),
    )?;
    counter(
        enc,
        "bgs_request_ring_published",
        "Entries ever published into the request ring",
        &one(req.produced()),
    )?;
    counter(
        enc,
        "bgs_completion_ring_published",
        "Entries ever published into the completion ring",
        &one(comp.produced()),
    )
}

fn encode_executor(enc: &mut DescriptorEncoder<'_>, e: &ExecutorStats) -> std::fmt::Result {
    use std::sync::atomic::Ordering::Relaxed;
    let rows: [(&str, &str, u64); 8] = [
        (
            "bgs_executor_requests",
            "Entries the CPU executor took from the request ring (rejections included)",
            e.requests.load(Relaxed),
        ),
        (
            "bgs_executor_completions",
            "Completions the CPU executor published (streamed tokens each count)",
            e.completions.load(Relaxed),
        ),
        (
            "bgs_executor_completion_stalls",
            "Times a completion found the completion ring full (retried later)",
            e.completion_stalls.load(Relaxed),
        ),
        (
            "bgs_executor_sleeps",
            "Times an executor thread slept on an empty request ring",
            e.sleeps.load(Relaxed),
        ),
        (
            "bgs_executor_streams",
            "Requests admitted into an engine (adapters run as engines too, so every request counts; for generate: streams started)",
            e.streams.load(Relaxed),
        ),
        (
            "bgs_executor_cancels",
            "Cancel markers taken from the request ring (client went away)",
            e.cancels.load(Relaxed),
        ),
        (
            "bgs_executor_credit_refusals",
            "Streamed frames held back because their stream had no credit left",
            e.credit_refusals.load(Relaxed),
        ),
        (
            "bgs_executor_lost_streams",
            "Streams an engine dropped without a final frame (answered internal)",
            e.lost_streams.load(Relaxed),
        ),
    ];
    for (name, help, v) in rows {
        counter(enc, name, help, &one(v))?;
    }
    Ok(())
}

fn encode_bpf(enc: &mut DescriptorEncoder<'_>, c: &bgs_bpf::KernelCounters) -> std::fmt::Result {
    let rows: [(&str, &str, u64); 18] = [
        (
            "bgs_bpf_frames",
            "Items BPF framed (requests and rejections)",
            c.frames,
        ),
        (
            "bgs_bpf_requests",
            "Valid requests BPF published into the request ring",
            c.requests,
        ),
        (
            "bgs_bpf_rejects",
            "Rejections BPF published into the request ring",
            c.rejects,
        ),
        (
            "bgs_bpf_rejects_direct",
            "Rejections BPF answered straight into the completion ring (request ring full)",
            c.rejects_direct,
        ),
        (
            "bgs_bpf_busy",
            "Busy replies BPF published (request ring full)",
            c.busy,
        ),
        (
            "bgs_bpf_completion_ring_full",
            "Items lost because both rings were full (connection failed)",
            c.completion_ring_full,
        ),
        (
            "bgs_bpf_connections_opened",
            "Connections that entered the sockhash",
            c.conns_opened,
        ),
        (
            "bgs_bpf_connections_closed",
            "Connections whose BPF state was removed at TCP_CLOSE",
            c.conns_closed,
        ),
        (
            "bgs_bpf_connections_refused",
            "Connections refused (state map or sockhash full)",
            c.conns_refused,
        ),
        (
            "bgs_bpf_eof_markers",
            "EOF markers published",
            c.eof_markers,
        ),
        (
            "bgs_bpf_reset_markers",
            "RESET markers published",
            c.reset_markers,
        ),
        (
            "bgs_bpf_bytes",
            "Bytes seen by the verdict program",
            c.bytes,
        ),
        (
            "bgs_bpf_dropped_bytes",
            "Bytes dropped after a closing item or a failure",
            c.dropped_bytes,
        ),
        (
            "bgs_bpf_no_state",
            "skbs of sockets without state (forgotten connections)",
            c.no_state,
        ),
        ("bgs_bpf_doorbells", "Doorbell records written", c.doorbells),
        (
            "bgs_bpf_marker_failed",
            "EOF/RESET markers that found the completion ring full",
            c.marker_failed,
        ),
        (
            "bgs_bpf_claim_contended",
            "Ring claims that gave up after many lost CAS races",
            c.claim_contended,
        ),
        (
            "bgs_bpf_internal",
            "BPF helper failures (should stay 0)",
            c.internal,
        ),
    ];
    for (name, help, v) in rows {
        counter(enc, name, help, &one(v))?;
    }
    let by_status: Vec<(Labels, u64)> = c
        .rejects_by_status
        .iter()
        .map(|&(s, n)| {
            let label = if s == 0 { "http" } else { status_label(s) };
            (vec![("status", label.to_string())], n)
        })
        .collect();
    counter(
        enc,
        "bgs_bpf_rejects_by_status",
        "BPF rejections by frame status (http: an HTTP error without a frame)",
        &by_status,
    )
}

/// utime + stime of this process from `/proc/self/stat`, in seconds.
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let f = stat_fields(&stat)?;
    // Fields after the command: state is field 3, so utime (14) and stime (15) are 11 and 12
    // positions after it.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| (utime + stime) as f64 / hz as f64)
}

/// Resident set size from `/proc/self/stat` (field 24, pages).
fn process_resident_bytes() -> Option<usize> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let f = stat_fields(&stat)?;
    let pages: usize = f.get(21)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * usize::try_from(page).ok()?)
}

/// The fields of `/proc/PID/stat` after the command name (which may hold spaces and
/// parentheses: it ends at the last `)`), starting with the state (field 3).
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_goes_starting_ready_stopping() {
        let a = Admin::new();
        assert_eq!(a.readiness().unwrap_err(), "starting: nothing declared yet");
        a.expect(&["transport", "executor"]);
        assert_eq!(
            a.readiness().unwrap_err(),
            "starting: waiting for transport, executor"
        );
        a.up("executor");
        assert_eq!(
            a.readiness().unwrap_err(),
            "starting: waiting for transport"
        );
        a.up("transport");
        assert!(a.readiness().is_ok());
        // Declaring a component already up does not make the server unready again.
        a.expect(&["transport"]);
        assert!(a.readiness().is_ok());
        a.stopping();
        assert_eq!(a.readiness().unwrap_err(), "shutting down");
    }

    #[test]
    fn stat_fields_survive_odd_command_names() {
        let stat = "42 (a b) c) S 1 2 3 4 5 6 7 8 9 10 111 222 0 0 20 0 1 0 5 100 7 rest";
        let f = stat_fields(stat).unwrap();
        assert_eq!(f[0], "S");
        assert_eq!(f[11], "111");
        assert_eq!(f[12], "222");
        assert_eq!(f[21], "7");
    }

    #[test]
    fn metrics_render_counters_and_histogram() {
        let a = Admin::new();
        let m = Arc::new(RequestMetrics::default());
        m.observe(Op::Gemm8 as u16, Status::Ok, 30_000);
        m.observe(Op::Gemm8 as u16, Status::Ok, 30_000_000_000);
        m.observe(77, Status::UnknownOp, 1);
        m.conn_opened();
        a.sources(|s| s.requests = Some(m.clone()));
        let text = a.render_metrics();
        assert!(
            text.contains("bgs_requests_total{op=\"gemm8\",status=\"ok\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("bgs_requests_total{op=\"other\",status=\"unknown_op\"} 1\n"));
        assert!(text.contains("# TYPE bgs_request_duration_seconds histogram\n"));
        assert!(text.contains("bgs_request_duration_seconds_count 3\n"));
        assert!(
            text.contains("bgs_request_duration_seconds_bucket{le=\"0.00001\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("bgs_request_duration_seconds_bucket{le=\"0.00005\"} 2\n"));
        assert!(text.contains("bgs_request_duration_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("bgs_connections_open 1\n"));
        assert!(text.contains("bgs_ready 0\n"));
        assert!(text.contains("# TYPE process_cpu_seconds counter\n"));
        assert!(text.ends_with("# EOF\n"));
    }
}
