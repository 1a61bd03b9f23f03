//! The region: header + request slots + completion slots in one block of memory.

use core::mem::offset_of;
use core::ptr::NonNull;

use crate::layout::{
    COMPLETION_SLOT_SIZE, CompletionEntry, DEFAULT_COMPLETION_SLOTS, DEFAULT_REQUEST_SLOTS, Entry,
    Geometry, HEADER_SIZE, LAYOUT_VERSION, REGION_MAGIC, REQUEST_SLOT_SIZE, RegionHeader,
    RequestEntry, SLOT_WORDS,
};
use crate::ring::{CompletionRing, RequestRing, Ring};

/// Ring capacities, in slots. Both must be powers of two, at least 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingConfig {
    /// Request ring capacity.
    pub request_slots: u32,
    /// Completion ring capacity.
    pub completion_slots: u32,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig {
            request_slots: DEFAULT_REQUEST_SLOTS,
            completion_slots: DEFAULT_COMPLETION_SLOTS,
        }
    }
}

/// Why a region could not be created or attached.
#[derive(thiserror::Error, Debug)]
pub enum RingError {
    /// A capacity is not a power of two, or is below 2 (with one slot, a published seq would
    /// equal the next lap's free seq).
    #[error("{ring} ring capacity {capacity} is not a power of two >= 2")]
    BadCapacity {
        /// "request" or "completion".
        ring: &'static str,
        /// The rejected capacity.
        capacity: u32,
    },
    /// The capacities need more bytes than the address space has.
    #[error("ring capacities {0:?} overflow the address space")]
    TooLarge(RingConfig),
    /// The memory is smaller than the layout needs.
    #[error("region of {len} bytes is smaller than the {needed} bytes needed")]
    TooSmall {
        /// Bytes available.
        len: usize,
        /// Bytes needed.
        needed: usize,
    },
    /// The pointer is not 8-byte aligned (the counters need it; mmaps are page aligned).
    #[error("region address {0:#x} is not 8-byte aligned")]
    Misaligned(usize),
    /// The region does not start with [`REGION_MAGIC`](crate::REGION_MAGIC): not initialized.
    #[error("bad region magic {found:#018x} (not an initialized ring region)")]
    BadMagic {
        /// The first 8 bytes, as a little-endian u64.
        found: u64,
    },
    /// The region was initialized with another layout version.
    #[error("region layout version {found}, this build understands {expected}")]
    BadVersion {
        /// Version in the header.
        found: u32,
        /// [`LAYOUT_VERSION`](crate::LAYOUT_VERSION).
        expected: u32,
    },
    /// A header field disagrees with the layout this build computes.
    #[error("region header field {field} is {found}, expected {expected}")]
    BadHeader {
        /// The field's name.
        field: &'static str,
        /// Its value.
        found: u64,
        /// What this build expects.
        expected: u64,
    },
    /// The anonymous mapping failed.
    #[error("mmap of {len} bytes failed: {source}")]
    Mmap {
        /// Bytes requested.
        len: usize,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// The shared memory region holding the request ring and the completion ring.
///
/// `Send + Sync`: share it between threads with an `Arc`.
pub struct RingRegion {
    base: NonNull<u8>,
    len: usize,
    /// True when we mapped the memory ourselves and must unmap it.
    owned: bool,
    requests: RequestRing,
    completions: CompletionRing,
    /// Under loom the credit counters are loom atomics on the heap (as the rings are), so
    /// that models see [`RingRegion::ack_stream`] and the executor's loads interleave; only
    /// [`LOOM_STREAMS`] of them, to keep the models small.
    #[cfg(loom)]
    acks: Box<[crate::sync::AtomicU32]>,
}

/// Credit counters a region has under loom (instead of [`MAX_STREAMS`](crate::MAX_STREAMS)).
#[cfg(loom)]
pub const LOOM_STREAMS: usize = 4;

// SAFETY: the region is a plain block of memory; all shared mutable state in it is accessed
// through atomics and the slot protocol (see `Ring`'s Send/Sync). The base pointer is only used
// to unmap on drop and to hand the address out.
unsafe impl Send for RingRegion {}
// SAFETY: as for Send; `&self` methods only read immutable fields or go through the rings.
unsafe impl Sync for RingRegion {}

impl core::fmt::Debug for RingRegion {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("RingRegion")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("owned", &self.owned)
            .field("requests", &self.requests)
            .field("completions", &self.completions)
            .finish()
    }
}

fn check_capacity(ring: &'static str, capacity: u32) -> Result<(), RingError> {
    if capacity >= 2 && capacity.is_power_of_two() {
        Ok(())
    } else {
        Err(RingError::BadCapacity { ring, capacity })
    }
}

fn geometry(cfg: &RingConfig) -> Result<Geometry, RingError> {
    check_capacity("request", cfg.request_slots)?;
    check_capacity("completion", cfg.completion_slots)?;
    Geometry::new(cfg.request_slots, cfg.completion_slots).ok_or(RingError::TooLarge(*cfg))
}

fn check_ptr(ptr: *mut u8, len: usize, needed: usize) -> Result<NonNull<u8>, RingError> {
    let base = NonNull::new(ptr).ok_or(RingError::Misaligned(0))?;
    if !(ptr as usize).is_multiple_of(8) {
        return Err(RingError::Misaligned(ptr as usize));
    }
    if len < needed {
        return Err(RingError::TooSmall { len, needed });
    }
    Ok(base)
}

/// Pointer to a header field, without creating a reference to the (shared, mutable) header.
macro_rules! field_ptr {
    ($base:expr, $field:ident, $ty:ty) => {
        $base.add(offset_of!(RegionHeader, $field)).cast::<$ty>()
    };
}

impl RingRegion {
    /// Map a fresh anonymous shared region, zeroed and initialized.
    pub fn new(cfg: RingConfig) -> Result<Self, RingError> {
        let geo = geometry(&cfg)?;
        let len = geo.total_size;
        // SAFETY: a fresh anonymous mapping at an address the kernel picks; it aliases nothing.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                core::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
            )
        }
        .map_err(|e| RingError::Mmap {
            len,
            source: e.into(),
        })?;
        // SAFETY: the mapping is `len` bytes, page aligned, zero filled and ours alone.
        let mut region =
            unsafe { Self::init_external(ptr.cast(), len, cfg) }.inspect_err(|_| {
                // SAFETY: we just mapped it and nothing else refers to it.
                let _ = unsafe { rustix::mm::munmap(ptr, len) };
            })?;
        region.owned = true;
        Ok(region)
    }

    /// Bytes a region with these capacities needs (0 if the capacities are invalid).
    pub fn size_for(cfg: &RingConfig) -> usize {
        geometry(cfg).map_or(0, |g| g.total_size)
    }

    /// Byte offset of completion slot 0 in a region with these capacities (0 if the
    /// capacities are invalid): what BPF code that reads the completion ring is told.
    pub fn completion_offset_for(cfg: &RingConfig) -> usize {
        geometry(cfg).map_or(0, |g| g.completion_slots_offset)
    }

    /// Initialize a region in memory owned elsewhere (e.g. the mmap of a `BPF_F_MMAPABLE`
    /// array map): writes the header, zeroes the counters and sets every slot's seq to its
    /// index. Slot payloads are left as they are. The magic is stored last (Release), so an
    /// agent that attaches concurrently and sees it also sees the rest of the header.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for the lifetime of the returned
    /// value (the caller keeps the memory alive and unmaps it only after dropping the region),
    /// and no other agent may use the region while it is being initialized.
    pub unsafe fn init_external(
        ptr: *mut u8,
        len: usize,
        cfg: RingConfig,
    ) -> Result<Self, RingError> {
        let geo = geometry(&cfg)?;
        let base = check_ptr(ptr, len, geo.total_size)?;
        // SAFETY: `ptr` is valid for `len >= total_size` bytes and we have exclusive access
        // during initialization (caller contract); all offsets are inside the header or the
        // slot arrays and aligned for their types (8-aligned base, header offsets and slot
        // sizes are multiples of 8).
        unsafe {
            // Zero the header: counters, waiters, doorbells, padding and the old magic.
            ptr.write_bytes(0, HEADER_SIZE);
            field_ptr!(ptr, version, u32).write(LAYOUT_VERSION);
            field_ptr!(ptr, request_capacity, u32).write(cfg.request_slots);
            field_ptr!(ptr, completion_capacity, u32).write(cfg.completion_slots);
            field_ptr!(ptr, slot_words, u32).write(SLOT_WORDS as u32);
            field_ptr!(ptr, request_slot_size, u32).write(REQUEST_SLOT_SIZE as u32);
            field_ptr!(ptr, completion_slot_size, u32).write(COMPLETION_SLOT_SIZE as u32);
            field_ptr!(ptr, request_slots_offset, u64).write(geo.request_slots_offset as u64);
            field_ptr!(ptr, completion_slots_offset, u64).write(geo.completion_slots_offset as u64);
            field_ptr!(ptr, total_size, u64).write(geo.total_size as u64);
            init_seqs(
                ptr.add(geo.request_slots_offset),
                cfg.request_slots,
                REQUEST_SLOT_SIZE,
            );
            init_seqs(
                ptr.add(geo.completion_slots_offset),
                cfg.completion_slots,
                COMPLETION_SLOT_SIZE,
            );
            let magic = &*ptr.cast::<std::sync::atomic::AtomicU64>();
            magic.store(REGION_MAGIC, std::sync::atomic::Ordering::Release);
        }
        // SAFETY: the region is initialized and valid (caller contract, checked sizes).
        Ok(unsafe { Self::from_initialized(base, len, cfg, geo) })
    }

    /// Use a region that another agent already initialized, after validating its header.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for the lifetime of the returned
    /// value, and every other agent using the memory must follow the ring protocol.
    pub unsafe fn attach_external(ptr: *mut u8, len: usize) -> Result<Self, RingError> {
        let base = check_ptr(ptr, len, HEADER_SIZE)?;
        // SAFETY: `ptr` is valid for at least HEADER_SIZE bytes and 8-aligned. The magic is read
        // atomically (Acquire, pairing with the initializer's Release store); the other header
        // fields are immutable once the magic is set.
        let (magic, read32, read64) = unsafe {
            let magic = (*ptr.cast::<std::sync::atomic::AtomicU64>())
                .load(std::sync::atomic::Ordering::Acquire);
            let read32 = |off: usize| ptr.add(off).cast::<u32>().read();
            let read64 = |off: usize| ptr.add(off).cast::<u64>().read();
            (magic, read32, read64)
        };
        if magic != REGION_MAGIC {
            return Err(RingError::BadMagic { found: magic });
        }
        let version = read32(offset_of!(RegionHeader, version));
        if version != LAYOUT_VERSION {
            return Err(RingError::BadVersion {
                found: version,
                expected: LAYOUT_VERSION,
            });
        }
        let cfg = RingConfig {
            request_slots: read32(offset_of!(RegionHeader, request_capacity)),
            completion_slots: read32(offset_of!(RegionHeader, completion_capacity)),
        };
        let geo = geometry(&cfg)?;
        let expect = |field: &'static str, found: u64, expected: usize| {
            if found == expected as u64 {
                Ok(())
            } else {
                Err(RingError::BadHeader {
                    field,
                    found,
                    expected: expected as u64,
                })
            }
        };
        let h32 = |off| u64::from(read32(off));
        expect(
            "slot_words",
            h32(offset_of!(RegionHeader, slot_words)),
            SLOT_WORDS,
        )?;
        expect(
            "request_slot_size",
            h32(offset_of!(RegionHeader, request_slot_size)),
            REQUEST_SLOT_SIZE,
        )?;
        expect(
            "completion_slot_size",
            h32(offset_of!(RegionHeader, completion_slot_size)),
            COMPLETION_SLOT_SIZE,
        )?;
        expect(
            "request_slots_offset",
            read64(offset_of!(RegionHeader, request_slots_offset)),
            geo.request_slots_offset,
        )?;
        expect(
            "completion_slots_offset",
            read64(offset_of!(RegionHeader, completion_slots_offset)),
            geo.completion_slots_offset,
        )?;
        expect(
            "total_size",
            read64(offset_of!(RegionHeader, total_size)),
            geo.total_size,
        )?;
        if len < geo.total_size {
            return Err(RingError::TooSmall {
                len,
                needed: geo.total_size,
            });
        }
        // SAFETY: validated header; the memory is valid for `len >= total_size` bytes.
        Ok(unsafe { Self::from_initialized(base, len, cfg, geo) })
    }

    /// # Safety
    /// `base` points to an initialized region of `len >= geo.total_size` bytes matching `cfg`,
    /// valid for the lifetime of the returned value.
    #[cfg(not(loom))]
    unsafe fn from_initialized(
        base: NonNull<u8>,
        len: usize,
        cfg: RingConfig,
        geo: Geometry,
    ) -> Self {
        let p = base.as_ptr();
        // SAFETY: every pointer is inside the region, aligned, and lives as long as `Self`
        // (caller contract); the slot arrays hold `capacity` slots each (geometry).
        let (requests, completions) = unsafe {
            (
                Ring::from_raw(
                    field_ptr!(p, request_tail, u64),
                    field_ptr!(p, request_head, u64),
                    field_ptr!(p, request_waiters, u32),
                    field_ptr!(p, request_doorbell, u32),
                    p.add(geo.request_slots_offset),
                    cfg.request_slots,
                ),
                Ring::from_raw(
                    field_ptr!(p, completion_tail, u64),
                    field_ptr!(p, completion_head, u64),
                    field_ptr!(p, completion_waiters, u32),
                    field_ptr!(p, completion_doorbell, u32),
                    p.add(geo.completion_slots_offset),
                    cfg.completion_slots,
                ),
            )
        };
        RingRegion {
            base,
            len,
            owned: false,
            requests,
            completions,
        }
    }

    /// Under loom the rings are heap-backed (loom atomics cannot live in mapped memory); the
    /// mapped region only carries the header.
    ///
    /// # Safety
    /// As the non-loom version.
    #[cfg(loom)]
    unsafe fn from_initialized(
        base: NonNull<u8>,
        len: usize,
        cfg: RingConfig,
        _geo: Geometry,
    ) -> Self {
        RingRegion {
            base,
            len,
            owned: false,
            requests: Ring::new_loom(cfg.request_slots),
            completions: Ring::new_loom(cfg.completion_slots),
            acks: (0..LOOM_STREAMS)
                .map(|_| crate::sync::AtomicU32::new(0))
                .collect(),
        }
    }

    /// Start of the region (page aligned when created by [`RingRegion::new`]).
    pub fn as_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Bytes of the region (the memory given to `*_external`, or the mapping's size).
    #[allow(clippy::len_without_is_empty, reason = "a region is never empty")]
    pub fn len(&self) -> usize {
        self.len
    }

    /// The request ring (transport produces, executor consumes).
    pub fn requests(&self) -> &RequestRing {
        &self.requests
    }

    /// The completion ring (executor produces, transport consumes).
    pub fn completions(&self) -> &CompletionRing {
        &self.completions
    }

    /// The per-stream credit counters of the header ([`RegionHeader::stream_acks`]):
    /// [`MAX_STREAMS`](crate::MAX_STREAMS) of them.
    #[cfg(not(loom))]
    pub fn stream_acks(&self) -> &[crate::sync::AtomicU32] {
        // SAFETY: the header is inside the region (at least HEADER_SIZE bytes, checked when
        // the region was made or attached), `stream_acks` is 4-aligned inside it, and every
        // agent accesses these words only atomically; AtomicU32 has u32's layout. The
        // reference lives no longer than `self`, which keeps the memory mapped.
        unsafe {
            &*self
                .base
                .as_ptr()
                .add(offset_of!(RegionHeader, stream_acks))
                .cast::<[crate::sync::AtomicU32; crate::MAX_STREAMS]>()
        }
    }

    /// Under loom: heap-backed loom atomics, [`LOOM_STREAMS`] of them.
    #[cfg(loom)]
    pub fn stream_acks(&self) -> &[crate::sync::AtomicU32] {
        &self.acks
    }

    /// Acknowledge `n` disposed-of completions of credit stream `stream` (the completion's
    /// `stream` field, index + 1; 0 and out-of-range values are ignored). Called by
    /// completion consumers. Release: the executor's acquire load of the counter then also
    /// sees that the consumer is done with the completions' slots.
    pub fn ack_stream(&self, stream: u32, n: u32) {
        if n == 0 {
            return;
        }
        if let Some(c) = (stream as usize)
            .checked_sub(1)
            .and_then(|i| self.stream_acks().get(i))
        {
            c.fetch_add(n, crate::sync::Ordering::Release);
        }
    }
}

