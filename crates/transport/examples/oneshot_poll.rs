//! What a transport's wait costs with an executor that cannot wake it (the one-shot GPU
//! executor in poll mode), without a GPU: a fake executor answers each echo request
//! `--service-us` (25 by default: the H200's gemm8 round trip) after it was published and
//! never wakes the transport. `--conns` closed-loop clients, each waiting `--think-us` between
//! requests. Client round trip p50/p99, the transport thread's CPU (schedstat) per request and
//! the whole host's busy time per request (`/proc/stat`: on loopback the kernel transport's
//! receive path, BPF included, runs on the clients' CPU), for each of `--transports`:
//! `native-poll` (the fixed 100 us poll), `native-paced` (`NativeConfig::pace_completions`),
//! `kernel-loop` (the io_uring reply loop: BPF's doorbell at each request, then its timer) and
//! `kernel-watch` (BPF watches the completion ring on a timer and rings the doorbell when the
//! reply is there), `kernel-sqe` (`--reply executor-sqe` with a send table, as for the GPU,
//! and adaptive submission: the GPU's sends paused at these rates, so the fake executor, which
//! never sends itself, is what a paused GPU is; the stage is woken by the completion watch and
//! sends with `send(2)`) and `kernel-sqpoll` (the same with `sqpoll_above` 0: the stage's SENDs
//! go through the SQPOLL ring and it polls every 50 µs while requests execute; an approximation
//! of GPU-written SENDs before adaptive submission, whose SQPOLL thread spins the same way).
//! The transport's CPU is its threads': the one that runs it, and for `--reply executor-sqe`
//! the stage (`bgs-exec-sqe`) and io_uring's threads (`iou-sqp`, `iou-wrk`). The kernel
//! transports need root.
//!
//! `cargo run --release -p bgs-transport --example oneshot_poll -- [--service-us N] [--conns N]
//! [--think-us N] [--secs S] [--transports a,b,..] [--rounds N]`; transport on CPU 0, executor
//! and clients on CPU 1.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bgs_protocol::{FramerConfig, Op, RequestHeader, encode_request};
use bgs_ring::{RingConfig, RingRegion};
use bgs_transport::kernel::{KernelConfig, KernelTransport, ReplyMode};
use bgs_transport::{NativeConfig, NativeTransport};

mod common;
use common::{pin, transport_usage};

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

/// Round trips as (end instant, nanoseconds).
type Rtts = Mutex<Vec<(Instant, u64)>>;

fn client(addr: std::net::SocketAddr, think: Duration, until: Instant, rtts: &Rtts) {
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
        mine.push((Instant::now(), t.elapsed().as_nanos() as u64));
        std::thread::sleep(think);
    }
    rtts.lock().unwrap().extend(mine);
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Transport {
    NativePoll,
    NativePaced,
    KernelLoop,
    KernelWatch,
    KernelSqe,
    KernelSqpoll,
}

impl Transport {
    fn parse(s: &str) -> Transport {
        match s {
            "native-poll" => Transport::NativePoll,
            "native-paced" => Transport::NativePaced,
            "kernel-loop" => Transport::KernelLoop,
            "kernel-watch" => Transport::KernelWatch,
            "kernel-sqe" => Transport::KernelSqe,
            "kernel-sqpoll" => Transport::KernelSqpoll,
            _ => panic!(
                "--transports: native-poll, native-paced, kernel-loop, kernel-watch, kernel-sqe or kernel-sqpoll"
            ),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Transport::NativePoll => "native, 100 us poll",
            Transport::NativePaced => "native, paced",
            Transport::KernelLoop => "kernel loop, doorbell + timer",
            Transport::KernelWatch => "kernel loop, BPF completion watch",
            Transport::KernelSqe => "kernel executor-sqe, GPU sends paused (adaptive)",
            Transport::KernelSqpoll => "kernel executor-sqe, SQPOLL ring (sqpoll_above 0)",
        }
    }
}

/// A started transport: its address, how to stop it, and its thread (returning the waits per
/// completion it counted).
struct Started {
    addr: std::net::SocketAddr,
    region: Arc<RingRegion>,
    stop: Box<dyn FnOnce() -> f64>,
}

