//! GPU executor checks and in-process measurements (run on the GPU machine by bench/gpu/run.sh).
//!
//! ```text
//! bgs-gpu-bench check      [--dispatcher device|host] [--slots N] [--schedulers K] [--digest FILE]
//! bgs-gpu-bench rtt        [--dispatcher ..] [--slots N] [--schedulers K] [--op gemm8|fft32|echo] [--repeat R] [--n N]
//! bgs-gpu-bench throughput [--dispatcher ..] [--slots N] [--schedulers K] [--op ..] [--repeat R] [--seconds S] [--outstanding K]
//! ```
//! Every mode prints one JSON object on stdout.
//!
//! Ranges (anything outside is refused before the GPU is touched): `--slots` 1..=64,
//! `--schedulers` 0..=64, `--repeat` 1..=256, `--n` 1..=100000000, `--seconds` 0 < S <= 3600,
//! `--outstanding` 1..=65536.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bgs_adapters::OneShotCpu;
use bgs_cpuacct::{ProcessCpu, ProcessSample};
use bgs_executor_gpu::{Dispatcher, GpuExecutor, GpuExecutorConfig};
use bgs_protocol::{Op, Status};
use bgs_ring::{OP_CANCEL, OP_REJECT, RingConfig, RingRegion};

struct Args {
    mode: String,
    dispatcher: Dispatcher,
    slots: usize,
    schedulers: usize,
    op: Op,
    repeat: u32,
    n: usize,
    seconds: f64,
    outstanding: usize,
    digest: Option<String>,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mode = it
        .next()
        .ok_or("usage: bgs-gpu-bench check|rtt|throughput [options]")?;
    let mut a = Args {
        mode,
        dispatcher: Dispatcher::DeviceLaunch,
        slots: 16,
        schedulers: 0,
        op: Op::Gemm8,
        repeat: 1,
        n: 20_000,
        seconds: 2.0,
        outstanding: 512,
        digest: None,
    };
    while let Some(k) = it.next() {
        let v = it.next().ok_or(format!("{k} needs a value"))?;
        // An integer flag's value in `lo..=hi`.
        let int = |lo: u64, hi: u64| -> Result<u64, String> {
            let n: u64 = v.parse().map_err(|e| format!("{k} {v}: {e}"))?;
            if !(lo..=hi).contains(&n) {
                return Err(format!("{k} {n} is outside {lo}..={hi}"));
            }
            Ok(n)
        };
        match k.as_str() {
            "--dispatcher" => {
                a.dispatcher = match v.as_str() {
                    "device" => Dispatcher::DeviceLaunch,
                    "host" => Dispatcher::HostLaunch,
                    _ => return Err(format!("bad dispatcher {v}")),
                }
            }
            "--slots" => a.slots = int(1, bgs_executor_gpu::layout::MAX_SLOTS as u64)? as usize,
            "--schedulers" => {
                a.schedulers = int(0, bgs_executor_gpu::layout::MAX_SLOTS as u64)? as usize
            }
            "--op" => {
                a.op = match v.as_str() {
                    "gemm8" => Op::Gemm8,
                    "fft32" => Op::Fft32,
                    "echo" => Op::Echo,
                    _ => return Err(format!("bad op {v}")),
                }
            }
            "--repeat" => a.repeat = int(1, u64::from(bgs_protocol::MAX_REPEAT))? as u32,
            "--n" => a.n = int(1, 100_000_000)? as usize,
            "--seconds" => {
                a.seconds = v.parse().map_err(|e| format!("{k} {v}: {e}"))?;
                if !(a.seconds.is_finite() && a.seconds > 0.0 && a.seconds <= 3600.0) {
                    return Err(format!("{k} {v} is outside 0 < S <= 3600"));
                }
            }
            "--outstanding" => a.outstanding = int(1, 65_536)? as usize,
            "--digest" => a.digest = Some(v),
            _ => return Err(format!("unknown option {k}")),
        }
    }
    Ok(a)
}

fn payload(seed: u64) -> [u32; 64] {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = [0u32; 64];
    for w in out.iter_mut() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        *w = ((((s >> 40) as f32) / (1u64 << 24) as f32) * 2.0 - 1.0).to_bits();
    }
    out
}

