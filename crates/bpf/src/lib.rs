//! The kernel transport's eBPF receive path (`docs/bpf.md`).
//!
//! [`KernelRx::load`] loads `src/bpf/rx.bpf.c` (compiled by `build.rs` with clang-19), sizes its
//! maps from a [`KernelRxConfig`], attaches
//!
//! - a `sock_ops` program to the cgroup2 root: connections passively established on the service
//!   port enter a sockhash keyed by their socket cookie and get a reassembly state; TCP state
//!   changes publish EOF / RESET markers into the completion ring;
//! - a verdict-only `sk_skb` program to that sockhash: it frames each connection's bytes with the
//!   exact rules of `docs/protocol.md` and publishes requests, rejections (`OP_REJECT` entries)
//!   and busy completions into the ring region, which lives in a `BPF_F_MMAPABLE` array map
//!   that this crate mmaps and hands out as a [`bgs_ring::RingRegion`].
//!
//! Userspace never reads the connections' sockets: the verdict consumes every byte.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bgs_ring::{RingConfig, RingRegion, SLOT_WORDS};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle};

#[allow(
    clippy::all,
    clippy::undocumented_unsafe_blocks,
    missing_debug_implementations,
    unused_qualifications,
    rust_2018_idioms,
    unsafe_op_in_unsafe_fn,
    dead_code,
    missing_docs
)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/rx.skel.rs"));
}

use skel::RxSkelBuilder;

/// Why the receive path could not be loaded.
#[derive(thiserror::Error, Debug)]
pub enum BpfError {
    /// BPF system calls need root (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON) here.
    #[error("loading the eBPF receive path needs root (effective uid is {0})")]
    NotRoot(u32),
    /// No cgroup2 hierarchy is mounted (the sock_ops program attaches to its root).
    #[error(
        "no cgroup2 file system is mounted (see /proc/mounts); mount one, e.g. `mount -t cgroup2 none /sys/fs/cgroup`"
    )]
    NoCgroup2,
    /// The configuration cannot be served.
    #[error("invalid kernel transport configuration: {0}")]
    Config(String),
    /// A libbpf step failed.
    #[error("{step}: {source}")]
    Libbpf {
        /// What was being done.
        step: &'static str,
        /// libbpf's error.
        #[source]
        source: libbpf_rs::Error,
    },
    /// An OS call failed.
    #[error("{step}: {source}")]
    Os {
        /// What was being done.
        step: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The mapped region could not be initialized as a ring region.
    #[error("ring region: {0}")]
    Ring(#[from] bgs_ring::RingError),
}

fn bpf(step: &'static str) -> impl FnOnce(libbpf_rs::Error) -> BpfError {
    move |source| BpfError::Libbpf { step, source }
}

/// What the receive path serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelRxConfig {
    /// The service's TCP port (the listening socket is the transport's).
    pub listen_port: u16,
    /// Largest request payload in words (at most [`SLOT_WORDS`]).
    pub max_words: u32,
    /// Largest HTTP head in bytes.
    pub max_http_head: u32,
    /// Connections tracked at once (sizes the sockhash and the state map, with slack for
    /// connections that are closing).
    pub max_connections: u32,
    /// Request ring capacity (power of two >= 2).
    pub request_slots: u32,
    /// Completion ring capacity (power of two >= 2).
    pub completion_slots: u32,
}

impl Default for KernelRxConfig {
    fn default() -> Self {
        KernelRxConfig {
            listen_port: 0,
            max_words: bgs_protocol::wire::DEFAULT_MAX_WORDS,
            max_http_head: 8192,
            max_connections: 4096,
            request_slots: DEFAULT_REQUEST_SLOTS,
            completion_slots: DEFAULT_COMPLETION_SLOTS,
        }
    }
}

/// Default request ring capacity of the kernel transport.
pub const DEFAULT_REQUEST_SLOTS: u32 = 1024;
/// Default completion ring capacity of the kernel transport.
pub const DEFAULT_COMPLETION_SLOTS: u32 = 4096;

/// Counter indices of the BPF program (`enum` at the top of `rx.bpf.c`).
mod idx {
    include!("counter_index.rs");
}

