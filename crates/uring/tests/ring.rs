//! Real io_uring tests on loopback sockets (Linux 6.18 in CI, as root).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bgs_uring::{
    Cqe, RingOptions, SqPoll, Uring, accept_multishot, cancel, close, futex_wait, futex_wake, nop,
    read, send, shutdown, sys, timeout,
};
use rustix::net::Shutdown;

const MSG: usize = 256;

fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    a.set_nodelay(true).unwrap();
    (a, b)
}

/// Large socket buffers, so loopback SENDs complete inline and in submission order (a SEND
/// that hits a full buffer is retried later by io_uring and can then be overtaken).
fn big_buffers(tx: &TcpStream, rx: &TcpStream) {
    const SZ: usize = 8 << 20;
    if rustix::net::sockopt::set_socket_send_buffer_size_force(tx, SZ).is_err() {
        let _ = rustix::net::sockopt::set_socket_send_buffer_size(tx, SZ);
    }
    if rustix::net::sockopt::set_socket_recv_buffer_size_force(rx, SZ).is_err() {
        let _ = rustix::net::sockopt::set_socket_recv_buffer_size(rx, SZ);
    }
}

/// Message `seq`: the sequence number, then a pattern derived from it.
fn message(seq: u32) -> [u8; MSG] {
    let mut m = [0u8; MSG];
    m[..4].copy_from_slice(&seq.to_le_bytes());
    for (i, b) in m[4..].iter_mut().enumerate() {
        *b = (seq as usize).wrapping_mul(31).wrapping_add(i) as u8;
    }
    m
}

/// Reads `n` messages from `rx` and checks each is intact and in order.
fn receive_in_order(mut rx: TcpStream, n: u32) {
    rx.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut buf = vec![0u8; n as usize * MSG];
    rx.read_exact(&mut buf).unwrap();
    for seq in 0..n {
        let got = &buf[seq as usize * MSG..(seq as usize + 1) * MSG];
        assert_eq!(
            got,
            &message(seq)[..],
            "message {seq} corrupt or out of order"
        );
    }
}

/// Reaps CQEs until `n` have arrived (entering the kernel to wait), or panics after 10 s.
fn reap(ring: &Uring, n: usize) -> Vec<Cqe> {
    let cq = ring.cq();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < n {
        while let Some(c) = cq.pop() {
            out.push(c);
        }
        if out.len() >= n {
            break;
        }
        assert!(Instant::now() < deadline, "only {} of {n} CQEs", out.len());
        ring.enter(0, 1, Some(Duration::from_millis(50))).unwrap();
    }
    out
}

