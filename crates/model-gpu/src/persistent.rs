//! The persistent form of a step: a bucket's whole op list run by one resident kernel
//! (`bgs_persistent` in `llm_kernels.cu`) instead of one launch per op (docs/gpu-model.md,
//! "The persistent form").
//!
//! The kernel reads a table of [`OpRecord`]s, one per op of the list [`Plan`](crate::plan::Plan)
//! builds, and runs each op's kernel body as every virtual block of the op's grid, with a
//! grid barrier between ops. The bodies are the kernels' own (each `__global__` kernel is a
//! wrapper around its body), so the persistent form computes the launched form's bits; what it
//! saves is a launch and a drain per op, about 220 of them in a decode step.
//!
//! Only the crate's own kernels can be put in a table: a bucket with a cuBLAS GEMM (the
//! default projections) has no persistent form, which [`encode`] says.
//!
//! The table layout is `struct bgs_op` of `include/bgs_llm_ops.h`, generated here
//! ([`render_ops_header`]) together with the kernels' ids.

use core::mem::size_of;

use bgs_ring::c_field as field;
use bgs_ring::c_header::{CType, StructDesc, banner_with, define, emit_struct};

use crate::host::GpuDtype;
use crate::plan::{ARGMAX_THREADS, Arg, Kernel, Op};

/// File name of the header inside `include/`.
pub const OPS_HEADER_NAME: &str = "bgs_llm_ops.h";

/// Threads of a `bgs_persistent` block (`BGS_OP_THREADS`): the largest block any op but the
/// argmax is planned with (the norms, projections and GEMMs all use 256).
pub const THREADS: u32 = 256;

/// Arguments an op record holds (`BGS_OP_MAX_ARGS`): the most any kernel takes is 17
/// (`bgs_proj_norm_rope_kv`).
pub const MAX_ARGS: usize = 20;

/// The id of an op that does nothing (`BGS_OP_NOP`): a table of them times the grid
/// barriers alone.
pub const NOP_KERNEL: u32 = 0xffff;

/// At most this many bytes of one op's weights are prefetched into L2 (the LM head's hundreds
/// of megabytes would only evict what the next ops need; the H200's L2 is 60 MiB).
pub const MAX_PREFETCH_BYTES: u64 = 16 << 20;

/// One op of a persistent table (`struct bgs_op`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpRecord {
    /// The kernel's id (`BGS_OP_*`: its index in the crate's kernel list).
    pub kernel: u32,
    /// Threads per block the op was planned with.
    pub block: u32,
    /// The op's grid.
    pub gx: u32,
    pub gy: u32,
    /// Dynamic shared memory the op's blocks use (the launch reserves the largest).
    pub shared: u32,
    /// Arguments used (the rest are 0).
    pub nargs: u32,
    /// Bytes at `pf_ptr` to prefetch into L2 while this op runs (0: none).
    pub pf_ptr: u64,
    pub pf_bytes: u64,
    /// The kernel's arguments in its parameter order, each in 8 bytes: a pointer or `long
    /// long` whole, an `int` or `float` in the low 4 bytes.
    pub args: [u64; MAX_ARGS],
}

fn op_struct() -> StructDesc {
    use CType::{U32, U64};
    type R = OpRecord;
    StructDesc {
        tag: "bgs_op",
        comment: "One op of a bgs_persistent table (bgs_model_gpu::persistent::OpRecord).",
        size: size_of::<R>(),
        fields: vec![
            field!(R, kernel, U32, "BGS_OP_* kernel id"),
            field!(R, block, U32, "threads per block, as planned"),
            field!(R, gx, U32, "grid x"),
            field!(R, gy, U32, "grid y"),
            field!(R, shared, U32, "dynamic shared memory, bytes"),
            field!(R, nargs, U32, "arguments used"),
            field!(
                R,
                pf_ptr,
                U64,
                "weights to prefetch into L2 while the op runs"
            ),
            field!(R, pf_bytes, U64, "their bytes (0: none)"),
            field!(R, args, U64; MAX_ARGS, "the kernel's arguments, 8 bytes each"),
        ],
    }
}

