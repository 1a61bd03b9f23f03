//! A small, low-level io_uring ring for the kernel transport's reply paths.
//!
//! * [`Uring::new`] sets up a plain ring or an SQPOLL ring, with kernel-allocated ring memory (the
//!   usual `mmap`s of the ring fd) or with memory this crate allocates and hands to the kernel
//!   (`IORING_SETUP_NO_MMAP`), so that a producer that is not a Linux thread (a GPU) can be given
//!   the SQE array and the SQ tail later ([`Uring::memory`]).
//! * [`SubmissionQueue::push`] and [`CompletionQueue::pop`] make no system calls: with SQPOLL, a
//!   thread that never enters the kernel can submit I/O; the kernel's SQPOLL thread picks the
//!   entries up. When that thread has gone to sleep ([`Uring::needs_wakeup`]), someone must call
//!   [`Uring::wake_sqpoll`] (on Linux 6.18 it sleeps ~2 ms after setup regardless of
//!   `sq_thread_idle`, and again after every idle period).
//! * [`sqe`](crate::send) builders for the few opcodes the transport uses.
//!
//! # Concurrency
//! * One producer: [`Uring::sq`] hands out the only [`SubmissionQueue`] (a second call while one
//!   is alive panics; [`Uring::try_sq`] returns `None` instead). Same for the consumer side and
//!   [`Uring::cq`] / [`Uring::try_cq`]. The guards can move between threads.
//! * Everything else on `&Uring` ([`Uring::enter`], [`Uring::needs_wakeup`],
//!   [`Uring::wake_sqpoll`], the counters) only does atomic loads of kernel-shared words or
//!   system calls, so `Uring` is `Send + Sync`: a writer thread holding the `SubmissionQueue` and
//!   a watchdog thread calling `needs_wakeup`/`wake_sqpoll` can share it by reference.
//!
//! # Layout of the ring memory (for a producer outside this crate, e.g. a GPU)
//! See [`RingMemory`].
//!
//! # Kernel notes (Linux 6.18, checked by the tests)
//! * `IORING_SETUP_NO_MMAP` accepts ordinary, non-contiguous 4 KiB pages for both regions (the
//!   kernel pins and `vmap`s them): no huge page is needed, up to the largest ring (32768 SQEs =
//!   2 MiB, 65536 CQEs ≈ 1 MiB). (Per their source, 6.5–6.12 wanted one folio above one page;
//!   not tested here.)
//! * `IORING_SETUP_NO_SQARRAY` is used whenever the kernel accepts it (6.6+), falling back to an
//!   identity-filled SQ index array otherwise.
//! * SENDs on one stream socket complete in submission order only while none finds the socket
//!   buffer full: one that gets `EAGAIN` is parked on poll and can be overtaken by later ones.
//!   Keep one SEND in flight per connection, chain them with `IOSQE_IO_LINK`, or size the send
//!   buffer so it never fills. A SEND may also complete short; `MSG_WAITALL`
//!   ([`send_with_flags`]) makes the kernel finish it.
//! * The SQPOLL thread sleeps about 2 ms after setup whatever `sq_thread_idle` says, and after
//!   every idle period; nothing pushed is seen until [`Uring::wake_sqpoll`] (or an
//!   [`Uring::enter`], which wakes it when needed).
//! * `IORING_SETUP_ATTACH_WQ` ([`Uring::new_attached`]) between two SQPOLL rings of one process
//!   gives one kernel thread for both (no second thread appears in `/proc/self/task`); when it
//!   sleeps it sets `IORING_SQ_NEED_WAKEUP` in both rings, a wake-up through either ring serves
//!   both, and it keeps running for the attached ring after the first ring is closed
//!   (`tests/attach.rs`).

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::ptr::{NonNull, null_mut};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
use std::time::Duration;

use rustix::io::Errno;
use rustix::io_uring::{
    IORING_OFF_SQ_RING, IORING_OFF_SQES, IoringCqeFlags, IoringEnterFlags, IoringFeatureFlags,
    IoringSetupFlags, IoringSqFlags, Timespec, io_uring_cqe, io_uring_getevents_arg,
    io_uring_params, io_uring_ptr, io_uring_sqe,
};
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

mod sqe;
pub use sqe::{
    Sqe, accept_multishot, cancel, close, futex_wait, futex_wake, nop, poll_readable,
    poll_readable_multishot, read, send, send_with_flags, shutdown, timeout,
};

/// The rustix io_uring bindings this crate is built on (flags, opcodes, raw structs).
pub use rustix::io_uring as sys;

