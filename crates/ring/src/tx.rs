//! The GPU send table: what a GPU executor needs to put replies on the wire itself
//! (`--transport kernel --reply executor-sqe --executor gpu`), shared between the kernel
//! transport's reply stage (host) and the GPU in one block of host memory registered with the
//! device. See docs/gpu.md ("GPU-written SENDs").
//!
//! Layout (all offsets fixed, mirrored for CUDA C in the generated `include/bgs_ring.h`):
//! a [`TxHeader`] page, then `capacity` [`TxEntry`] lines (an open-addressing table keyed by
//! socket cookie, at most [`TX_PROBES`] positions from the cookie's hash), then `capacity`
//! send buffers of [`TX_BUF_BYTES`] each (entry `i` owns buffer `i`).
//!
//! # The turn
//! Replies of one connection must leave in `conn_seq` order with at most one SEND in flight
//! (a SEND that finds the socket buffer full can be overtaken by a later one). Two agents send:
//! the GPU (the common case) and the host's reply stage (replies the GPU handed over, busy
//! answers, markers, HTTP). Without host-native atomics they cannot share a compare-and-swap,
//! so the entry's `next_seq` is a token with a single writer at any time: it names the reply
//! that goes on the wire next, and only the agent holding that reply may act on it. The holder
//! queues its SEND and, when the SEND's completion shows every byte sent, stores `next_seq =`
//! the sequence after what it sent (release). An agent that holds a reply that is not yet its
//! turn never waits for it: the GPU hands such a reply to the host (the completion ring), the
//! host keeps it. An agent that ends the connection keeps the token, so nobody sends on the
//! descriptor again and the host can close it.
//!
//! # Pausing the GPU's sends
//! The GPU's SENDs need the ring's SQPOLL kernel thread, which spins while it is awake and
//! sleeps only after its idle time without submissions: at a few thousand replies a second it
//! never sleeps and costs a core. So the host may pause them ([`TxTable::set_gpu_sends_paused`],
//! the header's `gpu_sends_paused`): the GPU then hands every reply to the host's reply stage
//! (as if it were not the turn) and queues nothing on its ring, not even the FUTEX_WAKE for
//! a sleeping stage (whoever pauses must wake the stage another way: BPF's completion watch).
//! A reply whose publish read the word before it changed may still be sent or woken for; the
//! turn keeps either order correct, and the host wakes the SQPOLL thread for SQEs left waiting.
//!
//! # Entry lifecycle (host only)
//! Fill: `fd`, `next_seq`, zeroed counters, then `cookie` with release. Empty:
//! `cookie = TX_TOMBSTONE` (release) before the descriptor is closed (the turn guarantees the
//! GPU is done with it). A tombstone is reused by a later insert; a lookup stops at
//! [`TX_EMPTY`] or after [`TX_PROBES`] positions.

use core::mem::{offset_of, size_of};
use core::ptr::NonNull;
use core::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

/// Bytes of the header page.
pub const TX_HEADER_BYTES: usize = 4096;
/// Bytes of one table entry.
pub const TX_ENTRY_BYTES: usize = 64;
/// Bytes of one entry's send buffer: the largest binary reply (24-byte header + 256 words),
/// rounded up to a cache line.
pub const TX_BUF_BYTES: usize = 1088;
/// Positions probed from a cookie's hash, by both the host's insert and the GPU's lookup.
pub const TX_PROBES: u32 = 8;
/// `cookie` of a never-used entry.
pub const TX_EMPTY: u64 = 0;
/// `cookie` of an entry whose connection was closed.
pub const TX_TOMBSTONE: u64 = u64::MAX;
/// Top byte of the `user_data` of a SEND the GPU queued: `kind << 56 | index << 32 | conn_seq`.
pub const TX_UD_SEND: u64 = 0xa0;
/// Top byte of the `user_data` of a futex wake the GPU queued for the host's reply stage.
pub const TX_UD_WAKE: u64 = 0xa1;
/// Multiplier of the cookie hash (Fibonacci hashing): `index = (cookie * M) >> (64 - log2 cap)`.
pub const TX_HASH_MUL: u64 = 0x9e37_79b9_7f4a_7c15;

