//! The kernel-owned transport: eBPF frames and admits requests; replies leave through
//! io_uring. See docs/kernel.md.
//!
//! Start-up (userspace): bind the socket, load and attach the BPF object for its port (the
//! request and completion rings live in its mmapable map), only then listen (so that no
//! connection is established before the programs see it), set up io_uring with a multishot
//! accept on the listener. Steady state:
//! - receive: the `sock_ops` program puts each new connection into the sockhash at handshake
//!   time; the verdict program frames every byte and publishes requests (and rejections, in
//!   order) into the request ring; busy and connection markers go to the completion ring.
//! - execute: the executor consumes the request ring as with any transport.
//! - reply: the [`reply::ReplyStage`] turns completions into SENDs. `--reply loop` runs it on
//!   a service thread that submits with `io_uring_enter` and waits for a completion event or a
//!   short timer; `--reply executor-sqe` runs it inside the executor, writing SQEs into an
//!   SQPOLL ring whose memory we provide, while a watchdog only wakes the SQPOLL thread when
//!   it sleeps.
//!
//! Per connection, userspace still does: take the accept CQE, read the socket cookie
//! (`getsockopt(SO_COOKIE)`), and close the descriptor (a CLOSE operation) when the connection
//! ends. Nothing per request.
//!
//! With [`KernelConfig::gpu_sends`] (`--reply executor-sqe` with the GPU executor) the GPU puts
//! most replies on the wire itself, through an io_uring ring of its own (SQPOLL, memory we
//! provide, served by the same SQPOLL kernel thread as our ring) and the send table
//! ([`bgs_ring::tx::TxTable`]), whose per-connection turn the reply stage shares with it
//! ([`reply`] module docs). See [`KernelTransport::gpu_tx`] and docs/kernel.md.

mod config;
mod driver;
mod loop_mode;
pub mod reply;
mod sqe_mode;
mod submit;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use bgs_bpf::{KernelRx, KernelRxConfig};
use bgs_ring::RingRegion;
use bgs_ring::tx::{TxDesc, TxTable};
use bgs_uring::{RingOptions, SqPoll, Uring};

use crate::native::ShutdownHandle;
use crate::stats::RequestMetrics;
pub use config::{
    ADAPTIVE_WATCHDOG, DEFAULT_SQPOLL_ABOVE, GpuSendStats, KernelConfig, KernelStats, ReplyMode,
};
use driver::{StageDriver, collect_stats};
pub use submit::DirectCounts;

/// What a GPU that writes SENDs itself works on: the send table and its own io_uring ring
/// (SQPOLL, `IORING_SETUP_NO_MMAP`). The GPU holds raw addresses into both, so keep this alive
/// (the `Arc` from [`KernelTransport::gpu_tx_owner`]) until the executor has stopped.
///
/// The GPU is the ring's only SQ producer and only CQ consumer: the host creates the ring,
/// wakes its SQPOLL thread when it sleeps, and never touches its queues.
pub struct GpuTx {
    // Field order is drop order: close the ring (its SENDs point into the table's buffers)
    // before unmapping the table.
    ring: Uring,
    table: Arc<TxTable>,
    /// The ring is served by the host ring's SQPOLL thread (`IORING_SETUP_ATTACH_WQ`).
    shared_sqpoll: bool,
}

impl std::fmt::Debug for GpuTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTx")
            .field("ring", &self.ring)
            .field("capacity", &self.table.capacity())
            .field("shared_sqpoll", &self.shared_sqpoll)
            .finish()
    }
}

impl GpuTx {
    /// The descriptor a GPU executor needs (`GpuExecutorConfig::tx`): the table's block and
    /// the ring's memory and offsets.
    pub fn desc(&self) -> TxDesc {
        let m = self.ring.memory();
        TxDesc {
            table: self.table.as_ptr(),
            table_len: self.table.len(),
            rings: m.rings,
            rings_len: m.rings_len,
            sqes: m.sqes,
            sqes_len: m.sqes_len,
            sq_entries: m.sq_entries,
            cq_entries: m.cq_entries,
            sq_head: m.sq_head,
            sq_tail: m.sq_tail,
            sq_flags: m.sq_flags,
            cq_head: m.cq_head,
            cq_tail: m.cq_tail,
            cqes: m.cqes,
        }
    }

