//! How the reply stage's operations reach the kernel: SQEs in an io_uring submission queue
//! ([`SqIo`]), and, for `--reply executor-sqe` with a CPU executor, plain system calls while
//! the SQPOLL thread sleeps and replies come slowly ([`Direct`]).
//!
//! # Why switch by load (issue 12, goal 3)
//! The SQPOLL kernel thread spins while it is awake and sleeps only after `sq_thread_idle`
//! (at least one scheduler tick, 10 ms by default here) without submissions. At 1,000 replies
//! a second the gaps are shorter than that, so it never sleeps and the server pays a whole
//! core: about 1 ms of CPU per request, against tens of µs for a system call per reply. Above
//! some rate the spinning thread is the cheaper submitter (one core for any number of
//! replies, and no system call on the stage's thread). So while the SENDs of the current and
//! of the previous 10 ms window stay under `ReplyMode::ExecutorSqe::sqpoll_above`, the stage
//! performs its operations itself (`send(2)`, `shutdown(2)`, `close(2)`), the SQPOLL thread
//! gets no work, and after its idle time it sleeps; from that rate on every operation goes
//! through the ring without a system call, and the stage wakes the thread if it sleeps.
//! When the load falls, the stage goes back to system calls and the thread to sleep.
//!
//! A GPU that writes SENDs itself (`--executor gpu`) keeps the SQPOLL thread busy whatever the
//! stage does, so the same rule also pauses the GPU's sends ([`GpuPause`]): below the
//! threshold (the GPU's SENDs counted with the stage's) the GPU hands every reply to the stage,
//! queues nothing on its ring, and BPF's completion watch wakes the stage when a reply is
//! there (the GPU's FUTEX_WAKE would need the sleeping SQPOLL thread); from the threshold on
//! the GPU sends again and the stage wakes the thread.
//!
//! # Ordering
//! Switching submitter per operation keeps each connection's bytes in order because the
//! stage keeps at most one SEND in flight per connection ([`super::reply`]): the next one is
//! issued only after the previous one's completion, whichever way it went. Direct operations
//! are used only when the submission queue is empty (everything queued earlier has been
//! taken by the kernel, which holds its own reference to each file), so a descriptor closed
//! directly can never be named by an SQE still waiting in the queue. An operation that cannot
//! complete at once (a full socket buffer: `EAGAIN`) goes to the ring instead, where the SEND
//! waits for room, and every later operation of that pass follows it there.

use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use bgs_bpf::KernelRx;
use bgs_ring::RingRegion;
use bgs_uring::Uring;
use rustix::io::Errno;
use rustix::net::SendFlags;
use serde::Serialize;

use super::reply::ReplyIo;

/// Queue operations into an io_uring submission queue (or, with [`Direct`] on, perform them);
/// credit and cancel markers go straight into the executor's region.
pub(super) struct SqIo<'a> {
    pub(super) uring: &'a Uring,
    pub(super) rx: &'a KernelRx,
    pub(super) region: &'a RingRegion,
    pub(super) queued: u32,
    /// Adaptive submission (`--reply executor-sqe`, CPU executor); `None` elsewhere.
    pub(super) direct: Option<&'a mut Direct>,
}

impl<'a> SqIo<'a> {
    /// Operations go into `uring`'s submission queue only.
    pub(super) fn ring(uring: &'a Uring, rx: &'a KernelRx, region: &'a RingRegion) -> Self {
        SqIo {
            uring,
            rx,
            region,
            queued: 0,
            direct: None,
        }
    }

    pub(super) fn push(&mut self, sqe: &bgs_uring::Sqe) -> bool {
        let ok = self.uring.sq().push(sqe).is_ok();
        if ok {
            self.queued += 1;
            // Everything after a queued operation follows it through the ring (order).
            if let Some(d) = self.direct.as_deref_mut() {
                d.on = false;
            }
        }
        ok
    }

    /// The direct submitter, if this operation may use a system call.
    fn direct_now(&mut self) -> Option<&mut Direct> {
        self.direct.as_deref_mut().filter(|d| d.allowed())
    }
}

