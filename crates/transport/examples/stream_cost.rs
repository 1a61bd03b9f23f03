//! What a streamed token costs the native transport, in the GPU step loop's regime, without a
//! GPU: a fake executor publishes one token frame for every live stream once per step
//! (`--step-us`, 1,800 by default: the Qwen2.5-0.5B shape's decode step on the H200) and wakes
//! the transport once per step, like the step loop's monitor. Closed-loop clients keep
//! `--streams` generate requests of `--tokens` tokens going. The transport thread's CPU
//! (schedstat) per frame and per request, its writes and epoll waits, for each configuration:
//! the timed wait (`poll`: a 100 us `epoll_wait` while requests are outstanding; `wake`: the
//! executor's wake-up with a 10 ms safety net) and the coalescing hold
//! (`NativeConfig::stream_coalesce`). With `--transports native,kernel` the kernel transport's
//! reply loop (root: BPF, io_uring) runs the same load, its timed wait either the loop's
//! 60 us timer while requests are outstanding or the executor's wake-up with a 10 ms safety
//! net (`KernelConfig::wake_timeout`); it has no hold. For it, writes are the stage's SENDs
//! and waits its returns from `io_uring_enter`.
//!
//! `cargo run --release -p bgs-transport --example stream_cost -- [--step-us N] [--streams N]
//! [--tokens N] [--secs S] [--holds-us 0,2000,8000] [--transports native,kernel]
//! [--transport-cpu C] [--load-cpu C]`
//!
//! The transport thread is pinned to `--transport-cpu` (0), the executor and the clients to
//! `--load-cpu` (1). On loopback the client's receive processing runs in the writer's context:
//! part of what the transport thread pays per write is the client's TCP receive.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bgs_protocol::FramerConfig;
use bgs_protocol::{Op, ReplyHeader, RequestHeader, Status, encode_request};
use bgs_ring::{RingConfig, RingRegion};
use bgs_transport::kernel::{KernelConfig, KernelTransport, ReplyMode};
use bgs_transport::{NativeConfig, NativeTransport};

mod common;
use common::{pin, transport_usage};

struct Args {
    step: Duration,
    streams: usize,
    tokens: u32,
    secs: f64,
    holds: Vec<u64>,
    kernel: bool,
    native: bool,
    transport_cpu: usize,
    load_cpu: usize,
}

fn parse() -> Args {
    let mut a = Args {
        step: Duration::from_micros(1800),
        streams: 24,
        tokens: 64,
        secs: 4.0,
        holds: vec![0, 2000, 8000],
        kernel: false,
        native: true,
        transport_cpu: 0,
        load_cpu: 1,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let (k, v) = (&pair[0], pair.get(1).expect("every flag takes a value"));
        match k.as_str() {
            "--step-us" => a.step = Duration::from_micros(v.parse().expect("--step-us")),
            "--streams" => a.streams = v.parse().expect("--streams"),
            "--tokens" => a.tokens = v.parse().expect("--tokens"),
            "--secs" => a.secs = v.parse().expect("--secs"),
            "--holds-us" => {
                a.holds = v
                    .split(',')
                    .map(|h| h.parse().expect("--holds-us"))
                    .collect();
            }
            "--transports" => {
                a.native = v.split(',').any(|t| t == "native");
                a.kernel = v.split(',').any(|t| t == "kernel");
                assert!(
                    v.split(',').all(|t| t == "native" || t == "kernel"),
                    "--transports: native, kernel"
                );
            }
            "--transport-cpu" => a.transport_cpu = v.parse().expect("--transport-cpu"),
            "--load-cpu" => a.load_cpu = v.parse().expect("--load-cpu"),
            _ => panic!("unknown flag {k}"),
        }
    }
    a
}

struct Live {
    conn: u64,
    conn_seq: u32,
    id: u32,
    route: u32,
    stream: u32,
    next: u32,
    tokens: u32,
}

