//! Closed-loop load (`bgs load --closed-loop`): N connections, each sends its next request
//! when the previous reply arrives (as `wrk` does), to find saturation throughput.
//!
//! Unlike the open loop there is no schedule: latency counts from the actual send, so it
//! hides queueing at the client by design (coordinated omission) and is reported only as a
//! service time. The number that matters is the achieved rate. Each connection has its own
//! blocking thread (simple, and a reply is waited for without polling); with many connections
//! the generator's own CPU is higher than the open loop's, which the report shows. Binary
//! frames and the one-shot ops only; every reply is checked against its golden reply, exactly
//! as in the open loop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail, ensure};
use bgs_cpuacct::monotonic_ns;
use bgs_protocol::{Op, Status};
use hdrhistogram::Histogram;

use crate::client::decode_reply;
use crate::engine::{Counts, new_histogram};
use crate::report::{HostCpuReport, ReportConfig};
use crate::{
    Latency, LoadConfig, LoadReport, golden_pass, process_report, request_frame, sample_cpu,
};

struct ConnResult {
    measured: Counts,
    warmup: Counts,
    hist: Histogram<u64>,
    sent_measured: u64,
    last_done_ns: u64,
    request_bytes: u64,
    reply_bytes: u64,
    samples: Vec<String>,
}

#[allow(clippy::too_many_arguments)]
fn conn_loop(
    mut s: TcpStream,
    requests: &[Vec<u8>],
    golden: &[Vec<u8>],
    next: &AtomicU64,
    measure_start_ns: u64,
    end_ns: u64,
    timeout: Duration,
) -> std::io::Result<ConnResult> {
    let mut r = ConnResult {
        measured: Counts::default(),
        warmup: Counts::default(),
        hist: new_histogram()?,
        sent_measured: 0,
        last_done_ns: 0,
        request_bytes: 0,
        reply_bytes: 0,
        samples: Vec::new(),
    };
    s.set_read_timeout(Some(timeout))?;
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut chunk = vec![0u8; 64 * 1024];
    let mut out = Vec::new();
    loop {
        let sent = monotonic_ns();
        if sent >= end_ns {
            return Ok(r);
        }
        let k = next.fetch_add(1, Ordering::Relaxed);
        let payload = (k % requests.len() as u64) as usize;
        out.clear();
        out.extend_from_slice(&requests[payload]);
        out[8..12].copy_from_slice(&(k as u32).to_le_bytes());
        let measured = sent >= measure_start_ns;
        let counts = if measured {
            &mut r.measured
        } else {
            &mut r.warmup
        };
        if measured {
            r.sent_measured += 1;
        }
        if let Err(e) = s.write_all(&out) {
            counts.conn_failed += 1;
            r.samples.push(format!("request {k}: write failed: {e}"));
            return Ok(r);
        }
        r.request_bytes += out.len() as u64;
        // Read until one whole frame is buffered.
        let reply = loop {
            match decode_reply(&buf) {
                Ok(Some((reply, n))) => {
                    buf.drain(..n);
                    r.reply_bytes += n as u64;
                    break Some(reply);
                }
                Ok(None) => {}
                Err(e) => {
                    counts.wrong += 1;
                    r.samples.push(format!("request {k}: malformed reply: {e}"));
                    return Ok(r);
                }
            }
            match s.read(&mut chunk) {
                Ok(0) => break None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    // A late reply would desynchronise the connection: stop using it.
                    counts.timed_out += 1;
                    return Ok(r);
                }
                Err(_) => break None,
            }
        };
        let done = monotonic_ns();
        let Some(reply) = reply else {
            counts.conn_failed += 1;
            r.samples.push(format!("request {k}: connection closed"));
            return Ok(r);
        };
        if measured {
            r.last_done_ns = r.last_done_ns.max(done);
        }
        let h = reply.header;
        if h.request_id != k as u32 || h.seq != 0 {
            counts.wrong += 1;
            r.samples.push(format!(
                "request {k}: reply carries id {} seq {}",
                h.request_id, h.seq
            ));
            return Ok(r);
        }
        if h.status == Status::Ok as u16 {
            let bytes: Vec<u8> = reply.words.iter().flat_map(|w| w.to_le_bytes()).collect();
            if bytes == golden[payload] {
                counts.ok += 1;
                if measured {
                    r.hist.saturating_record(done.saturating_sub(sent).max(1));
                }
            } else {
                counts.wrong += 1;
                if r.samples.len() < 5 {
                    r.samples.push(format!(
                        "request {k}: reply differs from the golden reply of payload {payload}"
                    ));
                }
            }
        } else if h.status == Status::Busy as u16 {
            counts.busy += 1;
        } else {
            counts.error += 1;
            if r.samples.len() < 5 {
                r.samples.push(format!("request {k}: status {}", h.status));
            }
        }
    }
}