    /// The send table.
    pub fn table(&self) -> &Arc<TxTable> {
        &self.table
    }

    /// The GPU's ring (for tests and diagnostics: its queues belong to the GPU).
    pub fn ring(&self) -> &Uring {
        &self.ring
    }

    /// Whether the GPU's ring shares the host ring's SQPOLL thread.
    pub fn shared_sqpoll(&self) -> bool {
        self.shared_sqpoll
    }
}

/// See [`KernelTransport::monitor`].
#[derive(Clone)]
pub struct KernelMonitor {
    rx: Arc<KernelRx>,
}

impl std::fmt::Debug for KernelMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelMonitor")
            .field("port", &self.rx.config().listen_port)
            .finish()
    }
}

impl KernelMonitor {
    /// Entries now in the sockhash (connections BPF frames).
    pub fn sockhash_entries(&self) -> usize {
        self.rx.sockhash_len()
    }

    /// BPF per-connection states now (removed when a socket reaches TCP_CLOSE).
    pub fn conn_states(&self) -> usize {
        self.rx.conn_states_len()
    }

    /// The BPF counters now.
    pub fn counters(&self) -> bgs_bpf::KernelCounters {
        self.rx.counters()
    }
}

/// The kernel transport, bound and loaded.
pub struct KernelTransport {
    cfg: KernelConfig,
    listener: TcpListener,
    local_addr: SocketAddr,
    rx: Arc<KernelRx>,
    uring: Arc<Uring>,
    shutdown_rx: UnixStream,
    shutdown_tx: ShutdownHandle,
    /// Executor completions wake the reply loop through this eventfd (loop mode).
    waker_fd: Arc<OwnedFd>,
    /// The send table and the GPU's ring ([`KernelConfig::gpu_sends`]).
    gpu: Option<Arc<GpuTx>>,
    /// Set by [`KernelTransport::enable_metrics`]; without it nothing is measured.
    metrics: Option<Arc<RequestMetrics>>,
}

impl std::fmt::Debug for KernelTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelTransport")
            .field("local_addr", &self.local_addr)
            .field("reply", &self.cfg.reply)
            .finish()
    }
}

/// The listening socket's backlog (the kernel caps it at `net.core.somaxconn`).
const LISTEN_BACKLOG: i32 = 4096;

/// A TCP socket bound to `addr` (with `SO_REUSEADDR`, as `TcpListener::bind` sets it) but not
/// yet listening, and the address it got (the port, when `addr` asked for port 0).
fn bind_unlistened(addr: SocketAddr) -> io::Result<(OwnedFd, SocketAddr)> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let family = if addr.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let socket = rustix::net::socket_with(family, SocketType::STREAM, SocketFlags::CLOEXEC, None)?;
    rustix::net::sockopt::set_socket_reuseaddr(&socket, true)?;
    rustix::net::bind(&socket, &addr)?;
    let local = SocketAddr::try_from(rustix::net::getsockname(&socket)?)
        .map_err(|_| io::Error::other("getsockname returned a non-IP address"))?;
    Ok((socket, local))
}

/// The unprivileged user a server will switch to (`bgs serve --user`), for
/// [`KernelTransport::bind_as`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingOwner {
    /// User id.
    pub uid: u32,
    /// Group id (also the only supplementary group while the rings are created).
    pub gid: u32,
}

