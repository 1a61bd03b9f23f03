//! The bpf-gpu-server load generator.
//!
//! Open loop with send times fixed in advance (latency counts from the scheduled time, so a
//! slow server cannot hide behind a slow client), exact replay checking of every reply against
//! golden replies that were themselves checked against an independent f64 reference (for
//! generation: every token stream against the prompt's golden stream), and CPU accounting of
//! the server, the host and the generator over the measured interval.
//! `docs/load.md` explains the method; [`run`] is the entry point and [`client`] has blocking
//! helpers for tests.

pub mod client;
mod closed;
pub mod discover;
mod engine;
mod generate;
mod http;
mod openai;
mod payload;
pub mod report;

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use bgs_cpuacct::{
    HostSample, ProcessCpu, ProcessSample, SoftirqSample, ThreadGroupCpu, monotonic_ns,
};
use bgs_protocol::reply::{encode_http_request, encode_request};
use bgs_protocol::{HEADER_LEN, MAX_REPEAT, Op, RequestHeader, Status};

pub use client::{FrameClient, HttpResponse, Reply};
pub use closed::run_closed;
pub use engine::Counts;
pub use generate::{FLAG_IGNORE_EOS, GenerateConfig, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS};
pub use openai::{OpenAiConfig, run_openai};
pub use payload::{check_reference, golden_reference, make_payload, make_prompt, payload_words};
pub use report::{GenerateReport, Latency, LoadReport, ReportConfig};

use engine::{GenPlan, GenStats, Plan, STATUS_SLOTS, ThreadResult};
use report::{HostCpuReport, ProcessCpuReport, SoftirqReport};

/// What to run.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// Server address.
    pub target: SocketAddr,
    /// Echo, Gemm8, Fft32 or Generate.
    pub op: Op,
    /// Repeat count (request param) for gemm8/fft32.
    pub repeat: u32,
    /// Payload words for echo; gemm8/fft32 always send 64 (generate: see `generate`).
    pub words: u32,
    /// Offered requests per second, all connections together.
    pub rate: f64,
    /// TCP connections.
    pub connections: usize,
    /// Measured duration (after warm-up); ignored when `requests` is given.
    pub duration: Option<Duration>,
    /// Or a fixed number of measured requests; when given, it takes precedence over `duration`.
    pub requests: Option<u64>,
    /// Warm-up: excluded from latency and throughput, still checked and reported.
    pub warmup: Duration,
    /// Max requests in flight per connection.
    pub pipeline: usize,
    /// Send HTTP POSTs instead of bare frames.
    pub http: bool,
    /// A request unanswered this long after its scheduled time is timed out.
    pub timeout: Duration,
    /// Distinct payloads (generate: prompts) cycled through.
    pub distinct_payloads: usize,
    /// Payload seed.
    pub seed: u64,
    /// Server pid for CPU accounting (None: discover it from the listening socket).
    pub server_pid: Option<u32>,
    /// Show a progress bar.
    pub progress: bool,
    /// Client I/O threads (connections are spread across them).
    pub threads: usize,
    /// Prompt length, max new tokens and flags of generate requests (other ops ignore it).
    pub generate: GenerateConfig,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            target: SocketAddr::from(([127, 0, 0, 1], 7700)),
            op: Op::Gemm8,
            repeat: 1,
            words: 64,
            rate: 1000.0,
            connections: 128,
            duration: Some(Duration::from_secs(10)),
            requests: None,
            warmup: Duration::from_secs(1),
            pipeline: 16,
            http: false,
            timeout: Duration::from_secs(10),
            distinct_payloads: 64,
            seed: 1,
            server_pid: None,
            progress: false,
            threads: 1,
            generate: GenerateConfig::default(),
        }
    }
}

/// Largest echo payload the generator will send (the server's own limit is usually lower).
const MAX_WORDS: u32 = 1 << 20;
/// Length of the first and last windows of the run whose time to first token is reported
/// apart (a queue that grows during the run shows as a later window's larger TTFT).
const TTFT_WINDOW_NS: u64 = 10_000_000_000;