/// The C name of a kernel's id: `BGS_OP_` and the kernel's name without `bgs_`, upper case.
pub fn kernel_id_name(kernel_name: &str) -> String {
    format!(
        "BGS_OP_{}",
        kernel_name
            .strip_prefix("bgs_")
            .unwrap_or(kernel_name)
            .to_uppercase()
    )
}

/// The text of `include/bgs_llm_ops.h`.
pub fn render_ops_header() -> String {
    let mut out = String::new();
    banner_with(
        &mut out,
        OPS_HEADER_NAME,
        "the persistent kernel's op table",
        "bgs_model_gpu::persistent",
        "BGS_BLESS=1 cargo test -p bgs-model-gpu --test c_header",
        "Included by crates/model-gpu/src/llm_kernels.cu. See docs/gpu-model.md.",
    );
    define(
        &mut out,
        "BGS_OP_THREADS",
        THREADS.to_string(),
        "threads of a bgs_persistent block",
    );
    define(
        &mut out,
        "BGS_OP_MAX_ARGS",
        MAX_ARGS.to_string(),
        "arguments of an op record",
    );
    out.push_str("\n/* Kernel ids (the crate's kernel list, in order). */\n");
    for (i, k) in Kernel::ALL.iter().enumerate() {
        define(&mut out, &kernel_id_name(k.name()), i.to_string(), k.name());
    }
    define(
        &mut out,
        "BGS_OP_NOP",
        NOP_KERNEL.to_string(),
        "nothing: the barrier alone",
    );
    out.push('\n');
    emit_struct(&mut out, &op_struct());
    out.push_str("#endif /* BGS_LLM_OPS_H */\n");
    out
}

/// The weights op `op` reads, for the L2 prefetch: (pointer, bytes), or `None` for an op
/// without a weight matrix (norms, RoPE, attention, gathers, the argmax). Argument positions
/// are those of the kernels' signatures (`Plan` builds them; the emulator tests check them).
fn weights(kernel: Kernel, args: &[Arg], dtype: GpuDtype) -> Option<(u64, u64)> {
    let p = |i: usize| match args.get(i) {
        Some(Arg::P(p)) => Some(*p),
        _ => None,
    };
    let n = |i: usize| match args.get(i) {
        Some(Arg::I(v)) => u64::try_from(*v).ok(),
        _ => None,
    };
    let es = dtype.size() as u64;
    // (The kernels `encode` refuses, the folded, small-, mid- and large-tile ones, never get
    // here.)
    let (w, rows, inp) = match kernel {
        // (w, x, y, out, in, n)
        Kernel::GemmTc | Kernel::Proj | Kernel::ProjAdd => (p(0)?, n(3)?, n(4)?),
        // (w, res, nw, eps, act, inter, in, n): gate and up rows.
        Kernel::ProjNormSilu => (p(0)?, 2 * n(5)?, n(6)?),
        // (w, res, nw, eps, qkv, bias, pos, slot, inv_freq, cache, heads, kv heads,
        // head_dim, block_size, block_stride, in, n)
        Kernel::ProjNormRopeKv => (p(0)?, (n(10)? + 2 * n(11)?) * n(12)?, n(15)?),
        _ => return None,
    };
    Some((w, rows * inp * es))
}