/// Run `f` on a thread of its own whose credentials are `owner`'s (no capability), or here
/// when there is no owner.
///
/// An io_uring ring keeps the credentials of the thread that created it where requests run
/// on the ring's behalf: an SQPOLL ring's kernel thread submits every SQE with them (and is a
/// thread of this process that a later `setresuid` cannot reach). A ring created by root
/// would go on executing whatever the process writes into its submission queue as root after
/// the process dropped to `owner`; created by a thread that is already `owner`, it cannot.
/// The raw system calls (`rustix::thread`) change only the calling thread, which exits
/// afterwards; the rest of the process stays root until it drops privileges itself.
fn as_ring_owner<T: Send>(
    owner: Option<RingOwner>,
    f: impl FnOnce() -> io::Result<T> + Send,
) -> io::Result<T> {
    let Some(o) = owner else {
        return f();
    };
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("bgs-ring-setup".into())
            .spawn_scoped(s, move || {
                let gid = rustix::process::Gid::from_raw(o.gid);
                let uid = rustix::process::Uid::from_raw(o.uid);
                rustix::thread::set_thread_groups(&[gid])?;
                rustix::thread::set_thread_res_gid(gid, gid, gid)?;
                rustix::thread::set_thread_res_uid(uid, uid, uid)?;
                f().map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!(
                            "setting up io_uring as uid {} ({e}; with sysctl kernel.io_uring_disabled=1 only root and kernel.io_uring_group may use io_uring)",
                            o.uid
                        ),
                    )
                })
            })?
            .join()
            .map_err(|_| io::Error::other("the io_uring set-up thread panicked"))?
    })
}

impl KernelTransport {
    /// Bind, load and attach the BPF programs for the port, listen, set up io_uring. No
    /// connection can complete its handshake before the programs are attached (see
    /// `bind_unlistened`).
    pub fn bind(cfg: KernelConfig) -> io::Result<Self> {
        Self::bind_as(cfg, None)
    }