fn start(which: Transport, tid: Arc<Mutex<i32>>) -> Started {
    let record_tid = move || {
        pin(0);
        *tid.lock().unwrap() = rustix::thread::gettid().as_raw_nonzero().get();
    };
    match which {
        Transport::NativePoll | Transport::NativePaced => {
            let region = Arc::new(RingRegion::new(RingConfig::default()).unwrap());
            let cfg = NativeConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                pace_completions: which == Transport::NativePaced,
                ..NativeConfig::default()
            };
            let t = NativeTransport::bind(cfg, Some(region.clone())).expect("bind");
            let (addr, handle) = (t.local_addr(), t.shutdown_handle());
            let thread = std::thread::spawn(move || {
                record_tid();
                t.run().expect("transport")
            });
            Started {
                addr,
                region,
                stop: Box::new(move || {
                    handle.shutdown();
                    let s = thread.join().unwrap();
                    s.epoll_waits as f64 / s.completions.max(1) as f64
                }),
            }
        }
        Transport::KernelLoop
        | Transport::KernelWatch
        | Transport::KernelSqe
        | Transport::KernelSqpoll => {
            let sqe = matches!(which, Transport::KernelSqe | Transport::KernelSqpoll);
            let reply = if sqe {
                ReplyMode::ExecutorSqe {
                    watchdog: Duration::from_micros(50),
                    sqpoll_idle_ms: 10,
                    sqpoll_cpu: None,
                    sqpoll_above: if which == Transport::KernelSqe {
                        bgs_transport::kernel::DEFAULT_SQPOLL_ABOVE
                    } else {
                        0
                    },
                }
            } else {
                ReplyMode::Loop {
                    timer: Duration::from_micros(60),
                }
            };
            let t = KernelTransport::bind(KernelConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                reply,
                framer: FramerConfig::default(),
                max_connections: 1024,
                executor_wakes: false,
                completion_watch: which != Transport::KernelLoop,
                stats_every: None,
                request_slots: 4096,
                completion_slots: 8192,
                gpu_sends: sqe,
                limits: bgs_transport::conn::ConnLimits::default(),
                cancel_markers: false,
                wake_timeout: None,
            })
            .expect("kernel transport (needs root, BPF and a cgroup2 mount)");
            let (addr, handle, region) = (t.local_addr(), t.shutdown_handle(), t.region());
            let thread = std::thread::spawn(move || {
                record_tid();
                t.run().expect("transport")
            });
            Started {
                addr,
                region,
                stop: Box::new(move || {
                    handle.shutdown();
                    let s = thread.join().unwrap();
                    eprintln!("{}", s.bpf);
                    s.wakeups as f64 / s.reply.completions.max(1) as f64
                }),
            }
        }
    }
}

/// Busy and total jiffies of the whole host (`/proc/stat`'s first line).
fn host_jiffies() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().sum();
    // idle and iowait
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

fn run(which: Transport, service: Duration, conns: usize, think: Duration, secs: f64) {
    let tid = Arc::new(Mutex::new(0));
    let started = start(which, tid.clone());
    let (addr, region) = (started.addr, started.region.clone());
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
    let tid = *tid.lock().unwrap();
    let ((run0, sleeps0), host0, t0) = (transport_usage(tid), host_jiffies(), Instant::now());
    std::thread::sleep(Duration::from_secs_f64(secs));
    let ((run1, sleeps1), host1, t1) = (transport_usage(tid), host_jiffies(), Instant::now());
    let elapsed = (t1 - t0).as_secs_f64();
    for c in clients {
        c.join().unwrap();
    }
    let waits = (started.stop)();
    stop.store(true, Ordering::Release);
    exec.join().unwrap();
    // The round trips that ended inside the measured interval.
    let mut r: Vec<u64> = rtts
        .lock()
        .unwrap()
        .iter()
        .filter(|(end, _)| (t0..t1).contains(end))
        .map(|&(_, ns)| ns)
        .collect();
    r.sort_unstable();
    let n = r.len().max(1);
    let q = |f: f64| r[((n as f64 * f) as usize).min(n - 1)] as f64 / 1e3;
    let served = n as f64;
    let ticks = 100.0; // USER_HZ
    let host_busy_us = (host1.0 - host0.0) as f64 / ticks * 1e6;
    println!(
        "| {} | {:.0} | {:.1} | {:.1} | {:.2} | {:.1} | {:.2} | {:.2} |",
        which.name(),
        served / elapsed,
        q(0.5),
        q(0.99),
        (run1 - run0) as f64 / 1e3 / served,
        host_busy_us / served,
        (sleeps1 - sleeps0) as f64 / served,
        waits,
    );
}

fn main() {
    let service = Duration::from_micros(arg("--service-us", 25));
    let conns = arg("--conns", 16) as usize;
    let think = Duration::from_micros(arg("--think-us", 15_000));
    let secs = arg("--secs", 4) as f64;
    let rounds = arg("--rounds", 2);
    let argv: Vec<String> = std::env::args().collect();
    let transports: Vec<Transport> = argv
        .iter()
        .position(|a| a == "--transports")
        .and_then(|i| argv.get(i + 1))
        .map_or("native-poll,native-paced", String::as_str)
        .split(',')
        .map(Transport::parse)
        .collect();
    println!(
        "executor answers {service:?} after publish, never wakes; {conns} closed-loop clients, {think:?} think time, {secs} s\n"
    );
    println!(
        "| transport wait | req/s | p50 us | p99 us | transport us/req | host us/req | sleeps/req | waits/req (sqe: SQPOLL wake-ups) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for _ in 0..rounds {
        for &t in &transports {
            run(t, service, conns, think, secs);
        }
    }
}
