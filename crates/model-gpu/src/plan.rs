//! The step as data: the device buffers, the weights' device images, and the list of kernel
//! launches and GEMMs (with their exact arguments) one bucket runs. `GpuModel` executes the
//! list on the GPU (and captures it into graphs); the tests execute the same list on an
//! emulator of the kernels and of `cublasGemmEx` (`crate::emu`), so argument order, offsets,
//! GEMM orientation and buffer sizes are checked without a GPU.

use bgs_model::{ModelConfig, Weights};

use crate::host::{self, GpuDtype, StepGeometry};
use crate::model::GpuModelError;

/// Threads of `bgs_add_rmsnorm` blocks (`BGS_NORM_THREADS` in the kernels).
pub(crate) const NORM_THREADS: u32 = 256;
/// Threads of `bgs_argmax` blocks (`BGS_ARGMAX_THREADS`).
pub(crate) const ARGMAX_THREADS: u32 = 1024;
/// Threads of `bgs_argmax_split` blocks (`-DBGS_ARGMAX_SPLIT_THREADS`, a power of two).
pub const ARGMAX_SPLIT_THREADS: u32 = 512;
/// Slices of a row `bgs_argmax_split` scans in as many blocks (the launched LM head's argmax;
/// the persistent form keeps `bgs_argmax`'s one block a row). 151,936 logits in 32 slices of
/// 4,748: about 9 a thread.
pub(crate) const ARGMAX_PARTS: usize = 32;
/// Tokens per block of the fused form's projections (`BGS_PROJ_TOKENS`).
pub(crate) const PROJ_TOKENS: usize = 8;
/// Warps per block of the fused form's projections (`BGS_PROJ_WARPS`; 256 threads, the
/// norm prologue's `BGS_NORM_THREADS`).
pub(crate) const PROJ_WARPS: usize = 8;
/// Shared memory of the norm prologue's tree (`sh` in `proj_norm_prologue`), which the
/// dynamic `xs` rows come on top of.
const PROJ_STATIC_SHARED: usize = PROJ_TOKENS * NORM_THREADS as usize * 4;
/// Warps of a `bgs_gemm_tc` block (`-DBGS_TC_WARPS`): the input width's 32-value chunks are
/// dealt out to them round-robin.
pub const TC_WARPS: usize = 8;
/// Tokens of a `bgs_gemm_tc` block (`-DBGS_TC_TOKENS`, a multiple of 8: the MMA's columns).
pub const TC_TOKENS: usize = 32;
/// Tokens of a block of the tensor-core kernels' small-tile entry points (`bgs_gemm_tc_small`
/// and the others' `_small` forms, `-DBGS_TC_SMALL_TOKENS`): buckets of at most this many
/// tokens (decode at small batch) run them where [`Plan::tc_small_tiles`] is on. Fragments for
/// 8 tokens instead of 32 take fewer registers, so more blocks share a multiprocessor; every
/// output is the same sum in the same order, so the same bits as the wide tiles.
pub const TC_SMALL_TOKENS: usize = 8;
/// Tokens of a block of the tensor-core kernels' mid-tile entry points (`bgs_gemm_tc_mid` and
/// the others' `_mid` forms, `-DBGS_TC_MID_TOKENS`): buckets of more than [`TC_SMALL_TOKENS`]
/// and at most [`Plan::tc_mid_max_tokens`] tokens run them, in one token block where the small
/// tiles take two, each loading the weights again. Staged like the small tiles
/// ([`TC_STAGED_KERNELS`]); the same bits as the small and the wide tiles.
pub const TC_MID_TOKENS: usize = 16;
/// Chunks whose weights a warp of a small or mid tile loads ahead (`-DBGS_TC_SMALL_UNROLL`; the
/// wide tiles load 4): registers against loads in flight. (At 4 the mid tiles' SiLU GEMM
/// meets its 128-register launch bound with 12 bytes spilled, outside its loops.)
pub const TC_SMALL_UNROLL: usize = 4;
/// Warp rows of a block of the tensor-core kernels' large-tile entry points
/// (`bgs_gemm_tc_large`, `bgs_gemm_tc_silu_large`; `-DBGS_TC_LARGE_WARP_ROWS`): a block's
/// [`TC_WARPS`] warps stand in this many rows of `TC_WARPS / TC_LARGE_WARP_ROWS` warps, each
/// warp's tile 32 weight rows (two 16-row MMA tiles) by [`TC_LARGE_WARP_TOKENS`] tokens.
pub const TC_LARGE_WARP_ROWS: usize = 2;
/// Tokens of one warp's tile in the large-tile entry points (`-DBGS_TC_LARGE_WARP_TOKENS`, a
/// multiple of 8: the MMA's columns).
pub const TC_LARGE_WARP_TOKENS: usize = 16;
/// 32-value chunks of the input width a stage of the large tiles' shared-memory pipeline holds
/// (`-DBGS_TC_LARGE_CHUNKS`): chunks of one class (w, w + 8, ...: a wide-tile warp's chunks).
pub const TC_LARGE_CHUNKS: usize = 4;
/// Stages of the large tiles' `cp.async` pipeline (`-DBGS_TC_LARGE_STAGES`).
pub const TC_LARGE_STAGES: usize = 3;
/// Weight rows of a `bgs_gemm_tc_large` block: 32 a warp row ([`TC_LARGE_WARP_ROWS`] of them,
/// 64). A `bgs_gemm_tc_silu_large` block pairs half as many gate rows with the same up rows.
pub const TC_LARGE_ROWS: usize = 32 * TC_LARGE_WARP_ROWS;
/// Tokens of a block of the large-tile entry points: [`TC_LARGE_WARP_TOKENS`] a warp column,
/// `TC_WARPS / TC_LARGE_WARP_ROWS` of them (64). Buckets of at least
/// [`Plan::tc_large_min_tokens`] tokens run them: a block reads its weights once for this many
/// tokens and its activations once for [`TC_LARGE_ROWS`] rows, both staged through shared
/// memory; the same bits as the wide tiles.
pub const TC_LARGE_TOKENS: usize = (TC_WARPS / TC_LARGE_WARP_ROWS) * TC_LARGE_WARP_TOKENS;
/// Dynamic shared memory of every large-tile launch: [`TC_LARGE_STAGES`] stages of
/// [`TC_LARGE_CHUNKS`] chunks of the block's [`TC_LARGE_ROWS`] weight rows and
/// [`TC_LARGE_TOKENS`] activation rows, 64 bytes a row and chunk (98,304 bytes, whatever the
/// input width). More than a block gets without the opt-in: the host allows it with
/// `cuFuncSetAttribute`, and turns the large tiles off where the device's opt-in limit is
/// smaller.
pub const fn tc_large_shared_bytes() -> usize {
    TC_LARGE_STAGES * TC_LARGE_CHUNKS * (TC_LARGE_ROWS + TC_LARGE_TOKENS) * 64
}
/// The large-tile entry points, split or not (not staged by [`Plan::tc_stage`]'s rules: they
/// always stage through their own pipeline, [`tc_large_shared_bytes`]).
pub(crate) const TC_LARGE_KERNELS: [Kernel; 4] = [
    Kernel::GemmTcLarge,
    Kernel::GemmTcSiluLarge,
    Kernel::GemmTcLargeSplit,
    Kernel::GemmTcSiluLargeSplit,
];
/// Class groups of a split large tile at most: a tile's 8 classes of input chunks (chunks w,
/// w + 8, ...), each class summed by one block at most ([`Plan::tc_large_split`]).
pub const TC_LARGE_SPLIT_MAX: usize = 8;
/// Input chunks a block of a split large tile takes at least (the device's
/// [`Plan::tc_large_split_min_chunks`]): a projection of `c` chunks splits over at most
/// `c / TC_LARGE_SPLIT_MIN_CHUNKS` blocks a tile ([`Plan::tc_large_split_groups`]; fewer than 2:
/// the wide tiles). A split block's fixed cost (its pipeline's first stages,
/// its class sums' stores, the last block's reads of them) needs a long enough chain to pay:
/// on an H100 with every short projection split over 8 (the Qwen2.5-0.5B shape's o and QKV,
/// 28 chunks: 3-4 a block) the split kernels' time at 256 tokens was that of the wide tiles
/// (1.78 against 1.79 ms a step), and SmolLM2-135M's gate/up (18 chunks) split made its
/// 64-token step 1.55 ms against 1.18 (`bench/results/20261207-gpu-tc-large-split-h100`).
pub const TC_LARGE_SPLIT_MIN_CHUNKS: usize = 16;
/// Bytes of one class sum of one large tile in the split form's scratch (`part`): every output
/// of the tile in f32, 16 KB.
pub const TC_LARGE_SPLIT_PART_BYTES: usize = TC_LARGE_ROWS * TC_LARGE_TOKENS * 4;
/// Row tiles a block of a staged small-tile GEMM takes at most (`-DBGS_TC_STAGE_MAX`; see
/// [`Plan::tc_stage`]).
pub const TC_STAGE_MAX: usize = 4;
/// The small- and mid-tile entry points that stage their weights in shared memory where the
/// launch gives them room ([`Plan::tc_stage`]).
pub(crate) const TC_STAGED_KERNELS: [Kernel; 6] = [
    Kernel::GemmTcSmall,
    Kernel::GemmTcSiluSmall,
    Kernel::GemmTcAddNormSmall,
    Kernel::GemmTcMid,
    Kernel::GemmTcSiluMid,
    Kernel::GemmTcAddNormMid,
];
/// Shared memory kept back from a staged block's opt-in limit for the kernels' static shared
/// memory (their partial sums: at most ~11 KB for the small tiles; the mid tiles keep back
/// more, [`tc_stage_kernel_bytes`]).
const TC_STAGE_RESERVE: usize = 16 * 1024;
/// Static shared memory of the largest staged block of tile width `tok`, the SiLU GEMM's: two
/// warp groups' partial sums and the gate and up values, `[16][tok + 1]` floats each (10,368
/// bytes for the small tiles, 19,584 for the mid ones: ptxas's counts).
fn tc_silu_static_shared(tok: usize) -> usize {
    2 * (TC_WARPS + 1) * TC_ROWS * (tok + 1) * 4
}
/// The dynamic shared memory a staged launch of `kernel` may take out of `budget`
/// ([`tc_stage_budget`], which keeps back the small tiles' static shared memory): less what
/// wider partial sums take beyond the small tiles' (9 KB for the mid tiles), so that static
/// and dynamic memory together stay within the block's opt-in limit.
pub(crate) fn tc_stage_kernel_bytes(kernel: Kernel, budget: usize) -> usize {
    let tok = kernel.tc_tile_tokens().unwrap_or(TC_SMALL_TOKENS);
    let wider = tc_silu_static_shared(tok).saturating_sub(tc_silu_static_shared(TC_SMALL_TOKENS));
    budget.saturating_sub(wider)
}
/// Bytes one warp stages for one tile of a projection of input width `inp`: its
/// ceil(chunks / TC_WARPS) chunks, 2 × 16 bytes a lane each (`TC_STAGE_U4` in the kernels).
fn tc_stage_warp_bytes(inp: usize) -> usize {
    (inp / TC_CHUNK).div_ceil(TC_WARPS) * 64 * 16
}
/// The dynamic shared memory a staged block may take on a device whose blocks may hold
/// `optin` bytes.
pub(crate) fn tc_stage_budget(optin: usize) -> usize {
    optin.saturating_sub(TC_STAGE_RESERVE)
}
/// When the small tiles stage their weights ([`Plan::tc_stage`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcStaging {
    /// Dynamic shared memory a staged block may take (0: never staged).
    pub bytes: usize,
    /// Stage a projection whose warps would take at least this many rounds of
    /// [`TC_SMALL_UNROLL`] chunks' loads into registers (0: never for that reason).
    pub min_rounds: usize,
    /// Stage a projection with more row tiles than multiprocessors (more than one wave).
    pub waves: bool,
}

