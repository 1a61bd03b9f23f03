//! [`GpuModel`]: device set-up, weights, buffers, the step's launches and its graphs.

use std::ffi::{CString, c_void};
use std::path::{Path, PathBuf};

use bgs_executor_gpu::{GpuError, compile, libs};
use bgs_llm::{KvShape, StepModel};
use bgs_model::{ModelConfig, StepItem, Weights};
use cudarc::cublas::sys as cublas;
use cudarc::driver::sys as cu;

use crate::host::{self, GpuDtype, Packed, StepGeometry};
use crate::persistent;
use crate::plan::{
    self, Arg, Bufs, DevWeights, DeviceMem, Gemm, Kernel, Op, Plan, fused_form_fits,
    mma_attention_shared, tc_gemm_covers,
};

/// Bytes of the cuBLAS workspace set before capture (32 MiB: NVIDIA's recommendation for
/// Hopper; a graph-captured cuBLAS call must not allocate).
const CUBLAS_WORKSPACE: usize = 32 << 20;
const STREAM_NON_BLOCKING: u32 = 1;
/// `CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH`.
const DEVICE_LAUNCH_FLAG: u64 = 4;

/// Settings of a [`GpuModel`].
#[derive(Debug, Clone)]
pub struct GpuModelOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Element type of weights, KV cache and GEMM inputs.
    pub dtype: GpuDtype,
    /// Positions per KV block.
    pub block_size: usize,
    /// KV blocks; `None`: `kv_memory_fraction` of the free memory after weights and buffers.
    pub num_blocks: Option<usize>,
    /// Share of free device memory for the KV pool when `num_blocks` is `None`.
    pub kv_memory_fraction: f64,
    /// Tokens per step (rounded up to a bucket, at most 512).
    pub max_batched_tokens: usize,
    /// Items (sequences) per step.
    pub max_seqs: usize,
    /// Where CUDA libraries live (else `CUDA_HOME`, `/usr/local/cuda`, the loader's path).
    pub cuda_home: Option<PathBuf>,
    /// Kernel cache directory (else `$XDG_CACHE_HOME/bgs`, `~/.cache/bgs`).
    pub cache_dir: Option<PathBuf>,
    /// Replay one captured graph per bucket (false: the same launches, uncaptured).
    pub use_graphs: bool,
    /// Every projection through the crate's own kernels, whose reduction order is fixed by the
    /// output's row alone, instead of cuBLAS: batch-invariant by construction. 16-bit models
    /// whose widths the tensor-core GEMM covers (`bgs_gemm_tc`; the served shapes) run it for
    /// every bucket (sm_80+, else refused); others (f32) run every bucket in the fused form
    /// (see `fused_max_tokens`; weights read once per 8 tokens on CUDA cores) and the LM head
    /// through `bgs_proj`, refused when the model's widths do not fit that form. Slower than
    /// cuBLAS beyond a few tokens (docs/gpu-model.md).
    pub batch_invariant_gemm: bool,
    /// Buckets of at most this many tokens (decode at small batch) run the fused form: the
    /// projections are the crate's own kernels with the layer's other steps fused into them
    /// (the norms as prologues; bias, RoPE and the K/V writes, SiLU and the residual adds as
    /// epilogues), 5 launches per layer instead of 9 (docs/gpu-model.md). 0: cuBLAS for every
    /// bucket (the default: cuBLAS gives a request the same tokens at the batch sizes of the
    /// paper's workload, and mixing the two forms would not; the fused form wins only at 1-2
    /// tokens, -18% at batch 1 on the H200, docs/gpu-model.md). Ignored (cuBLAS) when the
    /// model's widths do not fit the form.
    pub fused_max_tokens: usize,
    /// Projections over at most this many tokens (sampled rows, for the LM head) run on
    /// tensor cores in the crate's own GEMM (`bgs_gemm_tc`) instead of cuBLAS: 16-bit models
    /// on sm_80+, input widths in whole 32-value chunks (else cuBLAS). Its reduction order is
    /// fixed by the input width alone, so within these buckets a request's tokens do not
    /// depend on what else is in the step. Buckets the fused form takes keep it. 0 (the
    /// default): cuBLAS for every projection. On the H200 it is faster than cuBLAS at 1-4
    /// tokens only (1.119 against 1.143 ms a Qwen2.5-0.5B-shape step at batch 1), and mixing
    /// it with cuBLAS for larger buckets changes a request's bits with the batch size; the
    /// invariant option runs it for every bucket.
    pub tensor_core_gemm_max_tokens: usize,
    /// Where the gate/up projection runs on the tensor-core GEMM, run SiLU·up as its epilogue
    /// (`bgs_gemm_tc_silu`): the same bits as the GEMM then `bgs_silu_mul`, one launch a layer
    /// fewer and no f32 gate/up activations. On by default.
    pub tensor_core_gemm_epilogues: bool,
    /// With the epilogues on, buckets of at most this many tokens whose every projection runs
    /// on the tensor-core GEMM take the **folded form** (where the model fits: head_dim a
    /// multiple of 16, hidden at most `plan::TC_NORM_MAX_HIDDEN`): the residual adds and the
    /// norms after them become the epilogues of o and down (the grid's last block of a token
    /// block norms its rows), RoPE and the K/V writes the QKV GEMM's epilogue, five launches a
    /// layer instead of eight for the same bits, so buckets may mix the two forms. 4 by
    /// default: on the H200 it takes 5% off the Qwen2.5-0.5B-shape step at batch 1 and is
    /// slower past 8 tokens (its last block norms a token block's rows alone); 0: never
    /// (docs/gpu-model.md).
    pub tensor_core_gemm_fold_max_tokens: usize,
    /// Buckets of at most this many tokens, and LM heads of at most this many rows, run the
    /// tensor-core kernels' small-tile entry points (`bgs_gemm_tc_small` and the others'
    /// `_small` forms): fragments for `plan::TC_SMALL_TOKENS` (8) tokens instead of 32, so
    /// fewer registers and more blocks a multiprocessor, for the same bits (the check compares
    /// the two); past 8 tokens a bucket takes several token blocks, each reading the weights.
    /// 16 by default (on the H200 the 16-token bucket is 0.7-3.4% faster in two small blocks
    /// than in one wide one, the 32-token bucket 4-20% slower); 0: the wide tiles everywhere.
    /// The persistent form keeps the wide tiles.
    pub tensor_core_small_tiles_max_tokens: usize,
    /// Buckets of more than `plan::TC_SMALL_TOKENS` (8) and at most this many tokens, and LM
    /// heads of that many rows, run the tensor-core kernels' mid-tile entry points instead
    /// (`bgs_gemm_tc_mid` and the others' `_mid` forms): fragments for `plan::TC_MID_TOKENS`
    /// (16) tokens, so the 16-token bucket is one token block reading the weights once, where
    /// the small tiles take two blocks each reading them; staged like the small tiles, for the
    /// same bits (the check compares them with the small and the wide tiles). 16 by default:
    /// on an H100 the 16-token bucket's invariant step is 13% faster (Qwen2.5-0.5B shape 1.127
    /// against 1.299 ms; SmolLM2-135M 0.784 against 0.862), the 32-token bucket in two mid
    /// blocks no faster on the Qwen shape (`bench/results/20261207-gpu-tc-mid-tiles-h100`); 0:
    /// none. The persistent form keeps the wide tiles.
    pub tensor_core_mid_tiles_max_tokens: usize,
    /// Buckets of at least this many tokens, and LM heads of at least this many rows, run the
    /// plain and the gate/up SiLU tensor-core GEMM on their large-tile entry points
    /// (`bgs_gemm_tc_large`, `bgs_gemm_tc_silu_large`) wherever those would run on the wide,
    /// mid or small tiles: a block of 8 warps covers `plan::TC_LARGE_ROWS` (64) weight rows and
    /// `plan::TC_LARGE_TOKENS` (64) tokens, staging weights and activations through shared
    /// memory (`plan::tc_large_shared_bytes`, 96 KB a block with the opt-in), so each is read
    /// far fewer times; the input's chunks are summed in the wide tile's order, for the same
    /// bits (the check compares them). The add-norm and RoPE/KV forms keep their tiles. 64 by
    /// default; 0: never. Off (with a log line) where the device's opt-in shared memory a block
    /// is smaller. The persistent form keeps the wide tiles.
    pub tensor_core_large_tiles_min_tokens: usize,
    /// Where a projection's large grid would have fewer blocks than the device has
    /// multiprocessors (on the Qwen2.5-0.5B shape QKV, o and down_proj: 896 or 1,152 rows),
    /// run it on the large tiles **split** over at most this many blocks a tile
    /// (`bgs_gemm_tc_large_split`, `bgs_gemm_tc_silu_large_split`; 2..=8) instead of the wide
    /// tiles: each block sums its share of the 8 classes of input chunks, stores the class
    /// sums, and the tile's last block adds them in class order, for the same bits (the check
    /// compares large against wide tiles whatever this option). Only with at least
    /// `plan::TC_LARGE_SPLIT_MIN_CHUNKS` (16) input chunks a block and a split grid of at least
    /// a block a multiprocessor (`plan::Plan::tc_kernel_over`): on the Qwen2.5-0.5B shape
    /// down_proj from 128 tokens, on SmolLM2-135M at 512 only. 8 by default: on an H100 the
    /// Qwen shape's invariant step 5% faster at 128 tokens and 3% at 256, served saturation
    /// 4.9% more tokens (`bench/results/20261207-gpu-tc-large-split-h100`). The scratch: 128 KB
    /// a multiprocessor. 0 (or 1): such projections keep the wide tiles.
    pub tensor_core_large_split: usize,
    /// Let the small-tile GEMMs stage their weights in shared memory (`plan::Plan::tc_stage`):
    /// where a warp's share of a row tile takes more than one round of loads into registers
    /// (down_proj) or the row tiles outnumber the multiprocessors (gate/up), a block takes up
    /// to 4 row tiles and copies all their weights into shared memory at once, before waiting
    /// on the previous kernel; the same bits. Used where the device's shared memory a block
    /// holds them (sm_80 and later); on by default.
    pub tensor_core_staged_tiles: bool,
    /// With `tensor_core_staged_tiles`: stage a projection whose warps would take at least
    /// this many rounds of 4 chunks' register loads (0: never for that reason). 3 by default:
    /// Qwen2.5-0.5B's down_proj (5 rounds) stages, SmolLM2-135M's (2 rounds: slower staged
    /// on the H200) does not.
    pub tensor_core_stage_min_rounds: usize,
    /// With `tensor_core_staged_tiles`: stage a projection with more row tiles than
    /// multiprocessors (Qwen2.5-0.5B's gate/up: 304 tiles a block a multiprocessor). On by
    /// default.
    pub tensor_core_stage_waves: bool,
    /// Launch the crate's kernels with programmatic dependent launch (sm_90 and later; ignored
    /// on older devices): each may be scheduled while the one before it drains, and waits for
    /// it before reading (`BGS_PDL_BEGIN` in the kernels). cuBLAS's GEMMs launch as they do.
    /// On by default: 4-8% off the H200's decode step at every batch size, the same bits.
    pub programmatic_launch: bool,
    /// Warps per attention block, 1..=8: the positions a token attends to are split across
    /// them in fixed groups of 32 (more memory requests in flight at small batch; the split
    /// depends only on the positions, so results stay batch-invariant).
    pub attention_warps: u32,
    /// Attention on tensor cores (`bgs_attention_mma`): a block per kv head and token stages
    /// each group of 32 K/V rows once in shared memory and reduces it for all the query heads
    /// of the group with MMAs, instead of a block per query head (`bgs_attention`, shuffle
    /// trees, every row read once per head). The same splits and softmax either way; the
    /// products' sums differ in rounding only (docs/gpu-model.md). Ignored (per-head blocks)
    /// for f32, head sizes other than 16/32/64, more than 16 query heads a kv head, or a
    /// device older than sm_80.
    pub tensor_core_attention: bool,
    /// Instantiate the step graphs with `CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH` (and
    /// upload them) so that a graph running on the device (the resident step loop,
    /// `crate::gen_exec`) can launch them; [`GpuModel::device_handles`] exposes them. Requires
    /// `use_graphs`. Host replay (`step`) keeps working: a device-launchable graph can still be
    /// launched from the host.
    pub device_launch: bool,
    /// Buckets of at most this many tokens (and LM heads of at most this many rows) also get
    /// the **persistent form**: the bucket's whole op list in one cooperative launch of
    /// `bgs_persistent`, which runs each op's kernel body over the op's blocks with a grid
    /// barrier between ops (`crate::persistent`, docs/gpu-model.md). The same bits as the
    /// launched ops; what goes is a launch and its drain per op. Only buckets whose ops are all
    /// the crate's kernels have it (`batch_invariant_gemm`, `fused_max_tokens`,
    /// `tensor_core_gemm_max_tokens`); with cuBLAS projections it is skipped with a log line.
    /// Host replay uses it while [`GpuModel::set_persistent`] is on (the default when any
    /// bucket has it); the device-launched graphs (`device_launch`) stay the launched form.
    /// 0 (the default): none.
    pub persistent_max_tokens: usize,
    /// While op i of a persistent step runs, the grid prefetches into L2 the weights of op i +
    /// this (0, the default: no prefetch; on the H200 it changed nothing, docs/gpu-model.md).
    pub persistent_prefetch_distance: usize,
    /// Blocks of the persistent kernel per multiprocessor (at most what fits; 0: as many as
    /// fit).
    pub persistent_blocks_per_sm: u32,
}

