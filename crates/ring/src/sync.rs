//! The atomics the ring algorithm uses: std's in normal builds, loom's under `--cfg loom`.
//!
//! Only the algorithm goes through this module. The region header's fixed-layout fields are
//! plain integers in the `#[repr(C)]` structs; in normal builds they are viewed as std atomics
//! in place (same size and alignment as the integers). Loom atomics cannot live in mapped
//! memory, so under loom each ring owns heap-allocated counters and slots instead.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, fence};

pub(crate) use std::sync::atomic::Ordering;
