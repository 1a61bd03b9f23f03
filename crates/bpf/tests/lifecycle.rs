//! Connection lifecycle, admission and concurrency of the BPF receive path.

mod common;

use std::io::Write;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use bgs_bpf::KernelRxConfig;
use bgs_protocol::{Op, RequestHeader, encode_request};
use common::{Harness, Item, root_or_skip};

fn echo(id: u32, words: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let payload: Vec<u32> = (0..words).map(|i| i ^ id).collect();
    encode_request(
        &mut out,
        &RequestHeader::new(Op::Echo, id, words, 0),
        &payload,
    );
    out
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn eof_marker_follows_the_last_item() {
    if !root_or_skip("eof_marker_follows_the_last_item") {
        return;
    }
    let mut h = Harness::new(KernelRxConfig::default());
    // Data and FIN in separate segments, then in one (write + shutdown back to back).
    for sleep in [true, false] {
        let (mut c, s, cookie) = h.connect();
        c.write_all(&[echo(1, 2), echo(2, 0)].concat()).unwrap();
        if sleep {
            std::thread::sleep(Duration::from_millis(20));
        }
        c.shutdown(Shutdown::Write).unwrap();
        let items = h.until_marker(cookie, Duration::from_secs(5));
        assert_eq!(items.len(), 3, "{items:?}");
        assert!(matches!(items[0], Item::Req { request_id: 1, .. }));
        assert!(matches!(items[1], Item::Req { request_id: 2, .. }));
        assert_eq!(items[2], Item::Eof);
        h.rx.forget_connection(cookie);
        drop(s);
    }
    assert_eq!(h.rx.counters().eof_markers, 2);
}

#[test]
fn resets_publish_markers_and_state_is_reclaimed() {
    if !root_or_skip("resets_publish_markers_and_state_is_reclaimed") {
        return;
    }
    let mut h = Harness::new(KernelRxConfig::default());
    const N: usize = 300;
    let mut conns = Vec::new();
    for i in 0..N {
        let (mut c, s, cookie) = h.connect();
        c.write_all(&echo(i as u32, 1)).unwrap();
        conns.push((c, s, cookie));
    }
    wait_for(
        "all connections in the sockhash",
        Duration::from_secs(5),
        || h.rx.sockhash_len() == N,
    );
    assert_eq!(h.rx.conn_states_len(), N);
    let mut expect = Vec::new();
    for (i, (c, s, cookie)) in conns.into_iter().enumerate() {
        let reset = i % 2 == 0;
        if reset {
            // SO_LINGER 0: close sends RST.
            let l = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            // SAFETY: setsockopt reads `size_of::<linger>()` bytes from `l`.
            unsafe {
                libc::setsockopt(
                    c.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&l as *const libc::linger).cast(),
                    size_of::<libc::linger>() as libc::socklen_t,
                )
            };
        }
        drop(c);
        expect.push((cookie, reset, s));
    }
    for (cookie, reset, s) in expect {
        let items = h.until_marker(cookie, Duration::from_secs(5));
        assert!(matches!(items[0], Item::Req { .. }), "{items:?}");
        assert_eq!(items[1], if reset { Item::Reset } else { Item::Eof });
        // The server closes without forgetting: TCP_CLOSE removes the state by itself.
        drop(s);
    }
    wait_for(
        "the sockhash and the state map to empty",
        Duration::from_secs(10),
        || h.rx.sockhash_len() == 0 && h.rx.conn_states_len() == 0,
    );
    let c = h.rx.counters();
    assert_eq!(c.conns_opened, N as u64);
    assert_eq!(c.conns_closed, N as u64);
    assert_eq!(c.reset_markers, N as u64 / 2);
    assert_eq!(c.eof_markers, N as u64 / 2);
    // No further markers once the server closed (no RESET after our own close).
    std::thread::sleep(Duration::from_millis(50));
    h.pump();
    assert_eq!(h.rx.counters().reset_markers, N as u64 / 2);
}

#[test]
fn forgotten_connections_publish_nothing_more() {
    if !root_or_skip("forgotten_connections_publish_nothing_more") {
        return;
    }
    let mut h = Harness::new(KernelRxConfig::default());
    let (mut c, s, cookie) = h.connect();
    c.write_all(&echo(1, 1)).unwrap();
    wait_for("the request", Duration::from_secs(5), || {
        h.rx.counters().requests == 1
    });
    h.rx.forget_connection(cookie);
    h.rx.forget_connection(cookie); // idempotent
    c.write_all(&echo(2, 1)).unwrap();
    drop(s);
    drop(c);
    wait_for("the sockhash to empty", Duration::from_secs(5), || {
        h.rx.sockhash_len() == 0
    });
    let items = h.take(cookie);
    assert_eq!(items.len(), 1, "{items:?}");
    assert_eq!(h.rx.counters().reset_markers, 0);
}