/// Word indices of the completion watch's control block (`watch_ctl` in `rx.bpf.c`).
// The words only BPF uses are named here too: the header BPF includes is generated from this
// file, and the loader's words are checked against the same list.
#[allow(dead_code)]
mod watch {
    include!("watch_index.rs");
}

/// HTTP codes counted by [`KernelCounters::rejects_by_http`], in order (then "other").
pub const COUNTED_HTTP_CODES: [u16; 6] = [400, 404, 405, 411, 413, 431];

/// The receive path's counters, summed over CPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct KernelCounters {
    /// Items framed (requests and rejections).
    pub frames: u64,
    /// Valid requests published into the request ring.
    pub requests: u64,
    /// Rejections published into the request ring (`OP_REJECT`).
    pub rejects: u64,
    /// Rejections answered straight into the completion ring (request ring full).
    pub rejects_direct: u64,
    /// Busy completions (request ring full).
    pub busy: u64,
    /// Items lost because both rings were full (the connection failed).
    pub completion_ring_full: u64,
    /// Connections that entered the sockhash.
    pub conns_opened: u64,
    /// Connections whose state was removed at TCP_CLOSE.
    pub conns_closed: u64,
    /// Connections refused (state map or sockhash full).
    pub conns_refused: u64,
    /// EOF markers published.
    pub eof_markers: u64,
    /// RESET markers published.
    pub reset_markers: u64,
    /// Bytes seen by the verdict program.
    pub bytes: u64,
    /// Bytes dropped after a closing item or a failure.
    pub dropped_bytes: u64,
    /// skbs of sockets without state (forgotten connections).
    pub no_state: u64,
    /// Doorbell records written.
    pub doorbells: u64,
    /// EOF/RESET markers that found the completion ring full.
    pub marker_failed: u64,
    /// Ring claims that gave up after many lost CAS races (counted as full).
    pub claim_contended: u64,
    /// Helper failures (should stay 0).
    pub internal: u64,
    /// Completion watch ([`KernelRx::start_completion_watch`]): looks scheduled for a request
    /// published while the reply loop slept.
    pub watch_arms: u64,
    /// Looks that found a completion and rang the doorbell.
    pub watch_rings: u64,
    /// Looks that found none.
    pub watch_misses: u64,
    /// Requests published while a look was already scheduled (it covers them).
    pub watch_covered: u64,
    /// Rejections by frame status (index = status; 0 = HTTP error without a frame).
    pub rejects_by_status: Vec<(u16, u64)>,
    /// Rejections by HTTP code ([`COUNTED_HTTP_CODES`], 0 for any other).
    pub rejects_by_http: Vec<(u16, u64)>,
}

impl KernelCounters {
    fn from_sums(v: &[u64; idx::NUM]) -> Self {
        let rejects_by_status = (0..32)
            .filter(|&s| v[idx::STATUS_BASE + s] != 0)
            .map(|s| (s as u16, v[idx::STATUS_BASE + s]))
            .collect();
        let rejects_by_http = (0..7)
            .filter(|&i| v[idx::HTTP_BASE + i] != 0)
            .map(|i| {
                (
                    COUNTED_HTTP_CODES.get(i).copied().unwrap_or(0),
                    v[idx::HTTP_BASE + i],
                )
            })
            .collect();
        KernelCounters {
            frames: v[idx::FRAMES],
            requests: v[idx::REQUESTS],
            rejects: v[idx::REJECTS],
            rejects_direct: v[idx::REJECTS_DIRECT],
            busy: v[idx::BUSY],
            completion_ring_full: v[idx::COMP_FULL],
            conns_opened: v[idx::CONN_OPENED],
            conns_closed: v[idx::CONN_CLOSED],
            conns_refused: v[idx::CONN_REFUSED],
            eof_markers: v[idx::EOF],
            reset_markers: v[idx::RESET],
            bytes: v[idx::BYTES],
            dropped_bytes: v[idx::DROPPED_BYTES],
            no_state: v[idx::NO_STATE],
            doorbells: v[idx::DOORBELLS],
            marker_failed: v[idx::MARKER_FAILED],
            claim_contended: v[idx::CLAIM_CONTENDED],
            internal: v[idx::INTERNAL],
            watch_arms: v[idx::WATCH_ARMS],
            watch_rings: v[idx::WATCH_RINGS],
            watch_misses: v[idx::WATCH_MISSES],
            watch_covered: v[idx::WATCH_COVERED],
            rejects_by_status,
            rejects_by_http,
        }
    }
}

