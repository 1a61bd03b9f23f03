//! `include/bgs_gpu.h`, generated from the Rust definitions: the executor's own device structs
//! (`src/layout.rs`), the io_uring SQE/CQE the GPU writes and reads (rustix's kernel ABI
//! types), their constants, and a device function that reports every offset and size as the
//! device compiler laid them out.
//!
//! The structs go through the ring header's generator (`bgs_ring::c_header`): every field gets
//! a `_Static_assert` on its offset (evaluated by C compilers and by clang in CUDA mode; NVRTC
//! has no `__builtin_offsetof`, which is why `bgs_gpu_layout` exists: `start` runs it on the
//! device and compares it with [`layout_table`]).
//!
//! The committed file is kept equal to [`render_gpu`] by `tests/c_header.rs`
//! (`BGS_BLESS=1 cargo test -p bgs-executor-gpu --test c_header` rewrites it).

use core::fmt::Write as _;
use core::mem::{offset_of, size_of};

use bgs_ring::c_field as field;
use bgs_ring::c_header::{CType, StructDesc, banner_with, define, emit_struct, ring_structs};
use bgs_ring::{RequestEntry, c_header::check_covers};
use rustix::io_uring::{FutexWaitFlags, IoringOp, io_uring_cqe, io_uring_sqe};

use crate::layout::{Ctl, FUSED, FUSED_NONE, GpuSlot, MAX_SLOTS, REPEAT_BITS, STAGED, Sched};
use crate::layout::{SlotCtl, Tx};

/// File name of the GPU header inside `include/`.
pub const GPU_HEADER_NAME: &str = "bgs_gpu.h";

const REQUEST_ENTRY_TAG: &str = "bgs_request_entry";
const SQE_TAG: &str = "bgs_io_uring_sqe";
const CQE_TAG: &str = "bgs_io_uring_cqe";

/// `int` in the io_uring ABI (`fd`, `res`).
const C_INT: CType = CType::Plain("int", 4);

