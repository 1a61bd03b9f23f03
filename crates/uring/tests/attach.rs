//! `IORING_SETUP_ATTACH_WQ`: a second SQPOLL ring served by the first ring's kernel thread.
//!
//! One test in a binary of its own (its own process): it counts the process's SQPOLL threads in
//! `/proc/self/task`, which other tests' rings would disturb.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use bgs_uring::{Cqe, RingOptions, SqPoll, Uring, nop, send_with_flags, sys};

/// Threads of this process (a new SQPOLL thread is listed as soon as setup returns).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// Threads of this process that run an SQPOLL loop (`iou-sqp-<pid>`; the thread names itself
/// when it first runs, so a fresh one may not be counted yet).
fn sqpoll_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("iou-sqp"))
        .count()
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn sqpoll_opts() -> RingOptions {
    RingOptions {
        entries: 64,
        cq_entries: 256,
        sqpoll: Some(SqPoll {
            idle_ms: 1,
            cpu: None,
        }),
        no_mmap: true,
        ..Default::default()
    }
}

/// Pops one CQE without entering the kernel (the SQPOLL thread posts it), or panics after 10 s.
fn pop_one(ring: &Uring) -> Cqe {
    let cq = ring.cq();
    let mut got = None;
    wait_for("a CQE", || {
        got = cq.pop();
        got.is_some()
    });
    got.unwrap()
}

/// Waits until the shared SQPOLL thread sleeps: both rings must then say so.
fn wait_asleep(a: &Uring, b: &Uring) {
    wait_for("the SQPOLL thread to sleep", || a.needs_wakeup());
    assert!(
        b.needs_wakeup(),
        "a sleeping shared SQPOLL thread flags every attached ring"
    );
}

#[test]
fn attached_sqpoll_rings_share_one_thread() {
    let base = sqpoll_threads();
    let all = threads();
    let a = Uring::new(&sqpoll_opts()).unwrap();
    assert_eq!(threads(), all + 1, "ring a has an SQPOLL thread");
    wait_for("ring a's SQPOLL thread", || sqpoll_threads() == base + 1);
    let b = Uring::new_attached(&sqpoll_opts(), &a).unwrap();
    assert!(b.is_sqpoll() && b.memory().user_provided);
    assert_eq!(threads(), all + 1, "ring b needs no thread of its own");
    {
        // The count is real: an unattached SQPOLL ring brings a second thread.
        let c = Uring::new(&sqpoll_opts()).unwrap();
        assert_eq!(threads(), all + 2);
        wait_for("ring c's SQPOLL thread", || sqpoll_threads() == base + 2);
        drop(c);
        wait_for("ring c's thread to exit", || sqpoll_threads() == base + 1);
    }
    assert_eq!(threads(), all + 1);

    // Waking through either ring serves both.
    for (push_on, wake_via) in [(&b, &a), (&a, &b), (&b, &b)] {
        wait_asleep(&a, &b);
        push_on.sq().push(&nop(7)).unwrap();
        wake_via.wake_sqpoll().unwrap();
        let c = pop_one(push_on);
        assert_eq!((c.user_data, c.res), (7, 0));
    }

    // In-order SENDs through the attached ring, one in flight at a time, as a GPU writes them.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut rx, _) = l.accept().unwrap();
    const N: u32 = 200;
    let msgs: Vec<[u8; 64]> = (0..N).map(|i| [i as u8; 64]).collect();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; N as usize * 64];
        rx.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        rx.read_exact(&mut buf).unwrap();
        buf
    });
    for (i, m) in msgs.iter().enumerate() {
        // SAFETY: `m` lives in `msgs` until after its CQE is popped below.
        let sqe = unsafe {
            send_with_flags(
                tx.as_raw_fd(),
                m.as_ptr(),
                64,
                // MSG_WAITALL (rustix names it only for receives).
                sys::SendFlags::from_bits_retain(0x100) | sys::SendFlags::NOSIGNAL,
                i as u64,
            )
        };
        b.sq().push(&sqe).unwrap();
        if b.needs_wakeup() {
            a.wake_sqpoll().unwrap();
        }
        let c = pop_one(&b);
        assert_eq!((c.user_data, c.res), (i as u64, 64), "send {i}");
    }
    let got = reader.join().unwrap();
    for (i, chunk) in got.chunks(64).enumerate() {
        assert!(
            chunk.iter().all(|&x| x == i as u8),
            "message {i} out of order"
        );
    }

    // The thread outlives the ring that created it while an attached ring is open.
    drop(a);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(threads(), all + 1, "b still has the shared thread");
    assert_eq!(sqpoll_threads(), base + 1);
    b.sq().push(&nop(9)).unwrap();
    if b.needs_wakeup() {
        b.wake_sqpoll().unwrap();
    }
    assert_eq!(pop_one(&b).user_data, 9);
    assert_eq!(b.sq_dropped(), 0);
    assert_eq!(b.cq_overflow(), 0);
    drop(b);
    wait_for("the shared thread to exit", || sqpoll_threads() == base);
}
