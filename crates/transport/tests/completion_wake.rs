//! The transport side of the GPU executor's completion notifier: a native transport told that
//! its executor wakes it for every completion (`wake_timeout`) sleeps until the waker rings,
//! not on its short poll timer. A fake executor stands in for the GPU: it holds each request
//! for a while, publishes the completion, and rings the waker only if the transport sleeps,
//! exactly as the notifier does.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bgs_protocol::{Op, ReplyHeader, RequestHeader, Status, encode_request};
use bgs_ring::{OP_CANCEL, RingConfig, RingRegion};
use bgs_transport::{NativeConfig, NativeTransport, TransportStats};

/// How long the fake executor holds each request (a slow GPU).
const HOLD: Duration = Duration::from_millis(30);
const REQUESTS: u32 = 6;

struct Run {
    stats: TransportStats,
    /// Times the fake executor rang the waker.
    rings: u64,
}

/// One connection, `REQUESTS` echo requests one at a time; returns the transport's counters.
fn run(wake_timeout: Option<Duration>) -> Run {
    let region = Arc::new(
        RingRegion::new(RingConfig {
            request_slots: 64,
            completion_slots: 64,
        })
        .unwrap(),
    );
    let cfg = NativeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        poll_interval: Duration::from_micros(100),
        wake_timeout,
        // As for the GPU executor: no cancel markers.
        cancel_markers: false,
        ..NativeConfig::default()
    };
    let t = NativeTransport::bind(cfg, Some(region.clone())).unwrap();
    let (addr, handle, waker) = (t.local_addr(), t.shutdown_handle(), t.waker());
    let transport = std::thread::spawn(move || t.run().unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let rings = Arc::new(AtomicU64::new(0));
    let exec = {
        let (region, stop, rings) = (region.clone(), stop.clone(), rings.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                let got = region.requests().try_pop(|e| {
                    (e.op != OP_CANCEL).then(|| {
                        let n = e.words as usize;
                        (
                            e.conn,
                            e.conn_seq,
                            e.request_id,
                            e.route,
                            e.payload[..n].to_vec(),
                        )
                    })
                });
                let Some(Some((conn, conn_seq, request_id, route, payload))) = got else {
                    region.requests().wait_nonempty(Duration::from_millis(5));
                    continue;
                };
                std::thread::sleep(HOLD);
                region
                    .completions()
                    .try_push(|c| {
                        c.conn = conn;
                        c.conn_seq = conn_seq;
                        c.status = Status::Ok as u16;
                        c.final_ = 1;
                        c.request_id = request_id;
                        c.words = payload.len() as u32;
                        c.stream_seq = 0;
                        c.route = route;
                        c.stream = 0;
                        c.payload[..payload.len()].copy_from_slice(&payload);
                    })
                    .unwrap();
                if region.completions().has_sleepers() {
                    rings.fetch_add(1, Ordering::Relaxed);
                    waker();
                }
            }
        })
    };
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    // Far below the 60 s safety timeout of the interrupt case: a reply that only a timeout
    // could deliver fails the test instead of passing slowly.
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    for id in 1..=REQUESTS {
        let mut out = Vec::new();
        encode_request(&mut out, &RequestHeader::new(Op::Echo, id, 1, 0), &[id * 7]);
        s.write_all(&out).unwrap();
        let mut h = [0u8; 24];
        s.read_exact(&mut h).unwrap();
        let h = ReplyHeader::decode(&h);
        assert_eq!(
            (h.status, h.request_id, h.words),
            (Status::Ok as u16, id, 1)
        );
        let mut p = [0u8; 4];
        s.read_exact(&mut p).unwrap();
        assert_eq!(u32::from_le_bytes(p), id * 7);
    }
    drop(s);
    handle.shutdown();
    let stats = transport.join().unwrap();
    stop.store(true, Ordering::Release);
    exec.join().unwrap();
    Run {
        stats,
        rings: rings.load(Ordering::Relaxed),
    }
}

#[test]
fn interrupt_mode_wakes_on_the_waker_not_on_a_timer() {
    // A safety timeout far longer than the test: only the waker can end the waits in time.
    let woken = run(Some(Duration::from_secs(60)));
    assert_eq!(woken.stats.replies, u64::from(REQUESTS));
    assert_eq!(woken.stats.wake_timeouts, 0);
    // Each request: the wait that reads it, the one that the waker ends, and a few for the
    // connection's accept and close. Polling every 100 us through a 30 ms hold would take
    // hundreds per request.
    assert!(
        woken.stats.epoll_waits <= u64::from(REQUESTS) * 4 + 8,
        "{} epoll waits for {REQUESTS} requests",
        woken.stats.epoll_waits
    );
    assert!(woken.rings >= 1, "the fake executor never rang the waker");
    // The same transport in poll mode wakes on its timer throughout each hold.
    let polled = run(None);
    eprintln!(
        "epoll waits for {REQUESTS} requests held {HOLD:?} each: interrupt {} ({} rings), poll {}",
        woken.stats.epoll_waits, woken.rings, polled.stats.epoll_waits
    );
    assert_eq!(polled.stats.replies, u64::from(REQUESTS));
    assert!(
        polled.stats.epoll_waits > 4 * woken.stats.epoll_waits,
        "poll mode: {} epoll waits, interrupt mode: {}",
        polled.stats.epoll_waits,
        woken.stats.epoll_waits
    );
}
