//! The report of a run: JSON via serde, a compact table via `Display`.

use std::collections::BTreeMap;
use std::fmt;

use bgs_cpuacct::{
    HostDelta, HostPerRequest, ProcessDelta, ProcessPerRequest, SoftirqDelta, ThreadGroupCpu,
};
use serde::Serialize;

pub use crate::engine::Counts;
use crate::generate::GenerateConfig;

/// The configuration a report was produced with.
#[derive(Clone, Debug, Serialize)]
pub struct ReportConfig {
    /// Server address.
    pub target: String,
    /// Operation name.
    pub op: String,
    /// Repeat count (gemm8/fft32).
    pub repeat: u32,
    /// Payload words per request.
    pub words: u32,
    /// Offered rate asked for (requests/s).
    pub rate: f64,
    /// Connections.
    pub connections: usize,
    /// Max requests in flight per connection.
    pub pipeline: usize,
    /// HTTP mode.
    pub http: bool,
    /// Warm-up seconds.
    pub warmup_s: f64,
    /// Measured duration asked for, seconds.
    pub duration_s: Option<f64>,
    /// Measured requests asked for.
    pub requests: Option<u64>,
    /// Per-request timeout, seconds.
    pub timeout_s: f64,
    /// Distinct payloads replayed.
    pub distinct_payloads: usize,
    /// Payload seed.
    pub seed: u64,
    /// Client I/O threads.
    pub threads: usize,
    /// Generation parameters (op generate only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generate: Option<GenerateConfig>,
}

/// Latency of measured ok replies, from scheduled send time to complete reply, in µs.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Latency {
    /// Replies measured.
    pub count: u64,
    /// Smallest.
    pub min_us: f64,
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Largest.
    pub max_us: f64,
}