fn plain_send(no_mmap: bool) {
    let ring = Uring::new(&RingOptions {
        entries: 64,
        no_mmap,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(ring.memory().user_provided, no_mmap);
    let (tx, rx) = tcp_pair();
    big_buffers(&tx, &rx);
    const N: u32 = 1000;
    let msgs: Vec<[u8; MSG]> = (0..N).map(message).collect();
    std::thread::scope(|s| {
        s.spawn(|| receive_in_order(rx, N));
        let mut next = 0u32;
        while next < N {
            let sq = ring.sq();
            let mut batch = 0;
            while next < N && sq.space() > 0 {
                // SAFETY: `msgs` outlives the ring's use of it: every CQE is reaped below
                // before the next batch and before `msgs` is dropped.
                let sqe = unsafe {
                    send(
                        tx.as_raw_fd(),
                        msgs[next as usize].as_ptr(),
                        MSG as u32,
                        u64::from(next),
                    )
                };
                sq.push(&sqe).unwrap();
                next += 1;
                batch += 1;
            }
            drop(sq);
            assert_eq!(ring.enter(batch, 0, None).unwrap(), batch);
            let cqes = reap(&ring, batch as usize);
            for c in cqes {
                assert_eq!(c.res, MSG as i32, "send {} failed: {c:?}", c.user_data);
            }
        }
    });
    assert_eq!(ring.cq_overflow(), 0);
    assert_eq!(ring.sq_dropped(), 0);
}

#[test]
fn plain_ring_send_in_order() {
    plain_send(false);
}

#[test]
fn no_mmap_ring_send_in_order() {
    plain_send(true);
}

#[test]
fn sqpoll_no_mmap_writer_without_syscalls() {
    let ring = Uring::new(&RingOptions {
        entries: 256,
        cq_entries: 1024,
        sqpoll: Some(SqPoll {
            idle_ms: 1,
            cpu: None,
        }),
        no_mmap: true,
        ..Default::default()
    })
    .unwrap();
    assert!(ring.is_sqpoll());
    assert!(ring.memory().user_provided);
    let (tx, rx) = tcp_pair();
    big_buffers(&tx, &rx);
    const N: u32 = 10_000;
    const MAX_IN_FLIGHT: u32 = 128;
    let msgs: Vec<[u8; MSG]> = (0..N).map(message).collect();
    let txfd = tx.as_raw_fd();
    let done = AtomicBool::new(false);
    let half = AtomicBool::new(false);
    let resume = AtomicBool::new(false);
    let wakes = AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| receive_in_order(rx, N));
        // Watchdog: the only thread that enters the kernel for this ring.
        s.spawn(|| {
            while !done.load(Ordering::Acquire) {
                if ring.needs_wakeup() {
                    ring.wake_sqpoll().unwrap();
                    wakes.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        });
        // Halfway, the writer pauses for 20 ms (far past sq_thread_idle), so the SQPOLL thread
        // goes back to sleep and must be woken again.
        s.spawn(|| {
            while !half.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(Duration::from_millis(20));
            resume.store(true, Ordering::Release);
        });
        // Writer: pushes SQEs and pops CQEs with plain loads and stores only.
        let writer = s.spawn(|| {
            let sq = ring.sq();
            let cq = ring.cq();
            let (mut next, mut completed, mut bad) = (0u32, 0u32, 0u32);
            while completed < N {
                if completed == N / 2 && !resume.load(Ordering::Acquire) {
                    half.store(true, Ordering::Release);
                    std::hint::spin_loop();
                    continue;
                }
                let limit = if completed < N / 2 { N / 2 } else { N };
                while next < limit && next - completed < MAX_IN_FLIGHT {
                    // SAFETY: `msgs` outlives the scope; every CQE is reaped before it ends.
                    let sqe = unsafe {
                        send(
                            txfd,
                            msgs[next as usize].as_ptr(),
                            MSG as u32,
                            u64::from(next),
                        )
                    };
                    if sq.push(&sqe).is_err() {
                        break;
                    }
                    next += 1;
                }
                while let Some(c) = cq.pop() {
                    if c.res != MSG as i32 {
                        bad += 1;
                    }
                    completed += 1;
                }
                std::hint::spin_loop();
            }
            bad
        });
        let bad = writer.join().unwrap();
        done.store(true, Ordering::Release);
        assert_eq!(bad, 0, "sends with a short or failed result");
    });
    let wakes = wakes.load(Ordering::Relaxed);
    println!(
        "sqpoll+no_mmap: {N} sends of {MSG} B in {:?}, watchdog woke the SQPOLL thread {wakes} times",
        started.elapsed()
    );
    assert!(
        wakes >= 2,
        "the SQPOLL thread should have slept at start and after the pause"
    );
    assert_eq!(ring.cq_overflow(), 0);
    assert_eq!(ring.sq_dropped(), 0);
}

#[test]
fn multishot_accept_close_shutdown() {
    let ring = Uring::new(&RingOptions::default()).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    const ACCEPT: u64 = 1 << 40;
    ring.sq()
        .push(&accept_multishot(listener.as_raw_fd(), ACCEPT))
        .unwrap();
    assert_eq!(ring.enter(1, 0, None).unwrap(), 1);
    let clients: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let cqes = reap(&ring, 20);
    let mut accepted = Vec::new();
    for c in &cqes {
        assert_eq!(c.user_data, ACCEPT);
        assert!(c.res >= 0, "accept failed: {c:?}");
        assert!(c.more(), "multishot accept ended early: {c:?}");
        // SAFETY: a successful accept CQE carries a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(c.res) };
        let fl = rustix::fs::fcntl_getfl(&fd).unwrap();
        assert!(fl.contains(rustix::fs::OFlags::NONBLOCK));
        let fdfl = rustix::io::fcntl_getfd(&fd).unwrap();
        assert!(fdfl.contains(rustix::io::FdFlags::CLOEXEC));
        accepted.push(fd);
    }
    // Match each accepted socket to its client by the peer's port.
    let mut pairs: Vec<(OwnedFd, TcpStream)> = Vec::new();
    let mut clients: Vec<Option<TcpStream>> = clients.into_iter().map(Some).collect();
    for fd in accepted {
        let peer = rustix::net::getpeername(&fd).unwrap().unwrap();
        let peer = std::net::SocketAddr::try_from(peer).unwrap();
        let i = clients
            .iter()
            .position(|c| c.as_ref().is_some_and(|c| c.local_addr().unwrap() == peer))
            .expect("accepted socket has a client");
        pairs.push((fd, clients[i].take().unwrap()));
    }
    // First half: close through the ring. Second half: shutdown(write) through the ring.
    let sq = ring.sq();
    let mut kept = Vec::new();
    let mut clients = Vec::new();
    for (i, (fd, client)) in pairs.into_iter().enumerate() {
        let sqe = if i < 10 {
            close(fd.into_raw_fd(), 100 + i as u64)
        } else {
            let sqe = shutdown(fd.as_raw_fd(), Shutdown::Write, 100 + i as u64);
            kept.push(fd);
            sqe
        };
        sq.push(&sqe).unwrap();
        clients.push(client);
    }
    sq.push(&cancel(ACCEPT, 200)).unwrap();
    drop(sq);
    assert_eq!(ring.enter(21, 0, None).unwrap(), 21);
    let cqes = reap(&ring, 22);
    for c in &cqes {
        match c.user_data {
            ACCEPT => {
                assert_eq!(c.res, -(rustix::io::Errno::CANCELED.raw_os_error()));
                assert!(!c.more());
            }
            200 => assert_eq!(c.res, 0, "cancel: {c:?}"),
            100..120 => assert_eq!(c.res, 0, "close/shutdown: {c:?}"),
            _ => panic!("unexpected CQE {c:?}"),
        }
    }
    for mut client in clients {
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 1];
        assert_eq!(client.read(&mut b).unwrap(), 0, "client should see EOF");
    }
    // The shut-down sockets are still open for reading.
    for fd in &kept {
        assert!(rustix::fs::fcntl_getfl(fd).is_ok());
    }
    assert_eq!(ring.cq_overflow(), 0);
    assert_eq!(ring.sq_dropped(), 0);
}