/// Header of the send table. The host writes the geometry once; the GPU writes the counters
/// (the host only reads them).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct TxHeader {
    /// Entries (a power of two).
    pub capacity: u32,
    /// [`TX_PROBES`].
    pub probes: u32,
    /// [`TX_BUF_BYTES`].
    pub buf_bytes: u32,
    /// log2(capacity).
    pub capacity_log2: u32,
    /// Offset of the entry array.
    pub entries_offset: u64,
    /// Offset of the send buffers.
    pub bufs_offset: u64,
    /// Bytes of the whole block.
    pub total_size: u64,
    /// Host: nonzero while the GPU must send nothing itself (module docs, "Pausing the
    /// GPU's sends"): it hands every reply to the reply stage and queues nothing on its ring,
    /// so the SQPOLL thread gets no work and sleeps. 0 (the zeroed default): the GPU sends.
    pub gpu_sends_paused: u32,
    /// Padding to the counters' line.
    pub pad0: [u8; 20],
    /// GPU: replies the GPU queued a SEND for (each answers one request).
    pub gpu_sends: u64,
    /// GPU: SEND completions the GPU reaped.
    pub gpu_completed: u64,
    /// GPU: SEND completions reporting an error or a short send.
    pub gpu_send_errors: u64,
    /// GPU: replies handed to the host's reply stage (not the turn, not registered, HTTP,
    /// closing).
    pub gpu_deferred: u64,
    /// GPU: futex wakes queued for a sleeping host reply stage.
    pub gpu_wakes: u64,
    /// GPU: times a SEND waited for room in the submission queue.
    pub gpu_sq_full: u64,
    /// GPU: other completions reaped (futex wakes).
    pub gpu_other_cqes: u64,
    /// GPU: of those, futex wakes that failed (a wake that fails leaves the host stage to its
    /// timeout).
    pub gpu_wake_errors: u64,
}

/// One connection's entry (one cache line).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct TxEntry {
    /// Socket cookie; [`TX_EMPTY`] or [`TX_TOMBSTONE`] when unused. Host only, stored last.
    pub cookie: u64,
    /// The connection's descriptor. Host only.
    pub fd: i32,
    /// The turn: `conn_seq` of the reply that goes on the wire next (module docs).
    pub next_seq: u32,
    /// GPU: SENDs completed on this entry (for tests and stats).
    pub gpu_sends: u32,
    /// GPU: SEND errors on this entry.
    pub gpu_errors: u32,
    /// `reserved[0]`: the GPU's length of its SEND in flight (the reaper checks the completion
    /// against it); the rest unused.
    pub reserved: [u32; 10],
}

const _: () = assert!(size_of::<TxHeader>() == 128 && size_of::<TxHeader>() <= TX_HEADER_BYTES);
const _: () = assert!(size_of::<TxEntry>() == TX_ENTRY_BYTES);
const _: () = assert!(offset_of!(TxHeader, gpu_sends) == 64);
const _: () = assert!(offset_of!(TxHeader, gpu_sends_paused) == 40);
const _: () =
    assert!(TX_BUF_BYTES >= 24 + 4 * crate::SLOT_WORDS && TX_BUF_BYTES.is_multiple_of(64));

/// Index of the `i`-th probe for `cookie` in a table of `1 << log2` entries.
pub fn tx_probe(cookie: u64, log2: u32, i: u32) -> u32 {
    let h = if log2 == 0 {
        0
    } else {
        (cookie.wrapping_mul(TX_HASH_MUL) >> (64 - log2)) as u32
    };
    (h.wrapping_add(i)) & ((1u32 << log2) - 1)
}

/// What a device needs to find the table and the GPU's io_uring ring. Raw addresses of host
/// memory that lives as long as the transport that made it.
#[derive(Debug, Clone, Copy)]
pub struct TxDesc {
    /// The send table block.
    pub table: *mut u8,
    /// Its length in bytes (page multiple).
    pub table_len: usize,
    /// The io_uring rings region (SQ/CQ heads, tails, flags, CQEs).
    pub rings: *mut u8,
    /// Its length.
    pub rings_len: usize,
    /// The SQE array.
    pub sqes: *mut u8,
    /// Its length.
    pub sqes_len: usize,
    /// SQ entries (power of two).
    pub sq_entries: u32,
    /// CQ entries (power of two).
    pub cq_entries: u32,
    /// Offsets inside `rings` (u32 words).
    pub sq_head: u32,
    /// SQ tail offset.
    pub sq_tail: u32,
    /// SQ flags offset.
    pub sq_flags: u32,
    /// CQ head offset.
    pub cq_head: u32,
    /// CQ tail offset.
    pub cq_tail: u32,
    /// CQE array offset.
    pub cqes: u32,
}

