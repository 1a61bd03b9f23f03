//! Per-run metrics, computed from the raw files of a run: the `bgs load --json` document and
//! the lab's own CPU sample. The report recomputes them from the raw records, so a report can
//! always be rebuilt (and checked) from `DIR/runs/`.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::record::RunRecord;

/// A metric's name, unit and meaning.
#[derive(Clone, Copy, Debug)]
pub struct MetricDef {
    /// Name used in criteria, CSV columns and JSON.
    pub name: &'static str,
    /// Unit.
    pub unit: &'static str,
    /// What it is.
    pub about: &'static str,
}

const fn m(name: &'static str, unit: &'static str, about: &'static str) -> MetricDef {
    MetricDef { name, unit, about }
}

/// Every metric, in report order.
pub const METRICS: &[MetricDef] = &[
    m(
        "offered",
        "req/s",
        "offered rate (measured requests / send interval)",
    ),
    m(
        "throughput",
        "req/s",
        "achieved rate (ok replies / measured interval)",
    ),
    m(
        "failures",
        "req",
        "failed requests, measured and warm-up (wrong, error, timed out, connection failed, cancelled)",
    ),
    m(
        "p50",
        "us",
        "latency p50 from the scheduled send time (generation: to the end of the stream)",
    ),
    m("p90", "us", "latency p90"),
    m("p99", "us", "latency p99"),
    m("p999", "us", "latency p99.9"),
    m("mean_latency", "us", "mean latency"),
    m(
        "cpu",
        "us/req",
        "server process CPU per ok request, schedstat (ns resolution, all threads alive at the end sample, SQPOLL and io-wq included)",
    ),
    m(
        "server_user",
        "us/req",
        "server user time per request (tick-based, /proc/PID/stat)",
    ),
    m(
        "server_sys",
        "us/req",
        "server system time per request (tick-based)",
    ),
    m(
        "server_busy",
        "us/req",
        "server user+system per request (tick-based)",
    ),
    m(
        "server_helpers",
        "us/req",
        "server kernel helper threads (iou-sqp-*, iou-wrk-*) per request, schedstat",
    ),
    m(
        "host_cpu",
        "us/req",
        "whole-host busy CPU per request (wall x CPUs minus idle, iowait, steal)",
    ),
    m(
        "host_server_cpus",
        "us/req",
        "busy CPU per request on the server's CPU set (same method)",
    ),
    m(
        "host_client_cpus",
        "us/req",
        "busy CPU per request on the load generator's CPU set",
    ),
    m(
        "host_softirq",
        "us/req",
        "softirq column of /proc/stat per request, all CPUs (tick-sampled: an estimate)",
    ),
    m(
        "net_rx",
        "1/req",
        "NET_RX softirq runs per request, all CPUs (/proc/softirqs: exact counts)",
    ),
    m(
        "net_tx",
        "1/req",
        "NET_TX softirq runs per request, all CPUs (exact counts)",
    ),
    m(
        "client_cpu",
        "us/req",
        "load generator process CPU per request, schedstat",
    ),
    m(
        "observer_cpu",
        "us/req",
        "the lab process's own CPU per request (whole run: start, load, stop)",
    ),
    m(
        "tokens_per_s",
        "tok/s",
        "generation: token frames per second of the measured interval",
    ),
    m("ttft_p50", "us", "generation: time to first token p50"),
    m("ttft_p99", "us", "generation: time to first token p99"),
    m(
        "ttft_first",
        "us",
        "generation: mean TTFT of requests in the first 10 s",
    ),
    m(
        "ttft_last",
        "us",
        "generation: mean TTFT of requests in the last 10 s",
    ),
    m("gap_p99", "us", "generation: gap between tokens p99"),
    m(
        "cpu_per_token",
        "us/tok",
        "generation: server process CPU (schedstat) per token",
    ),
    m(
        "host_cpu_per_token",
        "us/tok",
        "generation: whole-host busy CPU per token",
    ),
];

/// Look a metric up by name.
pub fn def(name: &str) -> Option<&'static MetricDef> {
    METRICS.iter().find(|d| d.name == name)
}

fn num(v: &Value, path: &[&str]) -> f64 {
    let mut cur = v;
    for p in path {
        match cur.get(p) {
            Some(n) => cur = n,
            None => return f64::NAN,
        }
    }
    cur.as_f64().unwrap_or(f64::NAN)
}

