//! One bounded MPMC queue (Vyukov's algorithm with per-slot sequence numbers) plus an
//! eventcount so consumers can sleep.
//!
//! Protocol (also in docs/ring.md, which C producers and consumers follow):
//! - push at position `pos`: the slot is free when `seq == pos` (Acquire load, which orders our
//!   writes after the previous consumer's reads); claim by CAS `tail: pos -> pos + 1`; write the
//!   entry; publish with a Release store `seq = pos + 1`.
//! - pop at position `pos`: the entry is ready when `seq == pos + 1` (Acquire load, which makes
//!   the producer's writes visible); claim by CAS `head: pos -> pos + 1`; read the entry; free
//!   the slot with a Release store `seq = pos + capacity`.
//!
//! The CAS on tail/head only arbitrates between agents of the same side; all data visibility
//! comes from the seq word, so the CASes are Relaxed.

use std::time::Duration;

use crate::layout::Entry;
use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};

/// Returned by [`Ring::try_push`] when every slot holds an entry that is not yet consumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Full;

impl core::fmt::Display for Full {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("ring is full")
    }
}

impl std::error::Error for Full {}

/// Where a ring's counters and slots live.
///
/// In normal builds they are raw pointers into the region (mapped memory that other processes,
/// BPF programs or the GPU may also touch). Under loom they are owned heap objects, because
/// loom atomics cannot be overlaid on raw memory.
#[cfg(not(loom))]
struct Backing<E> {
    tail: *const AtomicU64,
    head: *const AtomicU64,
    waiters: *const AtomicU32,
    doorbell: *const AtomicU32,
    /// Start of slot 0; slot `i` is at `slots + i * E::SLOT_SIZE`.
    slots: *mut u8,
    _entries: core::marker::PhantomData<E>,
}

#[cfg(loom)]
struct Backing<E> {
    tail: AtomicU64,
    head: AtomicU64,
    waiters: AtomicU32,
    doorbell: AtomicU32,
    seqs: Box<[AtomicU64]>,
    cells: Box<[loom::cell::UnsafeCell<E>]>,
    /// The futex model: the kernel's hash-bucket lock and its wait queue.
    futex: (loom::sync::Mutex<()>, loom::sync::Condvar),
}

/// One ring of the region: bounded, multi-producer, multi-consumer.
pub struct Ring<E: Entry> {
    backing: Backing<E>,
    capacity: u64,
    mask: u64,
}

/// The request ring.
pub type RequestRing = Ring<crate::RequestEntry>;
/// The completion ring.
pub type CompletionRing = Ring<crate::CompletionEntry>;

// SAFETY: the raw pointers refer to the region, which the owning `RingRegion` keeps alive for
// as long as the ring (the ring is only lent out by reference). All shared state is accessed
// through atomics, and entry memory only through the slot protocol, which gives one agent at a
// time exclusive access to a slot's entry. Entries are plain integers, so sending them is fine.
unsafe impl<E: Entry> Send for Ring<E> {}
// SAFETY: as for Send: every `&self` method synchronizes through atomics and the slot protocol.
unsafe impl<E: Entry> Sync for Ring<E> {}

impl<E: Entry> core::fmt::Debug for Ring<E> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Ring")
            .field("capacity", &self.capacity)
            .field("len", &self.len())
            .field("sleepers", &self.waiters().load(Ordering::Relaxed))
            .finish()
    }
}

/// Completes a claimed slot's seq store even if the user closure panics, so one panic does not
/// wedge the ring for every other agent (a stuck seq blocks that position forever).
struct SeqStore<'a> {
    seq: &'a AtomicU64,
    value: u64,
}

impl Drop for SeqStore<'_> {
    fn drop(&mut self) {
        self.seq.store(self.value, Ordering::Release);
    }
}

