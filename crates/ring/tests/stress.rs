//! Multi-threaded tests of the rings inside a real (mmapped) region.
#![cfg(not(loom))]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use bgs_ring::{Full, RingConfig, RingRegion, SLOT_WORDS};

const PRODUCERS: u64 = 4;
const CONSUMERS: usize = 2;
const PER_PRODUCER: u64 = 200_000;

fn small_region(request_slots: u32) -> Arc<RingRegion> {
    Arc::new(
        RingRegion::new(RingConfig {
            request_slots,
            completion_slots: 64,
        })
        .unwrap(),
    )
}

/// Payload words derived from the item, so torn or stale entries are detected.
fn word(item: u64, i: usize) -> u32 {
    (item.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32 ^ i as u32
}

#[test]
fn mpmc_every_item_once_in_producer_order() {
    let region = small_region(64);
    let done_producing = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let region = Arc::clone(&region);
            thread::spawn(move || {
                let ring = region.requests();
                for n in 0..PER_PRODUCER {
                    let item = (p << 32) | n;
                    let mut spins = 0u32;
                    loop {
                        let pushed = ring.try_push(|e| {
                            e.conn = p;
                            e.conn_seq = n as u32;
                            e.words = 3;
                            e.payload[0] = word(item, 0);
                            e.payload[1] = word(item, 1);
                            e.payload[SLOT_WORDS - 1] = word(item, SLOT_WORDS - 1);
                        });
                        match pushed {
                            Ok(()) => break,
                            Err(Full) => {
                                spins += 1;
                                if spins.is_multiple_of(64) {
                                    thread::yield_now();
                                }
                            }
                        }
                    }
                    ring.notify();
                }
            })
        })
        .collect();

    let consumers: Vec<_> = (0..CONSUMERS)
        .map(|_| {
            let region = Arc::clone(&region);
            let done = Arc::clone(&done_producing);
            thread::spawn(move || {
                let ring = region.requests();
                // Last sequence number seen per producer by this consumer: each consumer sees a
                // subsequence of every producer's pushes, so it must be increasing.
                let mut last = vec![None::<u32>; PRODUCERS as usize];
                let mut seen = Vec::new();
                loop {
                    let got = ring.try_pop(|e| {
                        let item = (e.conn << 32) | u64::from(e.conn_seq);
                        assert_eq!(e.words, 3);
                        assert_eq!(e.payload[0], word(item, 0), "payload of {item:#x}");
                        assert_eq!(e.payload[1], word(item, 1), "payload of {item:#x}");
                        assert_eq!(e.payload[SLOT_WORDS - 1], word(item, SLOT_WORDS - 1));
                        (e.conn, e.conn_seq)
                    });
                    match got {
                        Some((p, n)) => {
                            let slot = &mut last[p as usize];
                            assert!(
                                slot.is_none_or(|l| l < n),
                                "producer {p}: {n} after {slot:?}"
                            );
                            *slot = Some(n);
                            seen.push((p << 32) | u64::from(n));
                        }
                        None if done.load(Ordering::Acquire) && ring.is_empty() => break,
                        None => {
                            ring.wait_nonempty(Duration::from_millis(1));
                        }
                    }
                }
                seen
            })
        })
        .collect();

    for p in producers {
        p.join().unwrap();
    }
    done_producing.store(true, Ordering::Release);
    let mut all: Vec<u64> = consumers
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    assert_eq!(all.len() as u64, PRODUCERS * PER_PRODUCER);
    all.sort_unstable();
    let expected: Vec<u64> = (0..PRODUCERS)
        .flat_map(|p| (0..PER_PRODUCER).map(move |n| (p << 32) | n))
        .collect();
    assert!(all == expected, "some item was lost or popped twice");
    assert!(region.requests().is_empty());
}

#[test]
fn full_exactly_at_capacity() {
    let region = small_region(8);
    let ring = region.completions();
    let cap = ring.capacity() as u32;
    assert_eq!(cap, 64);
    for lap in 0..3u32 {
        for i in 0..cap {
            ring.try_push(|e| e.stream_seq = lap * cap + i).unwrap();
            assert_eq!(ring.len(), i as usize + 1);
        }
        assert_eq!(
            ring.try_push(|_| panic!("a full ring must not call fill")),
            Err(Full)
        );
        // One pop makes exactly one slot free again.
        assert_eq!(ring.try_pop(|e| e.stream_seq), Some(lap * cap));
        ring.try_push(|e| e.stream_seq = u32::MAX).unwrap();
        assert_eq!(ring.try_push(|_| ()), Err(Full));
        for i in 1..cap {
            assert_eq!(ring.try_pop(|e| e.stream_seq), Some(lap * cap + i));
        }
        assert_eq!(ring.try_pop(|e| e.stream_seq), Some(u32::MAX));
        assert_eq!(ring.try_pop(|_| ()), None);
        assert!(ring.is_empty());
    }
}