/// One step a `step` apart: take new requests, publish a frame per live stream, wake once.
fn executor(
    region: &RingRegion,
    waker: &(dyn Fn() + Send + Sync),
    step: Duration,
    stop: &AtomicBool,
) {
    let mut live: Vec<Live> = Vec::new();
    let mut free: Vec<u32> = (1..=bgs_ring::MAX_STREAMS as u32).rev().collect();
    let mut next_step = Instant::now();
    while !stop.load(Ordering::Acquire) {
        while let Some(e) = region.requests().try_pop(|e| e.clone()) {
            if e.op == Op::Generate as u16 {
                live.push(Live {
                    conn: e.conn,
                    conn_seq: e.conn_seq,
                    id: e.request_id,
                    route: e.route,
                    stream: free.pop().expect("a free stream"),
                    next: 0,
                    tokens: e.param,
                });
            }
        }
        let now = Instant::now();
        if now < next_step {
            std::thread::sleep((next_step - now).min(Duration::from_micros(200)));
            continue;
        }
        next_step += step;
        let mut published = false;
        live.retain_mut(|s| {
            let final_ = s.next == s.tokens;
            let pushed = region.completions().try_push(|c| {
                c.conn = s.conn;
                c.conn_seq = s.conn_seq;
                c.status = if final_ {
                    Status::EndOfStream
                } else {
                    Status::Token
                } as u16;
                c.final_ = u16::from(final_);
                c.request_id = s.id;
                c.words = 1;
                c.stream_seq = s.next;
                c.route = s.route;
                c.stream = s.stream;
                c.payload[0] = s.next;
            });
            if pushed.is_err() {
                return true; // ring full: this stream's frame waits for the next step
            }
            published = true;
            s.next += 1;
            if final_ {
                free.push(s.stream);
            }
            !final_
        });
        if published {
            let ring = region.completions();
            if ring.has_sleepers() {
                ring.notify();
                waker();
            }
        }
    }
}

/// Closed loop: a request, its frames, the next. Counts finished requests in `done` and their
/// first frame's and last frame's times after the request (ns) in `first_ns` and `total_ns`.
fn client(
    addr: std::net::SocketAddr,
    tokens: u32,
    until: Instant,
    done: &AtomicU64,
    first_ns: &AtomicU64,
    total_ns: &AtomicU64,
) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).unwrap();
    let mut id = 0u32;
    let mut h = [0u8; 24];
    let mut w = [0u8; 4];
    while Instant::now() < until {
        id += 1;
        let mut req = Vec::new();
        // A two-token prompt (the fake executor ignores it).
        encode_request(
            &mut req,
            &RequestHeader::new(Op::Generate, id, 2, tokens),
            &[1, 2],
        );
        let sent = Instant::now();
        s.write_all(&req).unwrap();
        for k in 0..=tokens {
            s.read_exact(&mut h).unwrap();
            if k == 0 {
                first_ns.fetch_add(sent.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            let hd = ReplyHeader::decode(&h);
            assert!(
                hd.status == Status::Token as u16 || hd.status == Status::EndOfStream as u16,
                "request {id}: status {}",
                hd.status
            );
            for _ in 0..hd.words {
                s.read_exact(&mut w).unwrap();
            }
        }
        total_ns.fetch_add(sent.elapsed().as_nanos() as u64, Ordering::Relaxed);
        done.fetch_add(1, Ordering::Relaxed);
    }
}

/// A transport under test, started: its address, the executor's waker, and how to stop it
/// (returning its writes and waits).
struct Started {
    addr: std::net::SocketAddr,
    region: Arc<RingRegion>,
    waker: Arc<dyn Fn() + Send + Sync>,
    stop: Box<dyn FnOnce() -> (u64, u64, u64)>,
}

/// The native transport with the timed wait (`poll`) or the executor's wake-up, and a hold.
fn start_native(poll: bool, hold_us: u64, on_thread: impl FnOnce() + Send + 'static) -> Started {
    let region = Arc::new(
        RingRegion::new(RingConfig {
            request_slots: 4096,
            completion_slots: 16384,
        })
        .unwrap(),
    );
    let cfg = NativeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        wake_timeout: (!poll).then_some(Duration::from_millis(10)),
        stream_coalesce: Duration::from_micros(hold_us),
        ..NativeConfig::default()
    };
    let t = NativeTransport::bind(cfg, Some(region.clone())).expect("bind");
    let (addr, handle, waker) = (t.local_addr(), t.shutdown_handle(), t.waker());
    let thread = std::thread::spawn(move || {
        on_thread();
        t.run().expect("transport")
    });
    Started {
        addr,
        region,
        waker,
        stop: Box::new(move || {
            handle.shutdown();
            let s = thread.join().unwrap();
            (s.completions, s.writes, s.epoll_waits)
        }),
    }
}