impl ReplyIo for SqIo<'_> {
    fn send(&mut self, fd: RawFd, ptr: *const u8, len: usize, user_data: u64) -> bool {
        if let Some(d) = self.direct.as_deref_mut() {
            d.count_send();
        }
        if let Some(d) = self.direct_now() {
            // SAFETY: the reply stage keeps `len` bytes at `ptr` alive and unmodified until the
            // completion for `user_data` (ReplyIo contract); this borrow ends inside the call.
            let buf = unsafe { std::slice::from_raw_parts(ptr, len) };
            // SAFETY: `fd` is an accepted connection the stage owns; it stays open until the
            // stage's CLOSE, which comes after this SEND's completion.
            let sock = unsafe { BorrowedFd::borrow_raw(fd) };
            match rustix::net::send(sock, buf, SendFlags::NOSIGNAL | SendFlags::DONTWAIT) {
                Ok(n) if n > 0 || len == 0 => {
                    d.complete(user_data, i32::try_from(n).unwrap_or(i32::MAX));
                    d.counts.sends += 1;
                    return true;
                }
                // The socket buffer is full: the ring's SEND waits for room (below).
                Ok(_) | Err(Errno::AGAIN) => d.counts.fallbacks += 1,
                Err(e) => {
                    d.complete(user_data, -e.raw_os_error());
                    d.counts.sends += 1;
                    return true;
                }
            }
        }
        // SAFETY: the reply stage keeps the buffer alive and unmodified until the CQE for
        // `user_data` (ReplyIo contract).
        let sqe = unsafe { bgs_uring::send(fd, ptr, len as u32, user_data) };
        let ok = self.push(&sqe);
        if ok && let Some(d) = self.direct.as_deref_mut() {
            d.counts.ring_sends += 1;
        }
        ok
    }

    fn shutdown(&mut self, fd: RawFd, user_data: u64) -> bool {
        if let Some(d) = self.direct_now() {
            // SAFETY: as in `send`: the stage owns `fd` until its CLOSE.
            let sock = unsafe { BorrowedFd::borrow_raw(fd) };
            let res = match rustix::net::shutdown(sock, rustix::net::Shutdown::Write) {
                Ok(()) => 0,
                Err(e) => -e.raw_os_error(),
            };
            d.complete(user_data, res);
            return true;
        }
        self.push(&bgs_uring::shutdown(
            fd,
            rustix::net::Shutdown::Write,
            user_data,
        ))
    }

    fn close(&mut self, fd: RawFd, cookie: u64, user_data: u64) -> bool {
        // Tell BPF first: the socket's last state change then publishes no reset marker.
        self.rx.forget_connection(cookie);
        if let Some(d) = self.direct_now() {
            // SAFETY: the stage closes each accepted descriptor exactly once, after its last
            // SEND completed; direct operations run only with an empty submission queue, so
            // no SQE still names this number (module docs, "Ordering").
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
            d.complete(user_data, 0);
            return true;
        }
        self.push(&bgs_uring::close(fd, user_data))
    }

    fn ack_stream(&mut self, stream: u32, n: u32) {
        crate::credit::ack(self.region, stream, n);
    }

    fn cancel(&mut self, cookie: u64) -> bool {
        // The executor's slots sleep on BPF's doorbell with a short timeout (1 ms), or on the
        // ring's futex: a connection ends rarely, so wake them now.
        let ok = crate::credit::publish_cancel(self.region, cookie);
        if ok {
            self.region.requests().notify();
        }
        ok
    }
}

/// The span over which the reply rate is measured: the SQPOLL thread's default idle time, so
/// that a burst shorter than what one wake-up would cost in spinning does not wake it.
const WINDOW: Duration = Duration::from_millis(10);

/// Adaptive submission for `--reply executor-sqe` with a CPU executor: the stage's own system
/// calls while replies come slowly, the SQPOLL ring when they come fast (module docs).
#[derive(Debug)]
pub(super) struct Direct {
    /// SENDs per [`WINDOW`] from which the SQPOLL thread submits.
    per_window: u64,
    /// Whether the current operation may use a system call.
    on: bool,
    /// Completions of the operations performed, for the stage (as if they were CQEs).
    done: Vec<(u64, i32)>,
    /// Start of the current window, the SENDs issued in it (either way) and in the window
    /// before.
    window: Instant,
    in_window: u64,
    in_previous: u64,
    pub(super) counts: DirectCounts,
}

/// Counters of adaptive submission ([`Direct`]), printed with the transport's stats.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct DirectCounts {
    /// SENDs the stage made with `send(2)` (including failed ones).
    pub sends: u64,
    /// Of those tried, SENDs that found the socket buffer full and went to the ring.
    pub fallbacks: u64,
    /// SENDs queued for the SQPOLL thread instead (the rate was above the threshold, the
    /// queue was not empty, or a fallback).
    pub ring_sends: u64,
    /// SQPOLL wake-ups by the stage (operations queued while it slept, or the GPU's).
    pub wakes: u64,
    /// GPU-written SENDs: times the stage paused them again (the rate fell under the
    /// threshold; every reply then goes through the stage and the SQPOLL thread sleeps).
    /// They start paused, which is not counted.
    pub gpu_paused: u64,
    /// Times it resumed them (the rate reached the threshold).
    pub gpu_resumed: u64,
}

impl Direct {
    /// `sqpoll_above`: replies per second from which the SQPOLL thread submits (at least 1).
    pub(super) fn new(sqpoll_above: u32) -> Self {
        Direct {
            per_window: (u64::from(sqpoll_above) * WINDOW.as_millis() as u64)
                .div_ceil(1000)
                .max(1),
            on: false,
            done: Vec::new(),
            window: Instant::now(),
            in_window: 0,
            in_previous: 0,
            counts: DirectCounts::default(),
        }
    }