impl fmt::Display for KernelCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "bpf rx: frames {} requests {} rejects {} (direct {}) busy {} comp-full {} | conns opened {} closed {} refused {} | eof {} reset {} | bytes {} dropped {} no-state {} | doorbells {} marker-failed {} contended {} internal {}",
            self.frames,
            self.requests,
            self.rejects,
            self.rejects_direct,
            self.busy,
            self.completion_ring_full,
            self.conns_opened,
            self.conns_closed,
            self.conns_refused,
            self.eof_markers,
            self.reset_markers,
            self.bytes,
            self.dropped_bytes,
            self.no_state,
            self.doorbells,
            self.marker_failed,
            self.claim_contended,
            self.internal,
        )?;
        if self.watch_arms + self.watch_covered > 0 {
            write!(
                f,
                " | watch arms {} rings {} misses {} covered {}",
                self.watch_arms, self.watch_rings, self.watch_misses, self.watch_covered
            )?;
        }
        if !self.rejects_by_status.is_empty() {
            write!(f, " | by status")?;
            for (s, n) in &self.rejects_by_status {
                write!(f, " {s}:{n}")?;
            }
        }
        if !self.rejects_by_http.is_empty() {
            write!(f, " | by http")?;
            for (c, n) in &self.rejects_by_http {
                write!(f, " {c}:{n}")?;
            }
        }
        Ok(())
    }
}

/// A shared mapping that is unmapped on drop.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a plain shared mapping; the pointer is only used for atomics (doorbell positions),
// through `RingRegion` (which is Send + Sync), and to unmap.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(fd: BorrowedFd<'_>, len: usize, offset: u64, writable: bool) -> std::io::Result<Self> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of a BPF map fd at an address the kernel chooses; it
        // aliases no Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: NonNull::new(p.cast()).ok_or_else(std::io::Error::last_os_error)?,
            len,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we mapped exactly this range and nothing uses it any more (owners drop the
        // users first).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The consumer side of the doorbell ring buffer (records are only wake-up signals).
#[derive(Debug)]
struct Doorbell {
    /// Page 0 of the ringbuf map: the consumer position (writable).
    cons: Mapping,
    /// The producer page and the data pages (mapped twice by the kernel), read-only.
    prod: Mapping,
    /// Data size (a power of two).
    size: usize,
}

const PAGE: usize = 4096;
/// Ringbuf record header flags (`BPF_RINGBUF_BUSY_BIT`, `BPF_RINGBUF_DISCARD_BIT`).
const RINGBUF_BUSY: u32 = 1 << 31;
const RINGBUF_DISCARD: u32 = 1 << 30;
const RINGBUF_HDR: usize = 8;

impl Doorbell {
    fn new(fd: BorrowedFd<'_>, size: usize) -> std::io::Result<Self> {
        let cons = Mapping::new(fd, PAGE, 0, true)?;
        let prod = Mapping::new(fd, PAGE + 2 * size, PAGE as u64, false)?;
        Ok(Doorbell { cons, prod, size })
    }

    fn cons_pos(&self) -> &AtomicU64 {
        // SAFETY: the consumer page is mapped read-write and 8-aligned; the kernel reads it
        // concurrently, so it is only accessed atomically.
        unsafe { &*self.cons.ptr.as_ptr().cast::<AtomicU64>() }
    }

    fn prod_pos(&self) -> &AtomicU64 {
        // SAFETY: as above, the producer position at the start of the read-only mapping.
        unsafe { &*self.prod.ptr.as_ptr().cast::<AtomicU64>() }
    }

    /// Consume every committed record; returns how many there were.
    fn drain(&self) -> usize {
        let mut n = 0;
        let mut cons = self.cons_pos().load(Ordering::Acquire);
        loop {
            let prod = self.prod_pos().load(Ordering::Acquire);
            if cons >= prod {
                break;
            }
            let off = PAGE + (cons as usize & (self.size - 1));
            // SAFETY: `off + 8` lies within the data area (mapped twice, so a header at the
            // end does not wrap); the header's length word is written by the kernel with
            // release semantics on commit, read here with acquire.
            let hdr = unsafe {
                (*self
                    .prod
                    .ptr
                    .as_ptr()
                    .add(off)
                    .cast::<core::sync::atomic::AtomicU32>())
                .load(Ordering::Acquire)
            };
            if hdr & RINGBUF_BUSY != 0 {
                break;
            }
            let len = (hdr & !(RINGBUF_BUSY | RINGBUF_DISCARD)) as usize;
            cons += (len + RINGBUF_HDR).next_multiple_of(8) as u64;
            n += 1;
            self.cons_pos().store(cons, Ordering::Release);
        }
        n
    }
}

/// The completion watch's control block: `watch::NUM` words of the mmapable `watch_ctl` map,
/// shared with BPF (which reads the loader's words and writes its own; `watch_index.rs`).
#[derive(Debug)]
struct WatchCtl {
    map: Mapping,
}

impl WatchCtl {
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < watch::NUM);
        // SAFETY: the mapping is one page, page aligned, holding the map's value (NUM u64
        // words, NUM * 8 <= 4096); BPF accesses the words concurrently, so they are only
        // accessed atomically here.
        unsafe { &*self.map.ptr.as_ptr().cast::<AtomicU64>().add(i) }
    }
}