/// The kernel transport's reply loop, woken by the executor (its eventfd), with the loop's
/// 60 us timer while requests are outstanding (`poll`) or a 10 ms safety net.
fn start_kernel(poll: bool, on_thread: impl FnOnce() + Send + 'static) -> Started {
    let t = KernelTransport::bind(KernelConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        reply: ReplyMode::Loop {
            timer: Duration::from_micros(60),
        },
        framer: FramerConfig::default(),
        max_connections: 1024,
        executor_wakes: true,
        completion_watch: false,
        stats_every: None,
        wake_timeout: (!poll).then_some(Duration::from_millis(10)),
        request_slots: 4096,
        completion_slots: 16384,
        gpu_sends: false,
        limits: bgs_transport::conn::ConnLimits::default(),
        cancel_markers: false,
    })
    .expect("kernel transport (needs root, BPF and a cgroup2 mount)");
    let (addr, handle, region) = (t.local_addr(), t.shutdown_handle(), t.region());
    let waker = t.waker().expect("the reply loop has a waker");
    let thread = std::thread::spawn(move || {
        on_thread();
        t.run().expect("transport")
    });
    Started {
        addr,
        region,
        waker,
        stop: Box::new(move || {
            handle.shutdown();
            let s = thread.join().unwrap();
            (s.reply.completions, s.reply.sends, s.wakeups)
        }),
    }
}

fn run(a: &Args, kernel: bool, poll: bool, hold_us: u64) {
    let tid = Arc::new(Mutex::new(0));
    let tid2 = tid.clone();
    let cpu = a.transport_cpu;
    let on_thread = move || {
        pin(cpu);
        *tid2.lock().unwrap() = rustix::thread::gettid().as_raw_nonzero().get();
    };
    let started = if kernel {
        start_kernel(poll, on_thread)
    } else {
        start_native(poll, hold_us, on_thread)
    };
    let (addr, region, waker) = (started.addr, started.region.clone(), started.waker.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let (r2, s2, step, load_cpu) = (region.clone(), stop.clone(), a.step, a.load_cpu);
    let exec = std::thread::spawn(move || {
        pin(load_cpu);
        executor(&r2, &*waker, step, &s2)
    });
    // Warm-up: a second of the same load, not measured.
    let done = Arc::new(AtomicU64::new(0));
    let first_ns = Arc::new(AtomicU64::new(0));
    let total_ns = Arc::new(AtomicU64::new(0));
    let warm = Duration::from_secs(1);
    let start = Instant::now();
    let until = start + warm + Duration::from_secs_f64(a.secs);
    let clients: Vec<_> = (0..a.streams)
        .map(|_| {
            let (d, f, t, tokens) = (done.clone(), first_ns.clone(), total_ns.clone(), a.tokens);
            std::thread::spawn(move || {
                pin(load_cpu);
                client(addr, tokens, until, &d, &f, &t)
            })
        })
        .collect();
    std::thread::sleep(warm);
    let tid = *tid.lock().unwrap();
    let ((run0, _), done0, t0) = (
        transport_usage(tid),
        done.load(Ordering::Relaxed),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs_f64(a.secs));
    let ((run1, _), done1, secs) = (
        transport_usage(tid),
        done.load(Ordering::Relaxed),
        t0.elapsed().as_secs_f64(),
    );
    for c in clients {
        c.join().unwrap();
    }
    let (completions, writes, waits) = (started.stop)();
    stop.store(true, Ordering::Release);
    exec.join().unwrap();
    let reqs = (done1 - done0).max(1) as f64;
    // Over every request of the run (warm-up included).
    let all_done = done.load(Ordering::Relaxed).max(1) as f64;
    let first_ms = first_ns.load(Ordering::Relaxed) as f64 / all_done / 1e6;
    let total_ms = total_ns.load(Ordering::Relaxed) as f64 / all_done / 1e6;
    let frames = reqs * f64::from(a.tokens + 1);
    let us = (run1 - run0) as f64 / 1e3;
    let all = completions.max(1) as f64;
    let wait = match (kernel, poll) {
        (false, true) => "native, 100 us poll",
        (false, false) => "native, wake-up, 10 ms net",
        (true, true) => "kernel loop, 60 us timer",
        (true, false) => "kernel loop, wake-up, 10 ms net",
    };
    println!(
        "| {wait} | {} | {:.0} | {:.2} / {:.1} | {:.2} | {:.1} | {:.1} | {:.1} |",
        hold_us,
        reqs / secs,
        first_ms,
        total_ms,
        us / frames,
        us / reqs,
        writes as f64 / all * f64::from(a.tokens + 1),
        waits as f64 / all * f64::from(a.tokens + 1),
    );
}

fn main() {
    let a = parse();
    println!(
        "step {:?}, {} closed-loop streams of {} tokens, {} s per configuration (transport on CPU {}, load on CPU {})\n",
        a.step, a.streams, a.tokens, a.secs, a.transport_cpu, a.load_cpu
    );
    println!(
        "| transport wait | hold us | requests/s | first frame / request ms | transport us/frame | transport us/request | writes/request | waits/request |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for poll in [true, false] {
        if a.native {
            for &h in &a.holds {
                run(&a, false, poll, h);
            }
        }
        if a.kernel {
            run(&a, true, poll, 0);
        }
    }
}