impl Drop for RingRegion {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: we mapped exactly `len` bytes at `base` in `new`; the rings, which point
            // into it, are being dropped with us and were only ever lent by reference.
            let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
        }
    }
}

/// Set slot `i`'s seq to `i` (free for the producer of position `i`).
///
/// # Safety
/// `slots` must be valid for writes of `capacity * slot_size` bytes, 8-aligned.
unsafe fn init_seqs(slots: *mut u8, capacity: u32, slot_size: usize) {
    for i in 0..capacity as usize {
        // SAFETY: slot `i` is inside the array (caller contract); seq is at slot offset 0.
        unsafe { slots.add(i * slot_size).cast::<u64>().write(i as u64) };
    }
}

// Entry offsets that `Ring` relies on for in-place access.
const _: () = {
    assert!(<RequestEntry as Entry>::ENTRY_OFFSET == 8);
    assert!(<CompletionEntry as Entry>::ENTRY_OFFSET == 8);
};

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// An 8-aligned buffer standing in for memory owned elsewhere.
    fn buffer(bytes: usize) -> Vec<u64> {
        vec![0u64; bytes.div_ceil(8)]
    }

    const SMALL: RingConfig = RingConfig {
        request_slots: 4,
        completion_slots: 8,
    };

    #[test]
    fn size_for_is_page_rounded() {
        let n = RingRegion::size_for(&SMALL);
        assert_eq!(n % 4096, 0);
        assert_eq!(n, 4096 + 4096 * 2 + 4096 * 3);
        assert_eq!(
            RingRegion::size_for(&RingConfig {
                request_slots: 3,
                completion_slots: 8
            }),
            0
        );
        assert!(RingRegion::size_for(&RingConfig::default()) > 12 << 20);
    }

    #[test]
    fn init_then_attach_external() {
        let len = RingRegion::size_for(&SMALL);
        let mut buf = buffer(len);
        let ptr = buf.as_mut_ptr().cast::<u8>();
        // SAFETY: `buf` outlives both regions and is only used through them.
        let a = unsafe { RingRegion::init_external(ptr, len, SMALL) }.unwrap();
        a.requests()
            .try_push(|e| {
                e.conn = 7;
                e.words = 1;
                e.payload[0] = 99;
            })
            .unwrap();
        // SAFETY: as above.
        let b = unsafe { RingRegion::attach_external(ptr, len) }.unwrap();
        assert_eq!(b.requests().capacity(), 4);
        assert_eq!(b.completions().capacity(), 8);
        assert_eq!(
            b.requests().try_pop(|e| (e.conn, e.payload().to_vec())),
            Some((7, vec![99]))
        );
        assert!(a.requests().is_empty());
        drop((a, b));
        // The magic is the first 8 bytes, little endian.
        assert_eq!(&buf[0].to_le_bytes(), b"BGSRING1");
    }

    /// `attach_external` over a test buffer; the tests drop every region before its buffer.
    fn attach(buf: &mut [u64], len: usize) -> Result<RingRegion, RingError> {
        assert!(len <= buf.len() * 8);
        // SAFETY: `buf` is valid for `len` bytes, 8-aligned, and outlives the region (above).
        unsafe { RingRegion::attach_external(buf.as_mut_ptr().cast(), len) }
    }

    /// `init_external` over a test buffer (same contract as `attach`).
    fn init(buf: &mut [u64], len: usize, cfg: RingConfig) -> Result<RingRegion, RingError> {
        assert!(len <= buf.len() * 8);
        // SAFETY: as in `attach`.
        unsafe { RingRegion::init_external(buf.as_mut_ptr().cast(), len, cfg) }
    }

    #[test]
    fn attach_rejects_bad_regions() {
        let len = RingRegion::size_for(&SMALL);
        let mut buf = buffer(len);
        let err = attach(&mut buf, len).unwrap_err();
        assert!(matches!(err, RingError::BadMagic { found: 0 }), "{err}");

        drop(init(&mut buf, len, SMALL).unwrap());
        // A region is valid only for memory at least as large as the header says.
        let err = attach(&mut buf, len - 1).unwrap_err();
        assert!(matches!(err, RingError::TooSmall { .. }), "{err}");
        let err = attach(&mut buf, 100).unwrap_err();
        assert!(matches!(err, RingError::TooSmall { len: 100, .. }), "{err}");

        buf[1] = 7; // layout version (offset 8) = 7, request capacity (offset 12) = 0
        let err = attach(&mut buf, len).unwrap_err();
        assert!(
            matches!(err, RingError::BadVersion { found: 7, .. }),
            "{err}"
        );

        buf[1] = u64::from(LAYOUT_VERSION) | (3 << 32); // request capacity 3
        let err = attach(&mut buf, len).unwrap_err();
        assert!(
            matches!(err, RingError::BadCapacity { capacity: 3, .. }),
            "{err}"
        );

        drop(init(&mut buf, len, SMALL).unwrap());
        buf[6] += 4096; // total_size (offset 48)
        let err = attach(&mut buf, len).unwrap_err();
        assert!(
            matches!(
                err,
                RingError::BadHeader {
                    field: "total_size",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn init_rejects_bad_config_and_memory() {
        let len = RingRegion::size_for(&SMALL);
        let mut buf = buffer(len + 8);
        let ptr = buf.as_mut_ptr().cast::<u8>();
        for (r, c) in [(3, 8), (4, 6), (0, 8), (1, 8), (4, 0)] {
            let cfg = RingConfig {
                request_slots: r,
                completion_slots: c,
            };
            // SAFETY: `buf` outlives the call; it fails before touching memory.
            let err = unsafe { RingRegion::init_external(ptr, len, cfg) }.unwrap_err();
            assert!(matches!(err, RingError::BadCapacity { .. }), "{err}");
            assert!(RingRegion::new(cfg).is_err());
        }
        // SAFETY: as above.
        let err = unsafe { RingRegion::init_external(ptr, len - 4096, SMALL) }.unwrap_err();
        assert!(matches!(err, RingError::TooSmall { .. }), "{err}");
        // SAFETY: as above.
        let err = unsafe { RingRegion::init_external(ptr.add(4), len, SMALL) }.unwrap_err();
        assert!(matches!(err, RingError::Misaligned(_)), "{err}");
    }

    #[test]
    fn new_maps_page_aligned_initialized_memory() {
        let r = RingRegion::new(RingConfig::default()).unwrap();
        assert_eq!(r.as_ptr() as usize % 4096, 0);
        assert_eq!(r.len(), RingRegion::size_for(&RingConfig::default()));
        assert_eq!(r.requests().capacity(), 4096);
        assert_eq!(r.completions().capacity(), 8192);
        // SAFETY: the mapping outlives `again`, which is dropped first and does not unmap.
        let again = unsafe { RingRegion::attach_external(r.as_ptr(), r.len()) }.unwrap();
        assert_eq!(again.completions().capacity(), 8192);
    }
}