// SAFETY: plain addresses; whoever dereferences them must uphold the table's protocol.
unsafe impl Send for TxDesc {}
// SAFETY: as above.
unsafe impl Sync for TxDesc {}

/// The host's handle on a send table (it owns the memory).
#[derive(Debug)]
pub struct TxTable {
    base: NonNull<u8>,
    len: usize,
    capacity: u32,
    log2: u32,
}

// SAFETY: every shared word is accessed through atomics; the memory is owned by the table.
unsafe impl Send for TxTable {}
// SAFETY: as above.
unsafe impl Sync for TxTable {}

impl TxTable {
    /// A table with room for at least `connections` live connections (capacity: the next power
    /// of two of twice that, at least 64).
    pub fn new(connections: u32) -> std::io::Result<TxTable> {
        let capacity = (connections.max(32) as u64 * 2).next_power_of_two();
        if capacity > 1 << 24 {
            return Err(std::io::Error::other(format!(
                "send table for {connections} connections is too large"
            )));
        }
        let capacity = capacity as u32;
        let len = Self::size_for(capacity);
        // SAFETY: a fresh anonymous mapping; it aliases nothing. Zeroed by the kernel.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                core::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }?;
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| std::io::Error::other("null"))?;
        let t = TxTable {
            base,
            len,
            capacity,
            log2: capacity.trailing_zeros(),
        };
        // SAFETY: the header lies at the start of the (zeroed, page-aligned) mapping and
        // nobody else sees the memory yet.
        unsafe {
            let h = base.as_ptr().cast::<TxHeader>();
            (*h).capacity = capacity;
            (*h).probes = TX_PROBES;
            (*h).buf_bytes = TX_BUF_BYTES as u32;
            (*h).capacity_log2 = t.log2;
            (*h).entries_offset = TX_HEADER_BYTES as u64;
            (*h).bufs_offset = (TX_HEADER_BYTES + capacity as usize * TX_ENTRY_BYTES) as u64;
            (*h).total_size = len as u64;
        }
        Ok(t)
    }

    /// Bytes of a table of `capacity` entries (page multiple).
    pub fn size_for(capacity: u32) -> usize {
        let raw = TX_HEADER_BYTES + capacity as usize * (TX_ENTRY_BYTES + TX_BUF_BYTES);
        raw.div_ceil(4096) * 4096
    }

    /// Entries.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Start of the block (for registering it with a device).
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Length of the block.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty (for clippy's `len_without_is_empty`).
    pub fn is_empty(&self) -> bool {
        false
    }

    fn entry(&self, idx: u32) -> *mut TxEntry {
        assert!(idx < self.capacity, "send table index {idx} out of range");
        // SAFETY: idx < capacity, so the entry lies inside the mapping.
        unsafe {
            self.base
                .as_ptr()
                .add(TX_HEADER_BYTES + idx as usize * TX_ENTRY_BYTES)
                .cast::<TxEntry>()
        }
    }

    fn cookie_word(&self, idx: u32) -> &AtomicU64 {
        // SAFETY: the entry is 64-byte aligned inside the live mapping; the word is only ever
        // accessed atomically (by the host here, by the device with system-scope loads).
        unsafe { AtomicU64::from_ptr(&raw mut (*self.entry(idx)).cookie) }
    }

    fn u32_word(&self, idx: u32, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is the offset of a u32 field of TxEntry (callers pass offset_of!),
        // aligned, inside the live mapping, accessed atomically only.
        unsafe { AtomicU32::from_ptr(self.entry(idx).cast::<u8>().add(off).cast::<u32>()) }
    }

    /// Register connection `cookie` on descriptor `fd` whose next reply to send is
    /// `next_seq`. Returns the entry index, or `None` when all [`TX_PROBES`] positions are
    /// taken (the connection is then served by the host alone).
    pub fn insert(&self, cookie: u64, fd: i32, next_seq: u32) -> Option<u32> {
        assert!(cookie != TX_EMPTY && cookie != TX_TOMBSTONE);
        for i in 0..TX_PROBES {
            let idx = tx_probe(cookie, self.log2, i);
            let c = self.cookie_word(idx).load(Ordering::Acquire);
            if c == TX_EMPTY || c == TX_TOMBSTONE {
                // SAFETY: fd's word of an unused entry: only the host writes it, and no
                // reader trusts it until it sees the cookie stored below (release).
                unsafe {
                    AtomicI32::from_ptr(&raw mut (*self.entry(idx)).fd).store(fd, Ordering::Relaxed)
                };
                self.u32_word(idx, offset_of!(TxEntry, next_seq))
                    .store(next_seq, Ordering::Relaxed);
                self.u32_word(idx, offset_of!(TxEntry, gpu_sends))
                    .store(0, Ordering::Relaxed);
                self.u32_word(idx, offset_of!(TxEntry, gpu_errors))
                    .store(0, Ordering::Relaxed);
                self.cookie_word(idx).store(cookie, Ordering::Release);
                return Some(idx);
            }
            debug_assert_ne!(c, cookie, "cookie {cookie} registered twice");
        }
        None
    }

    /// The entry of `cookie`, if registered (the lookup the GPU does).
    pub fn lookup(&self, cookie: u64) -> Option<u32> {
        for i in 0..TX_PROBES {
            let idx = tx_probe(cookie, self.log2, i);
            match self.cookie_word(idx).load(Ordering::Acquire) {
                c if c == cookie => return Some(idx),
                TX_EMPTY => return None,
                _ => {}
            }
        }
        None
    }

    /// Unregister entry `idx` (its holder keeps the turn; see the module docs).
    pub fn remove(&self, idx: u32) {
        self.cookie_word(idx).store(TX_TOMBSTONE, Ordering::Release);
    }

    /// The turn of entry `idx` (acquire: the sends before it are complete).
    pub fn next_seq(&self, idx: u32) -> u32 {
        self.u32_word(idx, offset_of!(TxEntry, next_seq))
            .load(Ordering::Acquire)
    }

    /// Pass the turn of entry `idx` to `seq`. Only the current holder may call this.
    pub fn pass_turn(&self, idx: u32, seq: u32) {
        self.u32_word(idx, offset_of!(TxEntry, next_seq))
            .store(seq, Ordering::Release);
    }

    /// Pause (`true`) or resume the GPU's own SENDs (module docs, "Pausing the GPU's sends").
    pub fn set_gpu_sends_paused(&self, paused: bool) {
        self.paused_word()
            .store(u32::from(paused), Ordering::SeqCst);
    }

    /// Whether the GPU's own SENDs are paused.
    pub fn gpu_sends_paused(&self) -> bool {
        self.paused_word().load(Ordering::Acquire) != 0
    }

    fn paused_word(&self) -> &AtomicU32 {
        // SAFETY: an aligned u32 in the live header, accessed atomically only (by the device
        // with system-scope loads).
        unsafe {
            AtomicU32::from_ptr(&raw mut (*self.base.as_ptr().cast::<TxHeader>()).gpu_sends_paused)
        }
    }

    /// Replies the GPU put on the wire so far (one load; the reply stage polls it).
    pub fn gpu_sends(&self) -> u64 {
        self.gpu_sends_word().load(Ordering::Acquire)
    }

    /// The GPU's counters.
    pub fn counters(&self) -> TxCounters {
        let h = self.base.as_ptr().cast::<TxHeader>();
        // SAFETY: the counters are aligned u64 words of the header inside the live mapping;
        // the device writes them, so read them atomically.
        let rd = |p: *mut u64| unsafe { AtomicU64::from_ptr(p).load(Ordering::Acquire) };
        // SAFETY: field addresses inside the header (no reference to the racy memory).
        unsafe {
            TxCounters {
                gpu_sends: rd(&raw mut (*h).gpu_sends),
                gpu_completed: rd(&raw mut (*h).gpu_completed),
                gpu_send_errors: rd(&raw mut (*h).gpu_send_errors),
                gpu_deferred: rd(&raw mut (*h).gpu_deferred),
                gpu_wakes: rd(&raw mut (*h).gpu_wakes),
                gpu_sq_full: rd(&raw mut (*h).gpu_sq_full),
                gpu_other_cqes: rd(&raw mut (*h).gpu_other_cqes),
                gpu_wake_errors: rd(&raw mut (*h).gpu_wake_errors),
            }
        }
    }

    /// For tests that stand in for the device: the raw counter word `gpu_sends`.
    pub fn gpu_sends_word(&self) -> &AtomicU64 {
        // SAFETY: an aligned u64 in the live header, accessed atomically only.
        unsafe { AtomicU64::from_ptr(&raw mut (*self.base.as_ptr().cast::<TxHeader>()).gpu_sends) }
    }
}