impl Default for GpuModelOptions {
    fn default() -> Self {
        GpuModelOptions {
            device: 0,
            dtype: GpuDtype::Bf16,
            block_size: 16,
            num_blocks: None,
            kv_memory_fraction: 0.5,
            max_batched_tokens: 512,
            max_seqs: 256,
            cuda_home: None,
            cache_dir: None,
            use_graphs: true,
            batch_invariant_gemm: false,
            fused_max_tokens: 0,
            tensor_core_gemm_max_tokens: 0,
            tensor_core_gemm_epilogues: true,
            tensor_core_gemm_fold_max_tokens: 4,
            tensor_core_small_tiles_max_tokens: 2 * plan::TC_SMALL_TOKENS,
            tensor_core_mid_tiles_max_tokens: plan::TC_MID_TOKENS,
            tensor_core_large_tiles_min_tokens: plan::TC_LARGE_TOKENS,
            tensor_core_large_split: 8,
            tensor_core_staged_tiles: true,
            tensor_core_stage_min_rounds: 3,
            tensor_core_stage_waves: true,
            programmatic_launch: true,
            attention_warps: 4,
            tensor_core_attention: true,
            device_launch: false,
            persistent_max_tokens: 0,
            persistent_prefetch_distance: 0,
            persistent_blocks_per_sm: 1,
        }
    }
}

/// What a device-side step loop needs to drive a [`GpuModel`] built with
/// [`GpuModelOptions::device_launch`]: the graph handles per bucket and the device buffers.
/// The handles stay valid while the model lives; nothing here owns them.
#[derive(Debug, Clone)]
pub struct DeviceHandles {
    /// (token bucket, `CUgraphExec` as u64) of the body graphs, ascending buckets.
    pub body: Vec<(usize, u64)>,
    /// (sampled-row bucket, `CUgraphExec` as u64) of the LM-head graphs, ascending buckets.
    pub head: Vec<(usize, u64)>,
    /// Device address of the step-input buffer (`geometry.words()` i32, `bgs_llm_step.h`).
    pub inputs: u64,
    /// Device address of the sampled token ids (`geometry.max_samples` u32), written by the
    /// head graph: row r of the step's sampled rows.
    pub next: u64,
    /// The step geometry the graphs were captured for.
    pub geometry: StepGeometry,
}

/// Why the GPU model cannot be built or a step failed; one line naming the problem.
#[derive(Debug, thiserror::Error)]
pub enum GpuModelError {
    /// No driver, no device, a missing library, a failed CUDA/cuBLAS call (by name, with the
    /// error's name), or a kernel build failure.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// Invalid model or options.
    #[error("invalid GPU model settings: {0}")]
    Config(String),
    /// A device allocation failed for lack of memory.
    #[error(
        "out of GPU memory: {what} needs {need} bytes, {free} of {total} bytes free \
         ({held} already held by this model)"
    )]
    OutOfMemory {
        /// The buffer.
        what: String,
        /// Its size.
        need: usize,
        /// Free device memory at the failure.
        free: usize,
        /// Device memory.
        total: usize,
        /// Bytes this model had allocated before.
        held: usize,
    },
    /// The step's items are invalid (nothing ran).
    #[error("bad step: {0}")]
    Step(String),
}

use bgs_executor_gpu::device::check as ck;

fn ck_blas(r: cublas::cublasStatus_t, what: &str) -> Result<(), GpuError> {
    if r == cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Cuda {
            what: what.to_string(),
            name: format!("{r:?}"),
        })
    }
}

/// The device and its libraries, ready to use.
struct Env {
    dev: cu::CUdevice,
    name: String,
    cc: (i32, i32),
    driver: i32,
    /// Streaming multiprocessors (the fused form's norm kernels size their grids by them).
    sms: u32,
    /// Shared memory a block may hold with the opt-in
    /// (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`).
    smem_optin: usize,
}

fn init(device: usize, cuda_home: Option<&Path>) -> Result<Env, GpuError> {
    let d = bgs_executor_gpu::device::open(device)?;
    bgs_executor_gpu::device::load_libraries(
        cuda_home,
        &[
            libs::CUBLASLT,
            libs::CUBLAS,
            libs::NVRTC_BUILTINS,
            libs::NVRTC,
        ],
    )?;
    let mut optin = 0i32;
    ck(
        // SAFETY: `d.dev` is a device handle cuDeviceGet returned; out-pointer valid.
        unsafe {
            cu::cuDeviceGetAttribute(
                &mut optin,
                cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                d.dev,
            )
        },
        "cuDeviceGetAttribute(shared memory a block, opt-in)",
    )?;
    Ok(Env {
        dev: d.dev,
        smem_optin: optin.max(0) as usize,
        name: d.name,
        cc: d.compute_capability,
        sms: d.multiprocessors,
        driver: d.driver_version,
    })
}

/// Build (or read from the cache) the kernels' cubin for the device, dtype and head size.
fn kernels(
    env: &Env,
    dtype: GpuDtype,
    head_dim: usize,
    cache: Option<&Path>,
) -> Result<(Vec<u8>, bool), GpuError> {
    let options = crate::nvrtc_options(env.cc.0, env.cc.1, dtype, head_dim);
    let versions = format!("driver {} nvrtc {}", env.driver, compile::nvrtc_version()?);
    let key = crate::cache_key(&options, &env.name, &versions);
    let dir = compile::cache_dir(cache);
    if let Some(c) = dir.as_deref().and_then(|d| compile::cache_read(d, &key)) {
        return Ok((c, true));
    }
    let cubin = compile::nvrtc_compile_source(
        "llm_kernels.cu",
        crate::KERNEL_SOURCE,
        &crate::kernel_headers(),
        &options,
    )?;
    if let Some(d) = dir.as_deref() {
        compile::cache_write(d, &key, &cubin);
    }
    Ok((cubin, false))
}

/// A decoder-only model on one CUDA device (see the crate docs and docs/gpu-model.md).
pub struct GpuModel {
    cfg: ModelConfig,
    dtype: GpuDtype,
    geo: StepGeometry,
    use_graphs: bool,
    device_launch: bool,
    invariant_gemm: bool,
    /// Buckets of at most this many tokens run the fused form (0 when it cannot).
    fused_max_tokens: usize,
    /// Projections over at most this many tokens run `bgs_gemm_tc` (0 before sm_80).
    tc_gemm_max_tokens: usize,
    /// `tensor_core_gemm_epilogues` (`set_tc_epilogues` changes it for direct launches).
    tc_epilogues: bool,
    /// `tensor_core_gemm_fold_max_tokens`.
    tc_fold_max_tokens: usize,
    /// `tensor_core_small_tiles_max_tokens`.
    tc_small_max_tokens: usize,
    /// Whether the small tiles are used (`set_tc_small_tiles` changes it for direct launches).
    tc_small_on: bool,
    /// `tensor_core_mid_tiles_max_tokens` (`set_tc_mid_max_tokens` changes it for direct
    /// launches).
    tc_mid_max_tokens: usize,
    /// `tensor_core_large_tiles_min_tokens` (`set_tc_large_min_tokens` changes it for direct
    /// launches); 0 where the device cannot run the large tiles (`tc_large_fits`).
    tc_large_min_tokens: usize,
    /// Whether the device runs the large tiles: sm_80+ and its opt-in shared memory a block
    /// holds `plan::tc_large_shared_bytes` (their attribute is set at the build).
    tc_large_fits: bool,
    /// `tensor_core_large_split` (at most `plan::TC_LARGE_SPLIT_MAX`; `set_tc_large_split`
    /// changes it for direct launches); 0 where the model has no split scratch.
    tc_large_split: usize,
    /// Whether the split form's scratch is allocated: the large tiles fit the device and
    /// `tensor_core_large_split` is 2 or more.
    tc_large_split_scratch: bool,
    /// When the small tiles stage (`tensor_core_stage_min_rounds`, `tensor_core_stage_waves`)
    /// and the dynamic shared memory they may take a block (0: never staged).
    tc_stage: plan::TcStaging,
    /// Whether the plan stages (`set_tc_staged_tiles` changes it for direct launches).
    tc_stage_on: bool,
    /// Launch the crate's kernels with programmatic stream serialization
    /// (`programmatic_launch` on a device that has it); off while `profile_ops` captures
    /// events between the operations.
    pdl: std::cell::Cell<bool>,
    /// The device's multiprocessors.
    sms: u32,
    attention_warps: u32,
    /// `tensor_core_attention`, where the model and device allow it.
    mma_attention: bool,
    device_name: String,
    compute_capability: (i32, i32),
    cache_hit: bool,
    dev: cu::CUdevice,
    ctx: cu::CUcontext,
    module: cu::CUmodule,
    stream: cu::CUstream,
    /// Recorded after each served step and waited on with `cuEventSynchronize`: created with
    /// `CU_EVENT_BLOCKING_SYNC`, so the engine's thread sleeps until the GPU's interrupt
    /// instead of spinning a core for the whole step (the default for stream synchronization).
    step_done: cu::CUevent,
    blas: cublas::cublasHandle_t,
    /// The kernels, in `Kernel::ALL` order.
    funcs: Vec<cu::CUfunction>,
    allocs: Vec<(u64, usize)>,
    held: usize,
    w: DevWeights,
    cache: u64,
    kv_bytes: usize,
    b: Bufs,
    /// Step inputs (`StepGeometry` layout, i32).
    inputs: u64,
    workspace: u64,
    /// Pinned host staging of the step inputs (`geo.words()` i32).
    staging: *mut i32,
    /// Pinned host copy of `next` (`geo.max_samples` u32).
    next_host: *mut u32,
    /// (bucket, exec) for the body graphs and the LM-head graphs.
    body_graphs: Vec<(usize, cu::CUgraphExec)>,
    head_graphs: Vec<(usize, cu::CUgraphExec)>,
    graphs: Vec<cu::CUgraph>,
    /// The persistent form (`GpuModelOptions::persistent_max_tokens`).
    persist: Persist,
}

