// Word indices of the completion watch's control block (`watch_ctl`, one mmapable array value
// of `NUM` u64 words) shared by the BPF program and the loader. This file is the single source
// of truth: `lib.rs` includes it as `watch`, and `build.rs` includes it to generate
// `bgs_watch.h` (`W_<NAME>` enumerators) for the BPF C code. Who writes each word is in its
// comment; the other side only reads it.
/// Loader: 1 while the reply loop relies on the watch instead of the request doorbell.
pub const ON: usize = 0;
/// Loader: request-ring entries the reply loop has seen answered (final completions and the
/// cancel markers it published); `request_tail` minus this is what the executor still holds.
pub const ANSWERED: usize = 1;
/// BPF (the loader sets the first value): delay from a request's publish to the first look,
/// learned from the looks (ns).
pub const FIRST_NS: usize = 2;
/// Loader: longest gap between two looks (ns).
pub const MAX_NS: usize = 3;
/// BPF: 1 while a look is scheduled (the timer is armed or its callback runs).
pub const ARMED: usize = 4;
/// BPF: gap before the scheduled look (ns).
pub const DELAY_NS: usize = 5;
/// BPF: when the watch was armed for a request (ns, CLOCK_MONOTONIC).
pub const ARMED_AT: usize = 6;
/// BPF: looks since it was armed.
pub const LOOKS: usize = 7;
/// BPF: the timer's state: 0 not initialized, 1 being initialized, 2 ready (callback set).
pub const TIMER_STATE: usize = 8;
pub const NUM: usize = 9;