/// The loaded and attached receive path. Dropping it detaches everything.
pub struct KernelRx {
    cfg: KernelRxConfig,
    region: Arc<RingRegion>,
    sockops_link: Option<Link>,
    verdict_prog: OwnedFd,
    sockhash: MapHandle,
    conn_states: MapHandle,
    counters: MapHandle,
    failed: MapHandle,
    doorbell_map: MapHandle,
    _ring_map: MapHandle,
    _side_map: MapHandle,
    doorbell: Doorbell,
    watch: WatchCtl,
    _watch_map: MapHandle,
    _watch_timer: MapHandle,
    /// BPF's own completions (busy, direct rejections, EOF/RESET markers); its request ring
    /// is unused.
    side: Arc<RingRegion>,
    /// Must outlive `region` (declared after it, so dropped after it).
    _ring_mapping: Mapping,
    /// Must outlive `side`.
    _side_mapping: Mapping,
}

impl fmt::Debug for KernelRx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelRx")
            .field("cfg", &self.cfg)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

/// Where cgroup2 is mounted (the first `cgroup2` line of /proc/mounts).
fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        let (_src, dir, fstype) = (it.next()?, it.next()?, it.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(dir.replace("\\040", " ")))
    })
}

fn map_handle(m: &libbpf_rs::MapMut<'_>, step: &'static str) -> Result<MapHandle, BpfError> {
    MapHandle::try_from(m).map_err(bpf(step))
}