impl From<&crate::GpuModelOptions> for TcStaging {
    /// The options' rules; `bytes` 0 (the device decides it).
    fn from(o: &crate::GpuModelOptions) -> TcStaging {
        TcStaging {
            bytes: 0,
            min_rounds: o.tensor_core_stage_min_rounds,
            waves: o.tensor_core_stage_waves,
        }
    }
}

/// [`Plan::tc_stage`] on a device of `sms` multiprocessors.
fn tc_stage(
    kernel: Kernel,
    groups: usize,
    rows: usize,
    inp: usize,
    sms: usize,
    rule: &TcStaging,
) -> Option<(u32, u32)> {
    if rule.bytes == 0 || !TC_STAGED_KERNELS.contains(&kernel) {
        return None;
    }
    let tiles = rows.div_ceil(TC_ROWS);
    let sms = sms.max(1);
    let rounds = (inp / TC_CHUNK)
        .div_ceil(TC_WARPS)
        .div_ceil(TC_SMALL_UNROLL);
    let by_rounds = rule.min_rounds > 0 && rounds >= rule.min_rounds;
    let by_waves = rule.waves && tiles > sms;
    if !(by_rounds || by_waves) {
        return None;
    }
    let gx = tiles.min(sms);
    let mine = tiles.div_ceil(gx);
    let bytes = mine * groups * TC_WARPS * tc_stage_warp_bytes(inp);
    (mine <= TC_STAGE_MAX && bytes <= tc_stage_kernel_bytes(kernel, rule.bytes))
        .then_some((gx as u32, bytes as u32))
}
/// Output rows of a `bgs_gemm_tc` block (the MMA's 16 rows).
pub(crate) const TC_ROWS: usize = 16;
/// Values of one `bgs_gemm_tc` chunk: a projection's input width must be a multiple of it.
pub(crate) const TC_CHUNK: usize = 32;
/// Shared memory a block may use without an opt-in.
const MAX_BLOCK_SHARED: usize = 48 * 1024;

/// The kernels of `llm_kernels.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    Embed,
    AddRmsNorm,
    RopeKv,
    Attention,
    AttentionMma,
    SiluMul,
    GatherRows,
    Argmax,
    Proj,
    ProjAdd,
    ProjNormSilu,
    ProjNormRopeKv,
    GemmTc,
    GemmTcSilu,
    GemmTcAddNorm,
    GemmTcRopeKv,
    GemmTcSmall,
    GemmTcSiluSmall,
    GemmTcAddNormSmall,
    GemmTcRopeKvSmall,
    /// (After the kernels before it, so that the persistent op ids, which follow this order,
    /// stay as they were; later kernels come after it for the same reason.)
    ArgmaxSplit,
    GemmTcMid,
    GemmTcSiluMid,
    GemmTcAddNormMid,
    GemmTcRopeKvMid,
    GemmTcLarge,
    GemmTcSiluLarge,
    GemmTcLargeSplit,
    GemmTcSiluLargeSplit,
}

impl Kernel {
    pub(crate) const ALL: [Kernel; 29] = [
        Kernel::Embed,
        Kernel::AddRmsNorm,
        Kernel::RopeKv,
        Kernel::Attention,
        Kernel::AttentionMma,
        Kernel::SiluMul,
        Kernel::GatherRows,
        Kernel::Argmax,
        Kernel::Proj,
        Kernel::ProjAdd,
        Kernel::ProjNormSilu,
        Kernel::ProjNormRopeKv,
        Kernel::GemmTc,
        Kernel::GemmTcSilu,
        Kernel::GemmTcAddNorm,
        Kernel::GemmTcRopeKv,
        Kernel::GemmTcSmall,
        Kernel::GemmTcSiluSmall,
        Kernel::GemmTcAddNormSmall,
        Kernel::GemmTcRopeKvSmall,
        Kernel::ArgmaxSplit,
        Kernel::GemmTcMid,
        Kernel::GemmTcSiluMid,
        Kernel::GemmTcAddNormMid,
        Kernel::GemmTcRopeKvMid,
        Kernel::GemmTcLarge,
        Kernel::GemmTcSiluLarge,
        Kernel::GemmTcLargeSplit,
        Kernel::GemmTcSiluLargeSplit,
    ];

    /// The `extern "C"` name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kernel::Embed => "bgs_embed",
            Kernel::AddRmsNorm => "bgs_add_rmsnorm",
            Kernel::RopeKv => "bgs_rope_kv",
            Kernel::Attention => "bgs_attention",
            Kernel::AttentionMma => "bgs_attention_mma",
            Kernel::SiluMul => "bgs_silu_mul",
            Kernel::GatherRows => "bgs_gather_rows",
            Kernel::Argmax => "bgs_argmax",
            Kernel::ArgmaxSplit => "bgs_argmax_split",
            Kernel::Proj => "bgs_proj",
            Kernel::ProjAdd => "bgs_proj_add",
            Kernel::ProjNormSilu => "bgs_proj_norm_silu",
            Kernel::ProjNormRopeKv => "bgs_proj_norm_rope_kv",
            Kernel::GemmTc => "bgs_gemm_tc",
            Kernel::GemmTcSilu => "bgs_gemm_tc_silu",
            Kernel::GemmTcAddNorm => "bgs_gemm_tc_add_norm",
            Kernel::GemmTcRopeKv => "bgs_gemm_tc_rope_kv",
            Kernel::GemmTcSmall => "bgs_gemm_tc_small",
            Kernel::GemmTcSiluSmall => "bgs_gemm_tc_silu_small",
            Kernel::GemmTcAddNormSmall => "bgs_gemm_tc_add_norm_small",
            Kernel::GemmTcRopeKvSmall => "bgs_gemm_tc_rope_kv_small",
            Kernel::GemmTcMid => "bgs_gemm_tc_mid",
            Kernel::GemmTcSiluMid => "bgs_gemm_tc_silu_mid",
            Kernel::GemmTcAddNormMid => "bgs_gemm_tc_add_norm_mid",
            Kernel::GemmTcRopeKvMid => "bgs_gemm_tc_rope_kv_mid",
            Kernel::GemmTcLarge => "bgs_gemm_tc_large",
            Kernel::GemmTcSiluLarge => "bgs_gemm_tc_silu_large",
            Kernel::GemmTcLargeSplit => "bgs_gemm_tc_large_split",
            Kernel::GemmTcSiluLargeSplit => "bgs_gemm_tc_silu_large_split",
        }
    }

    /// The small-tile entry point of a tensor-core kernel (itself for the others).
    pub(crate) fn small(self) -> Kernel {
        match self {
            Kernel::GemmTc => Kernel::GemmTcSmall,
            Kernel::GemmTcSilu => Kernel::GemmTcSiluSmall,
            Kernel::GemmTcAddNorm => Kernel::GemmTcAddNormSmall,
            Kernel::GemmTcRopeKv => Kernel::GemmTcRopeKvSmall,
            k => k,
        }
    }

    /// The mid-tile entry point of a tensor-core kernel (itself for the others).
    pub(crate) fn mid(self) -> Kernel {
        match self {
            Kernel::GemmTc => Kernel::GemmTcMid,
            Kernel::GemmTcSilu => Kernel::GemmTcSiluMid,
            Kernel::GemmTcAddNorm => Kernel::GemmTcAddNormMid,
            Kernel::GemmTcRopeKv => Kernel::GemmTcRopeKvMid,
            k => k,
        }
    }

    /// The large-tile entry point of a tensor-core kernel that has one (the plain GEMM and the
    /// gate/up SiLU GEMM; itself for the others, the add-norm and RoPE/KV forms included).
    pub(crate) fn large(self) -> Kernel {
        match self {
            Kernel::GemmTc => Kernel::GemmTcLarge,
            Kernel::GemmTcSilu => Kernel::GemmTcSiluLarge,
            k => k,
        }
    }

    /// The split form of a large-tile entry point (itself for the others).
    pub(crate) fn split(self) -> Kernel {
        match self {
            Kernel::GemmTcLarge => Kernel::GemmTcLargeSplit,
            Kernel::GemmTcSiluLarge => Kernel::GemmTcSiluLargeSplit,
            k => k,
        }
    }

    /// Whether this is a large-tile entry point, split or not ([`TC_LARGE_KERNELS`]).
    pub(crate) fn is_tc_large(self) -> bool {
        TC_LARGE_KERNELS.contains(&self)
    }

    /// Whether this is a split large-tile entry point ([`Plan::tc_large_split`]).
    pub(crate) fn is_tc_large_split(self) -> bool {
        matches!(
            self,
            Kernel::GemmTcLargeSplit | Kernel::GemmTcSiluLargeSplit
        )
    }

    /// The wide-tile kernel a small-, mid- or large-tile entry point computes the same bits as
    /// (itself for the others): what the emulator (test builds only) matches on.
    #[cfg(test)]
    pub(crate) fn wide(self) -> Kernel {
        match self {
            Kernel::GemmTcSmall
            | Kernel::GemmTcMid
            | Kernel::GemmTcLarge
            | Kernel::GemmTcLargeSplit => Kernel::GemmTc,
            Kernel::GemmTcSiluSmall
            | Kernel::GemmTcSiluMid
            | Kernel::GemmTcSiluLarge
            | Kernel::GemmTcSiluLargeSplit => Kernel::GemmTcSilu,
            Kernel::GemmTcAddNormSmall | Kernel::GemmTcAddNormMid => Kernel::GemmTcAddNorm,
            Kernel::GemmTcRopeKvSmall | Kernel::GemmTcRopeKvMid => Kernel::GemmTcRopeKv,
            k => k,
        }
    }

    /// Tokens of a block of a tensor-core kernel ([`TC_TOKENS`], [`TC_LARGE_TOKENS`],
    /// [`TC_MID_TOKENS`] or [`TC_SMALL_TOKENS`]), or `None` for the others.
    pub(crate) fn tc_tile_tokens(self) -> Option<usize> {
        match self {
            Kernel::GemmTcLarge
            | Kernel::GemmTcSiluLarge
            | Kernel::GemmTcLargeSplit
            | Kernel::GemmTcSiluLargeSplit => Some(TC_LARGE_TOKENS),
            Kernel::GemmTc | Kernel::GemmTcSilu | Kernel::GemmTcAddNorm | Kernel::GemmTcRopeKv => {
                Some(TC_TOKENS)
            }
            Kernel::GemmTcMid
            | Kernel::GemmTcSiluMid
            | Kernel::GemmTcAddNormMid
            | Kernel::GemmTcRopeKvMid => Some(TC_MID_TOKENS),
            Kernel::GemmTcSmall
            | Kernel::GemmTcSiluSmall
            | Kernel::GemmTcAddNormSmall
            | Kernel::GemmTcRopeKvSmall => Some(TC_SMALL_TOKENS),
            _ => None,
        }
    }

    /// Units of the row dimension a block of a tensor-core kernel covers (its grid's x is the
    /// rows over this, rounded up): output rows of the plain GEMM, the add-norm and the
    /// RoPE/KV forms, gate/up row pairs (`inter` units) of the SiLU GEMM. [`TC_ROWS`] (the
    /// MMA's 16: the SiLU GEMM's two warp groups each take the 16 rows of its half) for every
    /// tile width but the large one: [`TC_LARGE_ROWS`] for `bgs_gemm_tc_large`, half as many
    /// gate/up pairs for `bgs_gemm_tc_silu_large` (32 gate rows with the same 32 up rows).
    /// `None` for the other kernels.
    pub(crate) fn tc_tile_rows(self) -> Option<usize> {
        match self {
            Kernel::GemmTcLarge | Kernel::GemmTcLargeSplit => Some(TC_LARGE_ROWS),
            Kernel::GemmTcSiluLarge | Kernel::GemmTcSiluLargeSplit => Some(TC_LARGE_ROWS / 2),
            k => k.tc_tile_tokens().map(|_| TC_ROWS),
        }
    }
}

/// A kernel argument, in the kernel's parameter order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Arg {
    /// A device pointer (0 = null).
    P(u64),
    /// `int`.
    I(i32),
    /// `float`.
    F(f32),
    /// `long long`.
    L(i64),
}

