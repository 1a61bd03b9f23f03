// Indices of the per-CPU counters array shared by the BPF program and the loader. This file is
// the single source of truth: `lib.rs` includes it as `idx`, and `build.rs` includes it to
// generate `bgs_counters.h` (`C_<NAME>` enumerators) for the BPF C code before compiling it,
// so the two sides cannot drift.
pub const FRAMES: usize = 0;
pub const REQUESTS: usize = 1;
pub const REJECTS: usize = 2;
pub const REJECTS_DIRECT: usize = 3;
pub const BUSY: usize = 4;
pub const COMP_FULL: usize = 5;
pub const CONN_OPENED: usize = 6;
pub const CONN_CLOSED: usize = 7;
pub const CONN_REFUSED: usize = 8;
pub const EOF: usize = 9;
pub const RESET: usize = 10;
pub const BYTES: usize = 11;
pub const DROPPED_BYTES: usize = 12;
pub const NO_STATE: usize = 13;
pub const DOORBELLS: usize = 14;
pub const MARKER_FAILED: usize = 15;
pub const CLAIM_CONTENDED: usize = 16;
pub const INTERNAL: usize = 17;
pub const STATUS_BASE: usize = 20;
pub const HTTP_BASE: usize = 52;
/// Completion watch (`watch_index.rs`): watches armed for a request published while the
/// reply loop slept, looks that found a completion and rang the doorbell, looks that found
/// none, and requests that found a look already scheduled.
pub const WATCH_ARMS: usize = 64;
pub const WATCH_RINGS: usize = 65;
pub const WATCH_MISSES: usize = 66;
pub const WATCH_COVERED: usize = 67;
pub const NUM: usize = 68;