    /// As [`Self::bind`], for a server that will drop root for `ring_owner` once it is set up:
    /// the io_uring rings are created with that user's credentials (see `as_ring_owner`), so
    /// that nothing the process keeps acts as root after the drop. Everything else (BPF, the
    /// listening socket) is set up with the caller's privileges.
    pub fn bind_as(cfg: KernelConfig, ring_owner: Option<RingOwner>) -> io::Result<Self> {
        if cfg.gpu_sends && !matches!(cfg.reply, ReplyMode::ExecutorSqe { .. }) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "GPU-written SENDs need the executor-sqe reply path (--reply executor-sqe)",
            ));
        }
        // Bind without listening, attach the BPF programs for the bound port, then listen.
        // The sock_ops program puts connections into the sockhash at handshake time
        // (PASSIVE_ESTABLISHED), so it must be attached before the first handshake can
        // complete: until `listen` the kernel answers SYNs with RST (the client sees "refused"
        // and may retry), and from then on every connection passes through the attached
        // program. Binding and listening in one step and loading afterwards left a window in
        // which a connection was accepted but never entered the sockhash, so its requests
        // were never framed and it hung.
        let (socket, local_addr) = bind_unlistened(cfg.listen)?;
        // Small replies must not wait for delayed ACKs: with Nagle on, a stream's second token
        // frame waited for the client's delayed ACK of the first (about 40 ms on loopback, seen
        // with `examples/stream_cost.rs`). Accepted sockets inherit it from the listener, so
        // it costs nothing per connection (`tests/startup.rs` checks an accepted one).
        rustix::net::sockopt::set_tcp_nodelay(&socket, true)?;
        let rx = KernelRx::load(&KernelRxConfig {
            listen_port: local_addr.port(),
            max_words: cfg.framer.max_words,
            max_http_head: cfg.framer.max_http_head as u32,
            max_connections: cfg.max_connections,
            request_slots: cfg.request_slots,
            completion_slots: cfg.completion_slots,
        })
        .map_err(|e| io::Error::other(format!("loading the BPF receive path: {e}")))?;
        rustix::net::listen(&socket, LISTEN_BACKLOG)?;
        let listener = TcpListener::from(socket);
        let opts = match cfg.reply {
            ReplyMode::Loop { .. } => RingOptions {
                entries: 4096,
                cq_entries: 16384,
                sqpoll: None,
                no_mmap: false,
                ..RingOptions::default()
            },
            ReplyMode::ExecutorSqe {
                sqpoll_idle_ms,
                sqpoll_cpu,
                ..
            } => RingOptions {
                entries: 4096,
                cq_entries: 16384,
                sqpoll: Some(SqPoll {
                    idle_ms: sqpoll_idle_ms,
                    cpu: sqpoll_cpu,
                }),
                no_mmap: true,
                ..RingOptions::default()
            },
        };
        let (uring, gpu) = as_ring_owner(ring_owner, || {
            let uring = Uring::new(&opts)?;
            let gpu = if cfg.gpu_sends {
                Some(Arc::new(Self::gpu_ring(&cfg, &opts, &uring)?))
            } else {
                None
            };
            Ok((uring, gpu))
        })?;
        let (shutdown_rx, tx) = UnixStream::pair()?;
        shutdown_rx.set_nonblocking(true)?;
        tx.set_nonblocking(true)?;
        let waker_fd = Arc::new(rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
        )?);
        Ok(KernelTransport {
            cfg,
            listener,
            local_addr,
            rx: Arc::new(rx),
            uring: Arc::new(uring),
            shutdown_rx,
            shutdown_tx: ShutdownHandle::from_stream(tx),
            waker_fd,
            gpu,
            metrics: None,
        })
    }

    /// The send table and the GPU's ring: the same sizes and SQPOLL settings as ours,
    /// attached to our ring's SQPOLL thread, so one kernel thread spins for both.
    fn gpu_ring(cfg: &KernelConfig, opts: &RingOptions, host: &Uring) -> io::Result<GpuTx> {
        let table = Arc::new(TxTable::new(cfg.max_connections)?);
        let (ring, shared_sqpoll) = match Uring::new_attached(opts, host) {
            Ok(ring) => (ring, true),
            Err(e) => {
                tracing::warn!(
                    "io_uring ATTACH_WQ refused ({e}): the GPU's ring gets an SQPOLL thread of its own"
                );
                (Uring::new(opts)?, false)
            }
        };
        if !ring.memory().user_provided || !ring.is_sqpoll() {
            return Err(io::Error::other(
                "the GPU's io_uring ring needs SQPOLL and user-provided memory",
            ));
        }
        Ok(GpuTx {
            ring,
            table,
            shared_sqpoll,
        })
    }

    /// With [`KernelConfig::gpu_sends`]: what the GPU executor needs to send replies itself
    /// (`GpuExecutorConfig::tx`). The addresses stay valid while the transport or an
    /// [`Self::gpu_tx_owner`] handle lives: the caller must stop the executor (which
    /// unregisters this memory from the device and stops touching it) before dropping the
    /// last of them. [`Self::run`] consumes the transport, so hold the owner handle across it.
    pub fn gpu_tx(&self) -> Option<TxDesc> {
        self.gpu.as_ref().map(|g| g.desc())
    }

    /// Keeps the send table and the GPU's ring alive after the transport is gone (see
    /// [`Self::gpu_tx`]).
    pub fn gpu_tx_owner(&self) -> Option<Arc<GpuTx>> {
        self.gpu.clone()
    }

    /// A read-only view of the BPF maps that stays usable while [`Self::run`] serves and
    /// after it returned (tests wait on it for connection state to settle; health checks can
    /// read it). It keeps the BPF programs loaded and attached until it is dropped, so drop it
    /// once the transport has stopped.
    pub fn monitor(&self) -> KernelMonitor {
        KernelMonitor {
            rx: self.rx.clone(),
        }
    }

    /// The rings (they live in the BPF map).
    pub fn region(&self) -> Arc<RingRegion> {
        self.rx.region()
    }

    /// A reader of BPF's counters (a per-CPU map lookup) for other threads, e.g. a metrics
    /// scrape; it keeps the maps alive.
    pub fn bpf_counters(&self) -> Arc<dyn Fn() -> bgs_bpf::KernelCounters + Send + Sync> {
        let rx = self.rx.clone();
        Arc::new(move || rx.counters())
    }

    /// A counter of open connections for other threads: the sockhash's entries (one map walk,
    /// O(connections); BPF's own opened/closed counters miss connections the server closes,
    /// which are forgotten before their TCP_CLOSE).
    pub fn open_connections(&self) -> Arc<dyn Fn() -> usize + Send + Sync> {
        let rx = self.rx.clone();
        Arc::new(move || rx.sockhash_len())
    }

    /// Count answered requests by op and status, and their durations, for a metrics
    /// scrape: the reply stage counts each request's final frame when it encodes it, from the
    /// op and `publish_ns` (BPF's CLOCK_MONOTONIC stamp at publication) that every completion
    /// carries. Rejections and connection markers are not counted, and neither are replies a
    /// GPU executor sends itself (`gpu_sends`: they never reach the stage). The connection
    /// counters of the returned value stay 0 here: [`Self::open_connections`] counts those.
    /// Call before [`Self::run`].
    pub fn enable_metrics(&mut self) -> Arc<RequestMetrics> {
        self.metrics.get_or_insert_default().clone()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// A handle that stops [`run`](Self::run).
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown_tx.clone()
    }

    /// For the executor: called after publishing a completion while the reply thread sleeps
    /// (announced on the completion ring): it writes an eventfd that the reply loop, or the
    /// executor-sqe stage with adaptive submission, waits on. None for executor-sqe with
    /// `sqpoll_above` 0: that stage sleeps on the completion ring's futex alone, so that the
    /// paper's path makes no read/write-family system call (`ring.notify()` is the wake-up).
    pub fn waker(&self) -> Option<Arc<dyn Fn() + Send + Sync>> {
        if let ReplyMode::ExecutorSqe {
            sqpoll_above: 0, ..
        } = self.cfg.reply
        {
            return None;
        }
        let fd = self.waker_fd.clone();
        Some(Arc::new(move || {
            let _ = rustix::io::write(&*fd, &1u64.to_ne_bytes());
        }))
    }

    /// How executor slots sleep: BPF cannot wake the request ring's futex, so it rings a BPF
    /// ring buffer when a consumer announced sleep; a sleeping slot waits on that buffer's
    /// descriptor. One slot at a time drains the doorbell records.
    pub fn executor_wait(&self) -> io::Result<Arc<dyn Fn(Duration) + Send + Sync>> {
        let epoll = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)?;
        rustix::event::epoll::add(
            &epoll,
            self.rx.doorbell_fd(),
            rustix::event::epoll::EventData::new_u64(0),
            rustix::event::epoll::EventFlags::IN,
        )?;
        let rx = self.rx.clone();
        let drain = std::sync::Mutex::new(());
        Ok(Arc::new(move |timeout: Duration| {
            let ts = rustix::event::Timespec {
                tv_sec: timeout.as_secs() as _,
                tv_nsec: timeout.subsec_nanos() as _,
            };
            let mut events = Vec::with_capacity(1);
            if let Ok(n) = rustix::event::epoll::wait(
                &epoll,
                rustix::buffer::spare_capacity(&mut events),
                Some(&ts),
            ) && n > 0
                && let Ok(_g) = drain.try_lock()
            {
                rx.drain_doorbell();
            }
        }))
    }

    /// Serve until shut down.
    pub fn run(self) -> io::Result<KernelStats> {
        match self.cfg.reply {
            ReplyMode::Loop { timer } => self.run_loop(timer),
            ReplyMode::ExecutorSqe {
                watchdog,
                sqpoll_above,
                ..
            } => self.run_executor_sqe(watchdog, sqpoll_above),
        }
    }

    fn stats(&self, driver: &StageDriver, wakeups: u64) -> KernelStats {
        collect_stats(&self.rx, driver, wakeups, self.gpu.as_deref())
    }
}