/// `IORING_MAX_ENTRIES`: the largest SQ size the kernel accepts without `IORING_SETUP_CLAMP`.
pub const MAX_SQ_ENTRIES: u32 = 32768;
/// `IORING_MAX_CQ_ENTRIES`.
pub const MAX_CQ_ENTRIES: u32 = 2 * MAX_SQ_ENTRIES;

const SQE_SIZE: usize = size_of::<io_uring_sqe>();
const CQE_SIZE: usize = size_of::<io_uring_cqe>();
/// Upper bound for the kernel's `struct io_rings` header before the CQE array (about 320 bytes
/// on 6.18: SQ and CQ head/tail each on their own cache line, masks, counters, flags).
const RINGS_HEADER_SLACK: usize = 4096;

const _: () = assert!(SQE_SIZE == 64 && CQE_SIZE == 16);

/// Setup flags a caller may add through [`RingOptions::setup_flags`]. Flags that change entry
/// sizes (`SQE128`, `CQE32`), counts (`CLAMP`) or fd semantics are not accepted.
const ALLOWED_EXTRA_FLAGS: IoringSetupFlags = IoringSetupFlags::SINGLE_ISSUER
    .union(IoringSetupFlags::DEFER_TASKRUN)
    .union(IoringSetupFlags::COOP_TASKRUN)
    .union(IoringSetupFlags::TASKRUN_FLAG)
    .union(IoringSetupFlags::SUBMIT_ALL);

/// How to build a [`Uring`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingOptions {
    /// SQ entries; rounded up to a power of two by the kernel; 1..=32768.
    pub entries: u32,
    /// CQ entries (`IORING_SETUP_CQSIZE`); 0 means the kernel default, 2 × SQ entries. Must be
    /// at least `entries` and at most 65536; rounded up to a power of two.
    pub cq_entries: u32,
    /// Run a kernel SQPOLL thread that submits what is pushed, with no `io_uring_enter`.
    pub sqpoll: Option<SqPoll>,
    /// Ring and SQE memory allocated by this crate (anonymous mmap) and passed to the kernel
    /// (`IORING_SETUP_NO_MMAP`, Linux 6.5+) instead of mapped from the ring fd.
    pub no_mmap: bool,
    /// Extra `IORING_SETUP_*` flags: only `SINGLE_ISSUER`, `DEFER_TASKRUN` (not with SQPOLL;
    /// then only the thread that called [`Uring::new`] may [`enter`](Uring::enter)),
    /// `COOP_TASKRUN`, `TASKRUN_FLAG`, `SUBMIT_ALL`.
    pub setup_flags: IoringSetupFlags,
}

impl Default for RingOptions {
    fn default() -> Self {
        RingOptions {
            entries: 256,
            cq_entries: 0,
            sqpoll: None,
            no_mmap: false,
            setup_flags: IoringSetupFlags::empty(),
        }
    }
}

/// SQPOLL settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqPoll {
    /// `sq_thread_idle`: how long the SQPOLL thread spins without work before it sleeps, in ms.
    pub idle_ms: u32,
    /// Pin the SQPOLL thread to this CPU (`IORING_SETUP_SQ_AFF`).
    pub cpu: Option<u32>,
}

/// [`SubmissionQueue::push`] found the SQ full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueFull;

impl fmt::Display for QueueFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("io_uring submission queue is full")
    }
}

impl std::error::Error for QueueFull {}

/// A completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    /// The `user_data` of the SQE this completes.
    pub user_data: u64,
    /// The result: a byte count, fd, etc., or `-errno`.
    pub res: i32,
    /// `IORING_CQE_F_*`.
    pub flags: u32,
}

impl Cqe {
    /// `IORING_CQE_F_MORE`: the (multishot) request stays armed and will post more CQEs.
    pub fn more(&self) -> bool {
        self.flags & IoringCqeFlags::MORE.bits() != 0
    }

    /// `res` as a result: `Ok(res)` when non-negative, else the errno.
    pub fn result(&self) -> io::Result<u32> {
        if self.res >= 0 {
            Ok(self.res as u32)
        } else {
            Err(io::Error::from_raw_os_error(-self.res))
        }
    }
}