/// One op list as a persistent table on the device.
#[derive(Debug, Clone)]
struct PersistTable {
    /// The bucket (tokens for a body, rows for a head).
    bucket: usize,
    head: bool,
    table: u64,
    ops: u32,
    /// Two zeroed u32: the grid barrier's arrivals and the blocks done.
    sync: u64,
    /// The ops' kernel ids (`persistent::OpRecord::kernel`), for the profile.
    kernels: Vec<u32>,
}

/// The persistent form's kernel, tables and graphs.
#[derive(Debug, Default)]
struct Persist {
    max_tokens: usize,
    prefetch_distance: usize,
    blocks_per_sm: u32,
    /// Replay the persistent graphs where a bucket has one.
    on: bool,
    func: Option<cu::CUfunction>,
    grid: u32,
    shared: u32,
    /// The kernel's registers a thread, static shared and local memory bytes (reported).
    regs: i32,
    static_shared: i32,
    local_bytes: i32,
    tables: Vec<PersistTable>,
    body_graphs: Vec<(usize, cu::CUgraphExec)>,
    head_graphs: Vec<(usize, cu::CUgraphExec)>,
    /// `profile_persistent`'s timer stamps: one u64 per op of the longest table, and one more.
    stamps: u64,
    /// `persistent_barrier_ms`'s tables of no-op ops, by length (made on first use).
    nop_tables: Vec<PersistTable>,
}

// SAFETY: the model owns its context, stream, handles and memory exclusively; every method
// that touches the device first makes the context current on the calling thread, and `&mut
// self` keeps calls from two threads at once out. The raw pointers are never shared.
unsafe impl Send for GpuModel {}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("device", &self.device_name)
            .field("dtype", &self.dtype)
            .field("geometry", &self.geo)
            .field("weight_bytes", &self.w.bytes)
            .field("kv_bytes", &self.kv_bytes)
            .field("use_graphs", &self.use_graphs)
            .field("batch_invariant_gemm", &self.invariant_gemm)
            .field("fused_max_tokens", &self.fused_max_tokens)
            .field("tensor_core_gemm_max_tokens", &self.tc_gemm_max_tokens)
            .field("programmatic_launch", &self.pdl.get())
            .finish_non_exhaustive()
    }
}

impl GpuModel {
    /// Upload `weights` for `cfg` to the device, size the KV pool, compile (or load) the
    /// kernels and capture the step graphs. Model and option errors come before any device
    /// work.
    pub fn new(
        cfg: ModelConfig,
        weights: &Weights,
        opts: &GpuModelOptions,
    ) -> Result<GpuModel, GpuModelError> {
        host::check_config(&cfg).map_err(GpuModelError::Config)?;
        weights.check_shapes(&cfg).map_err(GpuModelError::Config)?;
        if opts.device_launch && !opts.use_graphs {
            return Err(GpuModelError::Config(
                "device_launch needs use_graphs (only captured graphs can be device-launched)"
                    .into(),
            ));
        }
        // Checked before any device work (the real pool size comes later).
        let pre = if let Some(n) = opts.num_blocks {
            host::geometry(
                &cfg,
                opts.block_size,
                n,
                opts.max_batched_tokens,
                opts.max_seqs,
            )
        } else {
            host::blocks_for_budget(
                &cfg,
                opts.block_size.max(1),
                opts.dtype,
                usize::MAX / 2,
                opts.kv_memory_fraction,
                1,
            )
            .map_err(GpuModelError::Config)?;
            host::geometry(
                &cfg,
                opts.block_size,
                1,
                opts.max_batched_tokens,
                opts.max_seqs,
            )
        }
        .map_err(GpuModelError::Config)?;
        if !(1..=8).contains(&opts.attention_warps) {
            return Err(GpuModelError::Config(format!(
                "attention_warps must be 1..=8, got {}",
                opts.attention_warps
            )));
        }
        // The invariant option on a 16-bit model the tensor-core GEMM covers runs every
        // projection there (the device must be sm_80+: checked below); else the fused form.
        let invariant_tc = opts.batch_invariant_gemm && tc_gemm_covers(&cfg, opts.dtype);
        let fused_max_tokens = match fused_form_fits(&cfg, opts.dtype) {
            Ok(()) => opts.fused_max_tokens,
            Err(why) if opts.batch_invariant_gemm && !invariant_tc => {
                return Err(GpuModelError::Config(format!(
                    "batch_invariant_gemm runs every projection in the fused form, which \
                     cannot run this model: {why}"
                )));
            }
            Err(why) => {
                if opts.fused_max_tokens > 0 {
                    tracing::info!("fused form off (cuBLAS for every bucket): {why}");
                }
                0
            }
        };

        let env = init(opts.device, opts.cuda_home.as_deref())?;
        if invariant_tc && env.cc.0 < 8 {
            return Err(GpuModelError::Config(format!(
                "batch_invariant_gemm needs tensor cores for 16-bit values (sm_80+) on this \
                 model; {} is sm_{}{}",
                env.name, env.cc.0, env.cc.1
            )));
        }
        // The large tiles' pipeline takes more dynamic shared memory than a block gets
        // without the opt-in: where the device's opt-in limit is smaller, they are off.
        // (1 KB beside it for the kernels' static shared memory: the split form's flag.)
        let tc_large_fits = env.cc.0 >= 8 && env.smem_optin >= plan::tc_large_shared_bytes() + 1024;
        if !tc_large_fits && opts.tensor_core_large_tiles_min_tokens > 0 && env.cc.0 >= 8 {
            tracing::info!(
                "large tensor-core tiles off: a block of them takes {} bytes of shared memory, \
                 {} allows {} a block",
                plan::tc_large_shared_bytes(),
                env.name,
                env.smem_optin
            );
        }
        let mut m = GpuModel {
            cfg,
            dtype: opts.dtype,
            geo: pre,
            use_graphs: opts.use_graphs,
            device_launch: opts.device_launch,
            invariant_gemm: opts.batch_invariant_gemm && !invariant_tc,
            fused_max_tokens,
            tc_gemm_max_tokens: if invariant_tc {
                usize::MAX
            } else if env.cc.0 >= 8 {
                opts.tensor_core_gemm_max_tokens
            } else {
                0
            },
            tc_epilogues: opts.tensor_core_gemm_epilogues,
            tc_fold_max_tokens: opts.tensor_core_gemm_fold_max_tokens,
            tc_small_max_tokens: opts.tensor_core_small_tiles_max_tokens,
            tc_small_on: true,
            tc_mid_max_tokens: opts.tensor_core_mid_tiles_max_tokens,
            tc_large_min_tokens: if tc_large_fits {
                opts.tensor_core_large_tiles_min_tokens
            } else {
                0
            },
            tc_large_fits,
            tc_large_split: if tc_large_fits && opts.tensor_core_large_split >= 2 {
                opts.tensor_core_large_split.min(plan::TC_LARGE_SPLIT_MAX)
            } else {
                0
            },
            tc_large_split_scratch: tc_large_fits && opts.tensor_core_large_split >= 2,
            tc_stage: plan::TcStaging {
                bytes: if opts.tensor_core_staged_tiles && env.cc.0 >= 8 {
                    plan::tc_stage_budget(env.smem_optin)
                } else {
                    0
                },
                ..plan::TcStaging::from(opts)
            },
            tc_stage_on: true,
            pdl: std::cell::Cell::new(opts.programmatic_launch && env.cc.0 >= 9),
            sms: env.sms,
            attention_warps: opts.attention_warps,
            mma_attention: false,
            device_name: env.name.clone(),
            compute_capability: env.cc,
            cache_hit: false,
            dev: env.dev,
            ctx: std::ptr::null_mut(),
            module: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            step_done: std::ptr::null_mut(),
            blas: std::ptr::null_mut(),
            funcs: Vec::new(),
            allocs: Vec::new(),
            held: 0,
            w: DevWeights::default(),
            cache: 0,
            kv_bytes: 0,
            b: Bufs::default(),
            inputs: 0,
            workspace: 0,
            staging: std::ptr::null_mut(),
            next_host: std::ptr::null_mut(),
            body_graphs: Vec::new(),
            head_graphs: Vec::new(),
            graphs: Vec::new(),
            persist: Persist {
                max_tokens: opts.persistent_max_tokens,
                prefetch_distance: opts.persistent_prefetch_distance,
                blocks_per_sm: opts.persistent_blocks_per_sm,
                ..Default::default()
            },
        };
        // Before the build: the step graphs are captured with the attention form chosen here.
        m.set_tensor_core_attention(opts.tensor_core_attention);
        m.build(&env, weights, opts)?;
        Ok(m)
    }