impl Drop for TxTable {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; users of raw addresses (a device) must be gone
        // (the executor unregisters the memory before the transport drops).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// The GPU's counters from the table header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TxCounters {
    /// Replies the GPU queued a SEND for.
    pub gpu_sends: u64,
    /// SEND completions the GPU reaped.
    pub gpu_completed: u64,
    /// Of those, errors or short sends.
    pub gpu_send_errors: u64,
    /// Replies the GPU handed to the host.
    pub gpu_deferred: u64,
    /// Futex wakes the GPU queued.
    pub gpu_wakes: u64,
    /// Waits for SQ room.
    pub gpu_sq_full: u64,
    /// Other completions the GPU reaped (futex wakes).
    pub gpu_other_cqes: u64,
    /// Failed futex wakes.
    pub gpu_wake_errors: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_lookup_remove_reuse() {
        let t = TxTable::new(4).unwrap();
        assert_eq!(t.capacity(), 64);
        let a = t.insert(11, 5, 0).unwrap();
        let b = t.insert(12, 6, 3).unwrap();
        assert_ne!(a, b);
        assert_eq!(t.lookup(11), Some(a));
        assert_eq!(t.lookup(12), Some(b));
        assert_eq!(t.lookup(13), None);
        assert_eq!(t.next_seq(b), 3);
        t.pass_turn(b, 4);
        assert_eq!(t.next_seq(b), 4);
        t.remove(a);
        assert_eq!(t.lookup(11), None);
        assert_eq!(t.lookup(12), Some(b), "a tombstone does not end a probe");
        let c = t.insert(11, 7, 9).unwrap();
        assert_eq!(t.lookup(11), Some(c));
        assert_eq!(t.next_seq(c), 9);
    }