fn validate(cfg: &LoadConfig) -> anyhow::Result<()> {
    if cfg.op == Op::Generate {
        cfg.generate.validate()?;
    }
    ensure!(
        cfg.rate.is_finite() && cfg.rate > 0.0,
        "rate must be a positive number"
    );
    ensure!(cfg.connections >= 1, "need at least one connection");
    ensure!(cfg.pipeline >= 1, "pipeline must be at least 1");
    ensure!(cfg.threads >= 1, "need at least one thread");
    ensure!(
        cfg.distinct_payloads >= 1,
        "need at least one distinct payload"
    );
    ensure!(
        cfg.repeat <= MAX_REPEAT,
        "repeat must be at most {MAX_REPEAT}"
    );
    ensure!(cfg.words <= MAX_WORDS, "words must be at most {MAX_WORDS}");
    ensure!(
        cfg.duration.is_some() || cfg.requests.is_some(),
        "give a duration or a number of requests"
    );
    ensure!(!cfg.timeout.is_zero(), "timeout must be positive");
    Ok(())
}

/// One request frame (id 0) for payload `words`.
fn request_frame(cfg: &LoadConfig, id: u32, words: &[u32]) -> Vec<u8> {
    let h = if cfg.op == Op::Generate {
        cfg.generate.header(id, words.len() as u32)
    } else {
        RequestHeader::new(cfg.op, id, words.len() as u32, cfg.repeat)
    };
    let mut f = Vec::with_capacity(HEADER_LEN + words.len() * 4);
    encode_request(&mut f, &h, words);
    f
}

/// Send every payload once and record its reply, checked against the f64 reference.
fn golden_pass(cfg: &LoadConfig, payloads: &[Vec<u32>]) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut c = FrameClient::connect(cfg.target)
        .with_context(|| format!("connecting to {} for the golden pass", cfg.target))?;
    let mut golden = Vec::with_capacity(payloads.len());
    for (i, p) in payloads.iter().enumerate() {
        let h = RequestHeader::new(cfg.op, i as u32, p.len() as u32, cfg.repeat);
        // Busy is a valid answer but carries no result: retry for up to ~2 s.
        let mut attempts = 0;
        let reply = loop {
            let r = if cfg.http {
                let resp = c
                    .http_request(&h, p)
                    .with_context(|| format!("golden pass, payload {i}"))?;
                match resp.frames.as_slice() {
                    [f] if resp.status == 200 || resp.status == 503 => f.clone(),
                    _ => bail!(
                        "golden pass, payload {i}: HTTP {} with {} frame(s) in a {}-byte body",
                        resp.status,
                        resp.frames.len(),
                        resp.body.len()
                    ),
                }
            } else {
                c.request(&h, p)
                    .with_context(|| format!("golden pass, payload {i}"))?
            };
            attempts += 1;
            if r.header.status == Status::Busy as u16 && attempts < 400 {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            break r;
        };
        ensure!(
            reply.header.status == Status::Ok as u16,
            "golden pass, payload {i}: status {} instead of ok",
            reply.header.status
        );
        ensure!(
            reply.header.request_id == i as u32,
            "golden pass, payload {i}: reply carries request id {}",
            reply.header.request_id
        );
        if let Err(why) = check_reference(cfg.op, p, &reply.words) {
            bail!(
                "golden reply of payload {i} ({} x{}) fails the reference check: {why}",
                cfg.op.name(),
                cfg.repeat
            );
        }
        golden.push(reply.words.iter().flat_map(|w| w.to_le_bytes()).collect());
    }
    Ok(golden)
}

/// Dropped when a load thread ends (returning or unwinding): wakes the main thread, then
/// waits for the end-of-run CPU sample so that the thread is still alive when it is taken.
struct Finish {
    done: mpsc::Sender<()>,
    sampled: Arc<Barrier>,
}