/// Raw addresses and offsets of a ring's memory, for a producer or consumer outside this crate
/// (a GPU writing SQEs; a BPF/C view). All offsets are in bytes from the start of their region
/// and come from the kernel (`io_uring_params.sq_off` / `cq_off`).
///
/// Two regions:
/// * **rings** (`rings`, `rings_len`): the kernel's `struct io_rings`. `u32` words at
///   `sq_head`, `sq_tail`, `sq_flags`, `sq_dropped`, `cq_head`, `cq_tail`, `cq_overflow`; the CQE
///   array (`cq_entries` × 16 bytes: `u64 user_data, i32 res, u32 flags`) at `cqes`; with
///   `sq_array == None` (`IORING_SETUP_NO_SQARRAY`, used whenever the kernel has it) there is no SQ
///   index array and SQE slot `tail & sq_mask` is consumed directly; otherwise the `u32` index
///   array at `sq_array` has been pre-filled with the identity (`array[i] = i`) and must stay so.
/// * **sqes** (`sqes`, `sqes_len`): `sq_entries` × 64-byte `struct io_uring_sqe`.
///
/// Protocol for a producer (exactly one at a time: do not write while a [`SubmissionQueue`] is
/// in use): read `sq_head` with acquire; if `tail - head < sq_entries` write the 64-byte SQE into
/// slot `tail & sq_mask`, then store `tail + 1` to `sq_tail` with release (system scope, e.g.
/// `st.release.sys` on a GPU); then, if SQPOLL sleeps (`sq_flags & IORING_SQ_NEED_WAKEUP`, read
/// after a full fence), have a CPU thread call [`Uring::wake_sqpoll`]. The producer's own tail is
/// the value in `sq_tail` (nobody else writes it). Consumer: read `cq_tail` with acquire, read
/// entries `cq_head & cq_mask ..`, store the new `cq_head` with release.
///
/// With `user_provided` (NO_MMAP) both regions are anonymous private mappings made by this crate,
/// page-aligned, pinned by the kernel for the life of the ring (so they can also be registered
/// with a device, e.g. `cuMemHostRegister`). Otherwise they are shared mappings of the ring fd.
/// The pointers are valid while the [`Uring`] lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingMemory {
    /// Start of the rings region.
    pub rings: *mut u8,
    /// Length of the rings region in bytes (what the kernel uses of it, rounded to pages).
    pub rings_len: usize,
    /// Start of the SQE array.
    pub sqes: *mut u8,
    /// Length of the SQE region in bytes.
    pub sqes_len: usize,
    /// Whether the memory was allocated by this crate (`IORING_SETUP_NO_MMAP`).
    pub user_provided: bool,
    /// SQ size (power of two).
    pub sq_entries: u32,
    /// `sq_entries - 1`.
    pub sq_mask: u32,
    /// CQ size (power of two).
    pub cq_entries: u32,
    /// `cq_entries - 1`.
    pub cq_mask: u32,
    /// Offset of the SQ head (`u32`, written by the kernel).
    pub sq_head: u32,
    /// Offset of the SQ tail (`u32`, written by the producer).
    pub sq_tail: u32,
    /// Offset of the SQ flags (`u32`, `IORING_SQ_NEED_WAKEUP` = 1, `IORING_SQ_CQ_OVERFLOW` = 2).
    pub sq_flags: u32,
    /// Offset of the dropped-SQE counter (`u32`).
    pub sq_dropped: u32,
    /// Offset of the SQ index array, if the ring has one.
    pub sq_array: Option<u32>,
    /// Offset of the CQ head (`u32`, written by the consumer).
    pub cq_head: u32,
    /// Offset of the CQ tail (`u32`, written by the kernel).
    pub cq_tail: u32,
    /// Offset of the CQ overflow counter (`u32`).
    pub cq_overflow: u32,
    /// Offset of the CQE array.
    pub cqes: u32,
}

/// An owned memory mapping, unmapped on drop.
struct Region {
    ptr: NonNull<u8>,
    /// The whole mapping, including a guard page for user-provided regions.
    map_len: usize,
}

impl Region {
    /// A private anonymous read-write mapping of `len` bytes (a multiple of the page size),
    /// followed by one `PROT_NONE` guard page: if the kernel ever derived a larger size than we
    /// allocated, pinning would fail with `EFAULT` instead of pinning whatever is mapped next.
    fn anonymous(len: usize) -> io::Result<Region> {
        let page = rustix::param::page_size();
        let map_len = len + page;
        // SAFETY: a fresh mapping at an address of the kernel's choosing; it aliases nothing.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }?;
        let region = Region {
            ptr: NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?,
            map_len,
        };
        // SAFETY: the last page lies inside the mapping just made, which nothing else uses.
        unsafe {
            rustix::mm::mprotect(
                ptr.cast::<u8>().wrapping_add(len).cast(),
                page,
                MprotectFlags::empty(),
            )
        }?;
        Ok(region)
    }