    #[test]
    fn full_probe_window_refuses() {
        let t = TxTable::new(4).unwrap();
        // Cookies that all hash to the same start position fill its window.
        let log2 = t.capacity().trailing_zeros();
        let target = tx_probe(1, log2, 0);
        let same: Vec<u64> = (1u64..)
            .filter(|&c| tx_probe(c, log2, 0) == target)
            .take(TX_PROBES as usize + 1)
            .collect();
        for &c in &same[..TX_PROBES as usize] {
            assert!(t.insert(c, 1, 0).is_some());
        }
        assert_eq!(t.insert(same[TX_PROBES as usize], 1, 0), None);
        for &c in &same[..TX_PROBES as usize] {
            assert!(t.lookup(c).is_some());
        }
    }

    #[test]
    fn geometry_in_header() {
        let t = TxTable::new(1000).unwrap();
        assert_eq!(t.capacity(), 2048);
        // SAFETY: reading the header the constructor wrote; nothing else writes it.
        let h = unsafe { &*t.as_ptr().cast::<TxHeader>() };
        assert_eq!(h.capacity, 2048);
        assert_eq!(h.capacity_log2, 11);
        assert_eq!(h.entries_offset as usize, TX_HEADER_BYTES);
        assert_eq!(
            h.bufs_offset as usize,
            TX_HEADER_BYTES + 2048 * TX_ENTRY_BYTES
        );
        assert!(h.total_size as usize <= t.len());
        assert_eq!(t.len() % 4096, 0);
        assert_eq!(t.counters(), TxCounters::default());
    }
}
