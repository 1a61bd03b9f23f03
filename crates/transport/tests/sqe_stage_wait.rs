//! The executor-sqe reply stage with adaptive submission and a CPU executor sleeps in epoll on
//! events, not on a short timer: the executor's eventfd ([`KernelTransport::waker`]) after it
//! publishes, and the ring's descriptor for accepts. It leaves BPF's doorbell to the
//! executor's slots, which sleep on it as the fake executor here does. A fake executor stands in for the CPU executor: it holds each
//! request for a while (longer than the stage's old 2 ms poll, shorter than its 5 ms safety
//! net), publishes the completion, and wakes the stage exactly as `wake_consumers` does. Needs
//! root (BPF, io_uring) and a cgroup2 mount, like every kernel-transport test.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bgs_protocol::{FramerConfig, Op, ReplyHeader, RequestHeader, Status, encode_request};
use bgs_ring::{OP_CANCEL, RingRegion};
use bgs_transport::kernel::{KernelConfig, KernelTransport, ReplyMode};

/// How long the fake executor holds each request.
const HOLD: Duration = Duration::from_millis(3);

/// A slot's wait on the request ring while it is empty: BPF's doorbell through
/// `KernelTransport::executor_wait`, with a timeout far longer than the test's gaps.
const SLOT_WAIT: Duration = Duration::from_millis(50);

/// Answer each request `HOLD` after taking it; wake the stage only if it announced sleep, as
/// `wake_consumers` does. With nothing to do, sleep as the CPU executor's slots do: announced
/// on the request ring, on BPF's doorbell. Returns how many of those waits ran out with a
/// request waiting (BPF's ring did not wake it).
fn executor(
    region: &RingRegion,
    waker: &(dyn Fn() + Send + Sync),
    wait: &(dyn Fn(Duration) + Send + Sync),
    stop: &AtomicBool,
) -> u64 {
    let mut missed = 0;
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
        let Some(got) = got else {
            let _sleeping = region.requests().sleep_guard();
            if region.requests().is_empty() {
                let began = Instant::now();
                wait(SLOT_WAIT);
                if began.elapsed() >= SLOT_WAIT && !region.requests().is_empty() {
                    missed += 1;
                }
            }
            continue;
        };
        let Some((conn, conn_seq, request_id, route, payload)) = got else {
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
        let ring = region.completions();
        if ring.has_sleepers() {
            ring.notify();
            waker();
        }
    }
    missed
}

#[test]
fn the_adaptive_stage_wakes_on_events_not_on_its_timer() {
    const CONNS: u32 = 4;
    const REQUESTS: u32 = 25;
    let transport = KernelTransport::bind(KernelConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        reply: ReplyMode::ExecutorSqe {
            watchdog: Duration::from_micros(50),
            sqpoll_idle_ms: 10,
            sqpoll_cpu: None,
            sqpoll_above: bgs_transport::kernel::DEFAULT_SQPOLL_ABOVE,
        },
        framer: FramerConfig::default(),
        max_connections: 64,
        executor_wakes: true,
        completion_watch: false,
        stats_every: None,
        request_slots: 256,
        completion_slots: 1024,
        gpu_sends: false,
        limits: bgs_transport::conn::ConnLimits::default(),
        cancel_markers: false,
        wake_timeout: None,
    })
    .expect("kernel transport (root)");
    let waker = transport
        .waker()
        .expect("adaptive executor-sqe: the stage waits on the executor's eventfd");
    let addr = transport.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let wait = transport.executor_wait().unwrap();
    let exec = {
        let (region, stop) = (transport.region(), stop.clone());
        std::thread::spawn(move || executor(&region, &*waker, &*wait, &stop))
    };
    let handle = transport.shutdown_handle();
    let server = std::thread::spawn(move || transport.run().unwrap());
    // One connection after the other, one request at a time, with pauses: the stage and the
    // fake slot sleep between requests.
    for c in 0..CONNS {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        for i in 0..REQUESTS {
            let id = c << 16 | i;
            let mut req = Vec::new();
            encode_request(
                &mut req,
                &RequestHeader::new(Op::Echo, id, 2, 0),
                &[id, !id],
            );
            s.write_all(&req).unwrap();
            let mut reply = [0u8; 32];
            s.read_exact(&mut reply).expect("a reply within 10 s");
            let head: [u8; 24] = reply[..24].try_into().unwrap();
            let h = ReplyHeader::decode(&head);
            assert_eq!((h.request_id, h.status, h.words), (id, 0, 2));
            assert_eq!(u32::from_le_bytes(reply[24..28].try_into().unwrap()), id);
        }
        s.shutdown(Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
        std::thread::sleep(Duration::from_millis(20));
    }
    handle.shutdown();
    let stats = server.join().unwrap();
    stop.store(true, Ordering::Release);
    let missed = exec.join().unwrap();
    eprintln!("{stats}\nslot waits that ran out with a request waiting: {missed}");
    let total = u64::from(CONNS * REQUESTS);
    assert_eq!(
        stats.reply.completions - stats.reply.eof - stats.reply.resets,
        total
    );
    assert_eq!(stats.reply.closed, u64::from(CONNS));
    // Every reply ends a wait through the eventfd: a wait that ran out its 5 ms net with a
    // completion waiting means the wake-up did not arrive. Not none for sure (a loaded CI
    // machine can keep the waking thread off the CPU), but never most of them.
    assert!(
        stats.wake_timeouts * 4 < total,
        "{} of {total} waits ran out their safety net: {stats}",
        stats.wake_timeouts
    );
    // BPF's doorbell is the slots': every request BPF published while the slot slept woke it
    // (a stage that drained the doorbell's records too left woken slots asleep: epoll
    // re-checks the ring buffer's readiness before it reports it). Not none for sure, as
    // above.
    assert!(stats.bpf.doorbells > 0, "the slot never slept: {stats}");
    assert!(
        missed * 4 < total,
        "{missed} of {total} slot waits ran out with a request waiting"
    );
}
