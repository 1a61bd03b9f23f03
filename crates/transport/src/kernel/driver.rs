//! What both reply modes share: the [`StageDriver`] that feeds the reply stage from the
//! completion rings and the io_uring completions (accepts, the loop's own reads, the stage's
//! operations), and the counters it reports.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bgs_bpf::KernelRx;
use bgs_ring::RingRegion;
use bgs_uring::Uring;

use super::GpuTx;
use super::config::KernelStats;
use super::reply::ReplyStage;
use super::submit::{DirectCounts, SqIo};

pub(super) const UD_ACCEPT: u64 = 0xff << 56;
pub(super) const UD_DOORBELL: u64 = 0xfe << 56;
pub(super) const UD_SHUTDOWN: u64 = 0xfd << 56;
pub(super) const UD_WATCH: u64 = 0xfc << 56;

/// The shared part of both reply modes: one pass of the reply stage.
pub(super) struct StageDriver {
    pub(super) stage: ReplyStage,
    pub(super) region: Arc<RingRegion>,
    /// BPF's own completions (busy, markers): a ring of their own, so that each completion
    /// ring has producers on one side only (a GPU executor and CPUs cannot share a
    /// compare-and-swap target without host-native atomics).
    pub(super) side: Arc<RingRegion>,
    pub(super) accepts: u64,
    /// Accepted connections BPF does not track (reset at once).
    pub(super) untracked: u64,
    /// Loop waits ended by `KernelConfig::wake_timeout` ([`KernelStats::wake_timeouts`]).
    pub(super) wake_timeouts: u64,
    pub(super) rx: Arc<KernelRx>,
    /// Final completions taken from the executor's completion ring. Every request-ring entry
    /// (request or rejection) ends in exactly one, and cancel markers (published by the stage,
    /// `stage.stats().cancels`) in none, so `requests().produced() - finals - cancels` is the
    /// work still in the executor ([`Self::answered`]).
    pub(super) finals: u64,
    pub(super) listener_fd: RawFd,
    pub(super) accept_armed: bool,
    /// Loop mode: a READ on the executor's eventfd, re-armed after each completion.
    pub(super) bell: Option<Bell>,
    /// Loop mode: a READ on the shutdown pipe; its completion stops the loop.
    pub(super) stop: Option<Bell>,
    pub(super) stop_requested: bool,
    /// Loop mode with an executor that cannot wake us: a poll on BPF's doorbell, which rings
    /// when a request is published while we are registered as a request-ring sleeper.
    pub(super) watch: Option<(RawFd, bool)>,
    pub(super) watch_fired: bool,
    /// `--reply executor-sqe` with adaptive submission: what the stage did itself (copied
    /// from its [`Direct`] when stats are printed and at the end).
    pub(super) direct: Option<DirectCounts>,
}

pub(super) struct Bell {
    pub(super) fd: RawFd,
    pub(super) buf: Box<[u8; 8]>,
    pub(super) armed: bool,
}

impl StageDriver {
    pub(super) fn new(
        rx: Arc<KernelRx>,
        listener_fd: RawFd,
        bell_fd: Option<RawFd>,
        stop_fd: Option<RawFd>,
    ) -> Self {
        StageDriver {
            stage: ReplyStage::new(),
            region: rx.region(),
            side: rx.side_region(),
            accepts: 0,
            untracked: 0,
            wake_timeouts: 0,
            rx,
            finals: 0,
            listener_fd,
            accept_armed: false,
            bell: bell_fd.map(|fd| Bell {
                fd,
                buf: Box::new([0; 8]),
                armed: false,
            }),
            stop: stop_fd.map(|fd| Bell {
                fd,
                buf: Box::new([0; 8]),
                armed: false,
            }),
            stop_requested: false,
            watch: None,
            watch_fired: false,
            direct: None,
        }
    }
}

impl StageDriver {
    /// Request-ring entries that need no more work from the executor: final completions seen
    /// and the cancel markers this stage published (never answered).
    pub(super) fn answered(&self) -> u64 {
        self.finals + self.stage.stats().cancels
    }