/// The table of `ops` for `bgs_persistent`, each op's weights prefetched into L2 while the
/// op `prefetch_distance` places before it runs (0: no prefetch). `Err` names the first op
/// the persistent kernel cannot run: a cuBLAS GEMM, a block it cannot host, too many
/// arguments.
pub(crate) fn encode(
    ops: &[Op],
    dtype: GpuDtype,
    prefetch_distance: usize,
) -> Result<Vec<OpRecord>, String> {
    let mut out = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        let (kernel, grid, block, shared, args) = match op {
            Op::Launch {
                kernel,
                grid,
                block,
                shared,
                args,
            } => (kernel, grid, block, shared, args),
            Op::Gemm(g) => {
                return Err(format!(
                    "op {i} is a cuBLAS GEMM ({}): the persistent form runs only the crate's \
                     kernels (batch_invariant_gemm or the tensor-core GEMM for the bucket)",
                    g.what
                ));
            }
        };
        let k = *kernel;
        // The bodies that synchronize their block with __syncthreads need the whole
        // persistent block; the argmax runs its 1,024 threads as virtual ones. The others
        // (no barrier, or a barrier of their own threads: attention) may have fewer.
        let fits = match k {
            Kernel::Argmax => *block == ARGMAX_THREADS,
            Kernel::AddRmsNorm
            | Kernel::Proj
            | Kernel::ProjAdd
            | Kernel::ProjNormSilu
            | Kernel::ProjNormRopeKv
            | Kernel::GemmTc => *block == THREADS,
            Kernel::GemmTcSmall
            | Kernel::GemmTcSiluSmall
            | Kernel::GemmTcAddNormSmall
            | Kernel::GemmTcRopeKvSmall
            | Kernel::GemmTcMid
            | Kernel::GemmTcSiluMid
            | Kernel::GemmTcAddNormMid
            | Kernel::GemmTcRopeKvMid
            | Kernel::GemmTcLarge
            | Kernel::GemmTcSiluLarge
            | Kernel::GemmTcLargeSplit
            | Kernel::GemmTcSiluLargeSplit => {
                return Err(format!(
                    "op {i} ({}) is a small-, mid- or large-tile tensor-core kernel, which the \
                     persistent form does not run (build its tables with the wide tiles: the \
                     same bits)",
                    k.name()
                ));
            }
            // Two 256-thread warp groups (more than a persistent block), or a norm by the
            // grid's last block (blockIdx, gridDim: a launch's, not a virtual block's): the
            // persistent tables are built with the epilogues apart, the same bits.
            // Its last block per row is a launch's (blockIdx, gridDim): the persistent tables
            // take bgs_argmax (`Plan::split_argmax` off), the same ids.
            Kernel::ArgmaxSplit => {
                return Err(format!(
                    "op {i} (bgs_argmax_split) combines its slices in the grid's last block, which \
                     the persistent form does not run (build its tables with bgs_argmax: the \
                     same ids)"
                ));
            }
            Kernel::GemmTcSilu | Kernel::GemmTcAddNorm | Kernel::GemmTcRopeKv => {
                return Err(format!(
                    "op {i} ({}) is a tensor-core GEMM with a folded epilogue, which the \
                     persistent form does not run (build its tables with the epilogues apart: \
                     the same bits)",
                    k.name()
                ));
            }
            Kernel::Embed
            | Kernel::RopeKv
            | Kernel::Attention
            | Kernel::AttentionMma
            | Kernel::SiluMul
            | Kernel::GatherRows => *block <= THREADS && block.is_multiple_of(32) && *block > 0,
        };
        if !fits {
            return Err(format!(
                "op {i} ({}) has {block}-thread blocks, which a {THREADS}-thread persistent \
                 block cannot run",
                k.name()
            ));
        }
        if args.len() > MAX_ARGS {
            return Err(format!(
                "op {i} ({}) has {} arguments, more than {MAX_ARGS}",
                k.name(),
                args.len()
            ));
        }
        if grid.0 == 0 || grid.1 == 0 {
            return Err(format!("op {i} ({}) has an empty grid", k.name()));
        }
        let mut rec = OpRecord {
            kernel: Kernel::ALL
                .iter()
                .position(|&x| x == k)
                .expect("every kernel is in Kernel::ALL") as u32,
            block: *block,
            gx: grid.0,
            gy: grid.1,
            shared: *shared,
            nargs: args.len() as u32,
            ..Default::default()
        };
        for (cell, a) in rec.args.iter_mut().zip(args) {
            *cell = match *a {
                Arg::P(p) => p,
                Arg::I(v) => u64::from(v as u32),
                Arg::F(f) => u64::from(f.to_bits()),
                Arg::L(l) => l as u64,
            };
        }
        out.push(rec);
    }
    if prefetch_distance > 0 {
        for (j, op) in ops.iter().enumerate().skip(prefetch_distance) {
            if let Op::Launch { kernel, args, .. } = op
                && let Some((p, bytes)) = weights(*kernel, args, dtype)
            {
                let r = &mut out[j - prefetch_distance];
                r.pf_ptr = p;
                r.pf_bytes = bytes.min(MAX_PREFETCH_BYTES);
            }
        }
    }
    Ok(out)
}