impl<E: Entry> Ring<E> {
    /// A ring over counters and slots in mapped memory.
    ///
    /// # Safety
    /// The pointers must be valid, 8-byte aligned (4 for the u32 words) and stay valid for the
    /// ring's lifetime; `slots` must point to `capacity` slots of `E::SLOT_SIZE` bytes whose seq
    /// words follow the protocol (initially `seq[i] = i` for a fresh ring), and the memory may
    /// only be touched by other agents through this protocol.
    #[cfg(not(loom))]
    pub(crate) unsafe fn from_raw(
        tail: *mut u64,
        head: *mut u64,
        waiters: *mut u32,
        doorbell: *mut u32,
        slots: *mut u8,
        capacity: u32,
    ) -> Self {
        debug_assert!(capacity.is_power_of_two());
        Ring {
            backing: Backing {
                tail: tail.cast_const().cast(),
                head: head.cast_const().cast(),
                waiters: waiters.cast_const().cast(),
                doorbell: doorbell.cast_const().cast(),
                slots,
                _entries: core::marker::PhantomData,
            },
            capacity: u64::from(capacity),
            mask: u64::from(capacity) - 1,
        }
    }

    /// A fresh heap-backed ring for loom models.
    #[cfg(loom)]
    pub(crate) fn new_loom(capacity: u32) -> Self {
        assert!(capacity.is_power_of_two());
        let cap = capacity as usize;
        Ring {
            backing: Backing {
                tail: AtomicU64::new(0),
                head: AtomicU64::new(0),
                waiters: AtomicU32::new(0),
                doorbell: AtomicU32::new(0),
                seqs: (0..cap as u64).map(AtomicU64::new).collect(),
                cells: (0..cap)
                    .map(|_| {
                        // SAFETY: `Entry` types are plain old data; all zeroes is a valid value.
                        loom::cell::UnsafeCell::new(unsafe { core::mem::zeroed::<E>() })
                    })
                    .collect(),
                futex: (loom::sync::Mutex::new(()), loom::sync::Condvar::new()),
            },
            capacity: u64::from(capacity),
            mask: u64::from(capacity) - 1,
        }
    }