    /// Reap completions and CQEs, queue operations. Returns true if anything happened.
    pub(super) fn pass(&mut self, uring: &Uring, io: &mut SqIo<'_>) -> bool {
        let mut did = false;
        while let Some(final_) = self.region.completions().try_pop(|e| {
            self.stage.on_completion(e);
            e.final_ != 0
        }) {
            self.finals += u64::from(final_);
            did = true;
        }
        // BPF's own completions (busy, rejections, markers) never take credit; it does not
        // write their `stream` field, which the zeroed map keeps 0.
        while let Some(()) = self
            .side
            .completions()
            .try_pop(|e| self.stage.on_completion(e))
        {
            did = true;
        }
        did |= self.reap_cqes(uring);
        if !self.accept_armed && io.push(&bgs_uring::accept_multishot(self.listener_fd, UD_ACCEPT))
        {
            self.accept_armed = true;
        }
        if let Some(b) = &mut self.bell
            && !b.armed
        {
            // SAFETY: the buffer is boxed and owned by the driver, which outlives the ring's
            // use of it (the driver is dropped after the loop, the ring after that).
            let sqe = unsafe { bgs_uring::read(b.fd, b.buf.as_mut_ptr(), 8, UD_DOORBELL) };
            b.armed = io.push(&sqe);
        }
        if let Some((fd, armed)) = &mut self.watch
            && !*armed
        {
            // Multishot: it stays armed across wake-ups (one poll registration per
            // connection's life of the loop, not one per request).
            *armed = io.push(&bgs_uring::poll_readable_multishot(*fd, UD_WATCH));
        }
        if let Some(b) = &mut self.stop
            && !b.armed
        {
            // SAFETY: as for the doorbell buffer above.
            let sqe = unsafe { bgs_uring::read(b.fd, b.buf.as_mut_ptr(), 8, UD_SHUTDOWN) };
            b.armed = io.push(&sqe);
        }
        self.stage.flush(io);
        did
    }