/// A table of `n` ops that do nothing, one virtual block each: what the grid barriers cost.
pub(crate) fn nop_table(n: usize) -> Vec<OpRecord> {
    vec![
        OpRecord {
            kernel: NOP_KERNEL,
            block: THREADS,
            gx: 1,
            gy: 1,
            ..Default::default()
        };
        n
    ]
}

/// The table as the bytes to upload (`OpRecord` is plain `repr(C)` integers, little-endian
/// on every CUDA host).
pub(crate) fn table_bytes(records: &[OpRecord]) -> Vec<u8> {
    let mut out = Vec::with_capacity(size_of_val(records));
    for r in records {
        for w in [r.kernel, r.block, r.gx, r.gy, r.shared, r.nargs] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        for w in [r.pf_ptr, r.pf_bytes].iter().chain(&r.args) {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    out
}

/// The ops of a table, back from its records (the emulator runs a persistent launch this
/// way, so the tests see what the device would read). Argument kinds come from the kernel
/// signatures' order the records were written in: `kinds[i]` for record `i`.
#[cfg(test)]
pub(crate) fn decode(records: &[OpRecord], kinds: &[Vec<char>]) -> Vec<Op> {
    records
        .iter()
        .zip(kinds)
        .map(|(r, kinds)| Op::Launch {
            kernel: Kernel::ALL[r.kernel as usize],
            grid: (r.gx, r.gy),
            block: r.block,
            shared: r.shared,
            args: r.args[..r.nargs as usize]
                .iter()
                .zip(kinds)
                .map(|(&v, k)| match k {
                    'P' => Arg::P(v),
                    'I' => Arg::I(v as u32 as i32),
                    'F' => Arg::F(f32::from_bits(v as u32)),
                    'L' => Arg::L(v as i64),
                    _ => panic!("unknown argument kind {k}"),
                })
                .collect(),
        })
        .collect()
}

/// Bytes of `table_bytes` for one record (the C struct's size).
pub const RECORD_BYTES: usize = size_of::<OpRecord>();

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Gemm;

    fn launch(kernel: Kernel, block: u32, args: Vec<Arg>) -> Op {
        Op::Launch {
            kernel,
            grid: (3, 2),
            block,
            shared: 64,
            args,
        }
    }

    #[test]
    fn records_hold_each_argument_in_its_kernels_encoding() {
        let ops = [launch(
            Kernel::AddRmsNorm,
            256,
            vec![
                Arg::P(0x1000),
                Arg::P(0),
                Arg::P(0x2000),
                Arg::P(0x3000),
                Arg::I(-7),
                Arg::F(1.5e-6),
            ],
        )];
        let r = encode(&ops, GpuDtype::Bf16, 1).unwrap();
        assert_eq!(r.len(), 1);
        let r = r[0];
        assert_eq!(r.kernel, 1, "AddRmsNorm is Kernel::ALL[1]");
        assert_eq!((r.block, r.gx, r.gy, r.shared, r.nargs), (256, 3, 2, 64, 6));
        assert_eq!(r.args[4], 0xffff_fff9, "an int in the low 4 bytes");
        assert_eq!(r.args[5], u64::from(1.5e-6f32.to_bits()));
        assert_eq!(r.args[6..], [0; MAX_ARGS - 6]);
        let bytes = table_bytes(&[r]);
        assert_eq!(bytes.len(), RECORD_BYTES);
        assert_eq!(&bytes[..4], &1u32.to_le_bytes());
        // args[4] at offset 40 + 4 * 8.
        assert_eq!(&bytes[72..80], &0xffff_fff9u64.to_le_bytes());
        let kinds = vec![vec!['P', 'P', 'P', 'P', 'I', 'F']];
        assert_eq!(decode(&[r], &kinds), ops.to_vec());
    }

    #[test]
    fn a_cublas_gemm_or_a_block_it_cannot_host_is_refused() {
        let gemm = Op::Gemm(Gemm {
            trans_a: true,
            trans_b: false,
            m: 1,
            n: 1,
            k: 1,
            a: 0,
            lda: 1,
            b: 0,
            ldb: 1,
            c: 0,
            ldc: 1,
            what: "qkv",
        });
        let e = encode(&[gemm], GpuDtype::Bf16, 1).unwrap_err();
        assert!(e.contains("cuBLAS GEMM (qkv)"), "{e}");
        // A norm needs all 256 threads (its tree is __syncthreads); attention may have fewer.
        let e = encode(
            &[launch(Kernel::AddRmsNorm, 128, vec![])],
            GpuDtype::Bf16,
            1,
        )
        .unwrap_err();
        assert!(e.contains("128-thread blocks"), "{e}");
        assert!(
            encode(
                &[launch(Kernel::AttentionMma, 128, vec![])],
                GpuDtype::Bf16,
                1
            )
            .is_ok()
        );
        assert!(encode(&[launch(Kernel::RopeKv, 512, vec![])], GpuDtype::Bf16, 1).is_err());
        assert!(encode(&[launch(Kernel::Argmax, 1024, vec![])], GpuDtype::Bf16, 1).is_ok());
        let many = vec![Arg::I(0); MAX_ARGS + 1];
        let e = encode(&[launch(Kernel::SiluMul, 256, many)], GpuDtype::Bf16, 1).unwrap_err();
        assert!(e.contains("21 arguments"), "{e}");
    }

    #[test]
    fn weights_are_prefetched_the_given_number_of_ops_ahead() {
        let gemm = |w: u64, out: i32, inp: i32| {
            launch(
                Kernel::GemmTc,
                256,
                vec![
                    Arg::P(w),
                    Arg::P(0),
                    Arg::P(0),
                    Arg::I(out),
                    Arg::I(inp),
                    Arg::I(1),
                ],
            )
        };
        let norm = launch(Kernel::AddRmsNorm, 256, vec![]);
        let ops = [
            norm.clone(),
            gemm(0x10_0000, 64, 32),
            norm.clone(),
            gemm(0x20_0000, 1 << 14, 1 << 12),
        ];
        let r = encode(&ops, GpuDtype::Bf16, 1).unwrap();
        let pf: Vec<(u64, u64)> = r.iter().map(|r| (r.pf_ptr, r.pf_bytes)).collect();
        assert_eq!(
            pf,
            [
                (0x10_0000, 64 * 32 * 2),
                (0, 0),
                // 2^14 rows of 2^12 bf16 values: 128 MiB, capped.
                (0x20_0000, MAX_PREFETCH_BYTES),
                (0, 0)
            ]
        );
        let r = encode(&ops, GpuDtype::F32, 2).unwrap();
        assert_eq!(
            (r[1].pf_ptr, r[1].pf_bytes),
            (0x20_0000, MAX_PREFETCH_BYTES)
        );
        assert_eq!(r[0].pf_bytes, 0, "nothing two ops after the first");
        assert!(
            encode(&ops, GpuDtype::F32, 0)
                .unwrap()
                .iter()
                .all(|r| r.pf_bytes == 0)
        );
    }

    #[test]
    fn kernel_ids_are_named_after_the_kernels() {
        assert_eq!(
            kernel_id_name("bgs_proj_norm_rope_kv"),
            "BGS_OP_PROJ_NORM_ROPE_KV"
        );
        let h = render_ops_header();
        assert!(h.contains("#define BGS_OP_GEMM_TC 12"), "{h}");
        assert!(h.contains("#define BGS_OP_GEMM_TC_SILU 13"), "{h}");
        assert!(h.contains("struct bgs_op {"), "{h}");
    }
}