impl Latency {
    /// Summary of a nanosecond histogram (None when it is empty).
    pub fn from_histogram(h: &hdrhistogram::Histogram<u64>) -> Option<Latency> {
        let us = |v: u64| v as f64 / 1000.0;
        (!h.is_empty()).then(|| Latency {
            count: h.len(),
            min_us: us(h.min()),
            mean_us: h.mean() / 1000.0,
            p50_us: us(h.value_at_quantile(0.50)),
            p90_us: us(h.value_at_quantile(0.90)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        })
    }
}

/// What generation streams measured (measured requests only). Times count from the scheduled
/// send time, like `latency`; only streams that matched their golden stream up to that point
/// contribute timings.
#[derive(Clone, Debug, Serialize)]
pub struct GenerateReport {
    /// Prompts replayed (distinct payloads).
    pub prompts: usize,
    /// Tokens in the golden streams, all prompts together.
    pub golden_tokens: u64,
    /// Shortest and longest golden stream (tokens).
    pub golden_min_tokens: u64,
    /// Longest golden stream (tokens).
    pub golden_max_tokens: u64,
    /// Streams that ended with a correct end-of-stream frame (= `counts.ok`).
    pub completed: u64,
    /// Token frames received.
    pub tokens: u64,
    /// Token frames received per second of the measured interval.
    pub tokens_per_s: f64,
    /// Time to first token (scheduled send to the first token frame).
    pub ttft: Option<Latency>,
    /// Gaps between consecutive token frames of a stream (frames that arrive in one read share
    /// an arrival time, so a gap can be as small as 0.001 µs).
    pub inter_token: Option<Latency>,
    /// Time to first token of requests scheduled in the first 10 s of the measured interval.
    pub ttft_first_10s: Option<Latency>,
    /// Time to first token of requests scheduled in the last 10 s of the measured interval
    /// (the two windows overlap in runs shorter than 20 s).
    pub ttft_last_10s: Option<Latency>,
    /// Final frames by status name (end_of_stream, busy, cancelled, bad_param, ...).
    pub final_statuses: BTreeMap<String, u64>,
}

/// Thread groups listed in the text report (all of them are in the JSON).
const SERVER_THREADS_SHOWN: usize = 6;

/// CPU of one process over the measured interval.
#[derive(Clone, Debug, Serialize)]
pub struct ProcessCpuReport {
    /// Process id.
    pub pid: u32,
    /// The raw delta (with a per-thread breakdown).
    pub delta: ProcessDelta,
    /// Per measured ok request.
    pub per_request: ProcessPerRequest,
}

/// Host CPU over the measured interval.
#[derive(Clone, Debug, Serialize)]
pub struct HostCpuReport {
    /// The raw delta (aggregate and per CPU).
    pub delta: HostDelta,
    /// Per measured ok request.
    pub per_request: HostPerRequest,
}

/// Network softirqs over the measured interval, from `/proc/softirqs`: exact counts of
/// softirq runs (not time; the tick-sampled time is `host_cpu`'s softirq column).
#[derive(Clone, Debug, Serialize)]
pub struct SoftirqReport {
    /// The raw delta (totals and per CPU).
    pub delta: SoftirqDelta,
    /// NET_RX softirq runs per measured ok request.
    pub net_rx_per_request: f64,
    /// NET_TX softirq runs per measured ok request.
    pub net_tx_per_request: f64,
}

/// Everything a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct LoadReport {
    /// The configuration.
    pub config: ReportConfig,
    /// Wall-clock start (Unix ms).
    pub started_unix_ms: u64,
    /// Measured requests scheduled (after warm-up).
    pub scheduled: u64,
    /// Warm-up requests scheduled.
    pub warmup_scheduled: u64,
    /// Outcomes of measured requests.
    pub counts: Counts,
    /// Outcomes of warm-up requests.
    pub warmup_counts: Counts,
    /// wrong + error + timed_out + conn_failed of measured requests.
    pub failures: u64,
    /// The same for warm-up requests.
    pub warmup_failures: u64,
    /// Replies that arrived after their request was counted as timed out.
    pub late_replies: u64,
    /// Measured requests scheduled / send interval (requests/s).
    pub offered_rate: f64,
    /// Measured ok replies / measured interval (requests/s).
    pub achieved_rate: f64,
    /// From the first measured scheduled send to the last measured send, plus one period (s).
    pub send_interval_s: f64,
    /// From the first measured scheduled send to the last measured outcome (s).
    pub measured_interval_s: f64,
    /// Latency of measured ok replies (None when there were none).
    pub latency: Option<Latency>,
    /// How late measured requests were written after their scheduled time (client lag; it is
    /// already inside `latency`, which counts from the scheduled time).
    pub send_lag: Option<Latency>,
    /// Bytes written (all requests, warm-up included).
    pub request_bytes: u64,
    /// Bytes read (all replies, warm-up included).
    pub reply_bytes: u64,
    /// Server process CPU, when its pid is known.
    pub server_cpu: Option<ProcessCpuReport>,
    /// The server's CPU per thread name over the measured interval (schedstat), largest
    /// first; threads that exited in between as one estimated group. Empty without a pid.
    pub server_threads: Vec<ThreadGroupCpu>,
    /// Whole-host CPU.
    pub host_cpu: Option<HostCpuReport>,
    /// Network softirq counts (absent when `/proc/softirqs` could not be read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub softirqs: Option<SoftirqReport>,
    /// Generation metrics (op generate only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generate: Option<GenerateReport>,
    /// This load generator's own CPU.
    pub client_cpu: Option<ProcessCpuReport>,
    /// The first failures, described.
    pub failure_samples: Vec<String>,
    /// Anything worth knowing about how the numbers were obtained.
    pub notes: Vec<String>,
}

impl LoadReport {
    /// No failures at all, warm-up included, and every scheduled request classified.
    pub fn is_clean(&self) -> bool {
        self.failures == 0
            && self.warmup_failures == 0
            && self.counts.total() == self.scheduled
            && self.warmup_counts.total() == self.warmup_scheduled
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }
}