/// One `cublasGemmEx` call: column-major `C (m × n, ldc) = op(A) · op(B)`, A and B in the
/// model's dtype, C in f32, alpha 1, beta 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Gemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub a: u64,
    pub lda: i32,
    pub b: u64,
    pub ldb: i32,
    pub c: u64,
    pub ldc: i32,
    pub what: &'static str,
}

/// One operation of a step.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Op {
    Launch {
        kernel: Kernel,
        grid: (u32, u32),
        block: u32,
        /// Dynamic shared memory in bytes.
        shared: u32,
        args: Vec<Arg>,
    },
    Gemm(Gemm),
}

/// Device memory the model can allocate and fill (the GPU, or the tests' emulator).
pub(crate) trait DeviceMem {
    /// `bytes` zeroed bytes.
    fn alloc(&mut self, bytes: usize, what: &str) -> Result<u64, GpuModelError>;
    /// A new allocation holding `bytes`.
    fn upload(&mut self, bytes: &[u8], what: &str) -> Result<u64, GpuModelError>;
}

/// One decoder layer on the device.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct DevLayer {
    pub input_norm: u64,
    pub qkv: u64,
    /// 0 when the model has no q/k/v biases.
    pub qkv_bias: u64,
    pub o: u64,
    pub post_norm: u64,
    pub gate_up: u64,
    pub down: u64,
}

/// The weights on the device.
#[derive(Debug, Default, Clone)]
pub(crate) struct DevWeights {
    pub embed: u64,
    pub lm_head: u64,
    pub final_norm: u64,
    pub layers: Vec<DevLayer>,
    /// Bytes uploaded.
    pub bytes: usize,
}

/// Upload `w` in `dt` (norms and biases in f32; fused QKV, QKV bias and gate/up).
pub(crate) fn upload_weights(
    d: &mut impl DeviceMem,
    w: &Weights,
    dt: GpuDtype,
) -> Result<DevWeights, GpuModelError> {
    let mut bytes = 0usize;
    let mut put = |d: &mut _, data: Vec<u8>, what: &str| {
        bytes += data.len();
        DeviceMem::upload(d, &data, what)
    };
    let f32b = |v: &[f32]| GpuDtype::F32.encode(v);
    let cfg_err = GpuModelError::Config;
    let mut out = DevWeights {
        embed: put(d, dt.encode(&w.embed.data), "embedding")?,
        ..Default::default()
    };
    out.lm_head = match &w.lm_head {
        Some(t) => put(d, dt.encode(&t.data), "LM head")?,
        None => out.embed,
    };
    out.final_norm = put(d, f32b(&w.final_norm.data), "final norm")?;
    for (i, lw) in w.layers.iter().enumerate() {
        let qkv = host::stack_rows(&[&lw.q_proj, &lw.k_proj, &lw.v_proj]).map_err(cfg_err)?;
        let gate_up = host::stack_rows(&[&lw.gate_proj, &lw.up_proj]).map_err(cfg_err)?;
        let qkv_bias = match (&lw.q_bias, &lw.k_bias, &lw.v_bias) {
            (Some(q), Some(k), Some(v)) => {
                let b = host::stack_rows(&[q, k, v]).map_err(cfg_err)?;
                put(d, f32b(&b), &format!("layer {i} qkv bias"))?
            }
            (None, None, None) => 0,
            _ => {
                return Err(GpuModelError::Config(format!(
                    "layer {i}: q/k/v biases must be all present or all absent"
                )));
            }
        };
        let layer = DevLayer {
            input_norm: put(
                d,
                f32b(&lw.input_norm.data),
                &format!("layer {i} input norm"),
            )?,
            qkv: put(d, dt.encode(&qkv), &format!("layer {i} qkv"))?,
            qkv_bias,
            o: put(d, dt.encode(&lw.o_proj.data), &format!("layer {i} o_proj"))?,
            post_norm: put(d, f32b(&lw.post_norm.data), &format!("layer {i} post norm"))?,
            gate_up: put(d, dt.encode(&gate_up), &format!("layer {i} gate/up"))?,
            down: put(
                d,
                dt.encode(&lw.down_proj.data),
                &format!("layer {i} down_proj"),
            )?,
        };
        out.layers.push(layer);
    }
    out.bytes = bytes;
    Ok(out)
}

/// Per-step activation buffers (sized for `T` tokens and `S` sampled rows) and inputs.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Bufs {
    /// f32 `[T][hidden]`: the residual stream.
    pub x: u64,
    /// dtype `[T][hidden]`: normed activations (GEMM input).
    pub xn: u64,
    /// f32 `[T][q + 2 kv]`.
    pub qkv: u64,
    /// dtype `[T][q]`: attention output.
    pub attn: u64,
    /// f32 `[T][hidden]`: o_proj / down_proj output.
    pub tmp: u64,
    /// f32 `[T][2 inter]`.
    pub gu: u64,
    /// dtype `[T][inter]`.
    pub act: u64,
    /// dtype `[S][hidden]`: the sampled rows, normed.
    pub head_in: u64,
    /// f32 `[S][vocab]`.
    pub logits: u64,
    /// u32 `[S]`.
    pub next: u64,
    /// f32 `[head_dim / 2]`: RoPE inverse frequencies.
    pub inv_freq: u64,
    /// u32 `[token blocks]`, zero between launches: the folded form's o and down steps count
    /// their finished blocks per token block here (`bgs_gemm_tc_add_norm`; the last one norms
    /// the rows and zeroes its count).
    pub tiles_done: u64,
    /// u32 `[S][ARGMAX_PARTS][2]`: `bgs_argmax_split`'s slice winners (value bits, id).
    pub argmax_cand: u64,
    /// u32 `[S]`, zero between launches: `bgs_argmax_split`'s finished slices a row.
    pub argmax_done: u64,
    /// f32 `[tiles][8][TC_LARGE_SPLIT_PART_BYTES / 4]`: the split large tiles' class sums
    /// ([`Plan::tc_large_split`]; `tiles` is [`alloc_bufs`]'s `split_tiles`).
    pub split_part: u64,
    /// u32 `[tiles]`, zero between launches: a split large tile's finished blocks (the last one
    /// adds the class sums and zeroes its count).
    pub split_done: u64,
}

/// Allocate the activation buffers for `t` tokens and `s` sampled rows, and upload the RoPE
/// frequencies (the CPU oracle's, bit for bit: computed in f64 and rounded). `split_tiles`:
/// the most large tiles a split launch may have, the scratch of the split form
/// ([`TC_LARGE_SPLIT_PART_BYTES`] a tile and class; 0 where none runs): the device's
/// multiprocessors, since [`Plan::tc_kernel_over`] splits only grids of fewer tiles.
pub(crate) fn alloc_bufs(
    d: &mut impl DeviceMem,
    cfg: &ModelConfig,
    t: usize,
    s: usize,
    dt: GpuDtype,
    split_tiles: usize,
) -> Result<Bufs, GpuModelError> {
    let (h, inter, vocab) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let (qd, kvd) = (cfg.num_heads * cfg.head_dim, cfg.kv_dim());
    let es = dt.size();
    let hd = cfg.head_dim;
    let inv_freq: Vec<f32> = (0..hd / 2)
        .map(|i| (1.0 / cfg.rope_theta.powf((2 * i) as f64 / hd as f64)) as f32)
        .collect();
    Ok(Bufs {
        x: d.alloc(t * h * 4, "activations x")?,
        xn: d.alloc(t * h * es, "activations xn")?,
        qkv: d.alloc(t * (qd + 2 * kvd) * 4, "activations qkv")?,
        attn: d.alloc(t * qd * es, "activations attn")?,
        tmp: d.alloc(t * h * 4, "activations tmp")?,
        gu: d.alloc(t * 2 * inter * 4, "activations gate/up")?,
        act: d.alloc(t * inter * es, "activations act")?,
        head_in: d.alloc(s * h * es, "LM head input")?,
        logits: d.alloc(s * vocab * 4, "logits")?,
        next: d.alloc(s * 4, "next tokens")?,
        inv_freq: d.upload(&GpuDtype::F32.encode(&inv_freq), "RoPE frequencies")?,
        tiles_done: d.alloc(t.div_ceil(TC_SMALL_TOKENS) * 4, "tile counts")?,
        argmax_cand: d.alloc(s * ARGMAX_PARTS * 8, "argmax slice winners")?,
        argmax_done: d.alloc(s * 4, "argmax slice counts")?,
        split_part: d.alloc(
            split_tiles.max(1) * 8 * TC_LARGE_SPLIT_PART_BYTES,
            "split large tiles' class sums",
        )?,
        split_done: d.alloc(split_tiles.max(1) * 4, "split large tiles' counts")?,
    })
}

/// Whether the fused form's projections can run this model in `dtype`: every row they read
/// is whole 16-byte chunks, and a block's normed rows fit its shared memory. `Err` says why
/// not.
pub(crate) fn fused_form_fits(cfg: &ModelConfig, dtype: GpuDtype) -> Result<(), String> {
    let es = dtype.size();
    let per16 = 16 / es;
    let widths = [
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
        ("num_heads × head_dim", cfg.num_heads * cfg.head_dim),
    ];
    for (what, w) in widths {
        if w % per16 != 0 {
            return Err(format!(
                "{what} {w} is not a multiple of {per16} ({dtype:?} values per 16 bytes)"
            ));
        }
    }
    let shared = PROJ_STATIC_SHARED + PROJ_TOKENS * cfg.hidden_size * es;
    if shared > MAX_BLOCK_SHARED {
        return Err(format!(
            "{PROJ_TOKENS} normed rows of {} {dtype:?} values need {shared} bytes of shared \
             memory, more than {MAX_BLOCK_SHARED}",
            cfg.hidden_size
        ));
    }
    Ok(())
}

/// Head sizes `bgs_attention_mma` is built for (`BGS_ATTN_MMA` in the kernels).
pub(crate) const MMA_HEAD_DIMS: [usize; 3] = [16, 32, 64];

/// Whether `bgs_attention_mma`'s code covers `dtype` and `head_dim` (tensor cores multiply
/// 16-bit values; its tiles are written for these head sizes), whatever the device.
pub(crate) fn mma_form_covers(dtype: GpuDtype, head_dim: usize) -> bool {
    dtype != GpuDtype::F32 && MMA_HEAD_DIMS.contains(&head_dim)
}

/// Dynamic shared memory of a `bgs_attention_mma` block of `warps` warps for this model (per
/// warp a K and a V tile of 32 rows, `128 * head_dim` bytes, which the combine reuses), or
/// `None` where the kernel does not apply: f32 (tensor cores multiply 16-bit values), a head
/// size it is not built for, more than 16 query heads a kv head (an MMA's rows), or more than
/// [`MAX_BLOCK_SHARED`]. The device must be sm_80 or later (the host checks).
pub(crate) fn mma_attention_shared(cfg: &ModelConfig, dtype: GpuDtype, warps: u32) -> Option<u32> {
    let group = cfg.num_heads / cfg.num_kv_heads;
    let bytes = warps as usize * 128 * cfg.head_dim;
    (mma_form_covers(dtype, cfg.head_dim) && (1..=16).contains(&group) && bytes <= MAX_BLOCK_SHARED)
        .then_some(bytes as u32)
}

/// Whether `bgs_gemm_tc` can compute a projection of input width `inp` in `dtype` (tensor
/// cores multiply 16-bit values; the input is read in whole 32-value chunks). The device must
/// be sm_80 or later (the host checks).
pub(crate) fn tc_gemm_applies(dtype: GpuDtype, inp: usize) -> bool {
    dtype != GpuDtype::F32 && inp.is_multiple_of(TC_CHUNK) && inp > 0
}

/// Whether `bgs_gemm_tc` covers every projection of `cfg` in `dtype` (QKV, o_proj, gate/up,
/// down_proj and the LM head: their input widths are hidden, heads × head_dim and
/// intermediate).
pub(crate) fn tc_gemm_covers(cfg: &ModelConfig, dtype: GpuDtype) -> bool {
    [
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.intermediate_size,
    ]
    .into_iter()
    .all(|inp| tc_gemm_applies(dtype, inp))
}

