//! External servers through the same client: `bgs load --openai URL --model NAME` drives an
//! OpenAI-compatible `/v1/completions` endpoint (this project's API, vLLM, llama.cpp's server)
//! with the same open-loop schedule and reports the same latency and token statistics.
//!
//! Each of `connections` workers owns one keep-alive HTTP/1.1 connection and takes the next
//! scheduled request when it is free; latency and time to first token count from the
//! scheduled time, so a server (or a worker pool) that falls behind cannot hide it. Prompts are
//! the same token-id prompts as `--op generate` (`make_prompt`), sent as `prompt: [ids]`,
//! greedy (`temperature: 0`), with `ignore_eos` when asked. There is no exact replay here (an
//! external server's text is not this project's token stream): a response counts as ok when it
//! is HTTP 200 and well formed; tokens are `usage.completion_tokens` (streaming: the usage
//! chunk, requested with `stream_options.include_usage`, else one per text chunk).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use bgs_cpuacct::monotonic_ns;
use hdrhistogram::Histogram;
use serde_json::Value;

use crate::engine::{Counts, new_histogram};
use crate::report::{GenerateReport, HostCpuReport, ReportConfig, SoftirqReport};
use crate::{Latency, LoadConfig, LoadReport, make_prompt, process_report, sample_cpu};

/// Where and how to send.
#[derive(Clone, Debug)]
pub struct OpenAiConfig {
    /// `http://HOST:PORT[/PATH]` (path default `/v1/completions`).
    pub url: String,
    /// The `model` field.
    pub model: String,
    /// Stream (server-sent events) or one JSON response.
    pub stream: bool,
}

fn parse_url(url: &str) -> anyhow::Result<(SocketAddr, String, String)> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("--openai {url:?}: only http:// URLs are supported"))?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let path = if path.is_empty() || path == "/" || path == "/v1" {
        "/v1/completions".to_string()
    } else {
        path.to_string()
    };
    let addr = hostport
        .to_socket_addrs()
        .with_context(|| format!("--openai: cannot resolve {hostport:?}"))?
        .next()
        .with_context(|| format!("--openai: no address for {hostport:?}"))?;
    Ok((addr, hostport.to_string(), path))
}

struct Outcome {
    status: u16,
    /// Arrival of each text chunk (streaming) or of the whole body.
    token_times: Vec<u64>,
    completion_tokens: Option<u64>,
    done_ns: u64,
    keep_alive: bool,
}

fn read_line(r: &mut BufReader<TcpStream>) -> std::io::Result<String> {
    let mut l = String::new();
    if r.read_line(&mut l)? == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed",
        ));
    }
    Ok(l.trim_end_matches(['\r', '\n']).to_string())
}

/// Handle one SSE `data:` payload.
fn on_event(data: &str, o: &mut Outcome) {
    if data == "[DONE]" {
        return;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return;
    };
    if let Some(n) = v
        .get("usage")
        .and_then(|u| u.get("completion_tokens"))
        .and_then(Value::as_u64)
    {
        o.completion_tokens = Some(n);
    }
    let text = v
        .get("choices")
        .and_then(|c| c.get(0))
        .and_then(|c| {
            c.get("text")
                .or_else(|| c.get("delta").and_then(|d| d.get("content")))
        })
        .and_then(Value::as_str)
        .unwrap_or("");
    if !text.is_empty() {
        o.token_times.push(monotonic_ns());
    }
}