    #[cfg(not(loom))]
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: valid, aligned and alive for `self`'s lifetime (contract of `from_raw`);
        // AtomicU64 has the layout of u64, and every access to the word is atomic.
        unsafe { &*self.backing.tail }
    }
    #[cfg(not(loom))]
    fn head(&self) -> &AtomicU64 {
        // SAFETY: as in `tail`.
        unsafe { &*self.backing.head }
    }
    #[cfg(not(loom))]
    fn waiters(&self) -> &AtomicU32 {
        // SAFETY: as in `tail`; AtomicU32 has the layout of u32.
        unsafe { &*self.backing.waiters }
    }
    #[cfg(not(loom))]
    fn doorbell(&self) -> &AtomicU32 {
        // SAFETY: as in `waiters`.
        unsafe { &*self.backing.doorbell }
    }
    #[cfg(not(loom))]
    fn slot_ptr(&self, pos: u64) -> *mut u8 {
        // `pos & mask < capacity`, so the offset stays inside the slot array.
        let index = (pos & self.mask) as usize;
        self.backing.slots.wrapping_add(index * E::SLOT_SIZE)
    }
    #[cfg(not(loom))]
    fn seq(&self, pos: u64) -> &AtomicU64 {
        // SAFETY: the slot is inside the slot array (see `slot_ptr`), its seq word is at slot
        // offset 0, 8-byte aligned because the array and `E::SLOT_SIZE` are, and it is only
        // ever accessed atomically.
        unsafe { &*self.slot_ptr(pos).cast_const().cast::<AtomicU64>() }
    }

    /// Run `f` on the entry of the slot at `pos` with exclusive access.
    ///
    /// # Safety
    /// The caller must own the slot: it claimed `pos` (tail CAS) and has not yet published it.
    #[cfg(not(loom))]
    unsafe fn with_entry_mut<R>(&self, pos: u64, f: impl FnOnce(&mut E) -> R) -> R {
        // SAFETY: the entry is at `E::ENTRY_OFFSET` inside a slot of the array, suitably aligned
        // (slots are 8-aligned, the offset is 8) and valid for any bit pattern (`Entry`). The
        // caller owns the slot, so no other agent reads or writes it until the seq store.
        f(unsafe { &mut *self.slot_ptr(pos).add(E::ENTRY_OFFSET).cast::<E>() })
    }

    /// Run `f` on the entry of the slot at `pos`.
    ///
    /// # Safety
    /// The caller must have claimed `pos` for consumption (head CAS) and not yet freed it.
    #[cfg(not(loom))]
    unsafe fn with_entry<R>(&self, pos: u64, f: impl FnOnce(&E) -> R) -> R {
        // SAFETY: as in `with_entry_mut`; the claimed consumer is the only reader and no
        // producer writes the slot before the consumer's seq store frees it.
        f(unsafe { &*self.slot_ptr(pos).add(E::ENTRY_OFFSET).cast::<E>() })
    }

    #[cfg(loom)]
    fn tail(&self) -> &AtomicU64 {
        &self.backing.tail
    }
    #[cfg(loom)]
    fn head(&self) -> &AtomicU64 {
        &self.backing.head
    }
    #[cfg(loom)]
    fn waiters(&self) -> &AtomicU32 {
        &self.backing.waiters
    }
    #[cfg(loom)]
    fn doorbell(&self) -> &AtomicU32 {
        &self.backing.doorbell
    }
    #[cfg(loom)]
    fn seq(&self, pos: u64) -> &AtomicU64 {
        &self.backing.seqs[(pos & self.mask) as usize]
    }
    /// # Safety
    /// As the non-loom version; loom additionally checks the exclusivity claim.
    #[cfg(loom)]
    unsafe fn with_entry_mut<R>(&self, pos: u64, f: impl FnOnce(&mut E) -> R) -> R {
        // SAFETY: exclusive ownership of the claimed slot (caller contract); loom's cell
        // reports a causality violation if the protocol ever breaks that.
        self.backing.cells[(pos & self.mask) as usize].with_mut(|p| f(unsafe { &mut *p }))
    }
    /// # Safety
    /// As the non-loom version.
    #[cfg(loom)]
    unsafe fn with_entry<R>(&self, pos: u64, f: impl FnOnce(&E) -> R) -> R {
        // SAFETY: the claimed consumer is the only accessor (caller contract; loom checks it).
        self.backing.cells[(pos & self.mask) as usize].with(|p| f(unsafe { &*p }))
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// Positions claimed by producers since the ring was initialized (the tail counter): a
    /// monotonic count of entries ever pushed, claimed ones included.
    pub fn produced(&self) -> u64 {
        self.tail().load(Ordering::Acquire)
    }

    /// Entries claimed by producers and not yet claimed by consumers (approximate: the two
    /// counters are read one after the other while others move them).
    pub fn len(&self) -> usize {
        // Head first: head never passes tail, so reading tail second can only overestimate.
        let head = self.head().load(Ordering::Acquire);
        let tail = self.tail().load(Ordering::Acquire);
        tail.saturating_sub(head).min(self.capacity) as usize
    }

    /// True when no entry is claimed and unconsumed (approximate, see [`Ring::len`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Claim a slot, let `fill` write the entry in place, then publish it.
    ///
    /// The slot still holds whatever its previous entry left there: `fill` must set every field
    /// a consumer will read (payload words past `words` need not be set). If `fill` panics the
    /// entry is published anyway, as far as it got, rather than wedging the ring.
    pub fn try_push(&self, fill: impl FnOnce(&mut E)) -> Result<(), Full> {
        let mut pos = self.tail().load(Ordering::Relaxed);
        loop {
            let seq = self.seq(pos).load(Ordering::Acquire);
            // Counters never wrap (u64), so the signed distance is exact.
            match (seq as i64).wrapping_sub(pos as i64) {
                0 => match self.tail().compare_exchange_weak(
                    pos,
                    pos + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => break,
                    Err(now) => pos = now,
                },
                // The slot still holds the entry from one lap ago: the ring is full.
                d if d < 0 => return Err(Full),
                // Another producer claimed `pos` already; catch up.
                _ => pos = self.tail().load(Ordering::Relaxed),
            }
        }
        let publish = SeqStore {
            seq: self.seq(pos),
            value: pos + 1,
        };
        // SAFETY: our CAS moved tail from `pos`, so no other producer can claim `pos` in this
        // lap, and consumers ignore the slot until `seq == pos + 1`, which only `publish` (on
        // drop) stores. The slot is ours alone until then.
        unsafe { self.with_entry_mut(pos, fill) };
        drop(publish);
        Ok(())
    }

    /// Take the oldest published entry, let `take` read it in place, then free the slot.
    ///
    /// Returns `None` when the ring is empty, or when the oldest claimed entry is still being
    /// written by its producer (later entries wait behind it, preserving FIFO order).
    pub fn try_pop<R>(&self, take: impl FnOnce(&E) -> R) -> Option<R> {
        let mut pos = self.head().load(Ordering::Relaxed);
        loop {
            let seq = self.seq(pos).load(Ordering::Acquire);
            match (seq as i64).wrapping_sub(pos as i64 + 1) {
                0 => match self.head().compare_exchange_weak(
                    pos,
                    pos + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => break,
                    Err(now) => pos = now,
                },
                // Not yet published at this position.
                d if d < 0 => return None,
                // Another consumer took `pos` already; catch up.
                _ => pos = self.head().load(Ordering::Relaxed),
            }
        }
        let free = SeqStore {
            seq: self.seq(pos),
            value: pos + self.capacity,
        };
        // SAFETY: our CAS moved head from `pos`, so no other consumer reads this slot, and no
        // producer writes it until `seq == pos + capacity`, which only `free` (on drop) stores.
        // Our Acquire load of `seq == pos + 1` synchronized with the producer's Release store,
        // so its writes are visible.
        let r = unsafe { self.with_entry(pos, take) };
        drop(free);
        Some(r)
    }

    /// Register as a sleeper, then decide whether the ring is empty.
    ///
    /// Returns the doorbell value to sleep on, or `None` when there is work. The fence pairs
    /// with the one in [`Ring::has_sleepers`]: see docs/ring.md ("no lost wake-ups").
    fn register_and_check(&self) -> Option<u32> {
        fence(Ordering::SeqCst);
        // Read the doorbell before the re-check: a producer that bumps it after this load makes
        // the futex wait return at once; one that bumped it before made its entry visible to
        // the re-check (the bump is a release we acquire here).
        let bell = self.doorbell().load(Ordering::SeqCst);
        if self.is_empty() { Some(bell) } else { None }
    }

    /// Consumer: if the ring looks empty, sleep until a producer's [`Ring::notify`] or until
    /// `timeout`. Returns true when the ring is probably non-empty. Spurious `true` (another
    /// consumer won the race) and spurious wake-ups are possible; callers loop on `try_pop`.
    pub fn wait_nonempty(&self, timeout: Duration) -> bool {
        if !self.is_empty() {
            return true;
        }
        let _guard = self.sleep_guard_inner();
        match self.register_and_check() {
            None => true,
            Some(bell) => {
                self.futex_wait(bell, timeout);
                !self.is_empty()
            }
        }
    }

    /// Like [`Ring::wait_nonempty`], for a sleeper whose condition is not "this ring is
    /// non-empty" (the GPU executor's completion notifier waits for requests the GPU has not
    /// answered yet, which the GPU may already have taken off the ring). `ready` is checked
    /// after registering as a sleeper and reading the doorbell, so a producer that makes it
    /// true and then calls [`Ring::notify`] cannot be missed. Returns `ready()`'s last value.
    pub fn wait_until(&self, timeout: Duration, ready: impl Fn() -> bool) -> bool {
        if ready() {
            return true;
        }
        let _guard = self.sleep_guard_inner();
        fence(Ordering::SeqCst);
        let bell = self.doorbell().load(Ordering::SeqCst);
        if ready() {
            return true;
        }
        self.futex_wait(bell, timeout);
        ready()
    }

    /// Producer, after [`Ring::try_push`]: wake sleeping consumers, if any. Costs a fence and a
    /// load when nobody sleeps.
    pub fn notify(&self) {
        if self.has_sleepers() {
            // A new doorbell value makes a consumer that is between registering and entering
            // the futex return at once instead of sleeping on a stale value.
            self.doorbell().fetch_add(1, Ordering::SeqCst);
            self.futex_wake_all();
        }
    }

    /// Count the caller as a sleeping consumer until the guard drops, for consumers that sleep
    /// elsewhere (epoll on an eventfd that producers write when [`Ring::has_sleepers`]).
    ///
    /// After taking the guard, re-check the ring (`try_pop` or `is_empty`) before sleeping:
    /// that re-check is what makes the handshake lose no wake-ups.
    pub fn sleep_guard(&self) -> SleepGuard<'_> {
        let guard = self.sleep_guard_inner();
        fence(Ordering::SeqCst);
        guard
    }

    fn sleep_guard_inner(&self) -> SleepGuard<'_> {
        self.waiters().fetch_add(1, Ordering::SeqCst);
        SleepGuard {
            waiters: self.waiters(),
        }
    }

    /// Producer, after publishing: true if some consumer sleeps or is about to. The fence
    /// orders the publish before the read of the waiter count.
    pub fn has_sleepers(&self) -> bool {
        fence(Ordering::SeqCst);
        self.waiters().load(Ordering::SeqCst) != 0
    }
}