/// A `bgs_gemm_tc` launch (`kernel`: it or its small-, mid- or large-tile form) over `out`
/// rows and `n` tokens with its parameters `args` (w, x, y, out, in, n).
#[cfg(test)]
pub(crate) fn tc_gemm_launch(kernel: Kernel, out: usize, n: usize, args: &[Arg]) -> Op {
    tc_tiles_launch(kernel, 1, out, n, 0, args)
}

/// A launch of a tensor-core GEMM kernel over its tiles of `rows` ([`Kernel::tc_tile_rows`])
/// and of `n` tokens ([`Kernel::tc_tile_tokens`]), `groups` warp groups a block (each one
/// `bgs_gemm_tc` block's warps), `shared` bytes of dynamic shared memory. The large-tile entry
/// points take one group of [`TC_WARPS`] warps whatever `groups` (the SiLU form's warps pair
/// gate and up rows themselves) and [`tc_large_shared_bytes`] whatever `shared`.
fn tc_tiles_launch(
    kernel: Kernel,
    groups: usize,
    rows: usize,
    n: usize,
    shared: usize,
    args: &[Arg],
) -> Op {
    let (Some(tokens), Some(units)) = (kernel.tc_tile_tokens(), kernel.tc_tile_rows()) else {
        panic!("tc_tiles_launch launches tensor-core kernels, not {kernel:?}");
    };
    let (groups, shared) = if kernel.is_tc_large() {
        (1, tc_large_shared_bytes())
    } else {
        (groups, shared)
    };
    Op::Launch {
        kernel,
        grid: (rows.div_ceil(units) as u32, n.div_ceil(tokens) as u32),
        block: (groups * TC_WARPS * 32) as u32,
        shared: shared as u32,
        args: args.to_vec(),
    }
}

/// Values of a row each of the folded form's norm (`tc_norm_rows`, 256 virtual threads) holds
/// in registers at once (`-DBGS_TC_NORM_SPAN`): every load of a row is in flight together.
pub const TC_NORM_SPAN: usize = 4;
/// The widest row the folded form's norm takes (`NORM_THREADS * TC_NORM_SPAN`).
pub(crate) const TC_NORM_MAX_HIDDEN: usize = NORM_THREADS as usize * TC_NORM_SPAN;

/// Whether the folded tensor-core form (`Plan::tc_epilogues` with every projection of the
/// bucket on `bgs_gemm_tc`) can run `cfg` in `dtype`: the QKV epilogue pairs the rows RoPE
/// rotates inside a 16-row tile (head_dim a multiple of 16), and the norm at the end of o and
/// down holds a row in registers (hidden at most [`TC_NORM_MAX_HIDDEN`]). `Err` says why not.
pub(crate) fn tc_fold_fits(cfg: &ModelConfig, dtype: GpuDtype) -> Result<(), String> {
    if !tc_gemm_covers(cfg, dtype) {
        return Err(format!(
            "the tensor-core GEMM does not cover every projection in {dtype:?}"
        ));
    }
    if !cfg.head_dim.is_multiple_of(TC_ROWS) {
        return Err(format!(
            "head_dim {} is not a multiple of {TC_ROWS} (a tile holds 8 rows of a head and the \
             8 RoPE rotates them with)",
            cfg.head_dim
        ));
    }
    if cfg.hidden_size > TC_NORM_MAX_HIDDEN {
        return Err(format!(
            "hidden_size {} is wider than the folded norm's {TC_NORM_MAX_HIDDEN}",
            cfg.hidden_size
        ));
    }
    Ok(())
}

/// Blocks per multiprocessor of the fused norm kernels (see `Plan::sms`).
pub(crate) const PROJ_NORM_BLOCKS_PER_SM: usize = 2;

/// A launch of one of the fused form's projections over `units` warp units and `n` tokens, at
/// most `max_blocks` blocks per token group (the warps stride over the units).
fn proj_launch(
    kernel: Kernel,
    units: usize,
    n: usize,
    max_blocks: usize,
    shared: u32,
    args: &[Arg],
) -> Op {
    Op::Launch {
        kernel,
        grid: (
            units.div_ceil(PROJ_WARPS).min(max_blocks.max(1)) as u32,
            n.div_ceil(PROJ_TOKENS) as u32,
        ),
        block: (PROJ_WARPS * 32) as u32,
        shared,
        args: args.to_vec(),
    }
}

/// Everything a step's operations refer to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan<'a> {
    pub cfg: &'a ModelConfig,
    pub geo: &'a StepGeometry,
    pub dtype: GpuDtype,
    pub w: &'a DevWeights,
    pub b: &'a Bufs,
    /// The KV pool.
    pub cache: u64,
    /// The step-input buffer (`StepGeometry` layout).
    pub inputs: u64,
    /// Every projection through the fused form's kernels (a fixed reduction order per output,
    /// whatever the bucket), the LM head through `bgs_proj`, instead of cuBLAS.
    pub invariant_gemm: bool,
    /// Buckets of at most this many tokens run the fused form (0: none); see [`Plan::fused`].
    pub fused_max_tokens: usize,
    /// Projections over at most this many tokens (rows, for the LM head) run `bgs_gemm_tc`
    /// where [`tc_gemm_applies`], instead of cuBLAS (0: none; the host sets 0 before sm_80).
    pub tc_gemm_max_tokens: usize,
    /// The device's multiprocessors: the fused norm kernels run at most
    /// [`PROJ_NORM_BLOCKS_PER_SM`] blocks on each (every block norms its tokens first, so
    /// fewer blocks with more units each beat one unit per warp).
    pub sms: u32,
    /// Warps of one attention block (positions split across them), 1..=8.
    pub attention_warps: u32,
    /// Attention on tensor cores, a block per (kv head, token) (`bgs_attention_mma`), rather
    /// than a block per (query head, token); the host sets it only where
    /// [`mma_attention_shared`] allows.
    pub mma_attention: bool,
    /// Where the gate/up projection runs on `bgs_gemm_tc`, fold `bgs_silu_mul` into it
    /// (`bgs_gemm_tc_silu`: the same bits, one launch and the f32 gate/up activations fewer).
    pub tc_epilogues: bool,
    /// With `tc_epilogues`, buckets of at most this many tokens take the folded form where it
    /// applies ([`Plan::tc_fold`]; 0: none).
    pub tc_fold_max_tokens: usize,
    /// Buckets of at most this many tokens (and LM heads of at most this many rows) run the
    /// tensor-core kernels' small-tile entry points ([`Plan::tc_kernel`]): the same bits as
    /// the wide tiles (0: none).
    pub tc_small_max_tokens: usize,
    /// Buckets of more than [`TC_SMALL_TOKENS`] and at most this many tokens (and LM heads of
    /// that many rows) run the mid-tile entry points instead ([`Plan::tc_kernel`]): the same
    /// bits (0: none).
    pub tc_mid_max_tokens: usize,
    /// Buckets of at least this many tokens (and LM heads of at least that many rows) run
    /// the large-tile entry points of the plain and the SiLU GEMM ([`Plan::tc_kernel`]): the
    /// same bits (0: none; the host sets 0 where the device's shared memory cannot hold
    /// [`tc_large_shared_bytes`]).
    pub tc_large_min_tokens: usize,
    /// Class groups of the split large tiles (2..=[`TC_LARGE_SPLIT_MAX`]; 0 or 1: never
    /// split): where a projection's large grid has fewer blocks than multiprocessors,
    /// [`Plan::tc_kernel_over`] runs it split, each tile's 8 classes of input chunks summed by
    /// this many blocks and added in class order by the tile's last one (the same bits),
    /// instead of the wide tiles.
    pub tc_large_split: usize,
    /// Input chunks a split block takes at least ([`TC_LARGE_SPLIT_MIN_CHUNKS`] on the device;
    /// the emulator's tests take 1, so that the tiny models split).
    pub tc_large_split_min_chunks: usize,
    /// When the small and mid tiles stage their weights ([`Plan::tc_stage`]).
    pub staging: TcStaging,
    /// The LM head's argmax over [`ARGMAX_PARTS`] blocks a row (`bgs_argmax_split`) rather
    /// than one (`bgs_argmax`, which the persistent form runs): the same ids.
    pub split_argmax: bool,
}

