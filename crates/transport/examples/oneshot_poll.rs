//! What the native transport's wait costs with an executor that cannot wake it (the one-shot
//! GPU executor in poll mode), without a GPU: a fake executor answers each echo request
//! `--service-us` (25 by default: the H200's gemm8 round trip) after it was published and
//! never wakes the transport. `--conns` closed-loop clients, each waiting `--think-us` between
//! requests. Client round trip p50/p99 and the transport thread's CPU (schedstat) per request,
//! with the fixed 100 us poll and with completion pacing (`NativeConfig::pace_completions`).
//!
//! `cargo run --release -p bgs-transport --example oneshot_poll -- [--service-us N] [--conns N]
//! [--think-us N] [--secs S]`; transport on CPU 0, executor and clients on CPU 1.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bgs_protocol::{Op, RequestHeader, encode_request};
use bgs_ring::{RingConfig, RingRegion};
use bgs_transport::{NativeConfig, NativeTransport};

mod common;
use common::{pin, thread_run_ns};

fn arg(name: &str, default: u64) -> u64 {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .map_or(default, |v| v.parse().expect(name))
}

/// Answer each request `service` after its publish time, in order; never wake anyone.
fn executor(region: &RingRegion, service: Duration, stop: &AtomicBool) {
    let _ = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1_000));
    let mut held: std::collections::VecDeque<bgs_ring::RequestEntry> = Default::default();
    let service_ns = service.as_nanos() as u64;
    while !stop.load(Ordering::Acquire) {
        while let Some(e) = region.requests().try_pop(|e| e.clone()) {
            held.push_back(e);
        }
        let now = bgs_ring::monotonic_ns();
        while let Some(e) = held.front().filter(|e| e.publish_ns + service_ns <= now) {
            let words = e.payload().to_vec();
            let e = e.clone();
            if region
                .completions()
                .try_push(|c| {
                    c.conn = e.conn;
                    c.conn_seq = e.conn_seq;
                    c.status = 0;
                    c.final_ = 1;
                    c.request_id = e.request_id;
                    c.words = words.len() as u32;
                    c.route = e.route;
                    c.op = u32::from(e.op);
                    c.publish_ns = e.publish_ns;
                    c.payload[..words.len()].copy_from_slice(&words);
                })
                .is_err()
            {
                break;
            }
            held.pop_front();
        }
        let wait = held.front().map_or(Duration::from_micros(20), |e| {
            Duration::from_nanos((e.publish_ns + service_ns).saturating_sub(now))
                .min(Duration::from_micros(20))
        });
        std::thread::sleep(wait);
    }
}

fn client(addr: std::net::SocketAddr, think: Duration, until: Instant, rtts: &Mutex<Vec<u64>>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).unwrap();
    let mut mine = Vec::new();
    let mut id = 0u32;
    let mut buf = [0u8; 24 + 64 * 4];
    while Instant::now() < until {
        id += 1;
        let mut req = Vec::new();
        encode_request(
            &mut req,
            &RequestHeader::new(Op::Echo, id, 64, 0),
            &[id; 64],
        );
        let t = Instant::now();
        s.write_all(&req).unwrap();
        s.read_exact(&mut buf).unwrap();
        mine.push(t.elapsed().as_nanos() as u64);
        std::thread::sleep(think);
    }
    rtts.lock().unwrap().extend(mine);
}

fn run(service: Duration, conns: usize, think: Duration, secs: f64, pace: bool) {
    let region = Arc::new(RingRegion::new(RingConfig::default()).unwrap());
    let cfg = NativeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        pace_completions: pace,
        ..NativeConfig::default()
    };
    let t = NativeTransport::bind(cfg, Some(region.clone())).expect("bind");
    let (addr, handle) = (t.local_addr(), t.shutdown_handle());
    let tid = Arc::new(Mutex::new(0));
    let tid2 = tid.clone();
    let transport = std::thread::spawn(move || {
        pin(0);
        *tid2.lock().unwrap() = rustix::thread::gettid().as_raw_nonzero().get();
        t.run().expect("transport")
    });
    let stop = Arc::new(AtomicBool::new(false));
    let (r2, s2) = (region.clone(), stop.clone());
    let exec = std::thread::spawn(move || {
        pin(1);
        executor(&r2, service, &s2)
    });
    let warm = Duration::from_secs(1);
    let until = Instant::now() + warm + Duration::from_secs_f64(secs);
    let rtts = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..conns)
        .map(|_| {
            let r = rtts.clone();
            std::thread::spawn(move || {
                pin(1);
                client(addr, think, until, &r)
            })
        })
        .collect();
    std::thread::sleep(warm);
    rtts.lock().unwrap().clear();
    let tid = *tid.lock().unwrap();
    let (run0, t0) = (thread_run_ns(tid), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let run1 = thread_run_ns(tid);
    let elapsed = t0.elapsed().as_secs_f64();
    for c in clients {
        c.join().unwrap();
    }
    handle.shutdown();
    let stats = transport.join().unwrap();
    stop.store(true, Ordering::Release);
    exec.join().unwrap();
    let mut r = rtts.lock().unwrap().clone();
    r.sort_unstable();
    let n = r.len().max(1);
    let q = |f: f64| r[((n as f64 * f) as usize).min(n - 1)] as f64 / 1e3;
    println!(
        "| {} | {:.0} | {:.1} | {:.1} | {:.2} | {:.2} |",
        if pace { "paced" } else { "100 us poll" },
        n as f64 / elapsed,
        q(0.5),
        q(0.99),
        (run1 - run0) as f64 / 1e3 / n as f64,
        stats.epoll_waits as f64 / stats.completions.max(1) as f64,
    );
}

fn main() {
    let service = Duration::from_micros(arg("--service-us", 25));
    let conns = arg("--conns", 16) as usize;
    let think = Duration::from_micros(arg("--think-us", 15_000));
    let secs = arg("--secs", 4) as f64;
    println!(
        "executor answers {service:?} after publish, never wakes; {conns} closed-loop clients, {think:?} think time, {secs} s\n"
    );
    println!("| transport wait | req/s | p50 us | p99 us | transport us/req | epoll waits/req |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for pace in [false, true, false, true] {
        run(service, conns, think, secs, pace);
    }
}