impl Drop for Finish {
    fn drop(&mut self) {
        // The receiver only uses this as a wake-up; it never goes away before the barrier.
        let _ = self.done.send(());
        self.sampled.wait();
    }
}

/// Samples taken at one edge of the measured interval.
struct CpuSamples {
    server: Option<ProcessSample>,
    host: Option<HostSample>,
    client: Option<ProcessSample>,
    softirqs: Option<SoftirqSample>,
}

fn sample_cpu(server_pid: Option<u32>, notes: &mut Vec<String>) -> CpuSamples {
    let mut note = |what: &str, e: std::io::Error| notes.push(format!("sampling {what}: {e}"));
    let server = server_pid.and_then(|p| ProcessCpu::sample(p).map_err(|e| note("server", e)).ok());
    let host = HostSample::sample().map_err(|e| note("/proc/stat", e)).ok();
    let client = ProcessCpu::sample(std::process::id())
        .map_err(|e| note("the load generator", e))
        .ok();
    let softirqs = SoftirqSample::sample()
        .map_err(|e| notes.push(format!("sampling /proc/softirqs: {e}")))
        .ok();
    CpuSamples {
        server,
        host,
        client,
        softirqs,
    }
}

fn process_report(
    a: &Option<ProcessSample>,
    b: &Option<ProcessSample>,
    ok: u64,
) -> Option<ProcessCpuReport> {
    let (a, b) = (a.as_ref()?, b.as_ref()?);
    let delta = b.delta(a);
    Some(ProcessCpuReport {
        pid: b.pid,
        per_request: delta.per_request(ok),
        delta,
    })
}

/// The server's CPU per thread name, largest first (empty without a server pid).
fn server_threads(server: Option<&ProcessCpuReport>, ok: u64) -> Vec<ThreadGroupCpu> {
    server.map_or_else(Vec::new, |s| bgs_cpuacct::thread_groups(&s.delta, ok))
}