    /// A shared mapping of `len` bytes of the ring fd at `offset` (`IORING_OFF_*`).
    fn ring_fd(fd: BorrowedFd<'_>, len: usize, offset: u64) -> io::Result<Region> {
        // SAFETY: a fresh mapping at an address of the kernel's choosing of memory the kernel
        // owns for this ring; it aliases no Rust object.
        let ptr = unsafe {
            rustix::mm::mmap(
                null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::POPULATE,
                fd,
                offset,
            )
        }?;
        Ok(Region {
            ptr: NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap returned null"))?,
            map_len: len,
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`map_len` describe a mapping this Region made and owns; every pointer
        // into it is derived from a `Uring` (or guard borrowing it) that is being dropped.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

/// An io_uring instance: the fd and the ring memory. See the crate docs for the concurrency
/// rules.
pub struct Uring {
    // Field order is drop order: close the ring before unmapping its memory.
    fd: OwnedFd,
    sq_head: NonNull<AtomicU32>,
    sq_tail: NonNull<AtomicU32>,
    sq_flags: NonNull<AtomicU32>,
    sq_dropped: NonNull<AtomicU32>,
    cq_head: NonNull<AtomicU32>,
    cq_tail: NonNull<AtomicU32>,
    cq_overflow: NonNull<AtomicU32>,
    sqes: NonNull<io_uring_sqe>,
    cqes: NonNull<io_uring_cqe>,
    sq_mask: u32,
    sq_entries: u32,
    cq_mask: u32,
    cq_entries: u32,
    params: io_uring_params,
    memory: RingMemory,
    sq_claimed: AtomicBool,
    cq_claimed: AtomicBool,
    _rings: Region,
    _sqes: Region,
}

// SAFETY: `Uring` owns its fd and both mappings; the raw pointers point into those mappings,
// not into thread-local or borrowed data, so moving the owner to another thread is fine.
unsafe impl Send for Uring {}

// SAFETY: through `&Uring`, the ring words are only accessed atomically (`AtomicU32`, the same
// words the kernel accesses concurrently anyway). The non-atomic accesses, SQE slot writes and
// CQE reads, happen only through `SubmissionQueue` / `CompletionQueue`, of which at most one
// each exists at a time (claimed with an atomic flag), so no two threads race on them.
unsafe impl Sync for Uring {}

impl fmt::Debug for Uring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Uring")
            .field("fd", &self.fd.as_raw_fd())
            .field("flags", &self.params.flags)
            .field("sq_entries", &self.sq_entries)
            .field("cq_entries", &self.cq_entries)
            .finish_non_exhaustive()
    }
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.to_owned())
}

fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// A `u32` word at `off` inside `base[..len]`, checked for bounds and alignment.
fn word(base: NonNull<u8>, len: usize, off: u32) -> io::Result<NonNull<AtomicU32>> {
    let off = off as usize;
    if !off.is_multiple_of(4) || off + 4 > len {
        return Err(io::Error::other(format!(
            "io_uring ring offset {off} out of bounds"
        )));
    }
    Ok(base.wrapping_add(off).cast())
}

trait WrappingAdd {
    fn wrapping_add(self, n: usize) -> Self;
}

impl WrappingAdd for NonNull<u8> {
    fn wrapping_add(self, n: usize) -> Self {
        // Callers only pass offsets inside the mapping, and no mapping wraps to address 0.
        NonNull::new(self.as_ptr().wrapping_add(n)).expect("offset inside a mapping is non-null")
    }
}

impl Uring {
    /// Sets up a ring. Invalid options give `InvalidInput`; kernel refusals give the errno.
    pub fn new(opts: &RingOptions) -> io::Result<Uring> {
        Self::build(opts, None)
    }

    /// Sets up a ring attached to `wq` (`IORING_SETUP_ATTACH_WQ`): when both rings use SQPOLL,
    /// the new ring is served by `wq`'s SQPOLL kernel thread instead of a thread of its own
    /// (the new ring's `sqpoll.cpu` is then ignored, and the shared thread idles for the
    /// longer of the two `idle_ms`). The thread lives until every ring attached to it is
    /// closed, so the rings may be dropped in any order; it sets `IORING_SQ_NEED_WAKEUP` in
    /// every attached ring when it sleeps, and [`Uring::wake_sqpoll`] on any of them wakes it.
    /// Without SQPOLL the kernel only checks that `wq` is an io_uring.
    pub fn new_attached(opts: &RingOptions, wq: &Uring) -> io::Result<Uring> {
        Self::build(opts, Some(wq.fd.as_fd()))
    }