/// Run a closed-loop test: `cfg.connections` connections, one request in flight on each, for
/// `cfg.warmup` and then `cfg.duration` (a request count is not supported: the count is what
/// is measured). `cfg.rate`, `pipeline` and `threads` are ignored.
pub fn run_closed(cfg: &LoadConfig) -> anyhow::Result<LoadReport> {
    ensure!(
        matches!(cfg.op, Op::Echo | Op::Gemm8 | Op::Fft32),
        "closed loop drives echo, gemm8 and fft32 only"
    );
    ensure!(
        !cfg.http,
        "closed loop sends binary frames only (no --http)"
    );
    ensure!(cfg.connections >= 1, "need at least one connection");
    ensure!(!cfg.timeout.is_zero(), "timeout must be positive");
    let Some(duration) = cfg.duration else {
        bail!("closed loop runs for a duration (--duration), not a request count");
    };
    let mut notes = vec![
        "closed loop: each connection sends its next request when the previous reply arrives; \
         latency counts from the actual send (service time, not open-loop latency)"
            .to_string(),
    ];
    let words = crate::payload_words(cfg.op, cfg.words);
    let payloads: Vec<Vec<u32>> = (0..cfg.distinct_payloads.max(1))
        .map(|i| crate::make_payload(cfg.op, words, cfg.seed, i))
        .collect();
    let golden = golden_pass(cfg, &payloads)?;
    let requests: Vec<Vec<u8>> = payloads.iter().map(|p| request_frame(cfg, 0, p)).collect();
    let server_pid = match cfg.server_pid {
        Some(p) => Some(p),
        None => match crate::discover::find_listener_pid(cfg.target) {
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
    let mut streams = Vec::with_capacity(cfg.connections);
    for i in 0..cfg.connections {
        let s = TcpStream::connect_timeout(&cfg.target, Duration::from_secs(5))
            .with_context(|| format!("connection {i} to {}", cfg.target))?;
        s.set_nodelay(true)?;
        streams.push(s);
    }
    let started_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let t0 = monotonic_ns() + 5_000_000;
    let measure_start_ns = t0 + cfg.warmup.as_nanos() as u64;
    let end_ns = measure_start_ns + duration.as_nanos() as u64;
    let requests = Arc::new(requests);
    let golden = Arc::new(golden);
    let next = Arc::new(AtomicU64::new(0));
    let (done_tx, done_rx) = mpsc::channel::<()>();
    // Threads wait here after their loop until the end-of-run CPU sample is taken.
    let sampled = Arc::new(Barrier::new(cfg.connections + 1));
    let mut handles = Vec::with_capacity(cfg.connections);
    for (i, s) in streams.into_iter().enumerate() {
        let (requests, golden, next) = (requests.clone(), golden.clone(), next.clone());
        let (done_tx, sampled) = (done_tx.clone(), sampled.clone());
        let timeout = cfg.timeout;
        handles.push(
            std::thread::Builder::new()
                .name(format!("bgs-closed-{i}"))
                .spawn(move || {
                    let wait = t0.saturating_sub(monotonic_ns());
                    std::thread::sleep(Duration::from_nanos(wait));
                    let r = conn_loop(
                        s,
                        &requests,
                        &golden,
                        &next,
                        measure_start_ns,
                        end_ns,
                        timeout,
                    );
                    let _ = done_tx.send(());
                    sampled.wait();
                    r
                })
                .context("spawning a closed-loop thread")?,
        );
    }
    drop(done_tx);
    std::thread::sleep(Duration::from_nanos(
        measure_start_ns.saturating_sub(monotonic_ns()),
    ));
    let before = sample_cpu(server_pid, &mut notes);
    for _ in 0..cfg.connections {
        if done_rx.recv().is_err() {
            break;
        }
    }
    let after = sample_cpu(server_pid, &mut notes);
    sampled.wait();
    let mut measured = Counts::default();
    let mut warmup = Counts::default();
    let mut hist = new_histogram()?;
    let (mut sent, mut last_done, mut req_b, mut rep_b) = (0u64, 0u64, 0u64, 0u64);
    let mut samples = Vec::new();
    for h in handles {
        let r = match h.join() {
            Ok(r) => r.context("closed-loop connection failed")?,
            Err(_) => bail!("a closed-loop thread panicked"),
        };
        measured.add(&r.measured);
        warmup.add(&r.warmup);
        hist.add(&r.hist).map_err(|e| anyhow::anyhow!("{e}"))?;
        sent += r.sent_measured;
        last_done = last_done.max(r.last_done_ns);
        req_b += r.request_bytes;
        rep_b += r.reply_bytes;
        samples.extend(r.samples);
    }
    samples.truncate(20);
    let interval_ns = (last_done.max(end_ns) - measure_start_ns) as f64;
    let rate = |n: u64| {
        if interval_ns > 0.0 {
            n as f64 / (interval_ns / 1e9)
        } else {
            0.0
        }
    };
    let ok = measured.ok;
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
            Some(crate::report::SoftirqReport {
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
            target: cfg.target.to_string(),
            op: cfg.op.name().into(),
            repeat: cfg.repeat,
            words,
            rate: cfg.rate,
            connections: cfg.connections,
            pipeline: 1,
            http: false,
            warmup_s: cfg.warmup.as_secs_f64(),
            duration_s: Some(duration.as_secs_f64()),
            requests: None,
            timeout_s: cfg.timeout.as_secs_f64(),
            distinct_payloads: cfg.distinct_payloads,
            seed: cfg.seed,
            threads: cfg.connections,
            generate: None,
        },
        started_unix_ms,
        // Every request sent in the measured interval, classified.
        scheduled: sent,
        warmup_scheduled: warmup.total(),
        failures: measured.failures(),
        warmup_failures: warmup.failures(),
        counts: measured,
        warmup_counts: warmup,
        late_replies: 0,
        offered_rate: rate(sent),
        achieved_rate: rate(ok),
        send_interval_s: interval_ns / 1e9,
        measured_interval_s: interval_ns / 1e9,
        latency: Latency::from_histogram(&hist),
        send_lag: None,
        request_bytes: req_b,
        reply_bytes: rep_b,
        server_threads: crate::server_threads(server_cpu.as_ref(), ok),
        server_cpu,
        host_cpu,
        softirqs,
        generate: None,
        client_cpu: process_report(&before.client, &after.client, ok),
        failure_samples: samples,
        notes,
    })
}