impl KernelRx {
    /// Load the programs, size the maps, map the ring region and attach: sock_ops to the
    /// cgroup2 root, the verdict to the sockhash.
    pub fn load(cfg: &KernelRxConfig) -> Result<KernelRx, BpfError> {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 {
            return Err(BpfError::NotRoot(euid));
        }
        if cfg.max_words as usize > SLOT_WORDS {
            return Err(BpfError::Config(format!(
                "max_words {} exceeds the ring slot size ({SLOT_WORDS} words)",
                cfg.max_words
            )));
        }
        if cfg.max_http_head == 0 || cfg.max_connections == 0 {
            return Err(BpfError::Config(
                "max_http_head and max_connections must be positive".into(),
            ));
        }
        let ring_cfg = RingConfig {
            request_slots: cfg.request_slots,
            completion_slots: cfg.completion_slots,
        };
        let size = RingRegion::size_for(&ring_cfg);
        if size == 0 {
            return Err(BpfError::Config(format!(
                "ring capacities {}/{} must be powers of two >= 2",
                cfg.request_slots, cfg.completion_slots
            )));
        }
        let value_size = u32::try_from(size)
            .map_err(|_| BpfError::Config(format!("ring region of {size} bytes is too large")))?;
        // The side region: BPF's own completions. Its request ring is never used.
        let side_cfg = RingConfig {
            request_slots: 2,
            completion_slots: cfg.completion_slots,
        };
        let side_size = RingRegion::size_for(&side_cfg);
        let side_value_size = u32::try_from(side_size).map_err(|_| {
            BpfError::Config(format!("side region of {side_size} bytes is too large"))
        })?;
        let comp_off = RingRegion::completion_offset_for(&side_cfg);
        let main_comp_off = RingRegion::completion_offset_for(&ring_cfg);
        let cgroup = cgroup2_root().ok_or(BpfError::NoCgroup2)?;
        // Closing sockets keep their entries until TCP_CLOSE: leave room for them.
        let entries = cfg.max_connections.saturating_mul(2).saturating_add(256);

        let mut storage = std::mem::MaybeUninit::uninit();
        let mut open = RxSkelBuilder::default()
            .open(&mut storage)
            .map_err(bpf("opening the BPF object"))?;
        {
            let ro = open
                .maps
                .rodata_data
                .as_deref_mut()
                .ok_or_else(|| BpfError::Config("BPF object has no .rodata".into()))?;
            ro.cfg_port = u32::from(cfg.listen_port);
            ro.cfg_max_words = cfg.max_words;
            ro.cfg_max_head = cfg.max_http_head;
            ro.cfg_req_mask = u64::from(cfg.request_slots - 1);
            ro.cfg_comp_mask = u64::from(cfg.completion_slots - 1);
            ro.cfg_comp_off = comp_off as u64;
            ro.cfg_main_comp_off = main_comp_off as u64;
        }
        open.maps
            .ring_map
            .set_value_size(value_size)
            .map_err(bpf("sizing the ring map"))?;
        open.maps
            .side_map
            .set_value_size(side_value_size)
            .map_err(bpf("sizing the side ring map"))?;
        open.maps
            .sockhash
            .set_max_entries(entries)
            .map_err(bpf("sizing the sockhash"))?;
        open.maps
            .conn_states
            .set_max_entries(entries)
            .map_err(bpf("sizing the connection state map"))?;
        let skel = open.load().map_err(|e| BpfError::Libbpf {
            step: if value_size > 4 << 20 {
                "loading the BPF object (a ring region above 4 MiB may not fit one map value: try fewer slots)"
            } else {
                "loading the BPF object (see the verifier log above)"
            },
            source: e,
        })?;

        let ring_map = map_handle(&skel.maps.ring_map, "ring map fd")?;
        let side_map = map_handle(&skel.maps.side_map, "side ring map fd")?;
        let sockhash = map_handle(&skel.maps.sockhash, "sockhash fd")?;
        let conn_states = map_handle(&skel.maps.conn_states, "state map fd")?;
        let counters = map_handle(&skel.maps.counters, "counters fd")?;
        let failed = map_handle(&skel.maps.failed_conns, "failed map fd")?;
        let doorbell_map = map_handle(&skel.maps.doorbell, "doorbell fd")?;
        let doorbell_size = doorbell_map.max_entries() as usize;
        let watch_map = map_handle(&skel.maps.watch_ctl, "watch control fd")?;
        // Held for the transport's lifetime: the kernel arms timers only in maps that user
        // space holds (bpf_timer_init answers -EPERM once the last user reference is gone).
        let watch_timer = map_handle(&skel.maps.watch_timer, "watch timer fd")?;

        let ring_mapping =
            Mapping::new(ring_map.as_fd(), size, 0, true).map_err(|source| BpfError::Os {
                step: "mmap of the ring map",
                source,
            })?;
        // SAFETY: the mapping is `size` bytes, page aligned, and lives as long as the region
        // (`_ring_mapping` is dropped after `region`, and every clone of the Arc handed out
        // keeps... see `region()`); the BPF programs are not attached yet, so nobody uses it.
        let region =
            unsafe { RingRegion::init_external(ring_mapping.ptr.as_ptr(), size, ring_cfg) }?;
        let side_mapping =
            Mapping::new(side_map.as_fd(), side_size, 0, true).map_err(|source| BpfError::Os {
                step: "mmap of the side ring map",
                source,
            })?;
        // SAFETY: as for the ring mapping above (`_side_mapping` outlives `side`).
        let side =
            unsafe { RingRegion::init_external(side_mapping.ptr.as_ptr(), side_size, side_cfg) }?;
        let doorbell =
            Doorbell::new(doorbell_map.as_fd(), doorbell_size).map_err(|source| BpfError::Os {
                step: "mmap of the doorbell ring buffer",
                source,
            })?;

        let watch = WatchCtl {
            map: Mapping::new(watch_map.as_fd(), PAGE, 0, true).map_err(|source| BpfError::Os {
                step: "mmap of the completion watch's control block",
                source,
            })?,
        };
        let verdict_prog = skel
            .progs
            .bgs_verdict
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| BpfError::Os {
                step: "verdict program fd",
                source,
            })?;
        skel.progs
            .bgs_verdict
            .attach_sockmap(sockhash.as_fd().as_raw_fd())
            .map_err(bpf("attaching the verdict program to the sockhash"))?;
        let cg = std::fs::File::open(&cgroup).map_err(|source| BpfError::Os {
            step: "opening the cgroup2 root",
            source,
        })?;
        let link = skel
            .progs
            .bgs_sockops
            .attach_cgroup(cg.as_raw_fd())
            .map_err(bpf("attaching sock_ops to the cgroup2 root"))?;
        drop(skel);