impl Plan<'_> {
    fn gemm(&self, w: u64, x: u64, y: u64, [out, inp, n]: [usize; 3], what: &'static str) -> Op {
        // y = x · wᵀ: the parameters of bgs_proj and bgs_gemm_tc alike.
        let args = [
            Arg::P(w),
            Arg::P(x),
            Arg::P(y),
            Arg::I(out as i32),
            Arg::I(inp as i32),
            Arg::I(n as i32),
        ];
        if self.invariant_gemm {
            return proj_launch(Kernel::Proj, out, n, usize::MAX, 0, &args);
        }
        if self.tc_gemm(n, inp) {
            let k = self.tc_kernel_over(Kernel::GemmTc, n, out, inp);
            return self.tc_launch(k, 1, out, n, inp, &args);
        }
        // y[n][out] = x[n][in] · w[out][in]ᵀ. Column-major view: C (out × n, ldc out) =
        // op_T(A) · B with A the in × out matrix whose columns are w's rows (lda in) and B
        // the in × n matrix whose columns are x's rows (ldb in).
        Op::Gemm(Gemm {
            trans_a: true,
            trans_b: false,
            m: out as i32,
            n: n as i32,
            k: inp as i32,
            a: w,
            lda: inp as i32,
            b: x,
            ldb: inp as i32,
            c: y,
            ldc: out as i32,
            what,
        })
    }

    /// Whether and how a launch of `kernel` (`groups` warp groups a block) over `rows` output
    /// rows of input width `inp` stages its weights: `Some((grid x, dynamic shared bytes))`
    /// for the staged small- and mid-tile entry points ([`TC_STAGED_KERNELS`]) where loading
    /// into registers would take more than one round of loads a warp (more than
    /// [`TC_SMALL_UNROLL`] chunks) or more than one wave of blocks (more row tiles than
    /// multiprocessors: the gate/up tiles run one block a multiprocessor), and every block's
    /// tiles (at most [`TC_STAGE_MAX`], dealt out round-robin over at most one block a
    /// multiprocessor) fit `staging.bytes` ([`tc_stage_kernel_bytes`] of it). The tiles compute
    /// the same bits whichever block takes them.
    pub(crate) fn tc_stage(
        &self,
        kernel: Kernel,
        groups: usize,
        rows: usize,
        inp: usize,
    ) -> Option<(u32, u32)> {
        tc_stage(kernel, groups, rows, inp, self.sms as usize, &self.staging)
    }

    /// [`tc_tiles_launch`] with the staging [`Plan::tc_stage`] decides (`inp`: the input
    /// width); the large-tile entry points never take that path (their geometry and shared
    /// memory are fixed: [`tc_tiles_launch`]).
    fn tc_launch(
        &self,
        kernel: Kernel,
        groups: usize,
        rows: usize,
        n: usize,
        inp: usize,
        args: &[Arg],
    ) -> Op {
        if kernel.is_tc_large_split() {
            // Each tile's blocks side by side in x (`groups` of them), then the scratch.
            let split = self.tc_large_split_groups(inp);
            assert!(split >= 2, "{kernel:?} planned with {split} blocks a tile");
            let mut args = args.to_vec();
            args.extend([
                Arg::P(self.b.split_part),
                Arg::P(self.b.split_done),
                Arg::I(split as i32),
            ]);
            let mut op = tc_tiles_launch(kernel, groups, rows, n, 0, &args);
            if let Op::Launch { grid, .. } = &mut op {
                grid.0 *= split as u32;
            }
            return op;
        }
        let mut op = tc_tiles_launch(kernel, groups, rows, n, 0, args);
        if kernel.is_tc_large() {
            return op;
        }
        if let (Some((gx, bytes)), Op::Launch { grid, shared, .. }) =
            (self.tc_stage(kernel, groups, rows, inp), &mut op)
        {
            grid.0 = gx;
            *shared = bytes;
        }
        op
    }

    /// The entry point of tensor-core kernel `k` (its wide-tile name) for a bucket of `n`
    /// tokens: its large-tile form where it has one (the plain and the SiLU GEMM) and the
    /// bucket has at least `tc_large_min_tokens` tokens (a block of many rows and tokens,
    /// staged through shared memory), else its mid-tile form where `tc_mid_max_tokens` covers
    /// a bucket wider than one small tile (one token block rather than several small ones, each
    /// reading the weights), else its small-tile form where `tc_small_max_tokens` covers the
    /// bucket.
    pub(crate) fn tc_kernel(&self, k: Kernel, n: usize) -> Kernel {
        if self.tc_large_min_tokens > 0 && n >= self.tc_large_min_tokens && k.large() != k {
            k.large()
        } else if n > TC_SMALL_TOKENS && n <= self.tc_mid_max_tokens {
            k.mid()
        } else if n <= self.tc_small_max_tokens {
            k.small()
        } else {
            k
        }
    }

    /// [`Plan::tc_kernel`] for a projection over `rows` output rows (gate/up units for the SiLU
    /// GEMM): its large-tile form only where that grid has at least a block a multiprocessor,
    /// else what the bucket would run without the large tiles. A large block computes 64 rows
    /// × 64 tokens in a chain of stages over the whole input width; with fewer blocks than
    /// multiprocessors most of the device waits on a few long chains (H100, 192 tokens: the
    /// Qwen2.5-0.5B shape's down_proj in 42 large blocks took 67 µs alone,
    /// `bench/results/20261207-gpu-tc-large-probe-h100`), where the wide tiles' many short
    /// blocks keep every multiprocessor busy.
    ///
    /// With [`Plan::tc_large_split`], such a projection of input width `inp` runs the large
    /// tiles split instead where [`Plan::tc_large_split_groups`] gives it at least 2 blocks a
    /// tile and the split grid at least a block a multiprocessor: each tile's chain of chunks
    /// cut across them. (On an H100 a split grid short of the multiprocessors was slower than
    /// the wide tiles: the Qwen2.5-0.5B shape's down_proj at 64 tokens in 112 blocks, 1.59 ms
    /// a step against 1.55; SmolLM2-135M's over 3 blocks a tile at 64-256 tokens, 27-108
    /// blocks, 3-12% slower; `bench/results/20261207-gpu-tc-large-split-h100`.)
    pub(crate) fn tc_kernel_over(&self, k: Kernel, n: usize, rows: usize, inp: usize) -> Kernel {
        let chosen = self.tc_kernel(k, n);
        let (Some(units), Some(tokens)) = (chosen.tc_tile_rows(), chosen.tc_tile_tokens()) else {
            return chosen;
        };
        let tiles = rows.div_ceil(units) * n.div_ceil(tokens);
        if !chosen.is_tc_large() || tiles >= self.sms as usize {
            return chosen;
        }
        let groups = self.tc_large_split_groups(inp);
        if groups >= 2 && tiles * groups >= self.sms as usize {
            return chosen.split();
        }
        Plan {
            tc_large_min_tokens: 0,
            ..*self
        }
        .tc_kernel(k, n)
    }

    /// Blocks a tile of a split large-tile launch of input width `inp` takes: at most
    /// [`Plan::tc_large_split`] (and [`TC_LARGE_SPLIT_MAX`]), at most one for every
    /// [`Plan::tc_large_split_min_chunks`] chunks of the input. Fewer than 2: not split.
    pub(crate) fn tc_large_split_groups(&self, inp: usize) -> usize {
        self.tc_large_split
            .min(TC_LARGE_SPLIT_MAX)
            .min(inp / TC_CHUNK / self.tc_large_split_min_chunks.max(1))
    }

    /// Whether a projection of input width `inp` over `n` tokens runs on `bgs_gemm_tc`.
    fn tc_gemm(&self, n: usize, inp: usize) -> bool {
        !self.invariant_gemm && n <= self.tc_gemm_max_tokens && tc_gemm_applies(self.dtype, inp)
    }

    /// Whether a bucket of `n` tokens runs the folded tensor-core form: at most
    /// `tc_fold_max_tokens`, every projection on `bgs_gemm_tc` with the epilogues on, and
    /// [`tc_fold_fits`] the model. A layer is then
    /// five launches (QKV with the input norm, RoPE and K/V; attention; o with the residual
    /// add; gate/up with the post-attention norm and SiLU·up; down with the residual add) for
    /// the same bits as the launches apart.
    pub(crate) fn tc_fold(&self, n: usize) -> bool {
        let c = self.cfg;
        self.tc_epilogues
            && n <= self.tc_fold_max_tokens
            && [c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size]
                .into_iter()
                .all(|inp| self.tc_gemm(n, inp))
            && tc_fold_fits(c, self.dtype).is_ok()
    }

    /// Whether a bucket of `n` tokens runs the fused form: every bucket with the invariant
    /// option, else buckets of at most `fused_max_tokens` (the host only sets either when
    /// [`fused_form_fits`] the model).
    pub(crate) fn fused(&self, n: usize) -> bool {
        self.invariant_gemm || n <= self.fused_max_tokens
    }

    fn input(&self, word: usize) -> u64 {
        self.inputs + (word * 4) as u64
    }

    /// The decoder over `n` tokens (a bucket): embedding to the final norm's output in `xn`,
    /// writing every real token's K/V.
    pub(crate) fn body(&self, n: usize) -> Vec<Op> {
        let (c, g, b) = (self.cfg, self.geo, self.b);
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let (hd, nh, nkv) = (c.head_dim, c.num_heads, c.num_kv_heads);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let eps = c.rms_norm_eps as f32;
        let bs = g.block_size;
        let layer_elems = 2 * nkv * bs * hd;
        let block_stride = (c.num_layers * layer_elems) as i64;
        let es = self.dtype.size() as u64;
        let (tok, pos, seq, slot) = (
            self.input(StepGeometry::TOK),
            self.input(g.pos()),
            self.input(g.seq()),
            self.input(g.slot()),
        );
        let (bt_off, bt) = (self.input(g.bt_off()), self.input(g.bt()));
        let nu = n as u32;
        let scale = 1.0 / (hd as f32).sqrt();
        let launch = |kernel, grid, block, args: &[Arg]| Op::Launch {
            kernel,
            grid,
            block,
            shared: 0,
            args: args.to_vec(),
        };
        let fused = self.fused(n);
        let norm = |delta: u64, w: u64| {
            launch(
                Kernel::AddRmsNorm,
                (nu, 1),
                NORM_THREADS,
                &[
                    Arg::P(b.x),
                    Arg::P(delta),
                    Arg::P(w),
                    Arg::P(b.xn),
                    Arg::I(h as i32),
                    Arg::F(eps),
                ],
            )
        };
        let mut ops = vec![launch(
            Kernel::Embed,
            (nu, 1),
            256,
            &[
                Arg::P(tok),
                Arg::P(self.w.embed),
                Arg::P(b.x),
                Arg::I(h as i32),
            ],
        )];
        let fold = !fused && self.tc_fold(n);
        let xn_shared = (PROJ_TOKENS * h) as u32 * es as u32;
        let norm_blocks = PROJ_NORM_BLOCKS_PER_SM * self.sms as usize;
        for (l, lw) in self.w.layers.iter().enumerate() {
            let cache_l = self.cache + (l * layer_elems) as u64 * es;
            // The norm after this layer: the next layer's input norm, or the final one.
            let next_norm = self
                .w
                .layers
                .get(l + 1)
                .map_or(self.w.final_norm, |nl| nl.input_norm);
            // bgs_rope_kv's parameters after `qkv`, which the fused QKV kernel shares.
            let rope_kv = [
                Arg::P(lw.qkv_bias),
                Arg::P(pos),
                Arg::P(slot),
                Arg::P(b.inv_freq),
                Arg::P(cache_l),
                Arg::I(nh as i32),
                Arg::I(nkv as i32),
                Arg::I(hd as i32),
                Arg::I(bs as i32),
                Arg::L(block_stride),
            ];
            if !fused && l == 0 {
                // The first layer's input norm (the fused form norms in its QKV prologue; after
                // it, the norm before QKV is the previous layer's last).
                ops.push(norm(0, lw.input_norm));
            }
            if fused {
                // The input norm, QKV, bias, RoPE and the K/V writes in one launch.
                ops.push(proj_launch(
                    Kernel::ProjNormRopeKv,
                    (nh + 2 * nkv) * (hd / 2),
                    n,
                    norm_blocks,
                    xn_shared,
                    &[
                        &[
                            Arg::P(lw.qkv),
                            Arg::P(b.x),
                            Arg::P(lw.input_norm),
                            Arg::F(eps),
                            Arg::P(b.qkv),
                        ][..],
                        &rope_kv,
                        &[Arg::I(h as i32), Arg::I(n as i32)],
                    ]
                    .concat(),
                ));
            } else if fold {
                // QKV over the normed rows (the first layer's from its own norm, the others'
                // from the down step before), bias, RoPE and the K/V writes in one launch: a
                // block per 8 row pairs of a head (16 rows: head_dim is a multiple of 16).
                ops.push(tc_tiles_launch(
                    self.tc_kernel(Kernel::GemmTcRopeKv, n),
                    1,
                    qd + 2 * kvd,
                    n,
                    0,
                    &[
                        &[Arg::P(lw.qkv), Arg::P(b.xn), Arg::P(b.qkv)][..],
                        &rope_kv,
                        &[Arg::I(h as i32), Arg::I(n as i32)],
                    ]
                    .concat(),
                ));
            } else {
                ops.push(self.gemm(lw.qkv, b.xn, b.qkv, [qd + 2 * kvd, h, n], "qkv"));
                ops.push(launch(
                    Kernel::RopeKv,
                    (nu, 1),
                    128,
                    &[&[Arg::P(b.qkv)][..], &rope_kv].concat(),
                ));
            }
            let (attention, heads, attention_shared) = if self.mma_attention {
                (
                    Kernel::AttentionMma,
                    nkv,
                    mma_attention_shared(c, self.dtype, self.attention_warps)
                        .expect("tensor-core attention is only planned where it applies"),
                )
            } else {
                (Kernel::Attention, nh, 0)
            };
            ops.push(Op::Launch {
                kernel: attention,
                grid: (heads as u32, nu),
                block: 32 * self.attention_warps,
                shared: attention_shared,
                args: vec![
                    Arg::P(b.qkv),
                    Arg::P(cache_l),
                    Arg::P(pos),
                    Arg::P(seq),
                    Arg::P(bt_off),
                    Arg::P(bt),
                    Arg::P(b.attn),
                    Arg::I(nh as i32),
                    Arg::I(nkv as i32),
                    Arg::I(hd as i32),
                    Arg::I(bs as i32),
                    Arg::L(block_stride),
                    Arg::F(scale),
                ],
            });
            if fused {
                let add = |w: u64, x: u64, inp: usize| {
                    proj_launch(
                        Kernel::ProjAdd,
                        h,
                        n,
                        usize::MAX,
                        0,
                        &[
                            Arg::P(w),
                            Arg::P(x),
                            Arg::P(b.x),
                            Arg::I(h as i32),
                            Arg::I(inp as i32),
                            Arg::I(n as i32),
                        ],
                    )
                };
                ops.push(add(lw.o, b.attn, qd));
                ops.push(proj_launch(
                    Kernel::ProjNormSilu,
                    inter,
                    n,
                    norm_blocks,
                    xn_shared,
                    &[
                        Arg::P(lw.gate_up),
                        Arg::P(b.x),
                        Arg::P(lw.post_norm),
                        Arg::F(eps),
                        Arg::P(b.act),
                        Arg::I(inter as i32),
                        Arg::I(h as i32),
                        Arg::I(n as i32),
                    ],
                ));
                ops.push(add(lw.down, b.act, inter));
                continue;
            }
            if fold {
                // What the folded form's o_proj, gate/up and down_proj launches fetch into L2 for
                // the op after next (`prefetch_lines_l2`): gate/up's weights, down's, the next
                // layer's QKV; nothing for an op whose block stages its weights before its wait
                // anyway (`tc_stage`): there the prefetch only competed with the copies (H200,
                // Qwen2.5-0.5B shape: 0.9208 and 0.9298 ms at batch 1 against 0.9104 without),
                // where an unstaged down_proj gained (SmolLM2-135M: 0.7107 against 0.7188;
                // bench/results/20261204-gpu-attention-prestage, run5). Only in the folded form,
                // where it was measured; the unfolded gate/up launch passes an empty range.
                let unstaged =
                    |k: Kernel, groups: usize, rows: usize, inp: usize, w: u64, elems: usize| {
                        match self.tc_stage(self.tc_kernel_over(k, n, rows, inp), groups, rows, inp)
                        {
                            None => (w, elems as i64 * es as i64),
                            Some(_) => (0, 0),
                        }
                    };
                let gate_up_pf =
                    unstaged(Kernel::GemmTcSilu, 2, inter, h, lw.gate_up, 2 * inter * h);
                let down_pf = unstaged(Kernel::GemmTcAddNorm, 1, h, inter, lw.down, h * inter);
                // o and down with the residual add, each ending in the norm that follows it
                // (post-attention; the next layer's input norm, or the final one): the token
                // block's last block writes xn.
                // Each also fetches the weights of the op after next into L2 (`pf`, bytes:
                // `prefetch_lines_l2`): o_proj gate/up's, down_proj the next layer's QKV.
                let add_norm = |w: u64, x: u64, inp: usize, nw: u64, pf: (u64, i64)| {
                    let args = [
                        Arg::P(w),
                        Arg::P(x),
                        Arg::P(b.x),
                        Arg::I(h as i32),
                        Arg::I(inp as i32),
                        Arg::I(n as i32),
                        Arg::P(nw),
                        Arg::F(eps),
                        Arg::P(b.xn),
                        Arg::P(b.tiles_done),
                        Arg::P(pf.0),
                        Arg::L(pf.1),
                    ];
                    let k = self.tc_kernel(Kernel::GemmTcAddNorm, n);
                    self.tc_launch(k, 1, h, n, inp, &args)
                };
                ops.push(add_norm(lw.o, b.attn, qd, lw.post_norm, gate_up_pf));
                ops.push(self.tc_launch(
                    self.tc_kernel_over(Kernel::GemmTcSilu, n, inter, h),
                    2,
                    inter,
                    n,
                    h,
                    &[
                        Arg::P(lw.gate_up),
                        Arg::P(b.xn),
                        Arg::P(b.act),
                        Arg::I(inter as i32),
                        Arg::I(h as i32),
                        Arg::I(n as i32),
                        Arg::P(down_pf.0),
                        Arg::L(down_pf.1),
                    ],
                ));
                // (The QKV step never stages its weights: `TC_STAGED_KERNELS`.)
                let next_qkv = self.w.layers.get(l + 1).map_or((0, 0), |nl| {
                    (nl.qkv, ((qd + 2 * kvd) * h) as i64 * es as i64)
                });
                ops.push(add_norm(lw.down, b.act, inter, next_norm, next_qkv));
                continue;
            }
            ops.push(self.gemm(lw.o, b.attn, b.tmp, [h, qd, n], "o_proj"));
            ops.push(norm(b.tmp, lw.post_norm));
            if self.tc_epilogues && self.tc_gemm(n, h) {
                // gate/up and SiLU·up in one launch (bgs_gemm_tc_silu): two warp groups, the
                // gate tile and the up tile side by side.
                ops.push(self.tc_launch(
                    self.tc_kernel_over(Kernel::GemmTcSilu, n, inter, h),
                    2,
                    inter,
                    n,
                    h,
                    &[
                        Arg::P(lw.gate_up),
                        Arg::P(b.xn),
                        Arg::P(b.act),
                        Arg::I(inter as i32),
                        Arg::I(h as i32),
                        Arg::I(n as i32),
                        Arg::P(0),
                        Arg::L(0),
                    ],
                ));
            } else {
                ops.push(self.gemm(lw.gate_up, b.xn, b.gu, [2 * inter, h, n], "gate/up"));
                ops.push(launch(
                    Kernel::SiluMul,
                    (inter.div_ceil(256) as u32, nu),
                    256,
                    &[
                        Arg::P(b.gu),
                        Arg::P(b.act),
                        Arg::I(inter as i32),
                        Arg::I(n as i32),
                    ],
                ));
            }
            ops.push(self.gemm(lw.down, b.act, b.tmp, [h, inter, n], "down_proj"));
            ops.push(norm(b.tmp, next_norm));
        }
        if fused {
            // The final norm, for the LM head (the fused layers norm inside their
            // projections' prologues; the folded ones' last down step wrote it).
            ops.push(norm(0, self.w.final_norm));
        }
        ops
    }

    /// The LM head over `s` sampled rows (a bucket) and the greedy argmax into `next`.
    pub(crate) fn head(&self, s: usize) -> Vec<Op> {
        let (c, b) = (self.cfg, self.b);
        let rows = self.input(self.geo.rows());
        // The argmax: split over ARGMAX_PARTS blocks a row (the launched form) or one.
        let mut args = vec![
            Arg::P(b.logits),
            Arg::P(b.next),
            Arg::I(c.vocab_size as i32),
        ];
        let (kernel, parts, block) = if self.split_argmax {
            args.extend([Arg::P(b.argmax_cand), Arg::P(b.argmax_done)]);
            (
                Kernel::ArgmaxSplit,
                ARGMAX_PARTS as u32,
                ARGMAX_SPLIT_THREADS,
            )
        } else {
            (Kernel::Argmax, 1, ARGMAX_THREADS)
        };
        vec![
            Op::Launch {
                kernel: Kernel::GatherRows,
                grid: (s as u32, 1),
                block: 256,
                shared: 0,
                args: vec![
                    Arg::P(b.xn),
                    Arg::P(rows),
                    Arg::P(b.head_in),
                    Arg::I(c.hidden_size as i32),
                ],
            },
            self.gemm(
                self.w.lm_head,
                b.head_in,
                b.logits,
                [c.vocab_size, c.hidden_size, s],
                "lm_head",
            ),
            Op::Launch {
                kernel,
                grid: (s as u32, parts),
                block,
                shared: 0,
                args,
            },
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Staging on the H200 (132 multiprocessors, 227 KB a block with the opt-in) for the
    /// Qwen2.5-0.5B shape's small tiles: down_proj (19 chunks a warp: 5 rounds of loads into
    /// registers) a block a row tile with all its weights; gate/up (304 tiles of 2 groups: more
    /// than one wave) 132 blocks of at most 3 tiles; o_proj, QKV-sized and the LM head (one
    /// round, or more tiles a block than staging takes) and every wide kernel as before.
    #[test]
    fn staging_follows_rounds_waves_and_room() {
        let rule = |bytes| TcStaging {
            bytes,
            min_rounds: 3,
            waves: true,
        };
        let h200 = rule(tc_stage_budget(232_448));
        let stage = |k, groups, rows, inp| tc_stage(k, groups, rows, inp, 132, &h200);
        assert_eq!(
            stage(Kernel::GemmTcAddNormSmall, 1, 896, 4864),
            Some((56, 8 * 19 * 1024))
        );
        assert_eq!(
            stage(Kernel::GemmTcSmall, 1, 896, 4864),
            Some((56, 8 * 19 * 1024))
        );
        assert_eq!(
            stage(Kernel::GemmTcSiluSmall, 2, 4864, 896),
            Some((132, 3 * 2 * 8 * 4 * 1024))
        );
        assert_eq!(stage(Kernel::GemmTcAddNormSmall, 1, 896, 896), None);
        assert_eq!(stage(Kernel::GemmTcSmall, 1, 151_936, 896), None);
        assert_eq!(stage(Kernel::GemmTcRopeKvSmall, 1, 1152, 896), None);
        for k in [Kernel::GemmTc, Kernel::GemmTcSilu, Kernel::GemmTcAddNorm] {
            assert_eq!(stage(k, 1, 896, 4864), None);
        }
        // SmolLM2-135M's down_proj: 6 chunks a warp, 2 rounds: staged only from 2.
        assert_eq!(stage(Kernel::GemmTcAddNormSmall, 1, 576, 1536), None);
        let two = TcStaging {
            min_rounds: 2,
            ..h200
        };
        assert_eq!(
            tc_stage(Kernel::GemmTcAddNormSmall, 1, 576, 1536, 132, &two),
            Some((36, 8 * 6 * 1024))
        );
        // Each rule alone.
        let waves_only = TcStaging {
            min_rounds: 0,
            ..h200
        };
        let rounds_only = TcStaging {
            waves: false,
            ..h200
        };
        let down = |r: &TcStaging| tc_stage(Kernel::GemmTcAddNormSmall, 1, 896, 4864, 132, r);
        let gate_up = |r: &TcStaging| tc_stage(Kernel::GemmTcSiluSmall, 2, 4864, 896, 132, r);
        assert!(down(&waves_only).is_none() && gate_up(&waves_only).is_some());
        assert!(down(&rounds_only).is_some() && gate_up(&rounds_only).is_none());
        // No room: a consumer device's ~99 KB takes down_proj's 152 KB in no block.
        assert_eq!(down(&rule(tc_stage_budget(101_376))), None);
        assert_eq!(gate_up(&rule(0)), None);
        // Fewer multiprocessors: more tiles a block, up to TC_STAGE_MAX.
        let any = rule(usize::MAX);
        assert_eq!(
            tc_stage(Kernel::GemmTcSiluSmall, 2, 4864, 896, 76, &any),
            Some((76, 4 * 2 * 8 * 4 * 1024))
        );
        assert_eq!(
            tc_stage(Kernel::GemmTcSiluSmall, 2, 4864, 896, 75, &any),
            None
        );
        // The mid tiles stage as the small ones: the same shapes, the same blocks and bytes.
        for (small, groups, rows, inp) in [
            (Kernel::GemmTcAddNormSmall, 1, 896, 4864),
            (Kernel::GemmTcSmall, 1, 896, 4864),
            (Kernel::GemmTcSiluSmall, 2, 4864, 896),
            (Kernel::GemmTcAddNormSmall, 1, 896, 896),
        ] {
            let mid = small.wide().mid();
            assert!(TC_STAGED_KERNELS.contains(&mid));
            assert_eq!(
                stage(mid, groups, rows, inp),
                stage(small, groups, rows, inp),
                "{mid:?}"
            );
        }
        assert_eq!(stage(Kernel::GemmTcRopeKvMid, 1, 1152, 896), None);
    }

    /// The large tiles' constants: 64 weight rows and 64 tokens a block, 96 KB of pipeline
    /// (more than a block gets without the opt-in, within an H100's or H200's 227 KB), and
    /// none of the staging rules' kernels.
    #[test]
    fn large_tile_constants() {
        assert_eq!(TC_LARGE_ROWS, 64);
        assert_eq!(TC_LARGE_TOKENS, 64);
        assert_eq!(TC_LARGE_WARP_TOKENS % 8, 0);
        assert_eq!(TC_WARPS % TC_LARGE_WARP_ROWS, 0);
        assert_eq!(tc_large_shared_bytes(), 98_304);
        assert!(tc_large_shared_bytes() > MAX_BLOCK_SHARED);
        assert!(tc_large_shared_bytes() <= 232_448 - 1024);
        for k in TC_LARGE_KERNELS {
            assert!(!TC_STAGED_KERNELS.contains(&k));
            assert_eq!(k.tc_tile_tokens(), Some(TC_LARGE_TOKENS));
            let large = k.wide().large();
            assert_eq!(
                if k.is_tc_large_split() {
                    large.split()
                } else {
                    large
                },
                k
            );
            assert!(Kernel::ALL.contains(&k));
        }
        assert_eq!(Kernel::GemmTcLarge.tc_tile_rows(), Some(64));
        assert_eq!(Kernel::GemmTcSiluLarge.tc_tile_rows(), Some(32));
        // The add-norm and RoPE/KV forms (and the non-tensor-core kernels) have no large form.
        for k in [Kernel::GemmTcAddNorm, Kernel::GemmTcRopeKv, Kernel::Proj] {
            assert_eq!(k.large(), k);
        }
        // The persistent op ids: the large kernels come last, the split ones after them.
        assert_eq!(Kernel::ALL[Kernel::ALL.len() - 4..], TC_LARGE_KERNELS);
        for k in [Kernel::GemmTcLargeSplit, Kernel::GemmTcSiluLargeSplit] {
            assert!(k.is_tc_large() && k.is_tc_large_split());
            assert_ne!(k.wide().large(), k);
            assert_eq!(k.wide().large().split(), k);
            assert_eq!(k.tc_tile_rows(), k.wide().large().tc_tile_rows());
        }
        for k in [Kernel::GemmTcLarge, Kernel::GemmTcSiluLarge] {
            assert!(!k.is_tc_large_split());
            assert!(k.split().is_tc_large_split());
        }
        // A class sum of a tile: every output of 64 rows x 64 tokens in f32.
        assert_eq!(TC_LARGE_SPLIT_PART_BYTES, 16_384);
        assert_eq!(TC_LARGE_SPLIT_MAX, TC_WARPS);
    }

    /// The Qwen2.5-0.5B shape (hidden 896, intermediate 4864, vocab 151,936; 14 heads and 2 kv
    /// heads of 64) with up to 512 tokens and 256 sampled rows, weights and buffers at made-up
    /// addresses (the split form's scratch at 0x1000 and 0x2000).
    fn qwen_shape() -> (ModelConfig, StepGeometry, DevWeights, Bufs) {
        let cfg = bgs_model::synth::synth_config(bgs_model::synth::SynthArch::Qwen25_05b);
        let geo = host::geometry(&cfg, 16, 1024, 512, 256).unwrap();
        let w = DevWeights {
            layers: vec![DevLayer::default(); cfg.num_layers],
            ..Default::default()
        };
        let b = Bufs {
            split_part: 0x1000,
            split_done: 0x2000,
            ..Bufs::default()
        };
        (cfg, geo, w, b)
    }

    /// The invariant tensor-core form of [`qwen_shape`] on an H100/H200 (132 multiprocessors):
    /// large tiles from 64 tokens, not split.
    fn qwen_plan<'a>(
        (cfg, geo, w, b): &'a (ModelConfig, StepGeometry, DevWeights, Bufs),
    ) -> Plan<'a> {
        Plan {
            cfg,
            geo,
            dtype: GpuDtype::Bf16,
            w,
            b,
            cache: 0,
            inputs: 0,
            invariant_gemm: false,
            fused_max_tokens: 0,
            tc_gemm_max_tokens: usize::MAX,
            sms: 132,
            attention_warps: 4,
            mma_attention: true,
            tc_epilogues: true,
            tc_fold_max_tokens: 4,
            tc_small_max_tokens: 16,
            tc_mid_max_tokens: 16,
            tc_large_min_tokens: TC_LARGE_TOKENS,
            tc_large_split: 0,
            tc_large_split_min_chunks: 1,
            staging: TcStaging {
                bytes: tc_stage_budget(232_448),
                min_rounds: 3,
                waves: true,
            },
            split_argmax: true,
        }
    }

    /// (kernel, grid, block, shared, the input width) of a tensor-core launch.
    type TcLaunch = (Kernel, (u32, u32), u32, u32, i32);

    /// The tensor-core launches of `ops`.
    fn tc_launches(ops: Vec<Op>) -> Vec<TcLaunch> {
        ops.into_iter()
            .filter_map(|op| match op {
                Op::Launch {
                    kernel,
                    grid,
                    block,
                    shared,
                    args,
                } if kernel.tc_tile_tokens().is_some() => {
                    let Arg::I(inp) = args[4] else {
                        panic!("{kernel:?}: argument 4 is not the input width")
                    };
                    Some((kernel, grid, block, shared, inp))
                }
                _ => None,
            })
            .collect()
    }

    /// The large tiles' launches for the Qwen2.5-0.5B shape ([`qwen_shape`]) on the invariant
    /// tensor-core form, at buckets (and LM heads) of 64 and 256: a block of 256 threads per 64
    /// rows (QKV's 1,152: 18; o and down's 896: 14; the LM head's: 2,374) or 32 gate/up units
    /// (152) and per 64 tokens, 96 KB of dynamic shared memory, never staged; the add-norm and
    /// RoPE/KV forms (the folded form, at most 4 tokens) do not come in. At 32 tokens the wide
    /// tiles.
    #[test]
    fn large_tile_launches_for_the_qwen_shape() {
        let shape = qwen_shape();
        let cfg = &shape.0;
        let plan = qwen_plan(&shape);
        let launches = tc_launches;
        let big = tc_large_shared_bytes() as u32;
        // QKV, o and down_proj keep the wide tiles (their large grids, 18 and 14 blocks a
        // 64-token block, have fewer blocks than the 132 multiprocessors even at 256 tokens:
        // `Plan::tc_kernel_over`); gate/up (152 blocks) and the LM head (2,374) go large.
        for n in [64, 256] {
            let gy = (n / 64) as u32;
            let wy = (n / 32) as u32;
            let layer = [
                (Kernel::GemmTc, (72, wy), 256, 0, 896),
                (Kernel::GemmTc, (56, wy), 256, 0, 896),
                (Kernel::GemmTcSiluLarge, (152, gy), 256, big, 896),
                (Kernel::GemmTc, (56, wy), 256, 0, 4864),
            ];
            let body = launches(plan.body(n));
            assert_eq!(body.len(), 4 * cfg.num_layers, "bucket {n}");
            for (i, l) in body.chunks(4).enumerate() {
                assert_eq!(l, layer, "bucket {n}, layer {i}");
            }
            assert_eq!(
                launches(plan.head(n)),
                [(Kernel::GemmTcLarge, (2374, gy), 256, big, 896)],
                "LM head of {n}"
            );
        }
        // 32 tokens: the wide tiles (16-row blocks, 512 threads for the SiLU GEMM).
        let body = launches(plan.body(32));
        assert_eq!(
            body[..4],
            [
                (Kernel::GemmTc, (72, 1), 256, 0, 896),
                (Kernel::GemmTc, (56, 1), 256, 0, 896),
                (Kernel::GemmTcSilu, (304, 1), 512, 0, 896),
                (Kernel::GemmTc, (56, 1), 256, 0, 4864),
            ]
        );
        // Off: the wide tiles at 64 too.
        let off = Plan {
            tc_large_min_tokens: 0,
            ..plan
        };
        assert!(
            launches(off.body(64))
                .iter()
                .chain(&launches(off.head(64)))
                .all(|&(k, ..)| !k.is_tc_large() && k.wide() == k)
        );
    }

    /// With the device's rule ([`TC_LARGE_SPLIT_MIN_CHUNKS`] chunks a block at least), the
    /// Qwen2.5-0.5B shape splits only down_proj (152 chunks: 8 blocks a tile, or fewer where
    /// `tc_large_split` says), never QKV and o (28 chunks: the wide tiles), and down_proj only
    /// where its split grid has a block a multiprocessor (132): its 14 tiles a 64-token block
    /// times 8 groups are 112 blocks at 64 tokens (the wide tiles) and 224 at 128 (split); over
    /// 4 groups it splits from 256 tokens, over 2 at 384. SmolLM2-135M's down_proj (48 chunks)
    /// over 3 blocks at most, and only at 512 tokens (its 9 tiles a 64-token block: 27 and 108
    /// blocks at 64 and 256, 216 at 512); its gate/up (18 chunks) never.
    #[test]
    fn split_takes_at_least_the_min_chunks_a_block() {
        let shape = qwen_shape();
        // (tc_large_split, down_proj's groups, the buckets where down_proj splits)
        let cases: [(usize, usize, &[usize]); 5] = [
            (8, 8, &[128, 256, 384]),
            (4, 4, &[256, 384]),
            (2, 2, &[384]),
            (1, 0, &[]),
            (0, 0, &[]),
        ];
        for (split, down_groups, split_at) in cases {
            let plan = Plan {
                tc_large_split: split,
                tc_large_split_min_chunks: TC_LARGE_SPLIT_MIN_CHUNKS,
                ..qwen_plan(&shape)
            };
            assert_eq!(plan.tc_large_split_groups(896), split.min(1));
            assert_eq!(
                plan.tc_large_split_groups(4864),
                down_groups.max(split.min(1))
            );
            for n in [64, 128, 256, 384] {
                let what = format!("down at {n}, split {split}");
                let launches = tc_launches(plan.body(n));
                let mut downs = 0;
                for &(k, (gx, gy), _, _, inp) in &launches {
                    match inp {
                        4864 => {
                            downs += 1;
                            if split_at.contains(&n) {
                                assert_eq!(k, Kernel::GemmTcLargeSplit, "{what}");
                                assert_eq!(gx, 14 * down_groups as u32, "{what}");
                                assert_eq!(gy, n.div_ceil(64) as u32, "{what}");
                                assert!((gx * gy) as usize >= 132, "{what}");
                            } else {
                                // The split grid short of the multiprocessors (or no split):
                                // the wide tiles.
                                assert_eq!((k, gx), (Kernel::GemmTc, 56), "{what}");
                            }
                        }
                        896 if k == Kernel::GemmTcSiluLarge => {}
                        _ => assert!(
                            !k.is_tc_large_split(),
                            "{k:?} of input {inp} at {n}, split {split}"
                        ),
                    }
                }
                assert_eq!(downs, shape.0.num_layers, "{what}");
            }
        }
        let smol = bgs_model::synth::synth_config(bgs_model::synth::SynthArch::Smollm2_135m);
        let geo = host::geometry(&smol, 16, 1024, 512, 256).unwrap();
        let w = DevWeights {
            layers: vec![DevLayer::default(); smol.num_layers],
            ..Default::default()
        };
        let b = Bufs::default();
        let plan = Plan {
            cfg: &smol,
            geo: &geo,
            w: &w,
            b: &b,
            tc_large_split: 8,
            tc_large_split_min_chunks: TC_LARGE_SPLIT_MIN_CHUNKS,
            ..qwen_plan(&shape)
        };
        assert_eq!(plan.tc_large_split_groups(smol.intermediate_size), 3);
        assert_eq!(plan.tc_large_split_groups(smol.hidden_size), 1);
        for n in [64, 256, 512] {
            let launches = tc_launches(plan.body(n));
            let mut downs = 0;
            for &(k, (gx, gy), _, _, inp) in &launches {
                if inp as usize == smol.intermediate_size {
                    downs += 1;
                    if n == 512 {
                        assert_eq!((k, gx, gy), (Kernel::GemmTcLargeSplit, 9 * 3, 8), "{n}");
                    } else {
                        assert_eq!((k, gx), (Kernel::GemmTc, 576 / 16), "{n}");
                    }
                } else {
                    assert!(!k.is_tc_large_split(), "{k:?} of input {inp} at {n}");
                }
            }
            assert_eq!(downs, smol.num_layers, "{n}");
        }
    }

    /// The split large tiles for the Qwen2.5-0.5B shape ([`qwen_shape`], 132 multiprocessors)
    /// with 8 class groups: QKV (18 tiles a 64-token block), o and down_proj (14) run
    /// `bgs_gemm_tc_large_split` with 8 blocks a tile side by side in x (144 and 112) where
    /// the split grid has a block a multiprocessor, the large tiles' block and shared memory,
    /// their arguments followed by the scratch and the groups: QKV at 64, 128 and 256 tokens
    /// (144 blocks and more), o and down_proj at 128 to 512 (224 and more); at 64 tokens o and
    /// down_proj's 112 blocks are short of the device and they run the wide tiles. Gate/up
    /// (152 tiles) stays `bgs_gemm_tc_silu_large` and the LM head (2,374) `bgs_gemm_tc_large`.
    /// At 512 tokens QKV's 144 tiles fill the device and it runs unsplit; over 3 groups
    /// nothing splits at 128 tokens (108 and 84 blocks) and all three at 256 (216 and 168); at
    /// 32 the wide tiles whatever the split; 0 or 1 groups: never split.
    #[test]
    fn large_tile_split_launches_for_the_qwen_shape() {
        let shape = qwen_shape();
        let b = shape.3;
        let plan = Plan {
            tc_large_split: 8,
            tc_large_split_min_chunks: 1,
            ..qwen_plan(&shape)
        };
        let big = tc_large_shared_bytes() as u32;
        for n in [64usize, 128, 256, 512] {
            let gy = n.div_ceil(64) as u32;
            let qkv = if n == 512 {
                (Kernel::GemmTcLarge, (18, gy), 256, big, 896)
            } else {
                (Kernel::GemmTcLargeSplit, (18 * 8, gy), 256, big, 896)
            };
            // 14 tiles x 8 groups at 64 tokens: 112 blocks, short of 132: the wide tiles (16
            // rows x 32 tokens a block).
            let (o, down) = if n == 64 {
                (
                    (Kernel::GemmTc, (56, 2), 256, 0, 896),
                    (Kernel::GemmTc, (56, 2), 256, 0, 4864),
                )
            } else {
                (
                    (Kernel::GemmTcLargeSplit, (14 * 8, gy), 256, big, 896),
                    (Kernel::GemmTcLargeSplit, (14 * 8, gy), 256, big, 4864),
                )
            };
            let layer = [
                qkv,
                o,
                (Kernel::GemmTcSiluLarge, (152, gy), 256, big, 896),
                down,
            ];
            let ops = plan.body(n);
            let body = tc_launches(ops.clone());
            assert_eq!(body.len(), 4 * shape.0.num_layers, "bucket {n}");
            for (i, l) in body.chunks(4).enumerate() {
                assert_eq!(l, layer, "bucket {n}, layer {i}");
            }
            // The plain GEMM's (w, x, y, out, in, n), then (part, done, groups).
            for op in &ops {
                if let Op::Launch {
                    kernel: Kernel::GemmTcLargeSplit,
                    args,
                    ..
                } = op
                {
                    assert_eq!(args.len(), 9);
                    assert_eq!(args[5], Arg::I(n as i32));
                    assert_eq!(
                        args[6..],
                        [Arg::P(b.split_part), Arg::P(b.split_done), Arg::I(8)],
                        "bucket {n}"
                    );
                }
            }
            assert_eq!(
                tc_launches(plan.head(n.min(256))),
                [(
                    Kernel::GemmTcLarge,
                    (2374, n.min(256).div_ceil(64) as u32),
                    256,
                    big,
                    896
                )],
                "LM head of {n}"
            );
        }
        // 3 groups: 3 blocks a tile, at 256 tokens (QKV's 72 tiles in 216 blocks, o and
        // down_proj's 56 in 168); at 128 (108 and 84 blocks) the wide tiles, as unsplit.
        let three = Plan {
            tc_large_split: 3,
            tc_large_split_min_chunks: 1,
            ..plan
        };
        let body = tc_launches(three.body(256));
        assert_eq!(
            body[..4],
            [
                (Kernel::GemmTcLargeSplit, (18 * 3, 4), 256, big, 896),
                (Kernel::GemmTcLargeSplit, (14 * 3, 4), 256, big, 896),
                (Kernel::GemmTcSiluLarge, (152, 4), 256, big, 896),
                (Kernel::GemmTcLargeSplit, (14 * 3, 4), 256, big, 4864),
            ]
        );
        assert_eq!(
            tc_launches(three.body(128)),
            tc_launches(qwen_plan(&shape).body(128))
        );
        assert_eq!(
            tc_launches(three.body(128))[..4],
            [
                (Kernel::GemmTc, (72, 4), 256, 0, 896),
                (Kernel::GemmTc, (56, 4), 256, 0, 896),
                (Kernel::GemmTcSiluLarge, (152, 2), 256, big, 896),
                (Kernel::GemmTc, (56, 4), 256, 0, 4864),
            ]
        );
        // 32 tokens: the wide tiles, split or not.
        assert!(
            tc_launches(plan.body(32))
                .iter()
                .all(|&(k, ..)| !k.is_tc_large() && k.wide() == k)
        );
        // 0 or 1 groups: the wide tiles where the large grid is short, as without split.
        for groups in [0, 1] {
            let unsplit = Plan {
                tc_large_split: groups,
                tc_large_split_min_chunks: 1,
                ..plan
            };
            let not_split = qwen_plan(&shape);
            for n in [64, 256] {
                assert_eq!(
                    tc_launches(unsplit.body(n)),
                    tc_launches(not_split.body(n)),
                    "{groups} groups, bucket {n}"
                );
            }
        }
    }

    /// A split launch has fewer tiles than the plan's multiprocessors but a grid of at least
    /// a block a multiprocessor, the scratch `alloc_bufs` sizes for them (`split_tiles`: a
    /// tile a multiprocessor) holds every tile's 8 class sums and counts, and its grid is its
    /// tiles' blocks times the groups (at most `TC_LARGE_SPLIT_MAX`): the Qwen2.5-0.5B shape
    /// at every bucket and LM head from 64 to 512 tokens, apart and with the SiLU GEMM folded,
    /// on devices of 2 to 400 multiprocessors. Only short grids split, and of those only where
    /// the tiles times the groups reach the multiprocessors (`Plan::tc_kernel_over`); the rest
    /// run as without split (the wide tiles where the large grid is short).
    #[test]
    fn split_launches_have_fewer_tiles_than_multiprocessors() {
        let shape = qwen_shape();
        let mut seen = [false; 2];
        // Short large grids left unsplit as their split grid is short of the multiprocessors.
        let mut short_unsplit = 0;
        for sms in [2, 16, 66, 114, 132, 160, 400] {
            for groups in [2, 3, 7, 8] {
                for epilogues in [true, false] {
                    let split = Plan {
                        sms,
                        tc_large_split: groups,
                        tc_large_split_min_chunks: 1,
                        tc_epilogues: epilogues,
                        ..qwen_plan(&shape)
                    };
                    let unsplit = Plan {
                        tc_large_split: 0,
                        tc_large_split_min_chunks: 1,
                        ..split
                    };
                    for n in [64, 96, 128, 192, 256, 320, 448, 512] {
                        let what = format!("{sms} SMs, {groups} groups, bucket {n}");
                        let ops = [split.body(n), split.head(n.min(256))].concat();
                        let plain = [unsplit.body(n), unsplit.head(n.min(256))].concat();
                        assert_eq!(ops.len(), plain.len(), "{what}");
                        for (op, was) in ops.iter().zip(&plain) {
                            let (
                                Op::Launch {
                                    kernel,
                                    grid,
                                    block,
                                    shared,
                                    args,
                                },
                                Op::Launch {
                                    kernel: was_kernel,
                                    args: was_args,
                                    ..
                                },
                            ) = (op, was)
                            else {
                                assert_eq!(op, was, "{what}");
                                continue;
                            };
                            if !kernel.is_tc_large_split() {
                                assert_eq!(op, was, "{what}");
                                // The wide tiles of a large-tile GEMM (every bucket here has
                                // 64 tokens or more): its large grid short of the
                                // multiprocessors and, where it has 2 groups or more, the
                                // split grid too.
                                if matches!(kernel, Kernel::GemmTc | Kernel::GemmTcSilu) {
                                    let (Arg::I(rows), Arg::I(inp)) = (args[3], args[4]) else {
                                        panic!("{what}: {kernel:?} {args:?}");
                                    };
                                    let units = kernel.large().tc_tile_rows().unwrap();
                                    let tiles = (rows as usize).div_ceil(units)
                                        * n.div_ceil(TC_LARGE_TOKENS);
                                    let g = split.tc_large_split_groups(inp as usize);
                                    assert!(tiles < sms as usize, "{what}: {kernel:?}");
                                    assert!(g >= 2, "{what}: {kernel:?}, {g} groups");
                                    assert!(
                                        tiles * g < sms as usize,
                                        "{what}: {kernel:?}, {tiles} tiles x {g} not split"
                                    );
                                    short_unsplit += 1;
                                }
                                continue;
                            }
                            seen[usize::from(*kernel == Kernel::GemmTcSiluLargeSplit)] = true;
                            // Without split: the wide tiles (the large grid is short).
                            assert_eq!(*was_kernel, kernel.wide(), "{what}");
                            assert_eq!(args[..args.len() - 3], was_args[..], "{what}");
                            let rows = match args[3] {
                                Arg::I(r) => r as usize,
                                a => panic!("{what}: rows {a:?}"),
                            };
                            let units = kernel.tc_tile_rows().unwrap();
                            let tiles = rows.div_ceil(units) * n.div_ceil(TC_LARGE_TOKENS);
                            assert!(tiles < sms as usize, "{what}: {kernel:?}, {tiles} tiles");
                            // Never a split grid short of the multiprocessors.
                            assert!(
                                tiles * groups >= sms as usize
                                    && grid.0 as usize * grid.1 as usize >= sms as usize,
                                "{what}: {kernel:?}, {tiles} tiles x {groups} groups"
                            );
                            assert_eq!(
                                *grid,
                                (
                                    (rows.div_ceil(units) * groups) as u32,
                                    n.div_ceil(TC_LARGE_TOKENS) as u32
                                ),
                                "{what}: {kernel:?}"
                            );
                            assert_eq!(
                                (*block, *shared as usize),
                                (256, tc_large_shared_bytes()),
                                "{what}"
                            );
                            assert_eq!(
                                args[args.len() - 3..],
                                [
                                    Arg::P(shape.3.split_part),
                                    Arg::P(shape.3.split_done),
                                    Arg::I(groups as i32)
                                ],
                                "{what}"
                            );
                        }
                    }
                }
            }
        }
        assert_eq!(seen, [true, true], "both split kernels planned");
        assert!(short_unsplit > 0, "no short split grid left unsplit");
        // The scratch `alloc_bufs` allocates: 8 class sums and a count a tile, for `split_tiles`
        // tiles (one where none split).
        struct Sizes(Vec<(String, usize)>);
        impl DeviceMem for Sizes {
            fn alloc(&mut self, bytes: usize, what: &str) -> Result<u64, GpuModelError> {
                self.0.push((what.to_string(), bytes));
                Ok(0x1000 * self.0.len() as u64)
            }
            fn upload(&mut self, bytes: &[u8], what: &str) -> Result<u64, GpuModelError> {
                self.alloc(bytes.len(), what)
            }
        }
        for (tiles, want) in [(0, 1), (1, 1), (132, 132)] {
            let mut d = Sizes(Vec::new());
            alloc_bufs(&mut d, &shape.0, 512, 256, GpuDtype::Bf16, tiles).unwrap();
            let size = |what: &str| d.0.iter().find(|(w, _)| w == what).unwrap().1;
            assert_eq!(
                size("split large tiles' class sums"),
                want * 8 * TC_LARGE_SPLIT_PART_BYTES
            );
            assert_eq!(size("split large tiles' counts"), want * 4);
        }
    }

    /// Every staged entry point's dynamic shared memory (what the host allows it with
    /// `cuFuncSetAttribute`) and its static partial sums fit the H200's opt-in limit of a
    /// block (227 KB, of which 1 KB is the system's): the mid tiles' SiLU GEMM keeps back 9 KB
    /// more than the small tiles' budget.
    #[test]
    fn staged_kernels_fit_the_block_with_their_static_shared_memory() {
        let optin = 232_448;
        let budget = tc_stage_budget(optin);
        for k in TC_STAGED_KERNELS {
            let tok = k.tc_tile_tokens().unwrap();
            let dynamic = tc_stage_kernel_bytes(k, budget);
            assert!(
                dynamic + tc_silu_static_shared(tok) + 1024 <= optin,
                "{k:?}: {dynamic} dynamic bytes"
            );
        }
        assert_eq!(
            tc_stage_kernel_bytes(Kernel::GemmTcSiluSmall, budget),
            budget
        );
        assert_eq!(
            tc_stage_kernel_bytes(Kernel::GemmTcSiluMid, budget),
            budget - 9 * 1024
        );
        // Qwen2.5-0.5B's gate/up (3 tiles of 2 groups a block, 192 KB) still stages mid.
        assert!(3 * 2 * 8 * 4 * 1024 <= tc_stage_kernel_bytes(Kernel::GemmTcSiluMid, budget));
    }
}