fn f(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.2}")
    } else {
        "-".into()
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let what = match &c.generate {
            Some(g) => format!(
                "{} ({} prompt tokens, max {} new{}, {} prompts)",
                c.op,
                g.prompt_tokens,
                g.max_tokens,
                if g.ignore_eos { ", EOS ignored" } else { "" },
                c.distinct_payloads
            ),
            None => format!("{} x{}", c.op, c.repeat),
        };
        writeln!(
            out,
            "{what} -> {} ({}): {} conns, pipeline {}, {} thread(s)",
            c.target,
            if c.http { "HTTP" } else { "binary" },
            c.connections,
            c.pipeline,
            c.threads
        )?;
        writeln!(
            out,
            "  rate      offered {:>10.1}/s  achieved {:>10.1}/s  (asked {:.1}/s, {:.2} s)",
            self.offered_rate, self.achieved_rate, c.rate, self.measured_interval_s
        )?;
        // For generation streams latency runs to the end-of-stream frame.
        let label = if c.generate.is_some() {
            "complete "
        } else {
            "latency  "
        };
        match &self.latency {
            Some(l) => writeln!(
                out,
                "  {label} p50 {} us  p90 {} us  p99 {} us  p99.9 {} us  max {} us  mean {} us",
                f(l.p50_us),
                f(l.p90_us),
                f(l.p99_us),
                f(l.p999_us),
                f(l.max_us),
                f(l.mean_us)
            )?,
            None => writeln!(out, "  {label} (no ok replies)")?,
        }
        if let Some(g) = &self.generate {
            writeln!(
                out,
                "  tokens    {} received, {:.1}/s  (golden streams: {} tokens, {}..{} per prompt)",
                g.tokens, g.tokens_per_s, g.golden_tokens, g.golden_min_tokens, g.golden_max_tokens
            )?;
            let line = |name: &str, l: &Option<Latency>| match l {
                Some(l) => format!(
                    "  {name:<9} p50 {} us  p99 {} us  mean {} us  max {} us  (n {})",
                    f(l.p50_us),
                    f(l.p99_us),
                    f(l.mean_us),
                    f(l.max_us),
                    l.count
                ),
                None => format!("  {name:<9} (none)"),
            };
            writeln!(out, "{}", line("ttft", &g.ttft))?;
            writeln!(out, "{}", line("gap", &g.inter_token))?;
            writeln!(out, "{}", line("ttft 1st", &g.ttft_first_10s))?;
            writeln!(out, "{}", line("ttft last", &g.ttft_last_10s))?;
            let st: Vec<String> = g
                .final_statuses
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            writeln!(out, "  finals    {}", st.join(", "))?;
        }
        if let Some(l) = &self.send_lag {
            writeln!(
                out,
                "  send lag  p50 {} us  p99 {} us  max {} us (client behind schedule)",
                f(l.p50_us),
                f(l.p99_us),
                f(l.max_us)
            )?;
        }
        let k = &self.counts;
        writeln!(
            out,
            "  requests  {} scheduled: ok {}  busy {}  failures {} (wrong {}, error {}, timed out {}, conn failed {}, cancelled {})",
            self.scheduled,
            k.ok,
            k.busy,
            self.failures,
            k.wrong,
            k.error,
            k.timed_out,
            k.conn_failed,
            k.cancelled
        )?;
        writeln!(
            out,
            "  warm-up   {} scheduled: ok {}  busy {}  failures {}",
            self.warmup_scheduled,
            self.warmup_counts.ok,
            self.warmup_counts.busy,
            self.warmup_failures
        )?;
        match &self.server_cpu {
            Some(s) => writeln!(
                out,
                "  server    pid {} ({} threads): user+sys {} us/req (user {}, sys {}), schedstat {} us/req",
                s.pid,
                s.delta.thread_count,
                f(s.per_request.busy_us),
                f(s.per_request.user_us),
                f(s.per_request.system_us),
                f(s.per_request.run_us)
            )?,
            None => writeln!(out, "  server    CPU not accounted (see notes)")?,
        }
        // The top threads by CPU (schedstat): where the server's time per request goes.
        if !self.server_threads.is_empty() {
            let top: Vec<String> = self
                .server_threads
                .iter()
                .take(SERVER_THREADS_SHOWN)
                .map(|t| {
                    let n = if t.threads > 1 {
                        format!(" x{}", t.threads)
                    } else {
                        String::new()
                    };
                    format!("{}{n} {}", t.name, f(t.per_request_us))
                })
                .collect();
            let more = self
                .server_threads
                .len()
                .saturating_sub(SERVER_THREADS_SHOWN);
            writeln!(
                out,
                "  threads   us/req: {}{}",
                top.join(", "),
                if more > 0 {
                    format!(" (+{more} more in the JSON)")
                } else {
                    String::new()
                }
            )?;
        }
        if let Some(h) = &self.host_cpu {
            let p = &h.per_request;
            writeln!(
                out,
                "  host      busy {} us/req: user {}, sys {}, softirq {}, irq {}",
                f(p.busy_us),
                f(p.user_us),
                f(p.system_us),
                f(p.softirq_us),
                f(p.irq_us)
            )?;
        }
        if let Some(si) = &self.softirqs {
            writeln!(
                out,
                "  softirqs  NET_RX {} /req, NET_TX {} /req (exact counts, all CPUs)",
                f(si.net_rx_per_request),
                f(si.net_tx_per_request)
            )?;
        }
        if let Some(cl) = &self.client_cpu {
            writeln!(
                out,
                "  client    user+sys {} us/req, schedstat {} us/req",
                f(cl.per_request.busy_us),
                f(cl.per_request.run_us)
            )?;
        }
        for s in &self.failure_samples {
            writeln!(out, "  failure:  {s}")?;
        }
        for n in &self.notes {
            writeln!(out, "  note:     {n}")?;
        }
        Ok(())
    }
}
