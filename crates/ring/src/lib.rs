//! The shared request ring and completion ring of bpf-gpu-server.
//!
//! Both rings live in one memory region ([`RingRegion`]) with a fixed, C-compatible binary
//! layout ([`layout`], `docs/ring.md`), because the same memory is used by Rust threads, by BPF
//! programs (the mmap of a `BPF_F_MMAPABLE` array map) and by CUDA kernels (host memory
//! registered with `cuMemHostRegister`). Each ring is a bounded multi-producer multi-consumer
//! queue with per-slot sequence numbers (Vyukov), so any of those agents can produce or consume
//! with one CAS and one release store, and entries are written and read in place.
//!
//! Consumers that run out of work can sleep: [`Ring::wait_nonempty`] (futex on the ring's
//! doorbell word) or [`Ring::sleep_guard`] (for consumers that sleep in epoll), with
//! [`Ring::notify`] / [`Ring::has_sleepers`] on the producer side.
//!
//! [`c_header`] renders `include/bgs_ring.h` and `include/bgs_protocol.h` from the Rust
//! definitions; a test keeps the committed headers identical to the rendered text and compiles
//! them with the system C compiler.

pub mod c_header;
pub mod layout;
mod region;
mod ring;
mod sync;
pub mod tx;

pub use layout::{
    COMPLETION_SLOT_SIZE, CompletionEntry, DEFAULT_COMPLETION_SLOTS, DEFAULT_REQUEST_SLOTS,
    HEADER_SIZE, LAYOUT_VERSION, MAX_STREAMS, OP_CANCEL, OP_REJECT, REGION_MAGIC,
    REQUEST_SLOT_SIZE, RegionHeader, RequestEntry, SLOT_WORDS, Slot, route,
};
#[cfg(loom)]
pub use region::LOOM_STREAMS;
pub use region::{RingConfig, RingError, RingRegion};
pub use ring::{CompletionRing, Full, RequestRing, Ring, SleepGuard};

/// CLOCK_MONOTONIC in nanoseconds: the clock of [`RequestEntry::publish_ns`] (BPF's
/// `bpf_ktime_get_ns` reads the same clock).
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64) * 1_000_000_000 + t.tv_nsec as u64
}
