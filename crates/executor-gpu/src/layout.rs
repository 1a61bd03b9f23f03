//! The executor's own device structs: the one definition. `crate::c_header` renders them into
//! `include/bgs_gpu.h`, which `src/kernels.cu` includes; the ring structs come from `bgs_ring`.
//! At start-up `bgs_layout_probe` reports every offset as the device compiler laid it out and
//! `start` compares it with `c_header::layout_table`.

use bgs_ring::RequestEntry;

/// Most slots (the scheduler's `work[]` array).
pub const MAX_SLOTS: usize = 64;
/// Repeat counts 1..=256 are sums of the graphs of 2^0 .. 2^8 repeats.
pub const REPEAT_BITS: usize = 9;
/// `SlotCtl::pos` value meaning "the request is staged in `SlotCtl::staged`".
pub const STAGED: u64 = u64::MAX;
/// Fused work graphs per slot (`BGS_GPU_FUSED`): `[compute * REPEAT_BITS + k]` runs start →
/// 2^k library calls → publish; `[FUSED_NONE]` runs start → publish (no compute).
pub const FUSED: usize = 2 * REPEAT_BITS + 1;
/// Index of the no-compute fused graph.
pub const FUSED_NONE: usize = 2 * REPEAT_BITS;

/// `struct bgs_gpu_ctl` (mapped host memory).
#[repr(C)]
#[derive(Debug, Default)]
pub struct Ctl {
    pub stop: u32,
    pub error: u32,
    pub error_where: u32,
    pub stopped: u32,
    pub full_spins: u64,
    pub chain_errors: u64,
}

/// `struct bgs_gpu_slot_ctl`.
#[repr(C)]
#[derive(Debug)]
pub struct SlotCtl {
    pub pos: u64,
    pub busy: u32,
    pub pad0: u32,
    pub pad1: [u8; 48],
    pub staged: RequestEntry,
    pub pad2: [u8; 8],
}

/// `struct bgs_gpu_slot`.
#[repr(C)]
#[derive(Debug)]
pub struct GpuSlot {
    pub conn: u64,
    pub conn_seq: u32,
    pub request_id: u32,
    pub route: u32,
    pub status: u32,
    pub out_words: u32,
    pub from_out: u32,
    pub op: u32,
    pub param: u32,
    pub words: u32,
    pub device_chain: u32,
    pub chain: [[u64; REPEAT_BITS]; 2],
    pub publish: u64,
    pub tail_hint: u64,
    pub tx: u64,
    pub sole_producer: u32,
    pub pad0: u32,
    /// The request's `publish_ns`, copied into its completion (request metrics).
    pub publish_ns: u64,
    pub pad: [u8; 24],
    pub input: [u32; 256],
    pub out: [f32; 64],
}

/// `struct bgs_gpu_sched`.
#[repr(C)]
#[derive(Debug)]
pub struct Sched {
    pub ring: u64,
    pub ctl: u64,
    pub slot_ctl: u64,
    pub self_exec: u64,
    pub nslots: u32,
    pub budget: u32,
    pub next: u32,
    pub retries: u32,
    pub work: [u64; MAX_SLOTS],
    pub executions: u64,
    pub dispatched: u64,
    pub fused: u64,
    pub tail_hint: u64,
    pub lanes: u32,
    pub batches: u32,
}

/// `struct bgs_gpu_tx` (device memory): where the send table and the GPU's io_uring ring are.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Tx {
    pub table: u64,
    pub table_host: u64,
    pub rings: u64,
    pub sqes: u64,
    pub futex_host: u64,
    pub sq_mask: u32,
    pub sq_entries: u32,
    pub cq_mask: u32,
    pub off_sq_head: u32,
    pub off_sq_tail: u32,
    pub off_cq_head: u32,
    pub off_cq_tail: u32,
    pub off_cqes: u32,
    pub reserve: u32,
    pub committed: u32,
    pub pad0: [u32; 2],
    pub pad: [u64; 5],
}