fn per(total: f64, n: f64) -> f64 {
    if n > 0.0 { total / n } else { f64::NAN }
}

/// Busy ns of the CPUs in `set` from the host delta's per-CPU lines (NaN without a set).
fn busy_on(report: &Value, set: Option<&[usize]>) -> f64 {
    let Some(set) = set else { return f64::NAN };
    let wall = num(report, &["host_cpu", "delta", "wall_ns"]);
    let Some(cpus) = report
        .get("host_cpu")
        .and_then(|h| h.get("delta"))
        .and_then(|d| d.get("cpus"))
        .and_then(Value::as_array)
    else {
        return f64::NAN;
    };
    let mut busy = 0.0;
    for c in cpus {
        let id = c.get("cpu").and_then(Value::as_u64).unwrap_or(u64::MAX) as usize;
        if !set.contains(&id) {
            continue;
        }
        let t = |k: &str| num(c, &["times", k]);
        busy += (wall - t("idle") - t("iowait") - t("steal")).max(0.0);
    }
    busy
}

/// Server CPU per ok request by thread name (us/req, schedstat), recomputed from the raw
/// per-thread deltas of `server_cpu` with the grouping of [`bgs_cpuacct::thread_groups`]
/// (io_uring helpers lose their pid suffix; what the process totals grew by beyond the live
/// threads' user+system is [`bgs_cpuacct::EXITED_THREADS`]). Empty when not measured.
pub fn server_threads(rec: &RunRecord) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let null = Value::Null;
    let r = rec
        .load
        .as_ref()
        .and_then(|d| d.get("report"))
        .unwrap_or(&null);
    let ok = num(r, &["counts", "ok"]);
    let Some(delta) = r.get("server_cpu").and_then(|s| s.get("delta")) else {
        return out;
    };
    let Some(threads) = delta.get("threads").and_then(Value::as_array) else {
        return out;
    };
    let mut live_ticks = 0.0;
    for t in threads {
        let comm = t.get("comm").and_then(Value::as_str).unwrap_or("?");
        let name = bgs_cpuacct::thread_group_name(comm);
        *out.entry(name.to_string()).or_insert(0.0) += num(t, &["run_ns"]);
        live_ticks += num(t, &["user_ns"]) + num(t, &["system_ns"]);
    }
    // Records from before `exited_threads` existed: count none as known to have exited.
    let known_exited = num(delta, &["exited_threads"]);
    let exited = bgs_cpuacct::exited_estimate(
        (num(delta, &["user_ns"]) + num(delta, &["system_ns"])).max(0.0) as u64,
        live_ticks as u64,
        threads.len(),
        if known_exited.is_nan() {
            0
        } else {
            known_exited as usize
        },
    );
    if exited > 0 {
        out.insert(bgs_cpuacct::EXITED_THREADS.to_string(), exited as f64);
    }
    for v in out.values_mut() {
        *v = per(*v / 1000.0, ok);
    }
    out
}