/// The structs of `include/bgs_gpu.h`, in the order they are emitted.
pub fn gpu_structs() -> Vec<StructDesc> {
    use CType::{U8, U16, U32, U64};
    type S = io_uring_sqe;
    type Q = io_uring_cqe;
    vec![
        StructDesc {
            tag: "bgs_gpu_ctl",
            comment: "Executor control block, in mapped host memory (host writes stop; the GPU \
                      reports errors).",
            size: size_of::<Ctl>(),
            fields: vec![
                field!(
                    Ctl,
                    stop,
                    U32,
                    "host sets 1: the scheduler exits instead of relaunching"
                ),
                field!(
                    Ctl,
                    error,
                    U32,
                    "cudaError_t of a failed device-side launch, 0 if none"
                ),
                field!(
                    Ctl,
                    error_where,
                    U32,
                    "1 work launch, 2 scheduler relaunch, 3 chain launch, 4 publish launch"
                ),
                field!(Ctl, stopped, U32, "the scheduler saw stop and exited"),
                field!(
                    Ctl,
                    full_spins,
                    U64,
                    "publish found the completion ring full"
                ),
                field!(
                    Ctl,
                    chain_errors,
                    U64,
                    "repeat-chain launches that failed (answered Internal)"
                ),
            ],
        },
        StructDesc {
            tag: "bgs_gpu_slot_ctl",
            comment: "Per-slot dispatch state: device memory (device launch) or mapped host \
                      memory (host launch).",
            size: size_of::<SlotCtl>(),
            fields: vec![
                field!(SlotCtl, pos, U64, "ring position, or BGS_GPU_STAGED"),
                field!(
                    SlotCtl,
                    busy,
                    U32,
                    "1 from assignment until the completion is published"
                ),
                field!(SlotCtl, pad0, U32, ""),
                field!(SlotCtl, pad1, U8; 48, ""),
                field!(
                    SlotCtl,
                    staged,
                    CType::Struct(REQUEST_ENTRY_TAG, size_of::<RequestEntry>()),
                    "host launch copies the request here"
                ),
                field!(SlotCtl, pad2, U8; 8, ""),
            ],
        },
        StructDesc {
            tag: "bgs_gpu_slot",
            comment: "Per-slot work state, device memory. input/out are what the captured \
                      cuBLAS/cuFFT calls use.",
            size: size_of::<GpuSlot>(),
            fields: vec![
                field!(GpuSlot, conn, U64, ""),
                field!(GpuSlot, conn_seq, U32, ""),
                field!(GpuSlot, request_id, U32, ""),
                field!(GpuSlot, route, U32, ""),
                field!(GpuSlot, status, U32, ""),
                field!(GpuSlot, out_words, U32, ""),
                field!(
                    GpuSlot,
                    from_out,
                    U32,
                    "1: reply from out[], 0: from input[] (echo)"
                ),
                field!(GpuSlot, op, U32, ""),
                field!(GpuSlot, param, U32, ""),
                field!(GpuSlot, words, U32, ""),
                field!(
                    GpuSlot,
                    device_chain,
                    U32,
                    "1: the start kernel tail-launches the chain"
                ),
                field!(
                    GpuSlot,
                    chain,
                    U64; [2, REPEAT_BITS],
                    "[gemm|fft][k]: graph of 2^k repeats"
                ),
                field!(GpuSlot, publish, U64, "the slot's publish graph"),
                field!(
                    GpuSlot,
                    tail_hint,
                    U64,
                    "bgs_u64 * in device memory: a completion_tail guess"
                ),
                field!(
                    GpuSlot,
                    tx,
                    U64,
                    "struct bgs_gpu_tx * (device memory), 0: no GPU sends"
                ),
                field!(
                    GpuSlot,
                    sole_producer,
                    U32,
                    "1: this executor is the completion ring's only producer"
                ),
                field!(GpuSlot, pad0, U32, ""),
                field!(
                    GpuSlot,
                    publish_ns,
                    U64,
                    "the request's publish_ns, copied into its completion"
                ),
                field!(GpuSlot, pad, U8; 24, ""),
                field!(GpuSlot, input, U32; bgs_ring::SLOT_WORDS, "request payload"),
                field!(
                    GpuSlot,
                    out,
                    CType::Plain("float", 4); 64,
                    "library output"
                ),
            ],
        },
        StructDesc {
            tag: "bgs_gpu_sched",
            comment: "The scheduler's arguments, device memory.",
            size: size_of::<Sched>(),
            fields: vec![
                field!(Sched, ring, U64, "region base (device address)"),
                field!(Sched, ctl, U64, "struct bgs_gpu_ctl *"),
                field!(Sched, slot_ctl, U64, "struct bgs_gpu_slot_ctl[nslots]"),
                field!(Sched, self_exec, U64, "the scheduler's own graph exec"),
                field!(Sched, nslots, U32, ""),
                field!(
                    Sched,
                    budget,
                    U32,
                    "fire-and-forget launches per execution (< 120)"
                ),
                field!(
                    Sched,
                    next,
                    U32,
                    "round-robin cursor, kept across executions"
                ),
                field!(
                    Sched,
                    retries,
                    U32,
                    "launches retried (graph still finishing), all executions"
                ),
                field!(Sched, work, U64; MAX_SLOTS, "each slot's start graph"),
                field!(
                    Sched,
                    executions,
                    U64,
                    "scheduler executions (relaunches + 1)"
                ),
                field!(Sched, dispatched, U64, "requests launched by the scheduler"),
                field!(
                    Sched,
                    fused,
                    U64,
                    "bgs_u64[nslots][BGS_GPU_FUSED]: fused work graphs"
                ),
                field!(
                    Sched,
                    tail_hint,
                    U64,
                    "completion_tail guess (device memory, publish kernels)"
                ),
                field!(
                    Sched,
                    lanes,
                    U32,
                    "1: each lane launches its own graph; 0: lane 0 launches all"
                ),
                field!(
                    Sched,
                    batches,
                    U32,
                    "claims (one head CAS each), all executions"
                ),
            ],
        },
        StructDesc {
            tag: "bgs_gpu_tx",
            comment: "GPU-written SENDs: where the send table (struct bgs_tx_header / \
                      bgs_tx_entry) and the GPU's own io_uring ring live. Device memory; the \
                      host fills it once.",
            size: size_of::<Tx>(),
            fields: vec![
                field!(Tx, table, U64, "send table, device address"),
                field!(
                    Tx,
                    table_host,
                    U64,
                    "the same, host address (SQEs carry host addresses)"
                ),
                field!(
                    Tx,
                    rings,
                    U64,
                    "io_uring rings region (heads, tails, CQEs), device address"
                ),
                field!(Tx, sqes, U64, "SQE array, device address"),
                field!(
                    Tx,
                    futex_host,
                    U64,
                    "host address of the completion ring's doorbell word"
                ),
                field!(Tx, sq_mask, U32, ""),
                field!(Tx, sq_entries, U32, ""),
                field!(Tx, cq_mask, U32, ""),
                field!(Tx, off_sq_head, U32, "offsets in rings"),
                field!(Tx, off_sq_tail, U32, ""),
                field!(Tx, off_cq_head, U32, ""),
                field!(Tx, off_cq_tail, U32, ""),
                field!(Tx, off_cqes, U32, ""),
                field!(
                    Tx,
                    reserve,
                    U32,
                    "next SQ index to claim (device atomics among publish kernels)"
                ),
                field!(Tx, committed, U32, "SQ tail as last published, in order"),
                field!(Tx, pad0, U32; 2, ""),
                field!(Tx, pad, U64; 5, ""),
            ],
        },
        StructDesc {
            tag: SQE_TAG,
            comment: "struct io_uring_sqe (include/uapi/linux/io_uring.h, via rustix); unions \
                      as their unsigned words, named after rustix's fields.",
            size: size_of::<S>(),
            fields: vec![
                field!(S, opcode, U8, "IORING_OP_*"),
                field!(S, flags, U8, "IOSQE_*"),
                field!(S, ioprio, U16, ""),
                field!(S, fd, C_INT, "FUTEX_WAKE: futex2 flags"),
                field!(S, off_or_addr2, U64, "FUTEX_WAKE: count"),
                field!(S, addr_or_splice_off_in, U64, "buffer / futex address"),
                field!(S, len, U32, ""),
                field!(S, op_flags, U32, "msg_flags / futex flags"),
                field!(S, user_data, U64, ""),
                field!(S, buf, U16, "buf_index"),
                field!(S, personality, U16, ""),
                field!(S, splice_fd_in_or_file_index_or_addr_len, U32, ""),
                field!(S, addr3_or_cmd, U64; 2, "[0]: addr3 (FUTEX_WAKE: mask)"),
            ],
        },
        StructDesc {
            tag: CQE_TAG,
            comment: "struct io_uring_cqe (16-byte CQEs; no big_cqe tail).",
            size: size_of::<Q>(),
            fields: vec![
                field!(Q, user_data, U64, ""),
                field!(Q, res, C_INT, "result or -errno"),
                field!(Q, flags, U32, "IORING_CQE_F_*"),
            ],
        },
    ]
}