/// Send one request and read its response (chunked or Content-Length; SSE when streaming).
fn exchange(r: &mut BufReader<TcpStream>, req: &[u8], stream: bool) -> std::io::Result<Outcome> {
    r.get_mut().write_all(req)?;
    let status_line = read_line(r)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("bad status line {status_line:?}"),
            )
        })?;
    let (mut chunked, mut len, mut keep_alive) = (false, None, true);
    loop {
        let h = read_line(r)?;
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':').unwrap_or((&h, ""));
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_ascii_lowercase());
        match k.as_str() {
            "transfer-encoding" if v.contains("chunked") => chunked = true,
            "content-length" => len = v.parse::<usize>().ok(),
            "connection" if v == "close" => keep_alive = false,
            _ => {}
        }
    }
    let mut o = Outcome {
        status,
        token_times: Vec::new(),
        completion_tokens: None,
        done_ns: 0,
        keep_alive,
    };
    let mut body = Vec::new();
    let mut sse = String::new();
    let mut feed = |bytes: &[u8], o: &mut Outcome, body: &mut Vec<u8>| {
        if stream && status == 200 {
            sse.push_str(&String::from_utf8_lossy(bytes));
            while let Some(i) = sse.find('\n') {
                let line: String = sse.drain(..=i).collect();
                if let Some(d) = line.trim_end().strip_prefix("data:") {
                    on_event(d.trim(), o);
                }
            }
        } else {
            body.extend_from_slice(bytes);
        }
    };
    if chunked {
        loop {
            let size =
                usize::from_str_radix(read_line(r)?.split(';').next().unwrap_or("").trim(), 16)
                    .map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, "bad chunk size")
                    })?;
            if size == 0 {
                while !read_line(r)?.is_empty() {}
                break;
            }
            let mut c = vec![0u8; size];
            r.read_exact(&mut c)?;
            read_line(r)?;
            feed(&c, &mut o, &mut body);
        }
    } else if let Some(n) = len {
        let mut c = vec![0u8; n];
        r.read_exact(&mut c)?;
        feed(&c, &mut o, &mut body);
    } else {
        let mut c = Vec::new();
        r.read_to_end(&mut c)?;
        o.keep_alive = false;
        feed(&c, &mut o, &mut body);
    }
    o.done_ns = monotonic_ns();
    if !stream && status == 200 {
        let v: Value = serde_json::from_slice(&body).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("response is not JSON: {e}"),
            )
        })?;
        o.completion_tokens = v
            .get("usage")
            .and_then(|u| u.get("completion_tokens"))
            .and_then(Value::as_u64);
        o.token_times.push(o.done_ns);
    }
    Ok(o)
}

#[derive(Default)]
struct WorkerResult {
    measured: Counts,
    warmup: Counts,
    tokens: u64,
    last_send_ns: u64,
    last_done_ns: u64,
    samples: Vec<String>,
}

struct Hists {
    latency: Histogram<u64>,
    ttft: Histogram<u64>,
    gap: Histogram<u64>,
    ttft_first: Histogram<u64>,
    ttft_last: Histogram<u64>,
}

impl Hists {
    fn new() -> std::io::Result<Hists> {
        Ok(Hists {
            latency: new_histogram()?,
            ttft: new_histogram()?,
            gap: new_histogram()?,
            ttft_first: new_histogram()?,
            ttft_last: new_histogram()?,
        })
    }
    fn add(&mut self, o: &Hists) {
        let _ = self.latency.add(&o.latency);
        let _ = self.ttft.add(&o.ttft);
        let _ = self.gap.add(&o.gap);
        let _ = self.ttft_first.add(&o.ttft_first);
        let _ = self.ttft_last.add(&o.ttft_last);
    }
}