    fn build(opts: &RingOptions, attach: Option<BorrowedFd<'_>>) -> io::Result<Uring> {
        if opts.entries == 0 || opts.entries > MAX_SQ_ENTRIES {
            return Err(invalid("io_uring entries must be in 1..=32768"));
        }
        if opts.cq_entries != 0
            && (opts.cq_entries < opts.entries || opts.cq_entries > MAX_CQ_ENTRIES)
        {
            return Err(invalid(
                "io_uring cq_entries must be 0 or in entries..=65536",
            ));
        }
        if !ALLOWED_EXTRA_FLAGS.contains(opts.setup_flags) {
            return Err(invalid("unsupported extra io_uring setup flags"));
        }
        if opts.sqpoll.is_some() && opts.setup_flags.contains(IoringSetupFlags::DEFER_TASKRUN) {
            return Err(invalid("DEFER_TASKRUN cannot be combined with SQPOLL"));
        }
        let sq_n = opts.entries.next_power_of_two();
        let cq_n = if opts.cq_entries == 0 {
            2 * sq_n
        } else {
            opts.cq_entries.next_power_of_two()
        };
        let mut flags = opts.setup_flags;
        if opts.cq_entries != 0 {
            flags |= IoringSetupFlags::CQSIZE;
        }
        if let Some(sp) = opts.sqpoll {
            flags |= IoringSetupFlags::SQPOLL;
            if sp.cpu.is_some() {
                flags |= IoringSetupFlags::SQ_AFF;
            }
        }
        if opts.no_mmap {
            flags |= IoringSetupFlags::NO_MMAP;
        }
        if attach.is_some() {
            flags |= IoringSetupFlags::ATTACH_WQ;
        }
        // NO_SQARRAY (6.6+) makes SQE slot = tail & mask, which is simpler for foreign producers.
        match Self::setup(
            opts,
            attach,
            flags | IoringSetupFlags::NO_SQARRAY,
            sq_n,
            cq_n,
        ) {
            Err(e) if e.raw_os_error() == Some(Errno::INVAL.raw_os_error()) => {
                Self::setup(opts, attach, flags, sq_n, cq_n)
            }
            r => r,
        }
    }

    fn setup(
        opts: &RingOptions,
        attach: Option<BorrowedFd<'_>>,
        flags: IoringSetupFlags,
        sq_n: u32,
        cq_n: u32,
    ) -> io::Result<Uring> {
        let page = rustix::param::page_size();
        let mut p = io_uring_params::default();
        p.flags = flags;
        p.cq_entries = cq_n;
        if let Some(sp) = opts.sqpoll {
            p.sq_thread_idle = sp.idle_ms;
            p.sq_thread_cpu = sp.cpu.unwrap_or(0);
        }
        if let Some(wq) = attach {
            p.wq_fd = wq.as_raw_fd();
        }
        let has_array = !flags.contains(IoringSetupFlags::NO_SQARRAY);
        // With NO_MMAP: our own memory, sized like the kernel's `rings_size()` plus slack.
        let user = if opts.no_mmap {
            let mut rings_len = RINGS_HEADER_SLACK + cq_n as usize * CQE_SIZE;
            if has_array {
                rings_len += 64 + sq_n as usize * 4;
            }
            let rings_len = round_up(rings_len, page);
            let sqes_len = round_up(sq_n as usize * SQE_SIZE, page);
            let rings = Region::anonymous(rings_len)?;
            let sqes = Region::anonymous(sqes_len)?;
            p.cq_off.user_addr = io_uring_ptr::new(rings.ptr.as_ptr().cast());
            p.sq_off.user_addr = io_uring_ptr::new(sqes.ptr.as_ptr().cast());
            Some(((rings, rings_len), (sqes, sqes_len)))
        } else {
            None
        };
        // SAFETY: ATTACH_WQ is set only with `wq_fd` from a borrowed, open io_uring fd (a live
        // `Uring`). With NO_MMAP, `user_addr`s point to live, page-aligned, writable mappings
        // owned by `user`, which the returned `Uring` keeps until after the fd is closed; each
        // is followed by a PROT_NONE page, so a size mismatch fails with EFAULT instead of
        // pinning unrelated memory.
        let fd = unsafe { rustix::io_uring::io_uring_setup(sq_n, &mut p) }?;
        let sq_entries = p.sq_entries;
        let cq_entries = p.cq_entries;
        let (rings, rings_len, sqes, sqes_len) = match user {
            Some(((rings, rings_len), (sqes, sqes_len))) => {
                if sq_entries != sq_n || cq_entries != cq_n {
                    return Err(io::Error::other(format!(
                        "io_uring NO_MMAP: kernel chose {sq_entries}/{cq_entries} entries, \
                         memory was sized for {sq_n}/{cq_n}"
                    )));
                }
                (rings, rings_len, sqes, sqes_len)
            }
            None => {
                if !p.features.contains(IoringFeatureFlags::SINGLE_MMAP) {
                    return Err(io::Error::new(
                        io::ErrorKind::Unsupported,
                        "io_uring without IORING_FEAT_SINGLE_MMAP",
                    ));
                }
                let mut len = p.cq_off.cqes as usize + cq_entries as usize * CQE_SIZE;
                if has_array {
                    len = len.max(p.sq_off.array as usize + sq_entries as usize * 4);
                }
                let rings = Region::ring_fd(fd.as_fd(), len, IORING_OFF_SQ_RING)?;
                let sqes_len = sq_entries as usize * SQE_SIZE;
                let sqes = Region::ring_fd(fd.as_fd(), sqes_len, IORING_OFF_SQES)?;
                (rings, len, sqes, sqes_len)
            }
        };
        let base = rings.ptr;
        let cqes_end = p.cq_off.cqes as usize + cq_entries as usize * CQE_SIZE;
        if !p.cq_off.cqes.is_multiple_of(16)
            || cqes_end > rings_len
            || sqes_len < sq_entries as usize * SQE_SIZE
        {
            return Err(io::Error::other(
                "io_uring CQE array outside the rings region",
            ));
        }
        let sq_array = if has_array {
            let off = p.sq_off.array as usize;
            if !off.is_multiple_of(4) || off + sq_entries as usize * 4 > rings_len {
                return Err(io::Error::other(
                    "io_uring SQ array outside the rings region",
                ));
            }
            let array = base.wrapping_add(off).cast::<u32>();
            for i in 0..sq_entries {
                // SAFETY: `off + i*4` is in bounds (checked above) and 4-aligned; no SQE has been
                // published yet, so the kernel does not read the array concurrently.
                unsafe { array.as_ptr().add(i as usize).write(i) };
            }
            Some(p.sq_off.array)
        } else {
            None
        };
        let memory = RingMemory {
            rings: rings.ptr.as_ptr(),
            rings_len,
            sqes: sqes.ptr.as_ptr(),
            sqes_len,
            user_provided: opts.no_mmap,
            sq_entries,
            sq_mask: sq_entries - 1,
            cq_entries,
            cq_mask: cq_entries - 1,
            sq_head: p.sq_off.head,
            sq_tail: p.sq_off.tail,
            sq_flags: p.sq_off.flags,
            sq_dropped: p.sq_off.dropped,
            sq_array,
            cq_head: p.cq_off.head,
            cq_tail: p.cq_off.tail,
            cq_overflow: p.cq_off.overflow,
            cqes: p.cq_off.cqes,
        };
        Ok(Uring {
            sq_head: word(base, rings_len, p.sq_off.head)?,
            sq_tail: word(base, rings_len, p.sq_off.tail)?,
            sq_flags: word(base, rings_len, p.sq_off.flags)?,
            sq_dropped: word(base, rings_len, p.sq_off.dropped)?,
            cq_head: word(base, rings_len, p.cq_off.head)?,
            cq_tail: word(base, rings_len, p.cq_off.tail)?,
            cq_overflow: word(base, rings_len, p.cq_off.overflow)?,
            sqes: sqes.ptr.cast(),
            cqes: base.wrapping_add(p.cq_off.cqes as usize).cast(),
            sq_mask: sq_entries - 1,
            sq_entries,
            cq_mask: cq_entries - 1,
            cq_entries,
            params: p,
            memory,
            sq_claimed: AtomicBool::new(false),
            cq_claimed: AtomicBool::new(false),
            fd,
            _rings: rings,
            _sqes: sqes,
        })
    }