/// Request-entry bytes before the payload, in u32 words: the metadata the start kernel reads
/// in one parallel pass (as u64 pairs, so it must be even).
pub const ENTRY_META_WORDS: usize = offset_of!(RequestEntry, payload) / 4;
const _: () = assert!(
    ENTRY_META_WORDS.is_multiple_of(2) && offset_of!(RequestEntry, payload).is_multiple_of(4)
);

/// Every struct whose layout both Rust and the kernels rely on: the ring's and the GPU's.
fn checked_structs() -> Vec<StructDesc> {
    let mut all = ring_structs();
    all.extend(gpu_structs());
    all
}

/// What `bgs_gpu_layout` reports, entry by entry: per struct of [`checked_structs`], its size,
/// then each field's offset; with a name for error messages.
pub fn layout_table() -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for s in checked_structs() {
        check_covers(&s);
        out.push((format!("sizeof(struct {})", s.tag), s.size as u64));
        for f in &s.fields {
            out.push((format!("{}.{}", s.tag, f.name), f.offset as u64));
        }
    }
    out
}

/// The `bgs_gpu_layout` device function: the same entries as [`layout_table`], computed by
/// the device compiler.
fn render_layout_fn(out: &mut String) {
    let n = layout_table().len();
    out.push_str(
        "/* Offsets and sizes as the device compiler lays them out (NVRTC cannot evaluate the\n \
         * static asserts above): entry order is bgs_executor_gpu::c_header::layout_table, which\n \
         * the executor compares at start-up. */\n",
    );
    define(
        out,
        "BGS_GPU_LAYOUT_LEN",
        format!("{n}u"),
        "entries bgs_gpu_layout writes",
    );
    out.push_str(
        "#if defined(__CUDACC__) || defined(__CUDA__)\n\
         #define BGS_GPU_LAYOUT_OFF(type, field) \\\n\
         \x20   (bgs_u64)((const char *)&((const type *)base)->field - (const char *)base)\n\
         static __device__ __forceinline__ void bgs_gpu_layout(bgs_u64 *out) {\n\
         \x20   const char *base = (const char *)out; /* any address: only differences are stored */\n",
    );
    let mut i = 0;
    for s in checked_structs() {
        let _ = writeln!(out, "    out[{i}] = sizeof(struct {});", s.tag);
        i += 1;
        for f in &s.fields {
            let _ = writeln!(
                out,
                "    out[{i}] = BGS_GPU_LAYOUT_OFF(struct {}, {});",
                s.tag, f.name
            );
            i += 1;
        }
    }
    assert_eq!(i, n);
    out.push_str("}\n#undef BGS_GPU_LAYOUT_OFF\n#endif\n\n");
}