/// Run an open-loop load against an OpenAI-compatible completions endpoint.
pub fn run_openai(cfg: &LoadConfig, oa: &OpenAiConfig) -> anyhow::Result<LoadReport> {
    ensure!(
        cfg.rate.is_finite() && cfg.rate > 0.0,
        "rate must be a positive number"
    );
    ensure!(cfg.connections >= 1, "need at least one connection");
    cfg.generate.validate()?;
    let (addr, host, path) = parse_url(&oa.url)?;
    let g = cfg.generate;
    let bodies: Vec<Vec<u8>> = (0..cfg.distinct_payloads.max(1))
        .map(|i| {
            let prompt = make_prompt(cfg.seed, i, g.prompt_tokens, g.token_range);
            let mut b = serde_json::json!({
                "model": oa.model, "prompt": prompt, "max_tokens": g.max_tokens,
                "temperature": 0, "stream": oa.stream, "ignore_eos": g.ignore_eos,
            });
            if oa.stream {
                b["stream_options"] = serde_json::json!({"include_usage": true});
            }
            let body = b.to_string();
            format!(
                "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nAccept: {}\r\nContent-Length: {}\r\n\r\n{body}",
                if oa.stream { "text/event-stream" } else { "application/json" },
                body.len()
            )
            .into_bytes()
        })
        .collect();
    let mut notes = vec![format!(
        "external OpenAI-compatible server {} (model {:?}, {}): responses are checked for form, not replayed",
        oa.url,
        oa.model,
        if oa.stream {
            "streaming"
        } else {
            "not streaming"
        }
    )];
    let server_pid = cfg.server_pid;
    if server_pid.is_none() {
        notes.push("server CPU not accounted: give --server-pid for an external server".into());
    }
    let period_ns = 1e9 / cfg.rate;
    let warmup_end = (cfg.warmup.as_secs_f64() * cfg.rate).ceil() as u64;
    let measured = match (cfg.requests, cfg.duration) {
        (Some(n), _) => n,
        (None, Some(d)) => (d.as_secs_f64() * cfg.rate).ceil() as u64,
        (None, None) => bail!("give a duration or a number of requests"),
    };
    let end = warmup_end + measured;
    let started_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let t0 = monotonic_ns() + 20_000_000;
    let sched = move |k: u64| t0 + (k as f64 * period_ns) as u64;
    let first = sched(warmup_end);
    let last = sched(end.saturating_sub(1).max(warmup_end));
    let first_window_end = first + 10_000_000_000;
    let last_window_start = last.saturating_sub(10_000_000_000).max(first);
    let next = Arc::new(AtomicU64::new(0));
    let bodies = Arc::new(bodies);
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let sampled = Arc::new(Barrier::new(cfg.connections + 1));
    let mut handles = Vec::new();
    for w in 0..cfg.connections {
        let (next, bodies, done_tx, sampled) = (
            next.clone(),
            bodies.clone(),
            done_tx.clone(),
            sampled.clone(),
        );
        let (timeout, stream) = (cfg.timeout, oa.stream);
        handles.push(
            std::thread::Builder::new()
                .name(format!("bgs-openai-{w}"))
                .spawn(move || {
                    let mut r = WorkerResult::default();
                    let mut h = Hists::new().expect("histogram bounds");
                    let mut conn: Option<BufReader<TcpStream>> = None;
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= end {
                            break;
                        }
                        let due = sched(k);
                        let now = monotonic_ns();
                        if due > now {
                            std::thread::sleep(Duration::from_nanos(due - now));
                        }
                        let is_measured = k >= warmup_end;
                        let counts = if is_measured {
                            &mut r.measured
                        } else {
                            &mut r.warmup
                        };
                        if conn.is_none() {
                            match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
                                Ok(s) => {
                                    let _ = s.set_nodelay(true);
                                    let _ = s.set_read_timeout(Some(timeout));
                                    conn = Some(BufReader::new(s));
                                }
                                Err(e) => {
                                    counts.conn_failed += 1;
                                    if r.samples.len() < 5 {
                                        r.samples.push(format!("request {k}: connect: {e}"));
                                    }
                                    continue;
                                }
                            }
                        }
                        let c = conn.as_mut().expect("connected above");
                        if is_measured {
                            r.last_send_ns = r.last_send_ns.max(monotonic_ns());
                        }
                        match exchange(c, &bodies[(k % bodies.len() as u64) as usize], stream) {
                            Ok(o) => {
                                if !o.keep_alive {
                                    conn = None;
                                }
                                match o.status {
                                    200 if !o.token_times.is_empty()
                                        || o.completion_tokens.is_some() =>
                                    {
                                        counts.ok += 1;
                                        if is_measured {
                                            r.last_done_ns = r.last_done_ns.max(o.done_ns);
                                            let n = o
                                                .completion_tokens
                                                .unwrap_or(o.token_times.len() as u64);
                                            r.tokens += n;
                                            h.latency.saturating_record(
                                                o.done_ns.saturating_sub(due).max(1),
                                            );
                                            if let Some(&t) = o.token_times.first() {
                                                let ttft = t.saturating_sub(due).max(1);
                                                h.ttft.saturating_record(ttft);
                                                if due < first_window_end {
                                                    h.ttft_first.saturating_record(ttft);
                                                }
                                                if due >= last_window_start {
                                                    h.ttft_last.saturating_record(ttft);
                                                }
                                            }
                                            for w in o.token_times.windows(2) {
                                                h.gap.saturating_record((w[1] - w[0]).max(1));
                                            }
                                        }
                                    }
                                    200 => {
                                        counts.wrong += 1;
                                        if r.samples.len() < 5 {
                                            r.samples.push(format!(
                                                "request {k}: HTTP 200 without text or usage"
                                            ));
                                        }
                                    }
                                    429 | 503 => counts.busy += 1,
                                    s => {
                                        counts.error += 1;
                                        if r.samples.len() < 5 {
                                            r.samples.push(format!("request {k}: HTTP {s}"));
                                        }
                                    }
                                }
                            }
                            Err(e) => {
                                conn = None;
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) {
                                    counts.timed_out += 1;
                                } else {
                                    counts.conn_failed += 1;
                                }
                                if r.samples.len() < 5 {
                                    r.samples.push(format!("request {k}: {e}"));
                                }
                            }
                        }
                    }
                    let _ = done_tx.send(());
                    sampled.wait();
                    (r, h)
                })?,
        );
    }
    drop(done_tx);
    std::thread::sleep(Duration::from_nanos(first.saturating_sub(monotonic_ns())));
    let before = sample_cpu(server_pid, &mut notes);
    for _ in 0..cfg.connections {
        if done_rx.recv().is_err() {
            break;
        }
    }
    let after = sample_cpu(server_pid, &mut notes);
    sampled.wait();
    let mut total = WorkerResult::default();
    let mut hists = Hists::new()?;
    for hd in handles {
        let (r, h) = hd
            .join()
            .map_err(|_| anyhow::anyhow!("an OpenAI worker panicked"))?;
        total.measured.add(&r.measured);
        total.warmup.add(&r.warmup);
        total.tokens += r.tokens;
        total.last_send_ns = total.last_send_ns.max(r.last_send_ns);
        total.last_done_ns = total.last_done_ns.max(r.last_done_ns);
        total.samples.extend(r.samples);
        hists.add(&h);
    }
    total.samples.truncate(20);
    let send_ns = if measured == 0 {
        0.0
    } else {
        total.last_send_ns.saturating_sub(first) as f64 + period_ns
    };
    let interval_ns = (total.last_done_ns.saturating_sub(first) as f64).max(send_ns);
    let rate = |n: u64, ns: f64| if ns > 0.0 { n as f64 / (ns / 1e9) } else { 0.0 };
    let ok = total.measured.ok;
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
    let server_cpu = process_report(&before.server, &after.server, ok);
    Ok(LoadReport {
        config: ReportConfig {
            target: oa.url.clone(),
            op: "openai-completions".into(),
            repeat: 0,
            words: g.prompt_tokens,
            rate: cfg.rate,
            connections: cfg.connections,
            pipeline: 1,
            http: true,
            warmup_s: cfg.warmup.as_secs_f64(),
            duration_s: cfg.duration.map(|d| d.as_secs_f64()),
            requests: cfg.requests,
            timeout_s: cfg.timeout.as_secs_f64(),
            distinct_payloads: cfg.distinct_payloads,
            seed: cfg.seed,
            threads: cfg.connections,
            generate: Some(g),
        },
        started_unix_ms,
        scheduled: measured,
        warmup_scheduled: warmup_end,
        failures: total.measured.failures(),
        warmup_failures: total.warmup.failures(),
        counts: total.measured,
        warmup_counts: total.warmup,
        late_replies: 0,
        offered_rate: rate(measured, send_ns),
        achieved_rate: rate(ok, interval_ns),
        send_interval_s: send_ns / 1e9,
        measured_interval_s: interval_ns / 1e9,
        latency: Latency::from_histogram(&hists.latency),
        send_lag: None,
        request_bytes: 0,
        reply_bytes: 0,
        server_threads: crate::server_threads(server_cpu.as_ref(), ok),
        server_cpu,
        host_cpu,
        softirqs,
        generate: Some(GenerateReport {
            prompts: bodies.len(),
            golden_tokens: 0,
            golden_min_tokens: 0,
            golden_max_tokens: 0,
            completed: ok,
            tokens: total.tokens,
            tokens_per_s: rate(total.tokens, interval_ns),
            ttft: Latency::from_histogram(&hists.ttft),
            inter_token: Latency::from_histogram(&hists.gap),
            ttft_first_10s: Latency::from_histogram(&hists.ttft_first),
            ttft_last_10s: Latency::from_histogram(&hists.ttft_last),
            final_statuses: Default::default(),
        }),
        client_cpu: process_report(&before.client, &after.client, ok),
        failure_samples: total.samples,
        notes,
    })
}