    fn atomic(&self, word: NonNull<AtomicU32>) -> &AtomicU32 {
        // SAFETY: `word` was bounds- and alignment-checked at setup and points into the rings
        // mapping, which lives as long as `self`; the word is only ever accessed atomically (by
        // us, and by the kernel with its own atomics).
        unsafe { word.as_ref() }
    }

    /// Entries published to the submission queue that the kernel has not consumed yet, read
    /// from any thread without claiming the queue (a snapshot: the producer may publish more
    /// at any moment, the kernel consume more). For a watchdog that must not contend with
    /// the producer.
    pub fn sq_unconsumed(&self) -> u32 {
        let head = self.atomic(self.sq_head).load(Ordering::Acquire);
        let tail = self.atomic(self.sq_tail).load(Ordering::Acquire);
        tail.wrapping_sub(head)
    }

    /// The submission queue; its single producer. Panics if one is already in use.
    pub fn sq(&self) -> SubmissionQueue<'_> {
        self.try_sq()
            .expect("io_uring SubmissionQueue already in use (one producer at a time)")
    }

    /// The submission queue, or `None` if another `SubmissionQueue` is alive.
    pub fn try_sq(&self) -> Option<SubmissionQueue<'_>> {
        (!self.sq_claimed.swap(true, Ordering::Acquire)).then_some(SubmissionQueue { ring: self })
    }

    /// The completion queue; its single consumer. Panics if one is already in use.
    pub fn cq(&self) -> CompletionQueue<'_> {
        self.try_cq()
            .expect("io_uring CompletionQueue already in use (one consumer at a time)")
    }

    /// The completion queue, or `None` if another `CompletionQueue` is alive.
    pub fn try_cq(&self) -> Option<CompletionQueue<'_>> {
        (!self.cq_claimed.swap(true, Ordering::Acquire)).then_some(CompletionQueue { ring: self })
    }

    /// `io_uring_enter`: submits `to_submit` pushed entries (ignored with SQPOLL, where this
    /// also wakes a sleeping SQPOLL thread) and waits until `min_complete` CQEs are available or
    /// `timeout` passes (`IORING_ENTER_EXT_ARG`, nanosecond resolution). Returns the number of
    /// entries submitted. A wait that times out (`ETIME`) or is interrupted (`EINTR`) is not an
    /// error: it returns `Ok(0)` and the caller looks at the CQ.
    pub fn enter(
        &self,
        to_submit: u32,
        min_complete: u32,
        timeout: Option<Duration>,
    ) -> io::Result<u32> {
        let mut flags = IoringEnterFlags::empty();
        if min_complete > 0 || timeout.is_some() {
            flags |= IoringEnterFlags::GETEVENTS;
        }
        if self.is_sqpoll() && self.needs_wakeup() {
            flags |= IoringEnterFlags::SQ_WAKEUP;
        }
        let r = match timeout {
            None => {
                // SAFETY: no EXT_ARG flag and no argument; the memory queued SQEs point to is
                // the pusher's responsibility (the unsafe builders' contracts).
                unsafe {
                    rustix::io_uring::io_uring_enter(&self.fd, to_submit, min_complete, flags)
                }
            }
            Some(d) => {
                let ts = Timespec {
                    tv_sec: d.as_secs().min(i64::MAX as u64) as i64,
                    tv_nsec: i64::from(d.subsec_nanos()),
                };
                let arg = io_uring_getevents_arg {
                    ts: io_uring_ptr::new((&raw const ts).cast_mut().cast()),
                    ..Default::default()
                };
                // SAFETY: EXT_ARG is set and `arg` (with `ts`) lives across the call; the
                // sigmask pointer is null, so no signal mask is installed.
                unsafe {
                    rustix::io_uring::io_uring_enter_arg(
                        &self.fd,
                        to_submit,
                        min_complete,
                        flags | IoringEnterFlags::EXT_ARG,
                        Some(&arg),
                    )
                }
            }
        };
        match r {
            Ok(n) => Ok(n),
            Err(Errno::TIME | Errno::INTR) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether the SQPOLL thread is asleep and must be woken to see new entries
    /// (`IORING_SQ_NEED_WAKEUP`). Issues a full fence first, so a tail published before this
    /// call by this thread is ordered before the flag read (as liburing does). Always false
    /// without SQPOLL.
    pub fn needs_wakeup(&self) -> bool {
        fence(Ordering::SeqCst);
        self.atomic(self.sq_flags).load(Ordering::Relaxed) & IoringSqFlags::NEED_WAKEUP.bits() != 0
    }

    /// Whether completions are waiting in the kernel's overflow backlog
    /// (`IORING_SQ_CQ_OVERFLOW`); an [`enter`](Uring::enter) with `min_complete > 0` flushes it.
    pub fn cq_overflow_pending(&self) -> bool {
        self.atomic(self.sq_flags).load(Ordering::Acquire) & IoringSqFlags::CQ_OVERFLOW.bits() != 0
    }

    /// Wakes the SQPOLL thread: `io_uring_enter(fd, 0, 0, IORING_ENTER_SQ_WAKEUP)`.
    pub fn wake_sqpoll(&self) -> io::Result<()> {
        // SAFETY: no submission, no wait, no argument.
        unsafe { rustix::io_uring::io_uring_enter(&self.fd, 0, 0, IoringEnterFlags::SQ_WAKEUP) }?;
        Ok(())
    }

    /// SQEs the kernel dropped as invalid (bad index; should stay 0).
    pub fn sq_dropped(&self) -> u32 {
        self.atomic(self.sq_dropped).load(Ordering::Acquire)
    }

    /// CQEs lost because the CQ and the kernel's overflow backlog were full (should stay 0).
    pub fn cq_overflow(&self) -> u32 {
        self.atomic(self.cq_overflow).load(Ordering::Acquire)
    }

    /// Addresses and offsets of the ring memory; see [`RingMemory`].
    pub fn memory(&self) -> RingMemory {
        self.memory
    }

    /// SQ size (a power of two).
    pub fn sq_entries(&self) -> u32 {
        self.sq_entries
    }

    /// CQ size (a power of two).
    pub fn cq_entries(&self) -> u32 {
        self.cq_entries
    }

    /// The setup flags the ring was created with (including `NO_SQARRAY` when the kernel
    /// accepted it).
    pub fn setup_flags(&self) -> IoringSetupFlags {
        self.params.flags
    }

    /// The kernel's `IORING_FEAT_*` flags.
    pub fn features(&self) -> IoringFeatureFlags {
        self.params.features
    }

    /// Whether the ring has a kernel SQPOLL thread.
    pub fn is_sqpoll(&self) -> bool {
        self.params.flags.contains(IoringSetupFlags::SQPOLL)
    }
}

impl AsFd for Uring {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Uring {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// The producer side of the SQ; at most one exists per ring at a time. Makes no system calls.
#[derive(Debug)]
pub struct SubmissionQueue<'a> {
    ring: &'a Uring,
}

impl SubmissionQueue<'_> {
    /// Free SQ slots.
    pub fn space(&self) -> u32 {
        let r = self.ring;
        let head = r.atomic(r.sq_head).load(Ordering::Acquire);
        let tail = r.atomic(r.sq_tail).load(Ordering::Relaxed);
        r.sq_entries - tail.wrapping_sub(head)
    }

    /// Published entries the kernel has not consumed yet.
    pub fn pending(&self) -> u32 {
        self.ring.sq_entries - self.space()
    }

    /// Writes `sqe` into the next slot and publishes it (release store of the SQ tail).
    pub fn push(&self, sqe: &Sqe) -> Result<(), QueueFull> {
        if self.push_many(std::slice::from_ref(sqe)) == 1 {
            Ok(())
        } else {
            Err(QueueFull)
        }
    }

    /// Writes as many of `sqes` as fit, in order, and publishes them with one tail store.
    /// Returns how many were pushed.
    pub fn push_many(&self, sqes: &[Sqe]) -> usize {
        let r = self.ring;
        let head = r.atomic(r.sq_head).load(Ordering::Acquire);
        // Only the (single) producer writes the tail; the claim's Acquire orders earlier ones.
        let tail = r.atomic(r.sq_tail).load(Ordering::Relaxed);
        let free = r.sq_entries - tail.wrapping_sub(head);
        let n = sqes.len().min(free as usize);
        for (i, sqe) in sqes[..n].iter().enumerate() {
            let idx = tail.wrapping_add(i as u32) & r.sq_mask;
            // SAFETY: `idx < sq_entries`, inside the SQE mapping. The slot is free: the kernel's
            // head (Acquire) is past it, so it finished reading it, and it only reads slots
            // below the tail we publish after this write. This guard is the only producer.
            unsafe { r.sqes.as_ptr().add(idx as usize).write(sqe.0) };
        }
        if n > 0 {
            r.atomic(r.sq_tail)
                .store(tail.wrapping_add(n as u32), Ordering::Release);
        }
        n
    }
}

impl Drop for SubmissionQueue<'_> {
    fn drop(&mut self) {
        self.ring.sq_claimed.store(false, Ordering::Release);
    }
}

