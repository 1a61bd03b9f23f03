//! Rust mirrors of the executor's own device structs (`src/kernels.cu`). The ring structs come
//! from `bgs_ring`; `bgs_layout_probe` compares both sides on the device at start-up.

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
/// Entries reported by `bgs_layout_probe`.
pub const PROBE_LEN: usize = 31;

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
    pub pad: [u8; 36],
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

/// What `bgs_layout_probe` must report, index by index.
pub fn expected_probe() -> [u64; PROBE_LEN] {
    use bgs_ring::{CompletionEntry, RegionHeader, Slot};
    use core::mem::{offset_of, size_of};
    let req_entry = offset_of!(Slot<RequestEntry>, entry);
    let comp_entry = offset_of!(Slot<CompletionEntry>, entry);
    [
        offset_of!(RegionHeader, request_capacity),
        offset_of!(RegionHeader, request_slots_offset),
        offset_of!(RegionHeader, request_head),
        offset_of!(RegionHeader, completion_tail),
        req_entry + offset_of!(RequestEntry, words),
        req_entry + offset_of!(RequestEntry, route),
        req_entry + offset_of!(RequestEntry, payload),
        comp_entry + offset_of!(CompletionEntry, status),
        comp_entry + offset_of!(CompletionEntry, route),
        comp_entry + offset_of!(CompletionEntry, payload),
        offset_of!(SlotCtl, staged),
        offset_of!(GpuSlot, chain),
        offset_of!(GpuSlot, publish),
        offset_of!(GpuSlot, input),
        offset_of!(GpuSlot, out),
        offset_of!(Sched, work),
        size_of::<Slot<RequestEntry>>(),
        size_of::<Slot<CompletionEntry>>(),
        size_of::<SlotCtl>(),
        size_of::<GpuSlot>(),
        size_of::<Sched>(),
        size_of::<Ctl>(),
        offset_of!(Sched, dispatched),
        offset_of!(Ctl, chain_errors),
        offset_of!(GpuSlot, tail_hint),
        offset_of!(Sched, fused),
        offset_of!(GpuSlot, tx),
        offset_of!(Tx, reserve),
        offset_of!(bgs_ring::tx::TxHeader, gpu_sends),
        offset_of!(bgs_ring::tx::TxEntry, next_seq),
        size_of::<Tx>(),
    ]
    .map(|v| v as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_the_cuda_comments() {
        let p = expected_probe();
        assert_eq!(p[10], 64);
        assert_eq!(p[11], 48);
        assert_eq!(p[12], 192);
        assert_eq!(p[13], 256);
        assert_eq!(p[14], 1280);
        assert_eq!(p[15], 48);
        assert_eq!(p[18], 1152);
        assert_eq!(p[19], 1536);
        assert_eq!(p[20], 600);
        assert_eq!(p[21], 32);
        assert_eq!(p[22], 568);
        assert_eq!(p[24], 200);
        assert_eq!(p[25], 576);
        assert_eq!(p[26], 208);
        assert_eq!(p[27], 72);
        assert_eq!(p[30], 128);
    }

    /// The io_uring values `kernels.cu` writes into SQEs, against rustix's definitions of the
    /// kernel ABI.
    #[test]
    fn io_uring_abi_in_the_kernel_source() {
        use core::mem::{offset_of, size_of};
        use rustix::io_uring::{IoringOp, io_uring_cqe, io_uring_sqe};
        let src = crate::compile::KERNEL_SOURCE;
        let define = |name: &str| -> u64 {
            let line = src
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("{name} not defined in kernels.cu"));
            let v = line
                .split_whitespace()
                .nth(2)
                .unwrap()
                .trim_end_matches("ull");
            match v.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16).unwrap(),
                None => v.parse().unwrap(),
            }
        };
        assert_eq!(define("BGS_IORING_OP_SEND"), IoringOp::Send as u8 as u64);
        assert_eq!(
            define("BGS_IORING_OP_FUTEX_WAKE"),
            IoringOp::FutexWake as u8 as u64
        );
        assert_eq!(define("BGS_MSG_WAITALL"), libc_msg_waitall());
        let futex2 =
            rustix::io_uring::FutexWaitFlags::SIZE_U32 | rustix::io_uring::FutexWaitFlags::PRIVATE;
        assert_eq!(define("BGS_FUTEX2_FLAGS"), u64::from(futex2.bits()));
        assert_eq!(define("BGS_SQE_BYTES"), size_of::<io_uring_sqe>() as u64);
        assert_eq!(define("BGS_CQE_BYTES"), size_of::<io_uring_cqe>() as u64);
        // The SQE words the kernel fills: opcode @0, fd @4, off @8, addr @16, len @24,
        // op flags @28, user_data @32, addr3 @48.
        assert_eq!(offset_of!(io_uring_sqe, opcode), 0);
        assert_eq!(offset_of!(io_uring_sqe, fd), 4);
        assert_eq!(offset_of!(io_uring_sqe, off_or_addr2), 8);
        assert_eq!(offset_of!(io_uring_sqe, addr_or_splice_off_in), 16);
        assert_eq!(offset_of!(io_uring_sqe, len), 24);
        assert_eq!(offset_of!(io_uring_sqe, op_flags), 28);
        assert_eq!(offset_of!(io_uring_sqe, user_data), 32);
        assert_eq!(offset_of!(io_uring_sqe, addr3_or_cmd), 48);
        assert_eq!(offset_of!(io_uring_cqe, user_data), 0);
        assert_eq!(offset_of!(io_uring_cqe, res), 8);
    }

    fn libc_msg_waitall() -> u64 {
        libc::MSG_WAITALL as u64
    }
}