    fn build(
        &mut self,
        env: &Env,
        weights: &Weights,
        opts: &GpuModelOptions,
    ) -> Result<(), GpuModelError> {
        // SAFETY: initialized driver, valid device; out-pointer valid; released in Drop.
        unsafe {
            ck(
                cu::cuDevicePrimaryCtxRetain(&mut self.ctx, self.dev),
                "cuDevicePrimaryCtxRetain",
            )?;
        }
        self.make_current()?;
        let (cubin, hit) = kernels(
            env,
            self.dtype,
            self.cfg.head_dim,
            opts.cache_dir.as_deref(),
        )?;
        self.cache_hit = hit;
        ck(
            // SAFETY: `cubin` is a complete cubin for this device; out-pointer valid.
            unsafe { cu::cuModuleLoadData(&mut self.module, cubin.as_ptr().cast()) },
            "cuModuleLoadData(llm kernels)",
        )?;
        self.funcs = Kernel::ALL
            .iter()
            .map(|k| get_function(self.module, k.name()))
            .collect::<Result<_, _>>()?;
        if self.tc_stage.bytes > 0 {
            // The staged small and mid tiles take more dynamic shared memory than a block gets
            // without the opt-in (`plan::Plan::tc_stage` stays within what each is allowed).
            for k in plan::TC_STAGED_KERNELS {
                ck(
                    // SAFETY: `func(k)` is a kernel of the loaded module; the size is within
                    // the device's opt-in limit less the kernel's static shared memory
                    // (`plan::tc_stage_budget`, `plan::tc_stage_kernel_bytes`).
                    unsafe {
                        cu::cuFuncSetAttribute(
                            self.func(k)?,
                            cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            plan::tc_stage_kernel_bytes(k, self.tc_stage.bytes) as i32,
                        )
                    },
                    &format!(
                        "cuFuncSetAttribute({}, max dynamic shared memory)",
                        k.name()
                    ),
                )?;
            }
        }
        if self.tc_large_fits {
            // The large tiles' pipeline takes more dynamic shared memory than a block gets
            // without the opt-in, the same bytes on every launch (`plan::tc_large_shared_bytes`).
            // Set whatever `tensor_core_large_tiles_min_tokens` (`set_tc_large_min_tokens` may
            // turn them on for direct launches).
            for k in plan::TC_LARGE_KERNELS {
                ck(
                    // SAFETY: `func(k)` is a kernel of the loaded module; the size is within the
                    // device's opt-in limit (`tc_large_fits`).
                    unsafe {
                        cu::cuFuncSetAttribute(
                            self.func(k)?,
                            cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            plan::tc_large_shared_bytes() as i32,
                        )
                    },
                    &format!(
                        "cuFuncSetAttribute({}, max dynamic shared memory)",
                        k.name()
                    ),
                )?;
            }
        }
        ck(
            // SAFETY: a context is current; out-pointer valid; destroyed in Drop.
            unsafe { cu::cuStreamCreate(&mut self.stream, STREAM_NON_BLOCKING) },
            "cuStreamCreate",
        )?;
        ck(
            // SAFETY: a context is current; out-pointer valid; destroyed in Drop.
            unsafe {
                cu::cuEventCreate(
                    &mut self.step_done,
                    cu::CUevent_flags_enum::CU_EVENT_BLOCKING_SYNC as u32
                        | cu::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32,
                )
            },
            "cuEventCreate(blocking sync)",
        )?;

        self.w = plan::upload_weights(self, weights, self.dtype)?;

        // Activations for the largest bucket (the pool's size does not change them).
        let cfg = self.cfg.clone();
        let provisional = host::geometry(
            &cfg,
            opts.block_size,
            opts.num_blocks.unwrap_or(1),
            opts.max_batched_tokens,
            opts.max_seqs,
        )
        .map_err(GpuModelError::Config)?;
        self.b = plan::alloc_bufs(
            self,
            &cfg,
            provisional.max_tokens,
            provisional.max_samples,
            self.dtype,
            // A split launch has fewer tiles than multiprocessors (`Plan::tc_kernel_over`).
            if self.tc_large_split_scratch {
                self.sms as usize
            } else {
                0
            },
        )?;
        self.workspace = self.alloc(CUBLAS_WORKSPACE, "cuBLAS workspace")?;

        // The KV pool: given, or a share of what is free now.
        let num_blocks = match opts.num_blocks {
            Some(n) => n,
            None => {
                let (free, _) = mem_info()?;
                host::blocks_for_budget(
                    &cfg,
                    opts.block_size,
                    self.dtype,
                    free,
                    opts.kv_memory_fraction,
                    provisional.max_seqs,
                )
                .map_err(GpuModelError::Config)?
            }
        };
        self.geo = host::geometry(
            &cfg,
            opts.block_size,
            num_blocks,
            opts.max_batched_tokens,
            opts.max_seqs,
        )
        .map_err(GpuModelError::Config)?;
        let kv_bytes = num_blocks * host::kv_block_bytes(&cfg, opts.block_size, self.dtype);
        self.cache = self.alloc(kv_bytes, &format!("KV cache ({num_blocks} blocks)"))?;
        self.kv_bytes = kv_bytes;
        let words = self.geo.words();
        self.inputs = self.alloc(words * 4, "step inputs")?;
        // SAFETY: a context is current; out-pointers valid; freed in Drop.
        unsafe {
            let mut p: *mut c_void = std::ptr::null_mut();
            ck(
                cu::cuMemAllocHost_v2(&mut p, words * 4),
                "cuMemAllocHost(step input staging)",
            )?;
            self.staging = p.cast();
            let mut p: *mut c_void = std::ptr::null_mut();
            ck(
                cu::cuMemAllocHost_v2(&mut p, self.geo.max_samples * 4),
                "cuMemAllocHost(next tokens)",
            )?;
            self.next_host = p.cast();
            std::ptr::write_bytes(self.staging, 0, words);
        }
        // Valid all-padding inputs (token 0 at position 0 of block 0, slot -1, row 0) for the
        // warm-up runs below: they read only block 0 and write no KV.
        {
            let g = self.geo;
            let st = self.staging_mut();
            st[g.slot()..g.slot() + g.max_tokens].fill(-1);
        }
        ck(
            // SAFETY: `staging` holds `words` i32 and `inputs` as many bytes; synchronous copy.
            unsafe { cu::cuMemcpyHtoD_v2(self.inputs, self.staging.cast(), words * 4) },
            "cuMemcpyHtoD(step inputs)",
        )?;

        // SAFETY: cuBLAS is loaded; out-pointer valid; the handle is destroyed in Drop.
        unsafe {
            ck_blas(cublas::cublasCreate_v2(&mut self.blas), "cublasCreate")?;
            ck_blas(
                cublas::cublasSetStream_v2(self.blas, self.stream.cast()),
                "cublasSetStream",
            )?;
            ck_blas(
                cublas::cublasSetWorkspace_v2(
                    self.blas,
                    self.workspace as *mut c_void,
                    CUBLAS_WORKSPACE,
                ),
                "cublasSetWorkspace",
            )?;
            // f32: no TF32 or other reduced precision; f16/bf16: f32 accumulation with no
            // reduced-precision split-K reductions.
            let mode = match self.dtype {
                GpuDtype::F32 => cublas::cublasMath_t::CUBLAS_PEDANTIC_MATH,
                _ => cublas::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
            };
            ck_blas(
                cublas::cublasSetMathMode(self.blas, mode),
                "cublasSetMathMode",
            )?;
        }

        // Warm up every bucket uncaptured (loads lazily-loaded kernels outside capture and
        // surfaces launch errors with their names), then capture.
        let tb = host::buckets_up_to(self.geo.max_tokens);
        let sb = host::buckets_up_to(self.geo.max_samples);
        for &n in &tb {
            self.enqueue_body(n)?;
        }
        for &n in &sb {
            self.enqueue_head(n)?;
        }
        self.sync("warm-up of every bucket")?;
        if self.use_graphs {
            for &n in &tb {
                let e = self.capture(&format!("step body, {n} tokens"), |m| m.enqueue_body(n))?;
                self.body_graphs.push((n, e));
            }
            for &n in &sb {
                let e = self.capture(&format!("LM head, {n} rows"), |m| m.enqueue_head(n))?;
                self.head_graphs.push((n, e));
            }
            self.sync("graph upload")?;
        }
        self.build_persistent(&tb, &sb)?;
        tracing::info!(
            device = %self.device_name,
            dtype = self.dtype.name(),
            weight_bytes = self.w.bytes,
            kv_bytes = self.kv_bytes,
            num_blocks,
            cache_hit = self.cache_hit,
            "GPU model ready"
        );
        Ok(())
    }

