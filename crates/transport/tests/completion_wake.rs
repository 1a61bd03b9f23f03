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
    /// Round trip of each request at the client.
    rtts: Vec<Duration>,
}

/// How the transport waits and how the fake executor behaves.
struct Setup {
    wake_timeout: Option<Duration>,
    pace: bool,
    poll: Duration,
    hold: Duration,
    /// The executor rings the waker (the notifier); else it never wakes anyone (poll mode).
    rings: bool,
    requests: u32,
}

fn run(wake_timeout: Option<Duration>) -> Run {
    run_with(&Setup {
        wake_timeout,
        pace: false,
        poll: Duration::from_micros(100),
        hold: HOLD,
        rings: true,
        requests: REQUESTS,
    })
}

/// One connection, `requests` echo requests one at a time; returns the transport's counters.
fn run_with(setup: &Setup) -> Run {
    let (hold, ring_waker) = (setup.hold, setup.rings);
    let region = Arc::new(
        RingRegion::new(RingConfig {
            request_slots: 64,
            completion_slots: 64,
        })
        .unwrap(),
    );
    let cfg = NativeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        poll_interval: setup.poll,
        wake_timeout: setup.wake_timeout,
        pace_completions: setup.pace,
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
                            e.publish_ns,
                        )
                    })
                });
                let Some(Some((conn, conn_seq, request_id, route, payload, publish_ns))) = got
                else {
                    region.requests().wait_nonempty(Duration::from_millis(5));
                    continue;
                };
                std::thread::sleep(hold);
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
                        // As the executors do: the request's publish time comes back (the
                        // transport's pacing learns the service time from it).
                        c.publish_ns = publish_ns;
                        c.payload[..payload.len()].copy_from_slice(&payload);
                    })
                    .unwrap();
                if ring_waker && region.completions().has_sleepers() {
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
    let mut rtts = Vec::new();
    for id in 1..=setup.requests {
        let mut out = Vec::new();
        encode_request(&mut out, &RequestHeader::new(Op::Echo, id, 1, 0), &[id * 7]);
        let t0 = std::time::Instant::now();
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
        rtts.push(t0.elapsed());
    }
    drop(s);
    handle.shutdown();
    let stats = transport.join().unwrap();
    stop.store(true, Ordering::Release);
    exec.join().unwrap();
    Run {
        stats,
        rings: rings.load(Ordering::Relaxed),
        rtts,
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

/// An executor that cannot wake the transport and answers in 2 ms, with a 40 ms poll: the
/// fixed poll finds each answer at its timer (~40 ms); paced looks find them near 2 ms once
/// the first answers taught the pacer.
#[test]
fn paced_polling_finds_completions_when_they_are_expected() {
    let setup = |pace| Setup {
        wake_timeout: None,
        pace,
        poll: Duration::from_millis(40),
        hold: Duration::from_millis(2),
        rings: false,
        requests: 36,
    };
    // The first answer is found by the poll (40 ms); the estimate shrinks by an eighth per
    // answer found on time: near 2 ms after ~25.
    let median_of_last = |r: &Run| {
        let mut v: Vec<Duration> = r.rtts[26..].to_vec();
        v.sort();
        v[v.len() / 2]
    };
    let paced = run_with(&setup(true));
    let polled = run_with(&setup(false));
    let (p, q) = (median_of_last(&paced), median_of_last(&polled));
    eprintln!("median round trip, requests 27-36: paced {p:?}, 40 ms poll {q:?}");
    assert_eq!(paced.stats.replies, 36);
    assert!(p < Duration::from_millis(20), "paced: {p:?}");
    assert!(q > Duration::from_millis(30), "polled: {q:?}");
}