/// The metrics of one run (NaN where not applicable or not measured).
pub fn compute(rec: &RunRecord) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let null = Value::Null;
    let r = rec
        .load
        .as_ref()
        .and_then(|d| d.get("report"))
        .unwrap_or(&null);
    let ok = num(r, &["counts", "ok"]);
    let mut put = |k: &str, v: f64| {
        out.insert(k.to_string(), v);
    };
    put("offered", num(r, &["offered_rate"]));
    put("throughput", num(r, &["achieved_rate"]));
    put(
        "failures",
        if rec.load.is_some() {
            num(r, &["failures"]) + num(r, &["warmup_failures"])
        } else {
            f64::NAN
        },
    );
    put("p50", num(r, &["latency", "p50_us"]));
    put("p90", num(r, &["latency", "p90_us"]));
    put("p99", num(r, &["latency", "p99_us"]));
    put("p999", num(r, &["latency", "p999_us"]));
    put("mean_latency", num(r, &["latency", "mean_us"]));
    let srv_run = num(r, &["server_cpu", "delta", "run_ns"]);
    put("cpu", per(srv_run / 1000.0, ok));
    put(
        "server_user",
        num(r, &["server_cpu", "per_request", "user_us"]),
    );
    put(
        "server_sys",
        num(r, &["server_cpu", "per_request", "system_us"]),
    );
    put(
        "server_busy",
        num(r, &["server_cpu", "per_request", "busy_us"]),
    );
    // NaN, not zero, when the server has no io_uring helper threads at all.
    let helpers: Option<f64> = r
        .get("server_cpu")
        .and_then(|s| s.get("delta"))
        .and_then(|d| d.get("threads"))
        .and_then(Value::as_array)
        .map(|ts| {
            ts.iter()
                .filter(|t| {
                    t.get("comm")
                        .and_then(Value::as_str)
                        .is_some_and(|c| c.starts_with("iou-"))
                })
                .map(|t| num(t, &["run_ns"]))
                .fold(None, |acc: Option<f64>, v| Some(acc.unwrap_or(0.0) + v))
        })
        .and_then(|v| v);
    put(
        "server_helpers",
        per(helpers.unwrap_or(f64::NAN) / 1000.0, ok),
    );
    let host_busy = num(r, &["host_cpu", "per_request", "busy_us"]);
    put("host_cpu", host_busy);
    put(
        "host_server_cpus",
        per(busy_on(r, rec.server_cpu_set.as_deref()) / 1000.0, ok),
    );
    put(
        "host_client_cpus",
        per(busy_on(r, rec.client_cpu_set.as_deref()) / 1000.0, ok),
    );
    put(
        "host_softirq",
        num(r, &["host_cpu", "per_request", "softirq_us"]),
    );
    put("net_rx", num(r, &["softirqs", "net_rx_per_request"]));
    put("net_tx", num(r, &["softirqs", "net_tx_per_request"]));
    put(
        "client_cpu",
        per(num(r, &["client_cpu", "delta", "run_ns"]) / 1000.0, ok),
    );
    put(
        "observer_cpu",
        per(
            rec.observer.as_ref().map_or(f64::NAN, |o| o.run_ns as f64) / 1000.0,
            ok,
        ),
    );
    let tokens = num(r, &["generate", "tokens"]);
    put("tokens_per_s", num(r, &["generate", "tokens_per_s"]));
    put("ttft_p50", num(r, &["generate", "ttft", "p50_us"]));
    put("ttft_p99", num(r, &["generate", "ttft", "p99_us"]));
    put(
        "ttft_first",
        num(r, &["generate", "ttft_first_10s", "mean_us"]),
    );
    put(
        "ttft_last",
        num(r, &["generate", "ttft_last_10s", "mean_us"]),
    );
    put("gap_p99", num(r, &["generate", "inter_token", "p99_us"]));
    put("cpu_per_token", per(srv_run / 1000.0, tokens));
    put("host_cpu_per_token", per(host_busy * ok, tokens));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_threads_group_by_name_and_estimate_exited() {
        // 1,000 ok requests; two executor threads, an SQPOLL thread with its pid suffix, and
        // 10 ms of user time that only the process totals show (a thread that exited).
        let r = crate::record::tests::rec(serde_json::json!({
            "counts": { "ok": 1000 },
            "server_cpu": { "delta": {
                "user_ns": 60_000_000u64, "system_ns": 20_000_000u64, "run_ns": 75_000_000u64,
                "exited_threads": 1,
                "threads": [
                    { "comm": "bgs-exec", "run_ns": 20_000_000u64, "user_ns": 20_000_000u64, "system_ns": 0 },
                    { "comm": "bgs-exec", "run_ns": 30_000_000u64, "user_ns": 30_000_000u64, "system_ns": 0 },
                    { "comm": "iou-sqp-77", "run_ns": 25_000_000u64, "user_ns": 0, "system_ns": 20_000_000u64 }
                ]
            } }
        }));
        let t = server_threads(&r);
        assert_eq!(t.len(), 3, "{t:?}");
        assert!((t["bgs-exec"] - 50.0).abs() < 1e-9);
        assert!((t["iou-sqp"] - 25.0).abs() < 1e-9);
        assert!((t[bgs_cpuacct::EXITED_THREADS] - 10.0).abs() < 1e-9);
        // No server CPU: no breakdown.
        let none = crate::record::tests::rec(serde_json::json!({ "counts": { "ok": 1 } }));
        assert!(server_threads(&none).is_empty());
    }
}
