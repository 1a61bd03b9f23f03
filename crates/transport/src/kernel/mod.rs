//! The kernel-owned transport: eBPF frames and admits requests; replies leave through
//! io_uring. See docs/kernel.md.

pub mod reply;