/// Counts a consumer as sleeping on a ring until dropped (see [`Ring::sleep_guard`]).
#[must_use = "the consumer counts as a sleeper only while the guard lives"]
#[derive(Debug)]
pub struct SleepGuard<'a> {
    waiters: &'a AtomicU32,
}

impl Drop for SleepGuard<'_> {
    fn drop(&mut self) {
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(not(loom))]
impl<E: Entry> Ring<E> {
    /// Sleep while the doorbell equals `expected`, at most `timeout`. Private futexes (keyed
    /// by address space and address): every user of a region lives in one process, and the
    /// kernel refuses shared futexes on a BPF map's mapping (`EFAULT` at once: it has no page
    /// cache mapping), which made sleepers on the kernel transport's rings spin instead of
    /// sleeping. A GPU's io_uring `FUTEX_WAKE` (run by the process's SQPOLL thread) uses the
    /// private flag too.
    fn futex_wait(&self, expected: u32, timeout: Duration) {
        use rustix::thread::futex;
        let ts = futex::Timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        // EAGAIN (value already changed), EINTR and ETIMEDOUT all mean "go re-check".
        let _ = futex::wait(self.doorbell(), futex::Flags::PRIVATE, expected, Some(&ts));
    }

    fn futex_wake_all(&self) {
        use rustix::thread::futex;
        let _ = futex::wake(self.doorbell(), futex::Flags::PRIVATE, i32::MAX as u32);
    }
}

/// The loom model of a futex: the kernel compares the word and queues the waiter under a
/// bucket lock that the waker also takes. There is no timeout, so a lost wake-up shows up as
/// a deadlock that loom reports.
#[cfg(loom)]
impl<E: Entry> Ring<E> {
    fn futex_wait(&self, expected: u32, _timeout: Duration) {
        let (lock, queue) = &self.backing.futex;
        let bucket = lock.lock().unwrap();
        if self.doorbell().load(Ordering::SeqCst) == expected {
            drop(queue.wait(bucket).unwrap());
        }
    }

    fn futex_wake_all(&self) {
        let (lock, queue) = &self.backing.futex;
        let _bucket = lock.lock().unwrap();
        queue.notify_all();
    }
}

#[cfg(loom)]
impl<E: Entry> Ring<E> {
    /// A standalone heap-backed ring for loom models (loom atomics cannot live in mapped
    /// memory). Only exists under `--cfg loom`.
    #[doc(hidden)]
    pub fn new_for_loom(capacity: u32) -> Self {
        Self::new_loom(capacity)
    }
}