/// The consumer side of the CQ; at most one exists per ring at a time. Makes no system calls.
#[derive(Debug)]
pub struct CompletionQueue<'a> {
    ring: &'a Uring,
}

impl CompletionQueue<'_> {
    /// CQEs ready to pop.
    pub fn len(&self) -> u32 {
        let r = self.ring;
        let tail = r.atomic(r.cq_tail).load(Ordering::Acquire);
        tail.wrapping_sub(r.atomic(r.cq_head).load(Ordering::Relaxed))
    }

    /// Whether no CQE is ready.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes the next CQE, if any (acquire load of the CQ tail, release store of the head).
    pub fn pop(&self) -> Option<Cqe> {
        let r = self.ring;
        let head = r.atomic(r.cq_head).load(Ordering::Relaxed);
        let tail = r.atomic(r.cq_tail).load(Ordering::Acquire);
        if head == tail {
            return None;
        }
        let idx = (head & r.cq_mask) as usize;
        // SAFETY: `idx < cq_entries`, inside the rings mapping (checked at setup). `head !=
        // tail`, so the kernel wrote this entry before its Release store of the tail that our
        // Acquire load saw, and it will not rewrite it until we move the head past it. The
        // fields are read by value; no reference to kernel-shared memory is created.
        let cqe = unsafe {
            let p = r.cqes.as_ptr().add(idx);
            Cqe {
                user_data: (*p).user_data.u64_(),
                res: (*p).res,
                flags: (*p).flags.bits(),
            }
        };
        r.atomic(r.cq_head)
            .store(head.wrapping_add(1), Ordering::Release);
        Some(cqe)
    }
}

impl Drop for CompletionQueue<'_> {
    fn drop(&mut self) {
        self.ring.cq_claimed.store(false, Ordering::Release);
    }
}