    /// At shutdown: reap the completions of CLOSE operations already issued (queueing
    /// nothing new), so that the counters printed at shutdown count every connection whose
    /// descriptor is gone. A CLOSE removes the descriptor before its completion is posted, and
    /// a stop can come in between; without this the printed `closed` lagged behind the
    /// descriptors actually closed. Bounded: an operation that never completes is left alone.
    pub(super) fn finish(&mut self, uring: &Uring) {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            self.reap_cqes(uring);
            if self.stage.closes_in_flight() == 0 || Instant::now() >= deadline {
                break;
            }
            // The CLOSE may still sit in the submission queue: the loop stopped before its
            // `io_uring_enter`, or the SQPOLL thread sleeps and the watchdog has stopped
            // (`enter` sets SQ_WAKEUP then).
            let _ = uring.enter(uring.sq().pending(), 0, None);
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Take the io_uring completions: accepts, the loop's own reads, the stage's operations.
    /// Returns true if there were any.
    pub(super) fn reap_cqes(&mut self, uring: &Uring) -> bool {
        let mut did = false;
        while let Some(cqe) = uring.cq().pop() {
            did = true;
            match cqe.user_data {
                UD_ACCEPT => {
                    if cqe.res >= 0 {
                        self.accepts += 1;
                        let fd = cqe.res;
                        // SAFETY: the accept CQE handed us this live descriptor; the borrow
                        // ends before anything can close it.
                        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
                        match bgs_bpf::socket_cookie(borrowed) {
                            Ok(cookie) if !self.rx.tracks(cookie) && tcp_open(borrowed) => {
                                // BPF refused it at the handshake (maps full): nobody would
                                // ever read its bytes. Reset it so the client sees a refusal
                                // instead of waiting forever. (Checked in this order: BPF
                                // drops a connection's state only at TCP_CLOSE, which is
                                // final, so an open socket without state never had any.)
                                self.untracked += 1;
                                tracing::warn!(
                                    "connection refused by BPF (sockhash or state map full): reset"
                                );
                                let _ = rustix::net::sockopt::set_socket_linger(
                                    borrowed,
                                    Some(Duration::ZERO),
                                );
                                // SAFETY: the accept CQE handed us ownership of `fd`.
                                drop(unsafe { OwnedFd::from_raw_fd(fd) });
                            }
                            Ok(cookie) => {
                                kick_verdict(borrowed);
                                self.stage.on_accept(fd, cookie);
                            }
                            Err(e) => {
                                tracing::warn!("SO_COOKIE failed: {e}");
                                // SAFETY: the accept CQE handed us ownership of `fd`.
                                drop(unsafe { OwnedFd::from_raw_fd(fd) });
                            }
                        }
                    } else {
                        tracing::warn!("accept failed: {}", io::Error::from_raw_os_error(-cqe.res));
                    }
                    if !cqe.more() {
                        self.accept_armed = false;
                    }
                }
                UD_DOORBELL => {
                    if let Some(b) = &mut self.bell {
                        b.armed = false;
                    }
                }
                UD_SHUTDOWN => self.stop_requested = true,
                UD_WATCH => {
                    if let Some((_, armed)) = &mut self.watch
                        && !cqe.more()
                    {
                        *armed = false;
                    }
                    self.watch_fired = true;
                }
                ud => self.stage.on_cqe(ud, cqe.res),
            }
        }
        did
    }
}

pub(super) fn collect_stats(
    rx: &KernelRx,
    driver: &StageDriver,
    wakeups: u64,
    gpu: Option<&GpuTx>,
) -> KernelStats {
    KernelStats {
        bpf: rx.counters(),
        reply: driver.stage.stats().clone(),
        wakeups,
        wake_timeouts: driver.wake_timeouts,
        accepts: driver.accepts,
        untracked: driver.untracked,
        sockhash_entries: rx.sockhash_len(),
        conn_states: rx.conn_states_len(),
        gpu: gpu.map(|g| g.table.counters().into()),
        direct: driver.direct,
    }
}

/// Prints the counters every `every`, if set.
pub(super) struct StatsTimer {
    pub(super) every: Option<Duration>,
    pub(super) next: Instant,
}

impl StatsTimer {
    pub(super) fn new(every: Option<Duration>) -> Self {
        StatsTimer {
            every,
            next: Instant::now() + every.unwrap_or_default(),
        }
    }

    pub(super) fn due(&mut self, now: Instant) -> bool {
        match self.every {
            Some(every) if now >= self.next => {
                self.next = now + every;
                true
            }
            _ => false,
        }
    }
}

/// Whether the socket has not reached TCP_CLOSE (`TCP_INFO`'s state; an error counts as
/// closed).
pub(super) fn tcp_open(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    // SAFETY: tcp_info is plain old data; all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, a live tcp_info.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    const TCP_CLOSE: u8 = 7;
    rc == 0 && len >= 1 && info.tcpi_state != TCP_CLOSE
}

/// Bytes that arrived between the handshake and the accept sit in the socket's queue: the
/// sockmap verdict path only runs once the socket has a `struct socket`, i.e. after accept,
/// and only when more data arrives. Setting `SO_RCVLOWAT` makes TCP re-check readiness and
/// call the socket's data-ready hook, which is the verdict program's entry point, so those
/// bytes are framed now instead of waiting for the client's next segment (which may never
/// come: it is waiting for our reply).
pub(super) fn kick_verdict(fd: std::os::fd::BorrowedFd<'_>) {
    let one: libc::c_int = 1;
    // SAFETY: a valid descriptor and a pointer to a live c_int with its exact size; rustix has
    // no wrapper for SO_RCVLOWAT.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const one).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        tracing::warn!(
            "SO_RCVLOWAT on an accepted socket failed: {}",
            io::Error::last_os_error()
        );
    }
}