/// Run a load test and report on it. Fails on bad configuration, when the server cannot be
/// reached, or when a golden reply fails its reference check; failures during the run are
/// counted in the report instead.
pub fn run(cfg: &LoadConfig) -> anyhow::Result<LoadReport> {
    validate(cfg)?;
    let threads = cfg.threads.min(cfg.connections);
    let mut notes = Vec::new();
    if threads != cfg.threads {
        notes.push(format!(
            "threads reduced to {threads}, one per connection at most"
        ));
    }
    let (payloads, golden, gen_golden) = if cfg.op == Op::Generate {
        let g = &cfg.generate;
        let prompts: Vec<Vec<u32>> = (0..cfg.distinct_payloads)
            .map(|i| make_prompt(cfg.seed, i, g.prompt_tokens, g.token_range))
            .collect();
        let golden = generate::golden_pass(cfg.target, cfg.http, g, &prompts)?;
        (prompts, Vec::new(), Some(golden))
    } else {
        let words = payload_words(cfg.op, cfg.words);
        let payloads: Vec<Vec<u32>> = (0..cfg.distinct_payloads)
            .map(|i| make_payload(cfg.op, words, cfg.seed, i))
            .collect();
        let golden = golden_pass(cfg, &payloads)?;
        (payloads, golden, None)
    };

    // Encoded requests with id 0; the engine patches the id in place for each send.
    let host = cfg.target.to_string();
    let mut id_offset = 8;
    let requests: Vec<Vec<u8>> = payloads
        .iter()
        .map(|p| {
            let frame = request_frame(cfg, 0, p);
            if cfg.http {
                let mut out = Vec::with_capacity(frame.len() + 128);
                encode_http_request(&mut out, &host, &frame);
                // Every payload has the same length, so the head (and offset) is the same.
                id_offset = out.len() - frame.len() + 8;
                out
            } else {
                frame
            }
        })
        .collect();

    let mut streams = Vec::with_capacity(cfg.connections);
    for i in 0..cfg.connections {
        let s = TcpStream::connect_timeout(&cfg.target, Duration::from_secs(5))
            .with_context(|| format!("connection {i} to {}", cfg.target))?;
        s.set_nodelay(true)?;
        streams.push(s);
    }

    let server_pid = match cfg.server_pid {
        Some(p) => Some(p),
        None => match discover::find_listener_pid(cfg.target) {
            Ok((pid, note)) => {
                notes.push(note);
                Some(pid)
            }
            Err(why) => {
                notes.push(format!("server CPU not accounted: {why}"));
                None
            }
        },
    };
    if server_pid == Some(std::process::id()) {
        notes.push("the server runs in this process: server and client CPU overlap".into());
    }

    let period_ns = 1e9 / cfg.rate;
    let warmup_end = (cfg.warmup.as_secs_f64() * cfg.rate).ceil() as u64;
    // A request count wins over a duration, so that `requests: Some(n), ..Default::default()`
    // means n requests even though the default carries a duration.
    let measured = match (cfg.requests, cfg.duration) {
        (Some(n), _) => n,
        (None, Some(d)) => (d.as_secs_f64() * cfg.rate).ceil() as u64,
        (None, None) => bail!("give a duration or a number of requests"),
    };
    ensure!(measured < 1 << 48, "too many requests");
    let end = warmup_end + measured;

    let started_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    // A little slack so every thread is in its loop before request 0 is due.
    let t0_ns = monotonic_ns() + 5_000_000;
    let sched = |k: u64| t0_ns + (k as f64 * period_ns) as u64;
    let gen_plan = gen_golden.map(|golden| {
        let first = sched(warmup_end);
        let last = sched(end.saturating_sub(1).max(warmup_end));
        GenPlan {
            golden,
            first_window_end_ns: first + TTFT_WINDOW_NS,
            last_window_start_ns: last.saturating_sub(TTFT_WINDOW_NS).max(first),
        }
    });
    let plan = Arc::new(Plan {
        connections: cfg.connections,
        threads,
        pipeline: cfg.pipeline,
        http: cfg.http,
        period_ns,
        warmup_end,
        end,
        timeout_ns: cfg.timeout.as_nanos().min(u128::from(u64::MAX / 4)) as u64,
        t0_ns,
        requests,
        id_offset,
        golden,
        streams: gen_plan,
    });

    // Connection c goes to thread c % T, in order, so its local index is c / T.
    let mut per_thread: Vec<Vec<TcpStream>> = (0..threads).map(|_| Vec::new()).collect();
    for (c, s) in streams.into_iter().enumerate() {
        per_thread[c % threads].push(s);
    }
    let progress: Arc<Vec<AtomicU64>> = Arc::new((0..threads).map(|_| AtomicU64::new(0)).collect());
    let (done_tx, done_rx) = mpsc::channel::<()>();
    // Finished threads wait here until the end-of-run CPU sample is taken: a thread that has
    // exited is missing from task/*/schedstat, and the generator's own CPU would look tiny.
    let sampled = Arc::new(Barrier::new(threads + 1));
    let mut handles = Vec::with_capacity(threads);
    for (t, s) in per_thread.into_iter().enumerate() {
        let plan = Arc::clone(&plan);
        let progress = Arc::clone(&progress);
        let done_tx = done_tx.clone();
        let sampled = Arc::clone(&sampled);
        let h = std::thread::Builder::new()
            .name(format!("bgs-load-{t}"))
            .spawn(move || {
                // Reports "done" and holds the thread until the sample, even on a panic.
                let _finish = Finish {
                    done: done_tx,
                    sampled,
                };
                engine::run_thread(&plan, t, s, &progress[t])
            })
            .context("spawning a load thread")?;
        handles.push(h);
    }
    drop(done_tx);

    let bar = cfg.progress.then(|| {
        let b = indicatif::ProgressBar::new(end);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} requests ({per_sec}) {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b
    });
    let completed = || {
        progress
            .iter()
            .map(|a| a.load(std::sync::atomic::Ordering::Relaxed))
            .sum::<u64>()
    };

    // Start of the measured interval: the scheduled time of the first measured request.
    let measure_start_ns = plan.sched_ns(warmup_end);
    let mut finished = 0;
    loop {
        let now = monotonic_ns();
        if now >= measure_start_ns {
            break;
        }
        let wait = Duration::from_nanos((measure_start_ns - now).min(100_000_000));
        match done_rx.recv_timeout(wait) {
            Ok(()) => finished += 1,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if let Some(b) = &bar {
            b.set_position(completed());
        }
    }
    let before = sample_cpu(server_pid, &mut notes);
    while finished < threads {
        match done_rx.recv_timeout(Duration::from_millis(100)) {
            Ok(()) => finished += 1,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if let Some(b) = &bar {
            b.set_position(completed());
        }
    }
    // The run ends when the last outcome is known; sample right away.
    let after = sample_cpu(server_pid, &mut notes);
    sampled.wait();
    if let Some(b) = &bar {
        b.set_position(completed());
        b.finish_and_clear();
    }

    let mut results: Vec<ThreadResult> = Vec::with_capacity(threads);
    for h in handles {
        match h.join() {
            Ok(r) => results.push(r.context("load thread failed")?),
            Err(_) => bail!("a load thread panicked"),
        }
    }
    Ok(build_report(
        cfg,
        threads,
        &plan,
        results,
        &before,
        &after,
        started_unix_ms,
        notes,
        measured,
    ))
}

/// The report key of final-status slot `i` (see [`engine::GenStats::final_status`]).
fn status_key(i: usize) -> String {
    let name = match Status::from_u16(i as u16) {
        _ if i >= STATUS_SLOTS - 1 => "other",
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
        None => return format!("status_{i}"),
    };
    name.into()
}

#[allow(clippy::too_many_arguments)]
fn build_report(
    cfg: &LoadConfig,
    threads: usize,
    plan: &Plan,
    results: Vec<ThreadResult>,
    before: &CpuSamples,
    after: &CpuSamples,
    started_unix_ms: u64,
    mut notes: Vec<String>,
    measured: u64,
) -> LoadReport {
    let mut counts = Counts::default();
    let mut warmup_counts = Counts::default();
    let mut hist = engine::new_histogram().expect("valid histogram bounds");
    let mut lag = engine::new_histogram().expect("valid histogram bounds");
    let (mut request_bytes, mut reply_bytes, mut late) = (0, 0, 0);
    let (mut last_send, mut last_done) = (0u64, 0u64);
    let mut samples = Vec::new();
    let mut gen_stats = plan.streams.as_ref().and_then(|_| GenStats::new().ok());
    for r in results {
        if let (Some(g), Some(rg)) = (gen_stats.as_mut(), r.streams.as_ref())
            && g.add(rg).is_err()
        {
            notes.push("generation histograms could not be merged".into());
        }
        counts.add(&r.measured);
        warmup_counts.add(&r.warmup);
        if hist.add(&r.hist).is_err() || lag.add(&r.send_lag).is_err() {
            notes.push("latency histograms could not be merged".into());
        }
        request_bytes += r.request_bytes;
        reply_bytes += r.reply_bytes;
        late += r.late_replies;
        last_send = last_send.max(r.last_send_ns);
        last_done = last_done.max(r.last_done_ns);
        samples.extend(r.samples);
    }
    samples.truncate(20);
    let start = plan.sched_ns(plan.warmup_end);
    let send_interval_ns = if measured == 0 {
        0.0
    } else {
        last_send.saturating_sub(start) as f64 + plan.period_ns
    };
    let measured_interval_ns = (last_done.saturating_sub(start) as f64).max(send_interval_ns);
    let rate = |n: u64, ns: f64| if ns > 0.0 { n as f64 / (ns / 1e9) } else { 0.0 };
    let latency = Latency::from_histogram(&hist);
    let send_lag = Latency::from_histogram(&lag);
    let ok = counts.ok;
    let server_cpu = process_report(&before.server, &after.server, ok);
    let client_cpu = process_report(&before.client, &after.client, ok);
    let host_cpu = match (&before.host, &after.host) {
        (Some(a), Some(b)) => {
            let delta = b.delta(a);
            Some(HostCpuReport {
                per_request: delta.per_request(ok),
                delta,
            })
        }
        _ => None,
    };
    if host_cpu.is_some() {
        notes.push(
            "on loopback the receive softirq runs in the sender's context: compare process CPU \
             with host CPU, and pin client and server to disjoint CPUs (taskset)"
                .into(),
        );
    }
    let softirqs = match (&before.softirqs, &after.softirqs) {
        (Some(a), Some(b)) => {
            let delta = b.delta(a);
            let per = |n: u64| {
                if ok == 0 {
                    f64::NAN
                } else {
                    n as f64 / ok as f64
                }
            };
            Some(SoftirqReport {
                net_rx_per_request: per(delta.net_rx),
                net_tx_per_request: per(delta.net_tx),
                delta,
            })
        }
        _ => None,
    };
    let generate = match (gen_stats, &plan.streams) {
        (Some(g), Some(gp)) => {
            let lens = gp.golden.iter().map(|s| s.tokens.len() as u64);
            let final_statuses = g
                .final_status
                .iter()
                .enumerate()
                .filter(|&(_, &n)| n > 0)
                .map(|(i, &n)| (status_key(i), n))
                .collect();
            Some(GenerateReport {
                prompts: gp.golden.len(),
                golden_tokens: lens.clone().sum(),
                golden_min_tokens: lens.clone().min().unwrap_or(0),
                golden_max_tokens: lens.max().unwrap_or(0),
                completed: ok,
                tokens: g.tokens,
                tokens_per_s: rate(g.tokens, measured_interval_ns),
                ttft: Latency::from_histogram(&g.ttft),
                inter_token: Latency::from_histogram(&g.gap),
                ttft_first_10s: Latency::from_histogram(&g.ttft_first),
                ttft_last_10s: Latency::from_histogram(&g.ttft_last),
                final_statuses,
            })
        }
        _ => None,
    };
    LoadReport {
        config: ReportConfig {
            target: cfg.target.to_string(),
            op: cfg.op.name().into(),
            repeat: cfg.repeat,
            words: if cfg.op == Op::Generate {
                cfg.generate.prompt_tokens
            } else {
                payload_words(cfg.op, cfg.words)
            },
            rate: cfg.rate,
            connections: cfg.connections,
            pipeline: cfg.pipeline,
            http: cfg.http,
            warmup_s: cfg.warmup.as_secs_f64(),
            duration_s: cfg.duration.map(|d| d.as_secs_f64()),
            requests: cfg.requests,
            timeout_s: cfg.timeout.as_secs_f64(),
            distinct_payloads: cfg.distinct_payloads,
            seed: cfg.seed,
            threads,
            generate: (cfg.op == Op::Generate).then_some(cfg.generate),
        },
        started_unix_ms,
        scheduled: measured,
        warmup_scheduled: plan.warmup_end,
        failures: counts.failures(),
        warmup_failures: warmup_counts.failures(),
        counts,
        warmup_counts,
        late_replies: late,
        offered_rate: rate(measured, send_interval_ns),
        achieved_rate: rate(ok, measured_interval_ns),
        send_interval_s: send_interval_ns / 1e9,
        measured_interval_s: measured_interval_ns / 1e9,
        latency,
        send_lag,
        request_bytes,
        reply_bytes,
        server_threads: server_threads(server_cpu.as_ref(), ok),
        server_cpu,
        host_cpu,
        softirqs,
        generate,
        client_cpu,
        failure_samples: samples,
        notes,
    }
}