        Ok(KernelRx {
            cfg: *cfg,
            region: Arc::new(region),
            sockops_link: Some(link),
            verdict_prog,
            sockhash,
            conn_states,
            counters,
            failed,
            doorbell_map,
            _ring_map: ring_map,
            _side_map: side_map,
            doorbell,
            watch,
            _watch_map: watch_map,
            _watch_timer: watch_timer,
            side: Arc::new(side),
            _ring_mapping: ring_mapping,
            _side_mapping: side_mapping,
        })
    }

    /// The configuration it was loaded with.
    pub fn config(&self) -> &KernelRxConfig {
        &self.cfg
    }

    /// The rings living in the mmapable map.
    ///
    /// The memory stays mapped as long as this `KernelRx` lives: drop every clone of the
    /// region before dropping the `KernelRx` (a clone that outlives it would point at unmapped
    /// memory; `Drop` checks this and leaks the mapping rather than unmapping it under a user).
    pub fn region(&self) -> Arc<RingRegion> {
        self.region.clone()
    }

    /// The side region whose completion ring carries what BPF answers itself: busy answers,
    /// rejections that found the request ring full, and EOF / RESET markers. The reply path
    /// consumes it next to the executor's completion ring (`conn_seq` orders the two). Same
    /// lifetime rule as [`KernelRx::region`].
    pub fn side_region(&self) -> Arc<RingRegion> {
        self.side.clone()
    }

    /// The doorbell ring buffer's fd: readable (EPOLLIN) when BPF rang after publishing while a
    /// consumer announced itself in `request_waiters` / `completion_waiters`, or when a
    /// connection failed. Call [`KernelRx::drain_doorbell`] after waking.
    pub fn doorbell_fd(&self) -> BorrowedFd<'_> {
        self.doorbell_map.as_fd()
    }

    /// Consume pending doorbell records (returns how many).
    pub fn drain_doorbell(&self) -> usize {
        self.doorbell.drain()
    }

    /// Turn on the completion watch for a reply loop whose executor cannot wake it (the GPU):
    /// while the loop is announced in `request_waiters`, BPF no longer rings the doorbell when
    /// it publishes a request; it looks at the completion ring `first` after the publish
    /// (learned from then on) and every gap up to `max` after that, and rings when a
    /// completion is there. The loop must keep [`KernelRx::watch_answered`] current.
    pub fn start_completion_watch(&self, first: Duration, max: Duration) {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.watch
            .word(watch::MAX_NS)
            .store(ns(max), Ordering::Relaxed);
        self.watch
            .word(watch::FIRST_NS)
            .store(ns(first.min(max)), Ordering::Relaxed);
        self.watch.word(watch::ON).store(1, Ordering::SeqCst);
    }

    /// Tell the watch how many request-ring entries have been answered (it stops looking when
    /// the ring's tail reaches this).
    pub fn watch_answered(&self, answered: u64) {
        self.watch
            .word(watch::ANSWERED)
            .store(answered, Ordering::SeqCst);
    }

    /// Whether a look is scheduled: it keeps looking, as long as the loop is announced as a
    /// sleeper and requests are unanswered, until a completion is there. Read after the loop
    /// announced itself (`request_waiters`); false means the loop needs its own timer.
    pub fn watch_scheduled(&self) -> bool {
        self.watch.word(watch::ARMED).load(Ordering::SeqCst) != 0
    }

    /// Counters summed over CPUs.
    pub fn counters(&self) -> KernelCounters {
        let mut sums = [0u64; idx::NUM];
        if let Ok(Some(per_cpu)) = self
            .counters
            .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
        {
            for cpu in per_cpu {
                for (i, chunk) in cpu.chunks_exact(8).take(idx::NUM).enumerate() {
                    sums[i] += u64::from_ne_bytes(chunk.try_into().expect("8 bytes"));
                }
            }
        }
        KernelCounters::from_sums(&sums)
    }

    /// Entries currently in the sockhash.
    pub fn sockhash_len(&self) -> usize {
        self.sockhash.keys().count()
    }

    /// Per-connection state entries.
    pub fn conn_states_len(&self) -> usize {
        self.conn_states.keys().count()
    }

    /// Whether BPF tracks connection `cookie`: it took it into the sockhash at its handshake
    /// and it has neither reached TCP_CLOSE nor been forgotten. A connection that is still
    /// open but not tracked was refused at its handshake (the maps were full): BPF will never
    /// frame its bytes.
    pub fn tracks(&self, cookie: u64) -> bool {
        matches!(
            self.conn_states
                .lookup(&cookie.to_ne_bytes(), MapFlags::ANY),
            Ok(Some(_))
        )
    }

    /// The server closed this connection: delete its state (idempotent). Call it before
    /// closing the socket, so that its TCP_CLOSE publishes no RESET marker.
    pub fn forget_connection(&self, cookie: u64) {
        let _ = self.conn_states.delete(&cookie.to_ne_bytes());
        let _ = self.failed.delete(&cookie.to_ne_bytes());
    }

    /// Connections that lost an item because the request and completion rings were both full
    /// (they also get a RESET marker once the completion ring has room). Drains the list.
    pub fn take_failed_connections(&self) -> Vec<u64> {
        let keys: Vec<Vec<u8>> = self.failed.keys().collect();
        keys.into_iter()
            .filter_map(|k| {
                let _ = self.failed.delete(&k);
                Some(u64::from_ne_bytes(k.as_slice().try_into().ok()?))
            })
            .collect()
    }
}