#[test]
fn panicking_fill_does_not_wedge_the_ring() {
    let region = small_region(8);
    let ring = region.requests();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = ring.try_push(|e| {
            e.request_id = 5;
            panic!("fill failed");
        });
    }));
    assert!(r.is_err());
    // The entry was published as far as it got; the ring keeps working.
    assert_eq!(ring.try_pop(|e| e.request_id), Some(5));
    ring.try_push(|e| e.request_id = 6).unwrap();
    assert_eq!(ring.try_pop(|e| e.request_id), Some(6));
}

#[test]
fn wait_nonempty_times_out_on_empty_ring() {
    let region = small_region(8);
    let start = Instant::now();
    assert!(!region.requests().wait_nonempty(Duration::from_millis(20)));
    assert!(start.elapsed() >= Duration::from_millis(15));
    assert!(!region.requests().has_sleepers());
}

#[test]
fn notify_wakes_a_sleeping_consumer() {
    let region = small_region(8);
    let woke = Arc::new(AtomicU64::new(0));
    let consumer = {
        let region = Arc::clone(&region);
        let woke = Arc::clone(&woke);
        thread::spawn(move || {
            let ring = region.requests();
            let start = Instant::now();
            let mut got = None;
            while got.is_none() {
                // A long timeout: only notify() can end the wait quickly.
                ring.wait_nonempty(Duration::from_secs(10));
                got = ring.try_pop(|e| e.request_id);
            }
            woke.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
            got
        })
    };
    let ring = region.requests();
    // Wait until the consumer is registered as a sleeper, so the wake path is exercised.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !ring.has_sleepers() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
    }
    assert!(ring.has_sleepers());
    thread::sleep(Duration::from_millis(20));
    ring.try_push(|e| e.request_id = 42).unwrap();
    ring.notify();
    assert_eq!(consumer.join().unwrap(), Some(42));
    assert!(
        woke.load(Ordering::Relaxed) < 5_000,
        "woken by the timeout, not by notify"
    );
    assert!(!ring.has_sleepers());
}

#[test]
fn ping_pong_through_both_rings_with_sleeping_consumers() {
    // An executor thread echoes requests into completions; both sides sleep when idle, so a
    // lost wake-up shows up as a stall (each wait is capped at 2 s; the test fails if slow).
    const N: u32 = 20_000;
    let region = small_region(16);
    let executor = {
        let region = Arc::clone(&region);
        thread::spawn(move || {
            let (req, comp) = (region.requests(), region.completions());
            let mut n = 0;
            while n < N {
                let Some((id, w)) = req.try_pop(|e| (e.request_id, e.payload[0])) else {
                    req.wait_nonempty(Duration::from_secs(2));
                    continue;
                };
                while comp
                    .try_push(|c| {
                        c.request_id = id;
                        c.final_ = 1;
                        c.words = 1;
                        c.payload[0] = w + 1;
                    })
                    .is_err()
                {
                    thread::yield_now();
                }
                comp.notify();
                n += 1;
            }
        })
    };
    let (req, comp) = (region.requests(), region.completions());
    let start = Instant::now();
    for id in 0..N {
        req.try_push(|e| {
            e.request_id = id;
            e.words = 1;
            e.payload[0] = id * 2;
        })
        .unwrap();
        req.notify();
        loop {
            if let Some((rid, w)) = comp.try_pop(|c| (c.request_id, c.payload[0])) {
                assert_eq!((rid, w), (id, id * 2 + 1));
                break;
            }
            comp.wait_nonempty(Duration::from_secs(2));
        }
    }
    executor.join().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "suspiciously slow: lost wake-ups?"
    );
}

#[test]
fn sleep_guard_counts_a_waiter() {
    let region = small_region(8);
    let ring = region.completions();
    assert!(!ring.has_sleepers());
    {
        let _a = ring.sleep_guard();
        let _b = ring.sleep_guard();
        assert!(ring.has_sleepers());
    }
    assert!(!ring.has_sleepers());
}

#[test]
fn wait_until_wakes_on_notify_even_when_the_entry_is_already_gone() {
    // The notifier's case: its condition ("the producer count passed what I saw") stays true
    // after another consumer took the entry, so a wait on "non-empty" would sleep on.
    let region = small_region(8);
    let seen = region.requests().produced();
    let sleeper = {
        let region = Arc::clone(&region);
        thread::spawn(move || {
            let ring = region.requests();
            let mut ok = false;
            for _ in 0..100 {
                // A long timeout: only notify() ends the wait early.
                if ring.wait_until(Duration::from_secs(10), || ring.produced() > seen) {
                    ok = true;
                    break;
                }
            }
            ok
        })
    };
    let ring = region.requests();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !ring.has_sleepers() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(1));
    }
    assert!(ring.has_sleepers());
    ring.try_push(|e| e.request_id = 7).unwrap();
    assert_eq!(ring.try_pop(|e| e.request_id), Some(7));
    ring.notify();
    assert!(sleeper.join().unwrap());
    assert!(!ring.has_sleepers());
    assert!(ring.wait_until(Duration::from_secs(10), || true));
}