#[test]
fn concurrent_connections_keep_their_order() {
    if !root_or_skip("concurrent_connections_keep_their_order") {
        return;
    }
    // Room for every request: this test is about producers on several CPUs, not admission.
    let mut h = Harness::new(KernelRxConfig {
        request_slots: 16384,
        completion_slots: 64,
        ..KernelRxConfig::default()
    });
    const CONNS: usize = 4;
    const PER: u32 = 3000;
    let mut servers = Vec::new();
    let mut threads = Vec::new();
    let mut cookies = Vec::new();
    for t in 0..CONNS {
        let (mut c, s, cookie) = h.connect();
        servers.push(s);
        cookies.push(cookie);
        threads.push(std::thread::spawn(move || {
            let mut id = 0u32;
            while id < PER {
                // Batches of 1..8 frames per write: frames share and straddle segments.
                let n = 1 + (id as usize + t) % 8;
                let mut buf = Vec::new();
                for _ in 0..n {
                    if id < PER {
                        buf.extend(echo(id, id % 5));
                        id += 1;
                    }
                }
                c.write_all(&buf).unwrap();
            }
            c.shutdown(Shutdown::Write).unwrap();
            c
        }));
    }
    let mut results = Vec::new();
    for &cookie in &cookies {
        results.push(h.until_marker(cookie, Duration::from_secs(20)));
    }
    for t in threads {
        drop(t.join().unwrap());
    }
    for (items, cookie) in results.iter().zip(&cookies) {
        assert_eq!(items.len(), PER as usize + 1, "{cookie:#x}");
        for (i, item) in items[..PER as usize].iter().enumerate() {
            match item {
                Item::Req {
                    request_id,
                    words,
                    payload,
                    ..
                } => {
                    assert_eq!(*request_id, i as u32);
                    assert_eq!(*words, i as u32 % 5);
                    let want: Vec<u32> = (0..*words).map(|w| w ^ i as u32).collect();
                    assert_eq!(payload, &want);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(items[PER as usize], Item::Eof);
    }
    assert_eq!(h.rx.counters().busy, 0);
}

#[test]
fn full_rings_give_busy_then_fail_the_connection() {
    if !root_or_skip("full_rings_give_busy_then_fail_the_connection") {
        return;
    }
    let mut h = Harness::new(KernelRxConfig {
        request_slots: 2,
        completion_slots: 4,
        ..KernelRxConfig::default()
    });
    let (mut c, s, cookie) = h.connect();
    let six: Vec<u8> = (0..6).flat_map(|i| echo(i, 1)).collect();
    c.write_all(&six).unwrap();
    wait_for("busy completions", Duration::from_secs(5), || {
        h.rx.counters().busy == 4
    });
    assert_eq!(h.rx.counters().requests, 2);
    // Both rings full: the next request fails the connection.
    c.write_all(&echo(6, 1)).unwrap();
    wait_for("the failure", Duration::from_secs(5), || {
        h.rx.counters().completion_ring_full == 1
    });
    assert_eq!(h.rx.take_failed_connections(), vec![cookie]);
    let items = h.take(cookie);
    let want: Vec<(u32, Item)> = (0..6)
        .map(|i| {
            (
                i,
                if i < 2 {
                    Item::Req {
                        op: 0,
                        version: 1,
                        request_id: i,
                        words: 1,
                        param: 0,
                        flags: 0,
                        payload: vec![i],
                        http: false,
                        close: false,
                    }
                } else {
                    Item::Busy {
                        request_id: i,
                        http: false,
                        close: false,
                    }
                },
            )
        })
        .collect();
    assert_eq!(items, want);
    // Room again: the next bytes of that connection publish its RESET marker (conn_seq 7;
    // 6 was the lost request) and nothing else.
    c.write_all(&echo(7, 1)).unwrap();
    wait_for("the RESET marker", Duration::from_secs(5), || {
        h.rx.counters().reset_markers == 1
    });
    assert_eq!(h.take(cookie), vec![(7, Item::Reset)]);
    drop(s);
}

#[test]
fn doorbell_rings_for_sleeping_consumers() {
    if !root_or_skip("doorbell_rings_for_sleeping_consumers") {
        return;
    }
    let mut h = Harness::new(KernelRxConfig::default());
    let (mut c, _s, _cookie) = h.connect();
    c.write_all(&echo(1, 1)).unwrap();
    wait_for("the request", Duration::from_secs(5), || {
        h.rx.counters().requests == 1
    });
    assert_eq!(h.rx.drain_doorbell(), 0, "no sleeper, no doorbell");
    {
        let _sleeping = h.region.requests().sleep_guard();
        c.write_all(&echo(2, 1)).unwrap();
        let mut pfd = libc::pollfd {
            fd: h.rx.doorbell_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, 5000) };
        assert_eq!(n, 1, "doorbell fd readable");
    }
    assert!(h.rx.drain_doorbell() >= 1);
    assert_eq!(h.rx.drain_doorbell(), 0);
    h.pump();
}

#[test]
fn full_default_ring_sizes_load() {
    if !root_or_skip("full_default_ring_sizes_load") {
        return;
    }
    let mut h = Harness::new(KernelRxConfig {
        request_slots: bgs_ring::DEFAULT_REQUEST_SLOTS,
        completion_slots: bgs_ring::DEFAULT_COMPLETION_SLOTS,
        ..KernelRxConfig::default()
    });
    let items = h.run_case(&echo(5, 64), &[], Duration::ZERO);
    assert!(matches!(
        items.as_slice(),
        [Item::Req { request_id: 5, .. }]
    ));
}
