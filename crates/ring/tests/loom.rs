//! loom model checks of the ring algorithm and the sleep/notify handshake.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p bgs-ring --release --test loom`
//! Under loom the rings are heap-backed (loom atomics cannot live in mapped memory), but the
//! algorithm is the same code.
#![cfg(loom)]

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use bgs_ring::{Full, RequestRing, Ring};

fn ring(capacity: u32) -> Arc<RequestRing> {
    Arc::new(Ring::new_for_loom(capacity))
}

fn push(ring: &RequestRing, conn: u64, n: u32) -> Result<(), Full> {
    ring.try_push(|e| {
        e.conn = conn;
        e.conn_seq = n;
        e.payload[0] = n ^ 0xABCD;
    })
}

fn pop(ring: &RequestRing) -> Option<(u64, u32)> {
    ring.try_pop(|e| {
        assert_eq!(e.payload[0], e.conn_seq ^ 0xABCD, "torn entry");
        (e.conn, e.conn_seq)
    })
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

#[test]
fn two_producers_one_consumer() {
    model(|| {
        let r = ring(2);
        let producers: Vec<_> = (0..2u64)
            .map(|p| {
                let r = r.clone();
                thread::spawn(move || push(&r, p, 0).unwrap())
            })
            .collect();
        let mut got = Vec::new();
        while got.len() < 2 {
            match pop(&r) {
                Some(x) => got.push(x),
                None => thread::yield_now(),
            }
        }
        for p in producers {
            p.join().unwrap();
        }
        got.sort();
        assert_eq!(got, vec![(0, 0), (1, 0)]);
        assert_eq!(pop(&r), None);
    });
}

#[test]
fn one_producer_two_consumers_fifo() {
    model(|| {
        let r = ring(2);
        let consumers: Vec<_> = (0..2)
            .map(|_| {
                let r = r.clone();
                thread::spawn(move || pop(&r))
            })
            .collect();
        push(&r, 0, 0).unwrap();
        push(&r, 0, 1).unwrap();
        let mut got: Vec<_> = consumers
            .into_iter()
            .filter_map(|c| c.join().unwrap())
            .collect();
        while let Some(x) = pop(&r) {
            got.push(x);
        }
        // Each item exactly once; if one consumer got both, it got them in order.
        got.sort();
        assert_eq!(got, vec![(0, 0), (0, 1)]);
    });
}

#[test]
fn wrap_around_with_concurrent_push_and_pop() {
    // Capacity 2, three items: the third push reuses slot 0 only after the consumer freed it,
    // and must see the slot's old entry as consumed (the release/acquire on seq orders the
    // consumer's read before the producer's overwrite; loom's cell checks it).
    model(|| {
        let r = ring(2);
        let producer = {
            let r = r.clone();
            thread::spawn(move || {
                for n in 0..3 {
                    while push(&r, 0, n).is_err() {
                        thread::yield_now();
                    }
                }
            })
        };
        let mut next = 0;
        while next < 3 {
            match pop(&r) {
                Some((0, n)) => {
                    assert_eq!(n, next, "FIFO order");
                    next += 1;
                }
                Some(other) => panic!("unexpected {other:?}"),
                None => thread::yield_now(),
            }
        }
        producer.join().unwrap();
    });
}

#[test]
fn full_ring_rejects_until_popped() {
    model(|| {
        let r = ring(2);
        push(&r, 0, 0).unwrap();
        push(&r, 0, 1).unwrap();
        let consumer = {
            let r = r.clone();
            thread::spawn(move || pop(&r))
        };
        // Either the pop already freed a slot, or the ring is still full.
        let pushed = push(&r, 0, 2).is_ok();
        assert_eq!(consumer.join().unwrap(), Some((0, 0)));
        if !pushed {
            push(&r, 0, 2).unwrap();
        }
        assert_eq!(pop(&r), Some((0, 1)));
        assert_eq!(pop(&r), Some((0, 2)));
    });
}

#[test]
fn sleeping_consumer_is_never_forgotten() {
    // The consumer sleeps in the loom futex model, which has no timeout: if a notify could be
    // lost, the consumer would wait forever and loom would report the model as stuck.
    model(|| {
        let r = ring(2);
        let producer = {
            let r = r.clone();
            thread::spawn(move || {
                push(&r, 0, 7).unwrap();
                r.notify();
            })
        };
        loop {
            if let Some(x) = pop(&r) {
                assert_eq!(x, (0, 7));
                break;
            }
            // "Probably non-empty" while the producer is between claim and publish: real
            // code just retries; loom needs the yield to schedule the producer meanwhile.
            if r.wait_nonempty(Duration::from_secs(1)) {
                thread::yield_now();
            }
        }
        producer.join().unwrap();
    });
}

#[test]
fn sleeper_competing_with_another_consumer() {
    // One consumer sleeps between attempts, another takes at most one item without sleeping
    // (loom cannot model two threads that both spin: they may yield to each other forever).
    // Whatever the other consumer takes, the sleeper must get an item and wake up for it.
    model(|| {
        let r = ring(2);
        let sleeper = {
            let r = r.clone();
            thread::spawn(move || {
                loop {
                    if let Some(x) = pop(&r) {
                        return x;
                    }
                    if r.wait_nonempty(Duration::from_secs(1)) {
                        thread::yield_now();
                    }
                }
            })
        };
        let other = {
            let r = r.clone();
            thread::spawn(move || pop(&r))
        };
        for n in 0..2 {
            push(&r, 0, n).unwrap();
            r.notify();
        }
        let mut got = vec![sleeper.join().unwrap()];
        got.extend(other.join().unwrap());
        got.extend(pop(&r));
        got.sort();
        assert_eq!(got, vec![(0, 0), (0, 1)]);
    });
}