#[derive(Clone, Copy)]
struct Req {
    op: u16,
    param: u32,
    words: u32,
    seed: u64,
}

fn push(region: &RingRegion, id: u32, r: &Req) -> bool {
    let p = payload(r.seed);
    region
        .requests()
        .try_push(|e| {
            e.conn = 0xC0FFEE;
            e.conn_seq = id;
            e.op = r.op;
            e.version = 1;
            e.request_id = id;
            e.words = r.words;
            e.param = r.param;
            e.flags = 0;
            e.publish_ns = 0;
            e.route = id & 0x3;
            let n = r.words.min(64) as usize;
            e.payload[..n].copy_from_slice(&p[..n]);
        })
        .is_ok()
}

struct Done {
    id: u32,
    status: u16,
    final_: u16,
    route: u32,
    stream: u32,
    payload: Vec<u32>,
}

/// Request ids of the OP_CANCEL entries `check` interleaves with its requests.
const CANCEL_ID: u32 = 0xCA00_0000;

/// Push an OP_CANCEL entry (a connection ended): the executor must consume it silently.
fn push_cancel(region: &RingRegion, k: u32) -> bool {
    region
        .requests()
        .try_push(|e| {
            e.conn = 0xC0FFEE;
            e.conn_seq = 0;
            e.op = OP_CANCEL;
            e.version = 1;
            e.request_id = CANCEL_ID + k;
            e.words = 0;
            e.param = 0;
            e.flags = 0;
            e.publish_ns = 0;
            e.route = 0;
        })
        .is_ok()
}

fn pop(region: &RingRegion) -> Option<Done> {
    region.completions().try_pop(|c| Done {
        id: c.request_id,
        status: c.status,
        final_: c.final_,
        route: c.route,
        stream: c.stream,
        payload: c.payload[..c.words as usize].to_vec(),
    })
}

fn region() -> Arc<RingRegion> {
    Arc::new(
        RingRegion::new(RingConfig {
            request_slots: 4096,
            completion_slots: 8192,
        })
        .expect("ring region"),
    )
}

fn start(a: &Args, region: &Arc<RingRegion>) -> GpuExecutor {
    let cfg = GpuExecutorConfig {
        slots: a.slots,
        dispatcher: a.dispatcher,
        schedulers: a.schedulers,
        ..Default::default()
    };
    match GpuExecutor::start(region.clone(), &cfg) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("bgs-gpu-bench: {e}");
            std::process::exit(2);
        }
    }
}

/// The CPU executor's answer.
fn expected(cpu: &mut OneShotCpu, r: &Req) -> (u16, Vec<u32>) {
    let p = payload(r.seed);
    let n = r.words.min(64) as usize;
    // The bench never sends OP_CANCEL entries (the only ones without a plan).
    let Some(pl) = bgs_executor_gpu::plan::plan(r.op, r.param, r.words) else {
        return (Status::Internal as u16, vec![]);
    };
    if pl.status != Status::Ok as u16 {
        return (pl.status, vec![]);
    }
    match Op::from_u16(r.op) {
        Some(Op::Echo) => (0, p[..n].to_vec()),
        Some(Op::Gemm8) => (0, cpu.gemm8(&p, r.param).to_vec()),
        Some(Op::Fft32) => (0, cpu.fft32(&p, r.param).to_vec()),
        _ => (pl.status, vec![]),
    }
}