impl Drop for KernelRx {
    fn drop(&mut self) {
        // Stop new connections from entering, then detach the verdict.
        drop(self.sockops_link.take());
        // SAFETY: plain bpf(BPF_PROG_DETACH) on fds we own.
        unsafe {
            libbpf_rs::libbpf_sys::bpf_prog_detach2(
                self.verdict_prog.as_raw_fd(),
                self.sockhash.as_fd().as_raw_fd(),
                libbpf_rs::libbpf_sys::BPF_SK_SKB_VERDICT,
            );
        }
        if Arc::strong_count(&self.side) != 1 {
            let m = std::mem::replace(
                &mut self._side_mapping,
                Mapping {
                    ptr: NonNull::dangling(),
                    len: 0,
                },
            );
            std::mem::forget(m);
        }
        if Arc::strong_count(&self.region) != 1 {
            // Someone still holds the region: keep the memory mapped (leak) rather than
            // unmapping it under them.
            let m = std::mem::replace(
                &mut self._ring_mapping,
                Mapping {
                    ptr: NonNull::dangling(),
                    len: 0,
                },
            );
            std::mem::forget(m);
        }
    }
}

/// `SO_COOKIE` of a socket: the key of its connection in the BPF maps and the `conn` of its
/// ring entries.
pub fn socket_cookie(fd: BorrowedFd<'_>) -> std::io::Result<u64> {
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

// The transport shares one `KernelRx` between its threads.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<KernelRx>();
};