    fn complete(&mut self, user_data: u64, res: i32) {
        self.done.push((user_data, res));
    }

    /// Whether the next operation may be a system call: the rate of this window and of the
    /// one before stays under the threshold, and nothing is queued for the SQPOLL thread
    /// (module docs, "Ordering"). While replies go out this way the SQPOLL thread gets no
    /// work, so after its idle time it sleeps and costs nothing.
    fn allowed(&self) -> bool {
        self.on && !self.fast()
    }

    /// Whether replies come at the threshold rate or faster (this window or the one before):
    /// the SQPOLL thread is then the cheaper submitter, and a GPU that writes SENDs may send.
    pub(super) fn fast(&self) -> bool {
        self.in_window >= self.per_window || self.in_previous >= self.per_window
    }

    /// Count one SEND (either way) in the current window.
    fn count_send(&mut self) {
        self.in_window += 1;
    }

    /// Count `n` SENDs someone else made (a GPU's) in the current window.
    pub(super) fn count_others(&mut self, n: u64) {
        self.in_window += n;
    }

    /// Before a pass: roll the rate windows and look at the submission queue.
    pub(super) fn begin(&mut self, uring: &Uring, now: Instant) {
        let elapsed = now.duration_since(self.window);
        if elapsed >= WINDOW {
            // The window just ended becomes the previous one only if it was the last full
            // window; after a longer quiet spell the previous window was empty.
            self.in_previous = if elapsed < 2 * WINDOW {
                self.in_window
            } else {
                0
            };
            self.in_window = 0;
            self.window = now;
        }
        self.on = uring.sq_unconsumed() == 0;
    }

    /// Swap the completions of the operations performed since the last call into `buf`
    /// (empty on entry; the caller drains it). Two buffers trade places, so nothing is
    /// allocated per reply.
    pub(super) fn swap_done(&mut self, buf: &mut Vec<(u64, i32)>) {
        debug_assert!(buf.is_empty());
        std::mem::swap(&mut self.done, buf);
    }

    /// After a pass: wake the SQPOLL thread if operations wait for it while it sleeps (this
    /// thread can make the system call; the watchdog only checks now and then). Returns
    /// whether it woke it.
    pub(super) fn end(&mut self, uring: &Uring) -> std::io::Result<bool> {
        if uring.sq_unconsumed() > 0 && uring.needs_wakeup() {
            uring.wake_sqpoll()?;
            self.counts.wakes += 1;
            return Ok(true);
        }
        Ok(false)
    }
}

/// Adaptive submission with GPU-written SENDs (module docs): pauses the GPU's SENDs while the
/// reply rate (the stage's and the GPU's SENDs) stays under the threshold, resumes them from
/// it, and wakes the SQPOLL thread for SQEs the GPU left waiting while it slept.
#[derive(Debug)]
pub(super) struct GpuPause {
    table: std::sync::Arc<bgs_ring::tx::TxTable>,
    /// The GPU's SEND counter at the last look.
    sent: u64,
    paused: bool,
}

impl GpuPause {
    /// Starts paused (no rate seen yet): the GPU's first replies go through the stage.
    pub(super) fn new(table: std::sync::Arc<bgs_ring::tx::TxTable>) -> Self {
        table.set_gpu_sends_paused(true);
        GpuPause {
            sent: table.gpu_sends(),
            table,
            paused: true,
        }
    }

    /// Whether the GPU's sends are paused (the stage then waits for BPF's completion watch).
    pub(super) fn paused(&self) -> bool {
        self.paused
    }

    /// After [`Direct::begin`]: count the GPU's SENDs since the last look into the rate, and
    /// pause or resume them. On resuming, wake the SQPOLL thread at once (the GPU's SENDs
    /// would otherwise wait for the next look at its ring).
    pub(super) fn update(&mut self, d: &mut Direct, gpu_ring: &Uring) -> std::io::Result<()> {
        let sent = self.table.gpu_sends();
        d.count_others(sent.wrapping_sub(self.sent));
        self.sent = sent;
        let paused = !d.fast();
        if paused != self.paused {
            self.paused = paused;
            self.table.set_gpu_sends_paused(paused);
            if paused {
                d.counts.gpu_paused += 1;
            } else {
                d.counts.gpu_resumed += 1;
                if gpu_ring.needs_wakeup() {
                    gpu_ring.wake_sqpoll()?;
                    d.counts.wakes += 1;
                }
            }
        }
        Ok(())
    }

    /// After a pass: wake the SQPOLL thread if the GPU left SQEs waiting while it slept (a
    /// publish that read the word before a pause, or the moment after a resume).
    pub(super) fn end(&self, d: &mut Direct, gpu_ring: &Uring) -> std::io::Result<bool> {
        if gpu_ring.sq_unconsumed() > 0 && gpu_ring.needs_wakeup() {
            gpu_ring.wake_sqpoll()?;
            d.counts.wakes += 1;
            return Ok(true);
        }
        Ok(false)
    }
}