#[test]
fn bad_options_are_errors() {
    let bad = [
        RingOptions {
            entries: 0,
            ..Default::default()
        },
        RingOptions {
            entries: 100_000,
            ..Default::default()
        },
        RingOptions {
            entries: 64,
            cq_entries: 8,
            ..Default::default()
        },
        RingOptions {
            sqpoll: Some(SqPoll {
                idle_ms: 1,
                cpu: None,
            }),
            setup_flags: sys::IoringSetupFlags::SINGLE_ISSUER
                | sys::IoringSetupFlags::DEFER_TASKRUN,
            ..Default::default()
        },
        RingOptions {
            setup_flags: sys::IoringSetupFlags::SQE128,
            ..Default::default()
        },
    ];
    for opts in &bad {
        let e = Uring::new(opts).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{opts:?}");
    }
    // Refused by the kernel (no such CPU): an errno, not a panic.
    let e = Uring::new(&RingOptions {
        sqpoll: Some(SqPoll {
            idle_ms: 1,
            cpu: Some(1 << 20),
        }),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.raw_os_error().is_some(), "{e:?}");
}

#[test]
fn unconsumed_entries_are_readable_while_the_producer_holds_the_queue() {
    // A watchdog thread reads this while the stage thread owns the SubmissionQueue: it must
    // neither claim the queue (that panicked in the executor-sqe watchdog) nor miss entries.
    let ring = Uring::new(&RingOptions::default()).unwrap();
    let sq = ring.sq();
    assert_eq!(ring.sq_unconsumed(), 0);
    sq.push(&nop(1)).unwrap();
    sq.push(&nop(2)).unwrap();
    assert_eq!(ring.sq_unconsumed(), 2, "published, not submitted yet");
    assert_eq!(sq.pending(), 2);
    assert_eq!(ring.enter(2, 2, None).unwrap(), 2);
    assert_eq!(ring.sq_unconsumed(), 0, "the kernel consumed both");
    drop(sq);
    assert_eq!(reap(&ring, 2).len(), 2);
}

#[test]
fn one_producer_one_consumer_at_a_time() {
    let ring = Uring::new(&RingOptions::default()).unwrap();
    let sq = ring.sq();
    assert!(ring.try_sq().is_none());
    let cq = ring.cq();
    assert!(ring.try_cq().is_none());
    drop((sq, cq));
    assert!(ring.try_sq().is_some());
    assert!(ring.try_cq().is_some());
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Uring>();
}

#[test]
fn enter_timeout_and_timeout_op() {
    let ring = Uring::new(&RingOptions::default()).unwrap();
    // A sub-millisecond wait with nothing to complete returns Ok(0) after the timeout.
    let t = Instant::now();
    assert_eq!(
        ring.enter(0, 1, Some(Duration::from_micros(300))).unwrap(),
        0
    );
    let el = t.elapsed();
    assert!(
        el >= Duration::from_micros(300) && el < Duration::from_millis(200),
        "{el:?}"
    );
    let ts = sys::Timespec {
        tv_sec: 0,
        tv_nsec: 1_000_000,
    };
    // SAFETY: `ts` lives until the CQE is reaped below.
    ring.sq().push(&unsafe { timeout(&ts, 5) }).unwrap();
    ring.sq().push(&nop(6)).unwrap();
    ring.enter(2, 2, None).unwrap();
    let mut cqes = reap(&ring, 2);
    cqes.sort_by_key(|c| c.user_data);
    assert_eq!(cqes[0].res, -(rustix::io::Errno::TIME.raw_os_error()));
    assert_eq!(
        cqes[1],
        Cqe {
            user_data: 6,
            res: 0,
            flags: 0
        }
    );
}

#[test]
fn eventfd_read_and_futex_ops() {
    let ring = Uring::new(&RingOptions {
        no_mmap: true,
        ..Default::default()
    })
    .unwrap();
    let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    let mut buf = [0u8; 8];
    // SAFETY: `buf` is not touched until the CQE is reaped below.
    ring.sq()
        .push(&unsafe { read(efd.as_raw_fd(), buf.as_mut_ptr(), 8, 1) })
        .unwrap();
    ring.enter(1, 0, None).unwrap();
    rustix::io::write(&efd, &5u64.to_ne_bytes()).unwrap();
    let c = reap(&ring, 1)[0];
    assert_eq!((c.user_data, c.res), (1, 8));
    assert_eq!(u64::from_ne_bytes(buf), 5);

    let word = AtomicU32::new(0);
    // SAFETY: `word` outlives the ring's use of it (all CQEs reaped below).
    ring.sq().push(&unsafe { futex_wait(&word, 0, 2) }).unwrap();
    // SAFETY: as above; this one fails at once with EAGAIN (value mismatch).
    ring.sq().push(&unsafe { futex_wait(&word, 1, 3) }).unwrap();
    ring.enter(2, 1, None).unwrap();
    let c = reap(&ring, 1)[0];
    assert_eq!(
        (c.user_data, c.res),
        (3, -(rustix::io::Errno::AGAIN.raw_os_error()))
    );
    ring.sq().push(&futex_wake(&word, 1, 4)).unwrap();
    ring.enter(1, 2, None).unwrap();
    let mut cqes = reap(&ring, 2);
    cqes.sort_by_key(|c| c.user_data);
    assert_eq!((cqes[0].user_data, cqes[0].res), (2, 0));
    assert_eq!((cqes[1].user_data, cqes[1].res), (4, 1));
}

/// A large NO_MMAP ring (multi-page rings and SQE regions, which Linux 6.18 `vmap`s) and the
/// documented layout: SQEs written through `RingMemory` raw pointers, as a GPU would.
#[test]
fn large_no_mmap_ring_and_raw_layout() {
    let ring = Uring::new(&RingOptions {
        entries: 4096,
        cq_entries: 16384,
        no_mmap: true,
        ..Default::default()
    })
    .unwrap();
    let m = ring.memory();
    assert!(m.user_provided);
    assert_eq!((m.sq_entries, m.cq_entries), (4096, 16384));
    assert!(m.rings_len > 64 * 1024 && m.sqes_len == 4096 * 64);
    // Linux 6.6+ (CI runs 6.18): no SQ index array, SQE slot = tail & mask.
    assert!(
        ring.setup_flags()
            .contains(sys::IoringSetupFlags::NO_SQARRAY)
    );
    assert_eq!(m.sq_array, None);
    // Fill the whole SQ through the raw layout.
    let at = |off: u32| m.rings.wrapping_add(off as usize).cast::<AtomicU32>();
    // SAFETY: offsets come from the kernel and were bounds-checked by `Uring::new`; the words
    // are only accessed atomically; no SubmissionQueue is alive, so we are the only producer.
    let (head, tail) = unsafe { (&*at(m.sq_head), &*at(m.sq_tail)) };
    let t0 = tail.load(Ordering::Relaxed);
    assert_eq!(t0.wrapping_sub(head.load(Ordering::Acquire)), 0);
    for i in 0..m.sq_entries {
        let slot = (t0.wrapping_add(i) & m.sq_mask) as usize;
        let sqe = nop(u64::from(i) + 1000);
        // SAFETY: slot < sq_entries, inside the SQE region; the kernel reads only published
        // slots, and this one is published after the write.
        unsafe { m.sqes.cast::<bgs_uring::Sqe>().add(slot).write(sqe) };
    }
    tail.store(t0.wrapping_add(m.sq_entries), Ordering::Release);
    assert_eq!(ring.sq().space(), 0);
    assert_eq!(ring.enter(m.sq_entries, 0, None).unwrap(), m.sq_entries);
    let mut cqes = reap(&ring, m.sq_entries as usize);
    cqes.sort_by_key(|c| c.user_data);
    for (i, c) in cqes.iter().enumerate() {
        assert_eq!((c.user_data, c.res), (i as u64 + 1000, 0));
    }
    assert_eq!(ring.sq().space(), m.sq_entries);
    assert_eq!(ring.cq_overflow(), 0);
    drop(ring);

    // The largest ring: 2 MiB of SQEs and ~1 MiB of rings in ordinary 4 KiB pages.
    let ring = Uring::new(&RingOptions {
        entries: bgs_uring::MAX_SQ_ENTRIES,
        cq_entries: bgs_uring::MAX_CQ_ENTRIES,
        no_mmap: true,
        sqpoll: Some(SqPoll {
            idle_ms: 10,
            cpu: None,
        }),
        ..Default::default()
    })
    .unwrap();
    ring.sq().push(&nop(9)).unwrap();
    ring.enter(0, 1, None).unwrap();
    assert_eq!(reap(&ring, 1)[0].user_data, 9);
}

#[test]
fn write_after_close_of_peer_reports_error_not_signal() {
    let ring = Uring::new(&RingOptions::default()).unwrap();
    let (tx, rx) = tcp_pair();
    drop(rx);
    let data = [7u8; MSG];
    // A few sends: the first may succeed (RST not yet seen), later ones fail with EPIPE or
    // ECONNRESET; MSG_NOSIGNAL keeps SIGPIPE from killing the test.
    let mut saw_error = false;
    for i in 0..50 {
        // SAFETY: `data` outlives the CQE, reaped right below.
        ring.sq()
            .push(&unsafe { send(tx.as_raw_fd(), data.as_ptr(), MSG as u32, i) })
            .unwrap();
        ring.enter(1, 1, None).unwrap();
        if reap(&ring, 1)[0].res < 0 {
            saw_error = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(saw_error);
    let _ = (&tx).write(&[]);
}

#[test]
fn poll_readable_completes_when_the_fd_becomes_readable() {
    let ring = Uring::new(&RingOptions::default()).unwrap();
    let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    ring.sq()
        .push(&bgs_uring::poll_readable(efd.as_raw_fd(), 9))
        .unwrap();
    ring.enter(1, 0, None).unwrap();
    assert!(ring.cq().is_empty(), "nothing to read yet");
    rustix::io::write(&efd, &1u64.to_ne_bytes()).unwrap();
    let c = reap(&ring, 1)[0];
    assert_eq!(c.user_data, 9);
    assert!(c.res > 0 && c.res & 0x1 != 0, "POLLIN in {}", c.res);
}

#[test]
fn multishot_poll_completes_once_per_wake_up_and_stays_armed() {
    let ring = Uring::new(&RingOptions::default()).unwrap();
    let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
    ring.sq()
        .push(&bgs_uring::poll_readable_multishot(efd.as_raw_fd(), 7))
        .unwrap();
    ring.enter(1, 0, None).unwrap();
    assert!(ring.cq().is_empty(), "nothing to read yet");
    for round in 0..3 {
        rustix::io::write(&efd, &1u64.to_ne_bytes()).unwrap();
        let c = reap(&ring, 1)[0];
        assert_eq!(c.user_data, 7, "round {round}");
        assert!(c.res & 0x1 != 0, "POLLIN in {}", c.res);
        assert!(c.more(), "round {round}: the poll stays armed");
        let mut buf = [0u8; 8];
        rustix::io::read(&efd, &mut buf).unwrap();
    }
    // Consumed, and nobody writes: no further completion.
    ring.enter(0, 1, Some(Duration::from_millis(20))).unwrap();
    assert!(ring.cq().is_empty(), "a completion without a wake-up");
}