fn check(a: &Args) -> i32 {
    let region = region();
    let exec = start(a, &region);
    let mut reqs = Vec::new();
    for seed in 0..6u64 {
        for r in [0u32, 1, 2, 3, 5, 16, 17, 100, 255, 256] {
            reqs.push(Req {
                op: Op::Gemm8 as u16,
                param: r,
                words: 64,
                seed,
            });
            reqs.push(Req {
                op: Op::Fft32 as u16,
                param: r,
                words: 64,
                seed: seed + 100,
            });
        }
        for w in [0u32, 1, 7, 64] {
            reqs.push(Req {
                op: Op::Echo as u16,
                param: 0,
                words: w,
                seed: seed + 200,
            });
        }
    }
    reqs.push(Req {
        op: Op::Gemm8 as u16,
        param: 257,
        words: 64,
        seed: 1,
    });
    reqs.push(Req {
        op: Op::Fft32 as u16,
        param: 1,
        words: 8,
        seed: 1,
    });
    reqs.push(Req {
        op: Op::Generate as u16,
        param: 1,
        words: 0,
        seed: 1,
    });
    // A generate request the framer accepts: the GPU has no model, so status 18.
    reqs.push(Req {
        op: Op::Generate as u16,
        param: 16,
        words: 3,
        seed: 1,
    });
    reqs.push(Req {
        op: 77,
        param: 1,
        words: 0,
        seed: 1,
    });
    reqs.push(Req {
        op: OP_REJECT,
        param: Status::Busy as u32,
        words: 0,
        seed: 1,
    });
    reqs.push(Req {
        op: OP_REJECT,
        param: Status::BadMagic as u32,
        words: 0,
        seed: 1,
    });
    reqs.push(Req {
        op: OP_REJECT,
        param: 999,
        words: 0,
        seed: 1,
    });
    let mut got: HashMap<u32, Done> = HashMap::new();
    let t0 = Instant::now();
    // Every 7th push is an OP_CANCEL entry (also several in a row, so that a scheduler batch
    // holds cancels at its first, middle and last lanes).
    let is_cancel = |k: usize| k % 7 == 3 || (40..44).contains(&k);
    let mut pushed_reqs = 0usize;
    let mut cancels = 0u32;
    let mut k = 0usize;
    while got.len() < reqs.len() && t0.elapsed() < Duration::from_secs(60) {
        if pushed_reqs < reqs.len() {
            if is_cancel(k) {
                if push_cancel(&region, cancels) {
                    cancels += 1;
                    k += 1;
                }
            } else if push(&region, pushed_reqs as u32, &reqs[pushed_reqs]) {
                pushed_reqs += 1;
                k += 1;
            }
        }
        while let Some(d) = pop(&region) {
            got.insert(d.id, d);
        }
    }
    // A stray answer to a cancel would come about as fast as the others: drain a little longer.
    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_millis(200) {
        while let Some(d) = pop(&region) {
            got.insert(d.id, d);
        }
    }
    let mut cpu = OneShotCpu::default();
    let mut failures = Vec::new();
    let mut max_err = 0f64;
    let mut digest: u64 = 0xcbf2_9ce4_8422_2325;
    let mut mix = |v: u32| {
        for b in v.to_le_bytes() {
            digest ^= u64::from(b);
            digest = digest.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    let strays = got.keys().filter(|&&id| id >= CANCEL_ID).count();
    if strays > 0 {
        failures.push(format!(
            "{strays} of {cancels} OP_CANCEL entries were answered"
        ));
    }
    for d in got.values().filter(|d| d.stream != 0) {
        failures.push(format!("reply {}: stream {} (want 0)", d.id, d.stream));
    }
    for (i, r) in reqs.iter().enumerate() {
        let Some(d) = got.get(&(i as u32)) else {
            failures.push(format!(
                "request {i} (op {} r {}) unanswered",
                r.op, r.param
            ));
            continue;
        };
        mix(u32::from(d.status));
        mix(d.payload.len() as u32);
        for w in &d.payload {
            mix(*w);
        }
        let (status, want) = expected(&mut cpu, r);
        if d.status != status || d.final_ != 1 || d.route != (i as u32 & 3) {
            failures.push(format!(
                "request {i} (op {} r {} words {}): status {} final {} route {}, want status {status}",
                r.op, r.param, r.words, d.status, d.final_, d.route
            ));
            continue;
        }
        if d.payload.len() != want.len() {
            failures.push(format!(
                "request {i}: {} words, want {}",
                d.payload.len(),
                want.len()
            ));
            continue;
        }
        if r.op == Op::Echo as u16 {
            if d.payload != want {
                failures.push(format!("request {i}: echo payload differs"));
            }
            continue;
        }
        let scale = want
            .iter()
            .map(|w| f64::from(f32::from_bits(*w)).abs())
            .fold(0.0, f64::max);
        for (g, c) in d.payload.iter().zip(&want) {
            let e = (f64::from(f32::from_bits(*g)) - f64::from(f32::from_bits(*c))).abs();
            max_err = max_err.max(e / (1.0 + scale));
            if e > 1e-4 * (1.0 + scale) {
                failures.push(format!(
                    "request {i} (op {} r {}): {} vs CPU {}",
                    r.op,
                    r.param,
                    f32::from_bits(*g),
                    f32::from_bits(*c)
                ));
                break;
            }
        }
    }
    let stats = exec.shutdown_with_stats();
    let digest_hex = format!("{digest:016x}");
    if let Some(path) = &a.digest {
        let _ = std::fs::write(path, format!("{digest_hex}\n"));
    }
    let ok = failures.is_empty() && stats.is_ok();
    println!(
        "{}",
        serde_json::json!({
            "mode": "check",
            "dispatcher": format!("{:?}", a.dispatcher),
            "slots": a.slots,
            "schedulers": a.schedulers,
            "requests": reqs.len(),
            "answered": got.len(),
            "cancels_pushed": cancels,
            "failures": failures.len(),
            "first_failures": failures.iter().take(10).collect::<Vec<_>>(),
            "max_rel_err_vs_cpu": max_err,
            "digest": digest_hex,
            "shutdown": match &stats { Ok(s) => serde_json::to_value(s).unwrap_or_default(), Err(e) => serde_json::json!(e.to_string()) },
            "ok": ok,
        })
    );
    if ok { 0 } else { 1 }
}

fn cpu_sample() -> Option<ProcessSample> {
    ProcessCpu::sample(std::process::id()).ok()
}

/// This process's CPU since `before`, in total and per completed request, with the busiest
/// threads. It covers every host thread of the bench: the submitting client loop (which spins
/// while it waits, so it is about one core of wall time), the executor's host threads and
/// CUDA's; what the GPU executor costs the host without any network.
fn process_cpu(before: &Option<ProcessSample>, n: u64) -> serde_json::Value {
    let (Some(b), Some(a)) = (before, cpu_sample()) else {
        return serde_json::Value::Null;
    };
    let d = a.delta(b);
    let us = |ns: u64| ns as f64 / 1e3;
    let per = |ns: u64| if n == 0 { f64::NAN } else { us(ns) / n as f64 };
    let mut threads: Vec<_> = d.threads.iter().filter(|t| t.run_ns > 0).collect();
    threads.sort_by_key(|t| std::cmp::Reverse(t.run_ns));
    serde_json::json!({
        "wall_s": d.wall_ns as f64 / 1e9,
        "requests": n,
        "user_us": us(d.user_ns),
        "system_us": us(d.system_ns),
        "run_us": us(d.run_ns),
        "per_request_user_us": per(d.user_ns),
        "per_request_system_us": per(d.system_ns),
        "per_request_run_us": per(d.run_ns),
        "threads": threads.iter().take(12).map(|t| serde_json::json!({"comm": t.comm, "run_us": us(t.run_ns)})).collect::<Vec<_>>(),
        "note": "user/system: ticks; run: schedstat (ns); includes the spinning client loop",
    })
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn rtt(a: &Args) -> i32 {
    let region = region();
    let exec = start(a, &region);
    let req = Req {
        op: a.op as u16,
        param: a.repeat,
        words: 64,
        seed: 7,
    };
    let mut lat = Vec::with_capacity(a.n);
    let warm = 500;
    let mut lost = 0;
    let mut cpu_before = None;
    for i in 0..(a.n + warm) {
        if i == warm {
            cpu_before = cpu_sample();
        }
        let t = Instant::now();
        assert!(push(&region, i as u32, &req));
        let deadline = t + Duration::from_secs(2);
        loop {
            if let Some(d) = pop(&region) {
                assert_eq!(d.id, i as u32);
                break;
            }
            if Instant::now() > deadline {
                lost += 1;
                break;
            }
            std::hint::spin_loop();
        }
        if i >= warm {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let cpu = process_cpu(&cpu_before, lat.len() as u64);
    let stats = exec.shutdown_with_stats();
    let mean = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
    println!(
        "{}",
        serde_json::json!({
            "mode": "rtt",
            "dispatcher": format!("{:?}", a.dispatcher),
            "slots": a.slots,
            "schedulers": a.schedulers,
            "op": a.op.name(),
            "repeat": a.repeat,
            "n": lat.len(),
            "lost": lost,
            "p50_us": pct(&mut lat, 0.50),
            "p90_us": pct(&mut lat, 0.90),
            "p99_us": pct(&mut lat, 0.99),
            "p999_us": pct(&mut lat, 0.999),
            "mean_us": mean,
            "process_cpu": cpu,
            "shutdown": match &stats { Ok(s) => serde_json::to_value(s).unwrap_or_default(), Err(e) => serde_json::json!(e.to_string()) },
        })
    );
    i32::from(lost > 0 || stats.is_err())
}

fn throughput(a: &Args) -> i32 {
    let region = region();
    let exec = start(a, &region);
    let req = Req {
        op: a.op as u16,
        param: a.repeat,
        words: 64,
        seed: 9,
    };
    let (mut sent, mut done) = (0u64, 0u64);
    let warm = Duration::from_millis(300);
    let t0 = Instant::now();
    let mut measured_from: Option<(Instant, u64)> = None;
    let total = warm + Duration::from_secs_f64(a.seconds);
    let mut bad = 0u64;
    let mut cpu_before = None;
    while t0.elapsed() < total {
        while sent - done < a.outstanding as u64 && push(&region, sent as u32, &req) {
            sent += 1;
        }
        while let Some(d) = pop(&region) {
            if d.status != 0 {
                bad += 1;
            }
            done += 1;
        }
        if measured_from.is_none() && t0.elapsed() >= warm {
            measured_from = Some((Instant::now(), done));
            cpu_before = cpu_sample();
        }
    }
    // Before the drain: the same interval as completed_per_s.
    let cpu = process_cpu(&cpu_before, done - measured_from.map_or(0, |m| m.1));
    let (m0, d0) = measured_from.unwrap_or((t0, 0));
    let secs = m0.elapsed().as_secs_f64();
    let rate = (done - d0) as f64 / secs;
    // Drain.
    let end = Instant::now() + Duration::from_secs(5);
    while done < sent && Instant::now() < end {
        if pop(&region).is_some() {
            done += 1;
        }
    }
    let stats = exec.shutdown_with_stats();
    println!(
        "{}",
        serde_json::json!({
            "mode": "throughput",
            "dispatcher": format!("{:?}", a.dispatcher),
            "slots": a.slots,
            "schedulers": a.schedulers,
            "op": a.op.name(),
            "repeat": a.repeat,
            "outstanding": a.outstanding,
            "seconds": secs,
            "completed_per_s": rate,
            "sent": sent,
            "done": done,
            "bad_status": bad,
            "process_cpu": cpu,
            "shutdown": match &stats { Ok(s) => serde_json::to_value(s).unwrap_or_default(), Err(e) => serde_json::json!(e.to_string()) },
        })
    );
    i32::from(done < sent || bad > 0 || stats.is_err())
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bgs-gpu-bench: {e}");
            std::process::exit(2);
        }
    };
    if std::env::var_os("RUST_LOG").is_some() {
        // Library logs go to stderr through `tracing`; no subscriber is installed here.
    }
    let rc = match a.mode.as_str() {
        "check" => check(&a),
        "rtt" => rtt(&a),
        "throughput" => throughput(&a),
        "probe" => match bgs_executor_gpu::probe(&GpuExecutorConfig::default()) {
            Ok(i) => {
                println!(
                    "{}",
                    serde_json::json!({"mode": "probe", "ok": true, "device": i.name, "cc": i.compute_capability, "driver": i.driver_version, "host_native_atomics": i.host_native_atomics, "libraries": i.libraries})
                );
                0
            }
            Err(e) => {
                println!(
                    "{}",
                    serde_json::json!({"mode": "probe", "ok": false, "error": e.to_string()})
                );
                1
            }
        },
        m => {
            eprintln!("bgs-gpu-bench: unknown mode {m}");
            2
        }
    };
    std::process::exit(rc);
}
