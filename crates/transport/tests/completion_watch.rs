//! The kernel transport's completion watch (docs/kernel.md, "The completion watch"): with an
//! executor that cannot wake the reply loop, BPF looks at the completion ring on a timer and
//! rings the doorbell once a reply is there. A fake executor stands in for the GPU: it answers
//! each request a fixed time after BPF published it and never wakes anyone. Needs root (BPF,
//! io_uring) and a cgroup2 mount, like every kernel-transport test.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bgs_protocol::{FramerConfig, Op, ReplyHeader, RequestHeader, Status, encode_request};
use bgs_ring::RingRegion;
use bgs_transport::kernel::{KernelConfig, KernelStats, KernelTransport, ReplyMode};

/// Answer every request `hold` after its publish, in order, without notifying anyone.
fn silent_executor(region: &RingRegion, hold: Duration, stop: &AtomicBool) {
    let mut held = std::collections::VecDeque::new();
    let hold_ns = hold.as_nanos() as u64;
    while !stop.load(Ordering::Acquire) {
        while let Some(e) = region.requests().try_pop(|e| e.clone()) {
            held.push_back(e);
        }
        let now = bgs_ring::monotonic_ns();
        while let Some(e) = held.front().filter(|e| e.publish_ns + hold_ns <= now) {
            let e = e.clone();
            let words = e.payload().to_vec();
            let pushed = region.completions().try_push(|c| {
                c.conn = e.conn;
                c.conn_seq = e.conn_seq;
                c.status = Status::Ok as u16;
                c.final_ = 1;
                c.request_id = e.request_id;
                c.words = words.len() as u32;
                c.stream_seq = 0;
                c.stream = 0;
                c.route = e.route;
                c.op = u32::from(e.op);
                c.publish_ns = e.publish_ns;
                c.payload[..words.len()].copy_from_slice(&words);
            });
            if pushed.is_err() {
                break;
            }
            held.pop_front();
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// `conns` connections each send `requests` echo requests one at a time and check every reply;
/// returns the transport's counters.
fn serve(hold: Duration, conns: u32, requests: u32) -> KernelStats {
    let transport = KernelTransport::bind(KernelConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        reply: ReplyMode::Loop {
            timer: Duration::from_micros(60),
        },
        framer: FramerConfig::default(),
        max_connections: 64,
        executor_wakes: false,
        completion_watch: true,
        stats_every: None,
        request_slots: 256,
        completion_slots: 1024,
        gpu_sends: false,
        limits: bgs_transport::conn::ConnLimits::default(),
        cancel_markers: false,
        wake_timeout: None,
    })
    .expect("kernel transport (root)");
    let addr = transport.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let executor = {
        let (region, stop) = (transport.region(), stop.clone());
        std::thread::spawn(move || silent_executor(&region, hold, &stop))
    };
    let handle = transport.shutdown_handle();
    let server = std::thread::spawn(move || transport.run().unwrap());
    let clients: Vec<_> = (0..conns)
        .map(|c| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                for i in 0..requests {
                    let id = c * 1_000_000 + i;
                    let mut req = Vec::new();
                    encode_request(
                        &mut req,
                        &RequestHeader::new(Op::Echo, id, 2, 0),
                        &[id, !id],
                    );
                    s.write_all(&req).unwrap();
                    let mut reply = [0u8; 32];
                    s.read_exact(&mut reply).expect("a reply within 10 s");
                    let h = ReplyHeader::decode(&reply[..24]);
                    assert_eq!(
                        (h.request_id, h.status, h.words),
                        (id, Status::Ok as u16, 2)
                    );
                    assert_eq!(u32::from_le_bytes(reply[24..28].try_into().unwrap()), id);
                    assert_eq!(u32::from_le_bytes(reply[28..32].try_into().unwrap()), !id);
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    handle.shutdown();
    let stats = server.join().unwrap();
    stop.store(true, Ordering::Release);
    executor.join().unwrap();
    stats
}

/// Every look that found nothing either looked again or saw the loop awake, and the one that
/// found the reply rang: the loop waited out its safety timeout (10 ms while a look was
/// scheduled, 5 ms idle with a reply waiting) for hardly any of `requests`. Not for none: a
/// look is a soft timer, run from the softirq of the CPU that armed it, and a busy CPU can defer
/// softirqs to ksoftirqd for milliseconds (seen on the 2-CPU development VM: looks 2.5-3 ms
/// late, so that the loop's 5 ms idle wait ended first). A look that never rang would leave
/// every request to the timeout.
fn assert_few_timeouts(stats: &KernelStats, requests: u64) {
    assert!(
        stats.wake_timeouts * 4 < requests,
        "{} of {requests} waits ended at the safety timeout: {}",
        stats.wake_timeouts,
        stats.bpf
    );
}

#[test]
fn the_watch_rings_for_the_replies() {
    let stats = serve(Duration::from_micros(30), 4, 100);
    let bpf = &stats.bpf;
    assert_eq!(bpf.requests, 400);
    // Every request answered once (the rest are the connections' EOF markers).
    assert_eq!(
        stats.reply.completions - stats.reply.eof - stats.reply.resets,
        400
    );
    assert!(bpf.watch_arms > 0, "no look was scheduled: {bpf}");
    assert!(bpf.watch_rings > 0, "no look rang: {bpf}");
    assert_eq!(bpf.internal, 0, "a timer helper failed: {bpf}");
    assert_few_timeouts(&stats, 400);
}

#[test]
fn a_slow_reply_is_looked_for_until_it_is_there() {
    // 3 ms: some fifty looks at the 60 us gap before the reply is there.
    let stats = serve(Duration::from_millis(3), 1, 5);
    let bpf = &stats.bpf;
    assert_eq!(
        stats.reply.completions - stats.reply.eof - stats.reply.resets,
        5
    );
    assert!(bpf.watch_misses > 0, "{bpf}");
    assert_eq!(bpf.internal, 0, "{bpf}");
    assert_few_timeouts(&stats, 5);
}