    fn make_current(&self) -> Result<(), GpuError> {
        // SAFETY: `ctx` is the retained primary context of `dev`.
        ck(unsafe { cu::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    fn alloc(&mut self, bytes: usize, what: &str) -> Result<u64, GpuModelError> {
        let bytes = bytes.max(4);
        let mut p: cu::CUdeviceptr = 0;
        // SAFETY: a context is current; out-pointer valid.
        let r = unsafe { cu::cuMemAlloc_v2(&mut p, bytes) };
        if r == cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let (free, total) = mem_info().unwrap_or((0, 0));
            return Err(GpuModelError::OutOfMemory {
                what: what.to_string(),
                need: bytes,
                free,
                total,
                held: self.held,
            });
        }
        ck(r, &format!("cuMemAlloc({what}, {bytes} bytes)"))?;
        self.allocs.push((p, bytes));
        self.held += bytes;
        ck(
            // SAFETY: `p` holds `bytes` bytes.
            unsafe { cu::cuMemsetD8_v2(p, 0, bytes) },
            &format!("cuMemsetD8({what})"),
        )?;
        Ok(p)
    }

    fn upload(&mut self, bytes: &[u8], what: &str) -> Result<u64, GpuModelError> {
        let p = self.alloc(bytes.len(), what)?;
        ck(
            // SAFETY: `p` holds at least `bytes.len()` bytes; synchronous copy from host memory.
            unsafe { cu::cuMemcpyHtoD_v2(p, bytes.as_ptr().cast(), bytes.len()) },
            &format!("cuMemcpyHtoD({what})"),
        )?;
        Ok(p)
    }

    fn staging_mut(&mut self) -> &mut [i32] {
        // SAFETY: `staging` is a pinned allocation of `geo.words()` i32 owned by the model;
        // no copy from it is in flight (every step synchronizes before returning).
        unsafe { std::slice::from_raw_parts_mut(self.staging, self.geo.words()) }
    }

    fn sync(&self, what: &str) -> Result<(), GpuError> {
        ck(
            // SAFETY: `stream` is live.
            unsafe { cu::cuStreamSynchronize(self.stream) },
            &format!("cuStreamSynchronize ({what})"),
        )
    }

    /// Wait for everything enqueued so far without spinning: record `step_done` and sleep in
    /// `cuEventSynchronize` (woken by the GPU's interrupt).
    fn sleep_until_done(&self, what: &str) -> Result<(), GpuError> {
        ck(
            // SAFETY: a live event and stream of the current context.
            unsafe { cu::cuEventRecord(self.step_done, self.stream) },
            &format!("cuEventRecord ({what})"),
        )?;
        ck(
            // SAFETY: the event was recorded above.
            unsafe { cu::cuEventSynchronize(self.step_done) },
            &format!("cuEventSynchronize ({what})"),
        )
    }

    fn plan(&self) -> Plan<'_> {
        Plan {
            cfg: &self.cfg,
            geo: &self.geo,
            dtype: self.dtype,
            w: &self.w,
            b: &self.b,
            cache: self.cache,
            inputs: self.inputs,
            invariant_gemm: self.invariant_gemm,
            fused_max_tokens: self.fused_max_tokens,
            tc_gemm_max_tokens: self.tc_gemm_max_tokens,
            sms: self.sms,
            attention_warps: self.attention_warps,
            mma_attention: self.mma_attention,
            tc_epilogues: self.tc_epilogues,
            tc_fold_max_tokens: self.tc_fold_max_tokens,
            tc_small_max_tokens: if self.tc_small_on {
                self.tc_small_max_tokens
            } else {
                0
            },
            tc_mid_max_tokens: self.tc_mid_max_tokens,
            tc_large_min_tokens: self.tc_large_min_tokens,
            tc_large_split: self.tc_large_split,
            tc_large_split_min_chunks: plan::TC_LARGE_SPLIT_MIN_CHUNKS,
            staging: plan::TcStaging {
                bytes: if self.tc_stage_on {
                    self.tc_stage.bytes
                } else {
                    0
                },
                ..self.tc_stage
            },
            split_argmax: true,
        }
    }

    fn enqueue_body(&self, n: usize) -> Result<(), GpuError> {
        self.run(&self.plan().body(n))
    }

    fn enqueue_head(&self, s: usize) -> Result<(), GpuError> {
        self.run(&self.plan().head(s))
    }

    /// Enqueue `ops` on the stream.
    fn run(&self, ops: &[Op]) -> Result<(), GpuError> {
        for op in ops {
            match op {
                Op::Launch {
                    kernel,
                    grid,
                    block,
                    shared,
                    args,
                } => self.launch(*kernel, *grid, *block, *shared, args)?,
                Op::Gemm(g) => self.gemm(g)?,
            }
        }
        Ok(())
    }

    /// The loaded function of kernel `k`.
    fn func(&self, k: Kernel) -> Result<cu::CUfunction, GpuError> {
        Kernel::ALL
            .iter()
            .position(|&x| x == k)
            .and_then(|i| self.funcs.get(i).copied())
            .ok_or_else(|| GpuError::Failed(format!("kernel {} not loaded", k.name())))
    }

    fn launch(
        &self,
        k: Kernel,
        grid: (u32, u32),
        block: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        let f = self.func(k)?;
        let mut cells: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::P(p) => p,
                Arg::I(i) => u64::from(i as u32),
                Arg::F(f) => u64::from(f.to_bits()),
                Arg::L(l) => l as u64,
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = cells
            .iter_mut()
            .map(|c| (c as *mut u64).cast::<c_void>())
            .collect();
        if self.pdl.get() {
            // Programmatic stream serialization: the kernel may start while the previous one
            // drains; it waits for it (`BGS_PDL_BEGIN`) before reading anything.
            let mut attr = cu::CUlaunchAttribute {
                id: cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                // SAFETY: an all-zero union is a valid value of every member (plain integers).
                value: unsafe { std::mem::zeroed() },
            };
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = cu::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: 1,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: shared,
                hStream: self.stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            return ck(
                // SAFETY: as for cuLaunchKernel below; `config` and the attribute it points to
                // live through the call.
                unsafe {
                    cu::cuLaunchKernelEx(&config, f, ptrs.as_mut_ptr(), std::ptr::null_mut())
                },
                &format!("cuLaunchKernelEx({}, programmatic)", k.name()),
            );
        }
        ck(
            // SAFETY: `f` is a kernel of the loaded module whose parameters are, in order, the
            // types of `args` (`Plan` builds them from the kernels' signatures; the emulator
            // tests check the order): pointers and 8-byte integers are read whole, 4-byte
            // values from the first bytes of their little-endian cell. The cells outlive the
            // call (the launch copies the arguments); `stream` is live. `shared` is within the
            // 48 KB a block may use without an opt-in (`plan::fused_form_fits`).
            unsafe {
                cu::cuLaunchKernel(
                    f,
                    grid.0,
                    grid.1,
                    1,
                    block,
                    1,
                    1,
                    shared,
                    self.stream,
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            &format!("cuLaunchKernel({})", k.name()),
        )
    }

    fn gemm(&self, g: &Gemm) -> Result<(), GpuError> {
        let (ty, compute) = match self.dtype {
            GpuDtype::F32 => (
                cublas::cudaDataType::CUDA_R_32F,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
            ),
            GpuDtype::F16 => (
                cublas::cudaDataType::CUDA_R_16F,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            GpuDtype::Bf16 => (
                cublas::cudaDataType::CUDA_R_16BF,
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
        };
        let op = |t: bool| {
            if t {
                cublas::cublasOperation_t::CUBLAS_OP_T
            } else {
                cublas::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        ck_blas(
            // SAFETY: `Plan` sized every operand for the largest bucket: A holds k × m (or
            // m × k) elements of the dtype, B k × n, C m × n f32, with the leading dimensions
            // given; alpha/beta are host f32 (host pointer mode), read during the call.
            unsafe {
                cublas::cublasGemmEx(
                    self.blas,
                    op(g.trans_a),
                    op(g.trans_b),
                    g.m,
                    g.n,
                    g.k,
                    (&alpha as *const f32).cast(),
                    g.a as *const c_void,
                    ty,
                    g.lda,
                    g.b as *const c_void,
                    ty,
                    g.ldb,
                    (&beta as *const f32).cast(),
                    g.c as *mut c_void,
                    cublas::cudaDataType::CUDA_R_32F,
                    g.ldc,
                    compute,
                    cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                )
            },
            &format!("cublasGemmEx({}, m={} n={} k={})", g.what, g.m, g.n, g.k),
        )
    }

    fn capture(
        &mut self,
        what: &str,
        body: impl FnOnce(&Self) -> Result<(), GpuError>,
    ) -> Result<cu::CUgraphExec, GpuError> {
        let mut g: cu::CUgraph = std::ptr::null_mut();
        ck(
            // SAFETY: `stream` is a live stream of the current context.
            unsafe {
                cu::cuStreamBeginCapture_v2(
                    self.stream,
                    cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
            },
            &format!("cuStreamBeginCapture ({what})"),
        )?;
        let body_result = body(self);
        // SAFETY: ends the capture begun above; out-pointer valid.
        let end = ck(
            unsafe { cu::cuStreamEndCapture(self.stream, &mut g) },
            &format!("cuStreamEndCapture ({what})"),
        );
        body_result?;
        end?;
        self.graphs.push(g);
        let mut e: cu::CUgraphExec = std::ptr::null_mut();
        // Device-launchable graphs must be uploaded before a device launch (done below for
        // every graph anyway).
        let flags = if self.device_launch {
            DEVICE_LAUNCH_FLAG
        } else {
            0
        };
        // SAFETY: `g` is the captured graph; out-pointer valid; `stream` live.
        unsafe {
            ck(
                cu::cuGraphInstantiateWithFlags(&mut e, g, flags),
                &format!("cuGraphInstantiateWithFlags ({what})"),
            )?;
            ck(
                cu::cuGraphUpload(e, self.stream),
                &format!("cuGraphUpload ({what})"),
            )?;
        }
        Ok(e)
    }

    fn graph_for(list: &[(usize, cu::CUgraphExec)], n: usize) -> Option<cu::CUgraphExec> {
        list.iter().find(|(b, _)| *b == n).map(|(_, e)| *e)
    }

    /// The persistent form of every body bucket in `tb` and head bucket in `sb` up to
    /// `persistent_max_tokens` whose ops the persistent kernel can run: tables uploaded, each
    /// run once uncaptured (errors surface with their names), then captured.
    fn build_persistent(&mut self, tb: &[usize], sb: &[usize]) -> Result<(), GpuModelError> {
        let max = self.persist.max_tokens;
        if max == 0 {
            return Ok(());
        }
        if self.device_launch {
            // The resident step loop launches the device graphs, which stay the launched ops.
            tracing::info!("persistent form off: the step graphs are launched from the device");
            return Ok(());
        }
        // SiLU·up launched apart from the gate/up GEMM (its folded kernel takes two warp
        // groups, more than a persistent block) and the wide tiles alone (the persistent
        // kernel runs bgs_gemm_tc's body for 32 tokens): the same bits either way.
        let mut plan = self.plan();
        plan.tc_epilogues = false;
        plan.tc_small_max_tokens = 0;
        plan.tc_mid_max_tokens = 0;
        plan.tc_large_min_tokens = 0;
        plan.split_argmax = false;
        let mut lists = Vec::new();
        for &n in tb.iter().filter(|&&n| n <= max) {
            lists.push((n, false, plan.body(n)));
        }
        for &n in sb.iter().filter(|&&n| n <= max) {
            lists.push((n, true, plan.head(n)));
        }
        let mut shared = 0u32;
        for (bucket, head, ops) in lists {
            let what = if head { "LM head" } else { "step body" };
            match persistent::encode(&ops, self.dtype, self.persist.prefetch_distance) {
                Ok(recs) => {
                    shared = recs.iter().map(|r| r.shared).fold(shared, u32::max);
                    let table = self.upload(
                        &persistent::table_bytes(&recs),
                        &format!("persistent table ({what}, {bucket})"),
                    )?;
                    let sync = self.alloc(8, "persistent barrier")?;
                    self.persist.tables.push(PersistTable {
                        bucket,
                        head,
                        table,
                        ops: recs.len() as u32,
                        sync,
                        kernels: recs.iter().map(|r| r.kernel).collect(),
                    });
                }
                Err(why) => {
                    tracing::info!("no persistent form for the {what} of {bucket}: {why}");
                }
            }
        }
        if self.persist.tables.is_empty() {
            return Ok(());
        }
        let f = get_function(self.module, "bgs_persistent")?;
        let attr = |a: cu::CUfunction_attribute, what: &str| -> Result<i32, GpuError> {
            let mut v = 0i32;
            // SAFETY: `f` is a kernel of the loaded module; out-pointer valid.
            ck(unsafe { cu::cuFuncGetAttribute(&mut v, a, f) }, what)?;
            Ok(v)
        };
        use cu::CUfunction_attribute::{
            CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES as LOCAL,
            CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN,
            CU_FUNC_ATTRIBUTE_NUM_REGS as REGS, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES as STATIC,
        };
        ck(
            // SAFETY: as above; `shared` is what the ops planned (each within 48 KB).
            unsafe { cu::cuFuncSetAttribute(f, MAX_DYN, shared as i32) },
            "cuFuncSetAttribute(bgs_persistent, max dynamic shared memory)",
        )?;
        let regs = attr(REGS, "cuFuncGetAttribute(bgs_persistent, registers)")?;
        let mut fit = 0i32;
        ck(
            // SAFETY: as above.
            unsafe {
                cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut fit,
                    f,
                    persistent::THREADS as i32,
                    shared as usize,
                )
            },
            "cuOccupancyMaxActiveBlocksPerMultiprocessor(bgs_persistent)",
        )?;
        if fit < 1 {
            return Err(GpuModelError::Config(format!(
                "bgs_persistent does not fit a multiprocessor ({} bytes of dynamic shared \
                 memory, {regs} registers a thread)",
                shared
            )));
        }
        let longest = self.persist.tables.iter().map(|t| t.ops as usize).max();
        self.persist.stamps =
            self.alloc((longest.unwrap_or(0) + 1) * 8, "persistent profile stamps")?;
        let per_sm = match self.persist.blocks_per_sm {
            0 => fit as u32,
            n => n.min(fit as u32),
        };
        self.persist.func = Some(f);
        self.persist.shared = shared;
        self.persist.grid = per_sm * self.sms;
        self.persist.regs = regs;
        self.persist.static_shared =
            attr(STATIC, "cuFuncGetAttribute(bgs_persistent, static shared)")?;
        self.persist.local_bytes = attr(LOCAL, "cuFuncGetAttribute(bgs_persistent, local memory)")?;
        tracing::info!(
            grid = self.persist.grid,
            blocks_per_sm = per_sm,
            fit,
            dynamic_shared = shared,
            static_shared = self.persist.static_shared,
            registers = self.persist.regs,
            local_bytes = self.persist.local_bytes,
            tables = self.persist.tables.len(),
            "persistent form"
        );
        let tables = self.persist.tables.clone();
        for t in &tables {
            self.launch_persistent(t, 0)?;
        }
        self.sync("warm-up of the persistent form")?;
        if self.use_graphs {
            for t in &tables {
                let what = format!(
                    "persistent {}, {}",
                    if t.head { "LM head" } else { "step body" },
                    t.bucket
                );
                let e = self.capture(&what, |m| m.launch_persistent(t, 0))?;
                if t.head {
                    self.persist.head_graphs.push((t.bucket, e));
                } else {
                    self.persist.body_graphs.push((t.bucket, e));
                }
            }
            self.sync("persistent graph upload")?;
        }
        self.persist.on = true;
        Ok(())
    }

    /// Enqueue one cooperative launch of `bgs_persistent` over table `t` (`stamps`: 0, or
    /// `t.ops + 1` u64 that block 0 fills with the global timer at each op).
    fn launch_persistent(&self, t: &PersistTable, stamps: u64) -> Result<(), GpuError> {
        let f = self
            .persist
            .func
            .ok_or_else(|| GpuError::Failed("bgs_persistent not loaded".into()))?;
        let mut cells: [u64; 4] = [t.table, u64::from(t.ops), t.sync, stamps];
        let mut ptrs: [*mut c_void; 4] = cells.each_mut().map(|c| (c as *mut u64).cast());
        // Cooperative: every block resident at once (the grid barrier waits for all of them),
        // or the launch fails instead of hanging.
        let mut attr = cu::CUlaunchAttribute {
            id: cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
            pad: [0; 4],
            // SAFETY: an all-zero union is a valid value of every member (plain integers).
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.cooperative = 1;
        let config = cu::CUlaunchConfig {
            gridDimX: self.persist.grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: persistent::THREADS,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: self.persist.shared,
            hStream: self.stream,
            attrs: &mut attr,
            numAttrs: 1,
        };
        ck(
            // SAFETY: `f` is `bgs_persistent(const bgs_op *, int, unsigned *, u64 *)`: the table
            // (its `ops` records uploaded and never freed before the model), the count in the
            // low 4 bytes of its cell, two zeroed words of the model's, and null or `ops + 1`
            // u64 of the caller's (`profile_persistent`); the cells, `config` and
            // the attribute live through the call; the dynamic shared memory was allowed with
            // cuFuncSetAttribute and the grid fits the device (occupancy).
            unsafe { cu::cuLaunchKernelEx(&config, f, ptrs.as_mut_ptr(), std::ptr::null_mut()) },
            &format!(
                "cuLaunchKernelEx(bgs_persistent, {} ops, cooperative grid of {})",
                t.ops, self.persist.grid
            ),
        )
    }

    /// Fold SiLU·up into the tensor-core gate/up GEMM (true) or launch them apart (false), for
    /// the launches made without graphs (the captured graphs keep the option they were built
    /// with). The same bits either way; the check compares the two.
    pub fn set_tc_epilogues(&mut self, on: bool) {
        self.tc_epilogues = on;
    }

    /// Run the buckets `tensor_core_small_tiles_max_tokens` covers on the tensor-core kernels'
    /// small tiles (true) or the wide ones (false), for the launches made without graphs. The
    /// same bits either way; the check compares the two.
    pub fn set_tc_small_tiles(&mut self, on: bool) {
        self.tc_small_on = on;
    }

    /// Stage the small tiles' weights in shared memory where the plan would (true), or keep
    /// them in registers (false), for the launches made without graphs. The same bits either
    /// way; the check compares the two. Returns whether anything is staged at all (the
    /// option on and the device's shared memory enough).
    pub fn set_tc_staged_tiles(&mut self, on: bool) -> bool {
        self.tc_stage_on = on;
        self.tc_stage.bytes > 0
    }

    /// `tensor_core_small_tiles_max_tokens`.
    pub fn tc_small_max_tokens(&self) -> usize {
        self.tc_small_max_tokens
    }

    /// Run buckets of more than `plan::TC_SMALL_TOKENS` and at most `n` tokens on the
    /// tensor-core kernels' mid tiles (0: none), for the launches made without graphs (the
    /// captured graphs keep `tensor_core_mid_tiles_max_tokens`). The same bits as the small
    /// and the wide tiles; the check compares them whatever the option.
    pub fn set_tc_mid_max_tokens(&mut self, n: usize) {
        self.tc_mid_max_tokens = n;
    }

    /// The mid tiles' reach for the launches made now (`tensor_core_mid_tiles_max_tokens`
    /// unless `set_tc_mid_max_tokens` changed it).
    pub fn tc_mid_max_tokens(&self) -> usize {
        self.tc_mid_max_tokens
    }

    /// Run buckets of at least `n` tokens (and LM heads of at least `n` rows) on the plain and
    /// the SiLU tensor-core GEMM's large tiles (0: none), for the launches made without graphs
    /// (the captured graphs keep `tensor_core_large_tiles_min_tokens`). The same bits as the
    /// wide, mid and small tiles; the check compares them whatever the option. Returns whether
    /// the device runs the large tiles at all (sm_80+ with the opt-in shared memory for
    /// `plan::tc_large_shared_bytes`); where it does not, they stay off whatever `n`.
    pub fn set_tc_large_min_tokens(&mut self, n: usize) -> bool {
        self.tc_large_min_tokens = if self.tc_large_fits { n } else { 0 };
        self.tc_large_fits
    }

    /// The large tiles' threshold for the launches made now
    /// (`tensor_core_large_tiles_min_tokens` unless `set_tc_large_min_tokens` changed it; 0
    /// where the device cannot run them).
    pub fn tc_large_min_tokens(&self) -> usize {
        self.tc_large_min_tokens
    }

    /// Split large tiles over `groups` blocks a tile (0 or 1: never split; at most
    /// `plan::TC_LARGE_SPLIT_MAX`) for the launches made without graphs (the captured graphs
    /// keep `tensor_core_large_split`). Returns whether the model has the split form's scratch
    /// (built with `tensor_core_large_split` of 2 or more); where it does not, nothing splits.
    pub fn set_tc_large_split(&mut self, groups: usize) -> bool {
        self.tc_large_split = if self.tc_large_split_scratch {
            groups.min(plan::TC_LARGE_SPLIT_MAX)
        } else {
            0
        };
        self.tc_large_split_scratch
    }

    /// The split large tiles' class groups for the launches made now (0: never split).
    pub fn tc_large_split(&self) -> usize {
        self.tc_large_split
    }

    /// Replay (or launch, without graphs) the persistent form where a bucket has one (true),
    /// or always the launched ops (false). Returns whether any bucket has a persistent form.
    /// The same bits either way; the checks compare the two.
    pub fn set_persistent(&mut self, on: bool) -> bool {
        self.persist.on = on && !self.persist.tables.is_empty();
        !self.persist.tables.is_empty()
    }

    /// The persistent kernel's launch, when any bucket has the form: one line for logs and
    /// results (grid, dynamic and static shared memory, registers, local memory).
    pub fn persistent_launch(&self) -> Option<String> {
        let p = &self.persist;
        p.func.map(|_| {
            format!(
                "grid {} x {} threads, dynamic shared {} B, static shared {} B, {} registers, \
                 {} B local",
                p.grid,
                persistent::THREADS,
                p.shared,
                p.static_shared,
                p.regs,
                p.local_bytes
            )
        })
    }

    /// Buckets (tokens) whose step body has a persistent form.
    pub fn persistent_buckets(&self) -> Vec<usize> {
        self.persist
            .tables
            .iter()
            .filter(|t| !t.head)
            .map(|t| t.bucket)
            .collect()
    }

    /// The persistent table for a body (`head` false) or head bucket, when it is on.
    fn persistent_table(&self, head: bool, bucket: usize) -> Option<&PersistTable> {
        self.persist
            .on
            .then(|| self.persist_table(head, bucket))
            .flatten()
    }

    /// The persistent table for a body or head bucket, whether the form is on or not.
    fn persist_table(&self, head: bool, bucket: usize) -> Option<&PersistTable> {
        self.persist
            .tables
            .iter()
            .find(|t| t.head == head && t.bucket == bucket)
    }

    /// Where a persistent step body's time goes: it runs the body over `items` `iters` times
    /// (uncaptured, after one warm-up) with block 0 stamping the global timer at each op, and
    /// returns per kernel `(name, ops per step, ms per step)` in order of first appearance.
    /// An op's time runs from block 0's start of it to its start of the next, so it holds the
    /// op's slowest block and the barrier after it.
    pub fn profile_persistent(
        &mut self,
        items: &[StepItem<'_>],
        iters: usize,
    ) -> Result<Vec<(String, usize, f64)>, GpuModelError> {
        self.make_current()?;
        let want: Vec<bool> = items.iter().map(|it| it.sample).collect();
        let p = self.pack(items, &want)?;
        let t = self
            .persist_table(false, p.bucket)
            .cloned()
            .ok_or_else(|| {
                GpuModelError::Step(format!("bucket {} has no persistent form", p.bucket))
            })?;
        let n = t.ops as usize;
        let stamps = self.persist.stamps;
        ck(
            // SAFETY: as in `enqueue_step`.
            unsafe {
                cu::cuMemcpyHtoDAsync_v2(self.inputs, self.staging.cast(), p.words * 4, self.stream)
            },
            "cuMemcpyHtoDAsync(step inputs)",
        )?;
        let mut sums = vec![0f64; n];
        let mut host = vec![0u64; n + 1];
        for i in 0..=iters {
            self.launch_persistent(&t, stamps)?;
            self.sync("persistent profile")?;
            ck(
                // SAFETY: `stamps` holds n + 1 u64 written by the launch; synchronized.
                unsafe { cu::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), stamps, (n + 1) * 8) },
                "cuMemcpyDtoH(stamps)",
            )?;
            if i > 0 {
                for (k, s) in sums.iter_mut().enumerate() {
                    *s += host[k + 1].saturating_sub(host[k]) as f64;
                }
            }
        }
        let mut out: Vec<(String, usize, f64)> = Vec::new();
        for (k, ns) in sums.iter().enumerate() {
            let name = Kernel::ALL
                .get(t.kernels[k] as usize)
                .map_or("?", |k| k.name());
            let ms = ns / iters.max(1) as f64 / 1e6;
            match out.iter_mut().find(|(n, _, _)| n == name) {
                Some(e) => {
                    e.1 += 1;
                    e.2 += ms;
                }
                None => out.push((name.to_string(), 1, ms)),
            }
        }
        Ok(out)
    }

    /// Milliseconds of one launch of `n` ops that do nothing (`persistent::nop_table`): the
    /// grid barriers' cost at the persistent grid, median of `iters` after a warm-up.
    pub fn persistent_barrier_ms(&mut self, n: usize, iters: usize) -> Result<f64, GpuModelError> {
        if self.persist.func.is_none() {
            return Err(GpuModelError::Step("no persistent form built".into()));
        }
        let iters = iters.max(1);
        let n = n.max(1);
        self.make_current()?;
        let t = match self.persist.nop_tables.iter().find(|t| t.ops as usize == n) {
            Some(t) => t.clone(),
            None => {
                let recs = persistent::nop_table(n);
                let table = self.upload(&persistent::table_bytes(&recs), "persistent nop table")?;
                let sync = self.alloc(8, "persistent nop barrier")?;
                let t = PersistTable {
                    bucket: 0,
                    head: false,
                    table,
                    ops: recs.len() as u32,
                    sync,
                    kernels: recs.iter().map(|r| r.kernel).collect(),
                };
                self.persist.nop_tables.push(t.clone());
                t
            }
        };
        self.launch_persistent(&t, 0)?;
        self.sync("barrier warm-up")?;
        let events = Events::new(iters + 1)?;
        events.record(0, self.stream)?;
        for i in 0..iters {
            self.launch_persistent(&t, 0)?;
            events.record(i + 1, self.stream)?;
        }
        self.sync("barrier timing")?;
        let mut v: Vec<f64> = (0..iters)
            .map(|i| events.elapsed_ms(i, i + 1))
            .collect::<Result<_, _>>()?;
        v.sort_by(f64::total_cmp);
        Ok(v[v.len() / 2])
    }

    fn persistent_graph(&self, head: bool, bucket: usize) -> Option<cu::CUgraphExec> {
        if !self.persist.on {
            return None;
        }
        let list = if head {
            &self.persist.head_graphs
        } else {
            &self.persist.body_graphs
        };
        Self::graph_for(list, bucket)
    }

    /// Copy the packed inputs and enqueue the step's body and head (graphs or launches).
    fn enqueue_step(&self, p: &Packed) -> Result<(), GpuError> {
        ck(
            // SAFETY: `staging` is pinned and holds `geo.words()` ≥ `p.words` i32; `inputs` as
            // many bytes; the stream is synchronized before the staging is written again.
            unsafe {
                cu::cuMemcpyHtoDAsync_v2(self.inputs, self.staging.cast(), p.words * 4, self.stream)
            },
            "cuMemcpyHtoDAsync(step inputs)",
        )?;
        if self.use_graphs {
            let e = self
                .persistent_graph(false, p.bucket)
                .or_else(|| Self::graph_for(&self.body_graphs, p.bucket))
                .ok_or_else(|| GpuError::Failed(format!("no graph for bucket {}", p.bucket)))?;
            ck(
                // SAFETY: `e` is an instantiated, uploaded graph of this context.
                unsafe { cu::cuGraphLaunch(e, self.stream) },
                &format!("cuGraphLaunch(step body, {} tokens)", p.bucket),
            )?;
            if p.sample_bucket > 0 {
                let e = self
                    .persistent_graph(true, p.sample_bucket)
                    .or_else(|| Self::graph_for(&self.head_graphs, p.sample_bucket))
                    .ok_or_else(|| {
                        GpuError::Failed(format!("no LM head graph for {} rows", p.sample_bucket))
                    })?;
                ck(
                    // SAFETY: as above.
                    unsafe { cu::cuGraphLaunch(e, self.stream) },
                    &format!("cuGraphLaunch(LM head, {} rows)", p.sample_bucket),
                )?;
            }
        } else {
            match self.persistent_table(false, p.bucket) {
                Some(t) => self.launch_persistent(t, 0)?,
                None => self.enqueue_body(p.bucket)?,
            }
            if p.sample_bucket > 0 {
                match self.persistent_table(true, p.sample_bucket) {
                    Some(t) => self.launch_persistent(t, 0)?,
                    None => self.enqueue_head(p.sample_bucket)?,
                }
            }
        }
        Ok(())
    }

    fn pack(&mut self, items: &[StepItem<'_>], want: &[bool]) -> Result<Packed, GpuModelError> {
        let geo = self.geo;
        let (vocab, maxp) = (self.cfg.vocab_size, self.max_positions());
        host::pack_step(&geo, items, want, vocab, maxp, self.staging_mut())
            .map_err(GpuModelError::Step)
    }

    /// One forward step (see [`StepModel::step`]): writes the K/V of every item's tokens and,
    /// for items with `sample`, the greedy next token (ties to the lowest id) in `next[i]`.
    /// On a bad item nothing runs.
    pub fn step(&mut self, items: &[StepItem<'_>], next: &mut [u32]) -> Result<(), GpuModelError> {
        if next.len() != items.len() {
            return Err(GpuModelError::Step(format!(
                "next has {} entries for {} items",
                next.len(),
                items.len()
            )));
        }
        // Nothing to run (as the CPU model, an empty step is a no-op).
        if items.is_empty() {
            return Ok(());
        }
        self.make_current()?;
        let want: Vec<bool> = items.iter().map(|it| it.sample).collect();
        let p = self.pack(items, &want)?;
        self.enqueue_step(&p)?;
        if p.samples > 0 {
            ck(
                // SAFETY: `next_host` is pinned with `max_samples` ≥ `p.samples` u32; `next`
                // holds as many; synchronized below before it is read.
                unsafe {
                    cu::cuMemcpyDtoHAsync_v2(
                        self.next_host.cast(),
                        self.b.next,
                        p.samples * 4,
                        self.stream,
                    )
                },
                "cuMemcpyDtoHAsync(next tokens)",
            )?;
        }
        self.sleep_until_done("step")?;
        // SAFETY: the copy above completed; `p.samples` values were written.
        let got = unsafe { std::slice::from_raw_parts(self.next_host, p.samples) };
        for (&i, &t) in p.sampled_items.iter().zip(got) {
            next[i] = t;
        }
        Ok(())
    }

    /// The same step as [`GpuModel::step`], returning the last position's logits of every
    /// item (whatever its `sample` flag), for correctness checks.
    pub fn step_logits(&mut self, items: &[StepItem<'_>]) -> Result<Vec<Vec<f32>>, GpuModelError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        self.make_current()?;
        let want = vec![true; items.len()];
        let p = self.pack(items, &want)?;
        self.enqueue_step(&p)?;
        self.sync("step")?;
        let vocab = self.cfg.vocab_size;
        let mut all = vec![0f32; p.samples * vocab];
        ck(
            // SAFETY: `logits` holds at least `p.samples × vocab` f32 written by this step; the
            // stream is synchronized.
            unsafe { cu::cuMemcpyDtoH_v2(all.as_mut_ptr().cast(), self.b.logits, all.len() * 4) },
            "cuMemcpyDtoH(logits)",
        )?;
        Ok(all.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }

    /// Device time of `iters` back-to-back steps over `items` (input copy, graphs, copy of
    /// the next tokens), after `warmup` untimed ones, in milliseconds per step (cuEvent
    /// timing). The same inputs are replayed: each replay rewrites the same KV slots.
    pub fn time_steps(
        &mut self,
        items: &[StepItem<'_>],
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<f64>, GpuModelError> {
        self.make_current()?;
        let want: Vec<bool> = items.iter().map(|it| it.sample).collect();
        let p = self.pack(items, &want)?;
        let copy_next = |m: &Self| -> Result<(), GpuError> {
            if p.samples == 0 {
                return Ok(());
            }
            ck(
                // SAFETY: as in `step`.
                unsafe {
                    cu::cuMemcpyDtoHAsync_v2(m.next_host.cast(), m.b.next, p.samples * 4, m.stream)
                },
                "cuMemcpyDtoHAsync(next tokens)",
            )
        };
        for _ in 0..warmup {
            self.enqueue_step(&p)?;
            copy_next(self)?;
        }
        self.sync("timing warm-up")?;
        let events = Events::new(iters + 1)?;
        events.record(0, self.stream)?;
        for i in 0..iters {
            self.enqueue_step(&p)?;
            copy_next(self)?;
            events.record(i + 1, self.stream)?;
        }
        self.sync("timed steps")?;
        (0..iters)
            .map(|i| events.elapsed_ms(i, i + 1).map_err(GpuModelError::from))
            .collect()
    }

    /// Device time of every launch of one step over `items`, summed per operation (kernel
    /// name or GEMM role) in order of first appearance: `(name, launches per step, ms per
    /// step)`, averaged over `iters` replays after one warm-up. The step's launches are
    /// captured into one graph with an external event record after each (so host enqueue
    /// gaps do not count) and replayed; an interval is one launch's device time plus the
    /// graph's gap before it.
    pub fn profile_ops(
        &mut self,
        items: &[StepItem<'_>],
        iters: usize,
    ) -> Result<Vec<(String, usize, f64)>, GpuModelError> {
        self.make_current()?;
        let want: Vec<bool> = items.iter().map(|it| it.sample).collect();
        let p = self.pack(items, &want)?;
        let plan = self.plan();
        let mut ops = plan.body(p.bucket);
        if p.sample_bucket > 0 {
            ops.extend(plan.head(p.sample_bucket));
        }
        let names: Vec<&str> = ops
            .iter()
            .map(|op| match op {
                Op::Launch { kernel, .. } => kernel.name(),
                Op::Gemm(g) => g.what,
            })
            .collect();
        let events = Events::new(ops.len() + 1)?;
        let record = |i: usize, stream: cu::CUstream| {
            ck(
                // SAFETY: a live event and stream of the current context; under capture the
                // external flag makes the record a node of the graph.
                unsafe {
                    cu::cuEventRecordWithFlags(
                        events.0[i],
                        stream,
                        cu::CUevent_record_flags_enum::CU_EVENT_RECORD_EXTERNAL as u32,
                    )
                },
                "cuEventRecordWithFlags(external)",
            )
        };
        // Plain launches here: an event record between two kernels leaves nothing for a
        // programmatic edge to overlap, and the intervals should be the launches' own.
        let pdl = self.pdl.replace(false);
        let graph = self.capture("per-op profile", |m| {
            record(0, m.stream)?;
            for (i, op) in ops.iter().enumerate() {
                m.run(std::slice::from_ref(op))?;
                record(i + 1, m.stream)?;
            }
            Ok(())
        });
        self.pdl.set(pdl);
        let graph = graph?;
        let mut acc = vec![0f64; ops.len()];
        for it in 0..iters.max(1) + 1 {
            ck(
                // SAFETY: as in `enqueue_step`; the stream is synchronized below before the
                // staging is written again.
                unsafe {
                    cu::cuMemcpyHtoDAsync_v2(
                        self.inputs,
                        self.staging.cast(),
                        p.words * 4,
                        self.stream,
                    )
                },
                "cuMemcpyHtoDAsync(step inputs)",
            )?;
            ck(
                // SAFETY: `graph` is instantiated and uploaded on this context.
                unsafe { cu::cuGraphLaunch(graph, self.stream) },
                "cuGraphLaunch(per-op profile)",
            )?;
            self.sync("profiled step")?;
            if it > 0 {
                for (i, a) in acc.iter_mut().enumerate() {
                    *a += events.elapsed_ms(i, i + 1)?;
                }
            }
        }
        let n = iters.max(1) as f64;
        let mut out: Vec<(String, usize, f64)> = Vec::new();
        for (name, ms) in names.iter().zip(&acc) {
            match out.iter_mut().find(|(o, _, _)| o == name) {
                Some(e) => {
                    e.1 += 1;
                    e.2 += ms / n;
                }
                None => out.push(((*name).to_string(), 1, ms / n)),
            }
        }
        Ok(out)
    }

    /// Device copy bandwidth: a `bytes` device-to-device copy (`cuMemcpyDtoDAsync`), best of
    /// `iters`, as bytes read plus written per second.
    pub fn copy_bandwidth(&mut self, bytes: usize, iters: usize) -> Result<f64, GpuModelError> {
        self.make_current()?;
        let mut bufs = [0u64; 2];
        for i in 0..2 {
            // SAFETY: a context is current; out-pointer valid; freed below.
            let r = unsafe { cu::cuMemAlloc_v2(&mut bufs[i], bytes) };
            if r != cu::CUresult::CUDA_SUCCESS {
                for &p in bufs.iter().filter(|&&p| p != 0) {
                    // SAFETY: allocated above.
                    unsafe { cu::cuMemFree_v2(p) };
                }
                ck(
                    r,
                    &format!("cuMemAlloc(copy bandwidth buffer, {bytes} bytes)"),
                )?;
            }
        }
        let run = || -> Result<f64, GpuModelError> {
            let events = Events::new(2)?;
            let mut best = f64::INFINITY;
            for _ in 0..iters.max(1) + 1 {
                events.record(0, self.stream)?;
                ck(
                    // SAFETY: both buffers hold `bytes` bytes.
                    unsafe { cu::cuMemcpyDtoDAsync_v2(bufs[1], bufs[0], bytes, self.stream) },
                    "cuMemcpyDtoDAsync(copy bandwidth)",
                )?;
                events.record(1, self.stream)?;
                self.sync("copy bandwidth")?;
                best = best.min(events.elapsed_ms(0, 1)?);
            }
            Ok(2.0 * bytes as f64 / (best / 1e3))
        };
        let out = run();
        for p in bufs {
            // SAFETY: allocated above; the stream is synchronized (or failed).
            unsafe { cu::cuMemFree_v2(p) };
        }
        out
    }

    /// Replay the captured graphs (true) or enqueue the same launches directly (false), for
    /// checks that both give the same results. Graphs exist only when the model was built
    /// with `use_graphs`.
    pub fn set_use_graphs(&mut self, on: bool) -> Result<(), GpuModelError> {
        if on && self.body_graphs.is_empty() {
            return Err(GpuModelError::Config(
                "no graphs to replay: the model was built with use_graphs false".into(),
            ));
        }
        self.use_graphs = on;
        Ok(())
    }

    /// Whether attention runs on tensor cores (`bgs_attention_mma`).
    pub fn tensor_core_attention(&self) -> bool {
        self.mma_attention
    }

    /// Attention on tensor cores (`true`, where the model and device allow it: see
    /// [`GpuModelOptions::tensor_core_attention`]) or per query head, for the launches that
    /// follow; captured graphs keep the form they were captured with, so compare the forms
    /// with `set_use_graphs(false)`. Returns whether tensor-core attention is now in effect.
    pub fn set_tensor_core_attention(&mut self, on: bool) -> bool {
        self.mma_attention = on
            && crate::attention_mma_built(self.compute_capability.0, self.dtype, self.cfg.head_dim)
            && mma_attention_shared(&self.cfg, self.dtype, self.attention_warps).is_some();
        self.mma_attention
    }

    /// The graph handles and device buffers a device-side step loop drives; an error unless
    /// the model was built with `device_launch` (and so with graphs).
    pub fn device_handles(&self) -> Result<DeviceHandles, GpuModelError> {
        if !self.device_launch || self.body_graphs.is_empty() {
            return Err(GpuModelError::Config(
                "no device-launchable graphs: build the model with device_launch and use_graphs"
                    .into(),
            ));
        }
        let h = |l: &[(usize, cu::CUgraphExec)]| l.iter().map(|&(b, e)| (b, e as u64)).collect();
        Ok(DeviceHandles {
            body: h(&self.body_graphs),
            head: h(&self.head_graphs),
            inputs: self.inputs,
            next: self.b.next,
            geometry: self.geo,
        })
    }

    /// The CUDA context the model's memory and graphs belong to (a device-side loop's
    /// kernels must be loaded into it).
    pub fn context(&self) -> cu::CUcontext {
        self.ctx
    }

    /// Whether steps replay the captured graphs.
    pub fn uses_graphs(&self) -> bool {
        self.use_graphs
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Step limits and the KV pool's geometry.
    pub fn geometry(&self) -> &StepGeometry {
        &self.geo
    }

    /// Element type on the device.
    pub fn dtype(&self) -> GpuDtype {
        self.dtype
    }

    /// Bytes of weights on the device (norms and biases in f32 included).
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes
    }

    /// Bytes of the KV pool.
    pub fn kv_bytes(&self) -> usize {
        self.kv_bytes
    }

    /// Bytes of K and V one token reads per position of context in a step (all layers).
    pub fn kv_bytes_per_position(&self) -> usize {
        host::kv_block_bytes(&self.cfg, 1, self.dtype)
    }

    /// The device's name and compute capability.
    pub fn device(&self) -> (&str, (i32, i32)) {
        (&self.device_name, self.compute_capability)
    }

    /// The kernels' cubin came from the on-disk cache.
    pub fn cache_hit(&self) -> bool {
        self.cache_hit
    }

    /// Longest sequence: the model's limit, or what one sequence's block table can cover.
    pub fn max_positions(&self) -> usize {
        self.cfg
            .max_position_embeddings
            .min(self.geo.max_blocks_per_seq * self.geo.block_size)
    }
}

impl Drop for GpuModel {
    fn drop(&mut self) {
        if self.ctx.is_null() {
            return;
        }
        // SAFETY: every handle below was created by this model (or is null) and is released
        // exactly once; the stream is synchronized first so nothing still runs.
        unsafe {
            let _ = cu::cuCtxSetCurrent(self.ctx);
            if !self.stream.is_null() {
                let _ = cu::cuStreamSynchronize(self.stream);
            }
            for (_, e) in self
                .body_graphs
                .drain(..)
                .chain(self.head_graphs.drain(..))
                .chain(self.persist.body_graphs.drain(..))
                .chain(self.persist.head_graphs.drain(..))
            {
                let _ = cu::cuGraphExecDestroy(e);
            }
            for g in self.graphs.drain(..) {
                let _ = cu::cuGraphDestroy(g);
            }
            if !self.blas.is_null() {
                let _ = cublas::cublasDestroy_v2(self.blas);
            }
            if !self.step_done.is_null() {
                let _ = cu::cuEventDestroy_v2(self.step_done);
            }
            if !self.stream.is_null() {
                let _ = cu::cuStreamDestroy_v2(self.stream);
            }
            for (p, _) in self.allocs.drain(..) {
                let _ = cu::cuMemFree_v2(p);
            }
            for p in [self.staging.cast::<c_void>(), self.next_host.cast()] {
                if !p.is_null() {
                    let _ = cu::cuMemFreeHost(p);
                }
            }
            if !self.module.is_null() {
                let _ = cu::cuModuleUnload(self.module);
            }
            let _ = cu::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

impl DeviceMem for GpuModel {
    fn alloc(&mut self, bytes: usize, what: &str) -> Result<u64, GpuModelError> {
        GpuModel::alloc(self, bytes, what)
    }

    fn upload(&mut self, bytes: &[u8], what: &str) -> Result<u64, GpuModelError> {
        GpuModel::upload(self, bytes, what)
    }
}

impl StepModel for GpuModel {
    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn eos_ids(&self) -> &[u32] {
        &self.cfg.eos_token_ids
    }

    fn max_positions(&self) -> usize {
        GpuModel::max_positions(self)
    }

    fn kv(&self) -> KvShape {
        KvShape {
            block_size: self.geo.block_size,
            num_blocks: self.geo.num_blocks,
        }
    }

    fn step(&mut self, items: &[StepItem<'_>], next: &mut [u32]) -> Result<(), String> {
        GpuModel::step(self, items, next).map_err(|e| e.to_string())
    }
}

/// CUDA events for timing, destroyed on drop.
struct Events(Vec<cu::CUevent>);

impl Events {
    fn new(n: usize) -> Result<Events, GpuError> {
        let mut ev = Events(Vec::with_capacity(n));
        for _ in 0..n {
            let mut e: cu::CUevent = std::ptr::null_mut();
            // SAFETY: a context is current; out-pointer valid; destroyed on drop.
            ck(unsafe { cu::cuEventCreate(&mut e, 0) }, "cuEventCreate")?;
            ev.0.push(e);
        }
        Ok(ev)
    }

    fn record(&self, i: usize, s: cu::CUstream) -> Result<(), GpuError> {
        // SAFETY: a live event and stream of the current context.
        ck(unsafe { cu::cuEventRecord(self.0[i], s) }, "cuEventRecord")
    }

    fn elapsed_ms(&self, a: usize, b: usize) -> Result<f64, GpuError> {
        let mut ms = 0f32;
        ck(
            // SAFETY: both events were recorded and have completed (the stream was synchronized).
            unsafe { cu::cuEventElapsedTime_v2(&mut ms, self.0[a], self.0[b]) },
            "cuEventElapsedTime",
        )?;
        Ok(f64::from(ms))
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        for &e in &self.0 {
            // SAFETY: created in `new`, destroyed once.
            unsafe { cu::cuEventDestroy_v2(e) };
        }
    }
}

fn get_function(module: cu::CUmodule, name: &str) -> Result<cu::CUfunction, GpuError> {
    let c = CString::new(name).map_err(|e| GpuError::Compile(e.to_string()))?;
    let mut f: cu::CUfunction = std::ptr::null_mut();
    ck(
        // SAFETY: `module` is a loaded module; `c` is NUL-terminated; out-pointer valid.
        unsafe { cu::cuModuleGetFunction(&mut f, module, c.as_ptr()) },
        &format!("cuModuleGetFunction({name})"),
    )?;
    Ok(f)
}

fn mem_info() -> Result<(usize, usize), GpuError> {
    let (mut free, mut total) = (0usize, 0usize);
    ck(
        // SAFETY: a context is current; out-pointers valid.
        unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) },
        "cuMemGetInfo",
    )?;
    Ok((free, total))
}