/// The text of `include/bgs_gpu.h`.
pub fn render_gpu() -> String {
    let mut out = String::new();
    banner_with(
        &mut out,
        GPU_HEADER_NAME,
        "the GPU executor's device structs and the io_uring ABI its kernels use",
        "bgs_executor_gpu::c_header",
        "BGS_BLESS=1 cargo test -p bgs-executor-gpu --test c_header",
        "Included by crates/executor-gpu/src/kernels.cu (CUDA, NVRTC). See docs/gpu.md.",
    );
    out.push_str(
        "#include \"bgs_ring.h\" /* struct bgs_request_entry, bgs_tx_header, bgs_tx_entry */\n\n",
    );
    // Spelled as the kernels always had them (int literals), so every expression using them
    // keeps its type.
    out.push_str("/* Executor constants (crates/executor-gpu/src/layout.rs). */\n");
    define(
        &mut out,
        "BGS_GPU_MAX_SLOTS",
        MAX_SLOTS.to_string(),
        "the scheduler's work[] array",
    );
    define(
        &mut out,
        "BGS_GPU_REPEAT_BITS",
        REPEAT_BITS.to_string(),
        "repeat counts 1..=2^BITS-1 = sums of 2^0 .. 2^(BITS-1)",
    );
    assert_eq!(STAGED, u64::MAX);
    define(
        &mut out,
        "BGS_GPU_STAGED",
        "(~0ull)".into(),
        "slot_ctl.pos: the request is staged in slot_ctl.staged",
    );
    define(
        &mut out,
        "BGS_GPU_FUSED",
        FUSED.to_string(),
        "fused graphs per slot: [compute * REPEAT_BITS + k], and [FUSED_NONE]",
    );
    define(
        &mut out,
        "BGS_GPU_FUSED_NONE",
        FUSED_NONE.to_string(),
        "start -> publish (no compute)",
    );
    define(
        &mut out,
        "BGS_GPU_ENTRY_META_WORDS",
        ENTRY_META_WORDS.to_string(),
        "u32 words of a request entry before its payload",
    );
    out.push_str(
        "BGS_STATIC_ASSERT(BGS_OFFSETOF(struct bgs_request_entry, payload) == \
         BGS_GPU_ENTRY_META_WORDS * 4, \"entry meta words\");\n",
    );

    out.push_str("\n/* The io_uring ABI (include/uapi/linux/io_uring.h, stable): values the GPU writes. */\n");
    define(
        &mut out,
        "BGS_IORING_OP_SEND",
        (IoringOp::Send as u8).to_string(),
        "",
    );
    define(
        &mut out,
        "BGS_IORING_OP_FUTEX_WAKE",
        (IoringOp::FutexWake as u8).to_string(),
        "",
    );
    define(
        &mut out,
        "BGS_MSG_WAITALL",
        format!("{:#x}", rustix::net::RecvFlags::WAITALL.bits()),
        "MSG_WAITALL: a short SEND is retried",
    );
    let futex2 = FutexWaitFlags::SIZE_U32 | FutexWaitFlags::PRIVATE;
    define(
        &mut out,
        "BGS_FUTEX2_FLAGS",
        format!("{:#x}", futex2.bits()),
        "FUTEX2_SIZE_U32 | FUTEX2_PRIVATE: the host stage sleeps on a private futex",
    );
    define(
        &mut out,
        "BGS_FUTEX_BITSET_MATCH_ANY",
        format!("{:#x}ull", u32::MAX),
        "FUTEX_BITSET_MATCH_ANY",
    );
    define(
        &mut out,
        "BGS_SQE_BYTES",
        size_of::<io_uring_sqe>().to_string(),
        "",
    );
    define(
        &mut out,
        "BGS_CQE_BYTES",
        size_of::<io_uring_cqe>().to_string(),
        "",
    );
    out.push('\n');
    for s in gpu_structs() {
        emit_struct(&mut out, &s);
    }
    out.push_str(
        "BGS_STATIC_ASSERT(sizeof(struct bgs_io_uring_sqe) == BGS_SQE_BYTES, \"sqe\");\n\
         BGS_STATIC_ASSERT(sizeof(struct bgs_io_uring_cqe) == BGS_CQE_BYTES, \"cqe\");\n\n",
    );
    render_layout_fn(&mut out);
    let _ = writeln!(out, "#endif /* BGS_GPU_H */");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_has_every_struct_and_known_offsets() {
        let h = render_gpu();
        for needle in [
            "struct bgs_gpu_ctl {",
            "struct bgs_gpu_slot_ctl {",
            "struct bgs_gpu_slot {",
            "struct bgs_gpu_sched {",
            "struct bgs_gpu_tx {",
            "struct bgs_io_uring_sqe {",
            "struct bgs_io_uring_cqe {",
            "bgs_u64 chain[2][9];",
            "float out[64];",
            "BGS_OFFSETOF(struct bgs_gpu_slot_ctl, staged) == 64",
            "BGS_OFFSETOF(struct bgs_gpu_slot, publish) == 192",
            "BGS_OFFSETOF(struct bgs_gpu_slot, input) == 256",
            "BGS_OFFSETOF(struct bgs_gpu_slot, out) == 1280",
            "BGS_OFFSETOF(struct bgs_gpu_sched, fused) == 576",
            "BGS_OFFSETOF(struct bgs_gpu_tx, reserve) == 72",
            "sizeof(struct bgs_gpu_tx) == 128",
            "sizeof(struct bgs_gpu_sched) == 600",
            "sizeof(struct bgs_gpu_slot) == 1536",
            "BGS_OFFSETOF(struct bgs_io_uring_sqe, user_data) == 32",
            "BGS_OFFSETOF(struct bgs_io_uring_sqe, addr3_or_cmd) == 48",
            "BGS_OFFSETOF(struct bgs_io_uring_cqe, res) == 8",
            "#define BGS_IORING_OP_SEND 26",
            "#define BGS_IORING_OP_FUTEX_WAKE 52",
            "#define BGS_GPU_ENTRY_META_WORDS 14",
        ] {
            assert!(h.contains(needle), "missing {needle:?}");
        }
    }

    #[test]
    fn layout_function_matches_the_table() {
        let h = render_gpu();
        let t = layout_table();
        assert!(h.contains(&format!("#define BGS_GPU_LAYOUT_LEN {}u", t.len())));
        assert!(h.contains(&format!("    out[{}] = ", t.len() - 1)));
        assert!(!h.contains(&format!("    out[{}] = ", t.len())));
        let slot = t
            .iter()
            .position(|(n, _)| n == "sizeof(struct bgs_gpu_slot)")
            .unwrap();
        assert_eq!(t[slot].1, 1536);
        assert!(h.contains(&format!("    out[{slot}] = sizeof(struct bgs_gpu_slot);")));
    }

    /// The io_uring values against libc's view of the kernel ABI (rustix generated them).
    #[test]
    fn io_uring_constants_match_libc() {
        let h = render_gpu();
        assert!(h.contains(&format!(
            "#define BGS_MSG_WAITALL {:#x} ",
            libc::MSG_WAITALL
        )));
        assert!(h.contains("#define BGS_FUTEX2_FLAGS 0x82 "));
    }
}
