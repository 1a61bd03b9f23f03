//! The GPU forward pass for generation (docs/gpu-model.md).
//!
//! [`GpuModel`] holds a Qwen2/Llama decoder's weights on one CUDA device (in f32, f16 or
//! bf16, with fused QKV and gate/up projections), a paged KV cache, and one captured CUDA
//! graph per token-count bucket. It implements [`bgs_llm::StepModel`], so the generation
//! engine drives it exactly as it drives the CPU oracle ([`bgs_model::CpuModel`]), whose maths
//! it follows operation by operation. Projections run through cuBLAS (`cublasGemmEx`, f32
//! output and accumulation); everything else is the NVRTC kernels of `src/llm_kernels.cu`.
//!
//! Libraries are loaded at run time (cudarc, dynamic loading): without a driver, a device or
//! a library, [`GpuModel::new`] returns an error naming what is missing.

pub mod c_header;
#[cfg(test)]
mod emu;
pub mod gen_exec;
pub mod host;
mod model;
mod pacer;
pub mod persistent;
mod plan;

pub use gen_exec::{GenLoopConfig, GenLoopStats, GpuGenError, GpuGenExecutor};
pub use host::{GpuDtype, StepGeometry};
pub use model::{DeviceHandles, GpuModel, GpuModelError, GpuModelOptions};
/// The large tensor-core tiles' block of tokens
/// (`GpuModelOptions::tensor_core_large_tiles_min_tokens`): the check runs them from it.
pub use plan::TC_LARGE_TOKENS;
/// The mid tensor-core tiles' width (`GpuModelOptions::tensor_core_mid_tiles_max_tokens`): the
/// check runs them up to it.
pub use plan::TC_MID_TOKENS;
/// The large tensor-core tiles' dynamic shared memory a block (the device's opt-in limit must
/// hold it, else they stay off).
pub use plan::tc_large_shared_bytes;

/// The kernels' CUDA C++ source.
pub const KERNEL_SOURCE: &str = include_str!("llm_kernels.cu");

/// The generated header the kernels include (`include/bgs_llm_ops.h`, kept equal to
/// [`persistent::render_ops_header`] by `tests/c_header.rs`).
pub const OPS_HEADER: &str = include_str!("../../../include/bgs_llm_ops.h");

/// The headers NVRTC compiles [`KERNEL_SOURCE`] with, by include name.
pub fn kernel_headers() -> [(&'static str, &'static str); 1] {
    [(persistent::OPS_HEADER_NAME, OPS_HEADER)]
}

/// NVRTC options for compute capability `major.minor`, `dtype` and the model's `head_dim`
/// (attention's fast form is compiled for that head size alone; no `-rdc`: the kernels
/// launch nothing themselves, so NVRTC's cubin loads as is).
pub fn nvrtc_options(major: i32, minor: i32, dtype: GpuDtype, head_dim: usize) -> Vec<String> {
    let mut o = vec![
        format!("-arch=sm_{major}{minor}"),
        "-std=c++17".into(),
        // Keep multiplies and adds separate, as the CPU oracle computes them.
        "-fmad=false".into(),
        format!("-DBGS_DT={}", dtype.kernel_id()),
        format!("-DBGS_HEAD_DIM={head_dim}"),
        format!(
            "-DBGS_ATTN_MMA={}",
            u8::from(attention_mma_built(major, dtype, head_dim))
        ),
        // The tensor-core GEMM's block shape, which the plan's grids are sized by.
        format!("-DBGS_TC_WARPS={}", plan::TC_WARPS),
        format!("-DBGS_TC_TOKENS={}", plan::TC_TOKENS),
        format!("-DBGS_TC_SMALL_TOKENS={}", plan::TC_SMALL_TOKENS),
        format!("-DBGS_TC_MID_TOKENS={}", TC_MID_TOKENS),
        format!("-DBGS_TC_SMALL_UNROLL={}", plan::TC_SMALL_UNROLL),
        // The large tiles' block (warp rows of 32 weight rows, warp tiles of tokens) and their
        // shared-memory pipeline (chunks a stage, stages), which the plan's grids and dynamic
        // shared memory are sized by (`plan::tc_large_shared_bytes`).
        format!("-DBGS_TC_LARGE_WARP_ROWS={}", plan::TC_LARGE_WARP_ROWS),
        format!("-DBGS_TC_LARGE_WARP_TOKENS={}", plan::TC_LARGE_WARP_TOKENS),
        format!("-DBGS_TC_LARGE_CHUNKS={}", plan::TC_LARGE_CHUNKS),
        format!("-DBGS_TC_LARGE_STAGES={}", plan::TC_LARGE_STAGES),
        // The split argmax's block size.
        format!("-DBGS_ARGMAX_SPLIT_THREADS={}", plan::ARGMAX_SPLIT_THREADS),
        // Row tiles a staged small-tile block takes at most (`Plan::tc_stage`).
        format!("-DBGS_TC_STAGE_MAX={}", plan::TC_STAGE_MAX),
        // The folded form's norm: values of a row per virtual thread.
        format!("-DBGS_TC_NORM_SPAN={}", plan::TC_NORM_SPAN),
    ];
    // Experiments only: extra `-D` definitions (e.g. `BGS_ATTN_SCALAR=1`), each replacing the
    // host's definition of the same macro (e.g. `BGS_TC_SMALL_UNROLL=4`; never one the plan
    // sizes launches by, such as the tile widths); part of the cache key like every option.
    if let Ok(extra) = std::env::var("BGS_LLM_KERNEL_DEFINES") {
        add_defines(&mut o, &extra);
    }
    o
}

/// Appends each whitespace-separated `NAME[=VALUE]` of `extra` to the options as `-D`,
/// removing any earlier definition of the same NAME.
fn add_defines(o: &mut Vec<String>, extra: &str) {
    for d in extra.split_whitespace() {
        let name = d.split('=').next().unwrap_or(d);
        o.retain(|have| {
            have.strip_prefix("-D")
                .is_none_or(|h| h.split('=').next() != Some(name))
        });
        o.push(format!("-D{d}"));
    }
}

/// Whether the kernels are built with `bgs_attention_mma` (`-DBGS_ATTN_MMA=1`) for compute
/// capability `major`, `dtype` and `head_dim`: tensor cores multiply 16-bit values, its tiles
/// are written for head sizes 16, 32 and 64, and it needs sm_80's `cp.async`, `ldmatrix` and
/// bf16 MMA. The one place this is decided; the kernel source only refuses a definition it
/// cannot honour.
pub fn attention_mma_built(major: i32, dtype: GpuDtype, head_dim: usize) -> bool {
    major >= 8 && plan::mma_form_covers(dtype, head_dim)
}

/// The kernel cache key: a 128-bit hash of the source and its header, options, device name
/// and the driver and NVRTC versions.
pub fn cache_key(options: &[String], device: &str, versions: &str) -> String {
    let opts = options.join("\u{1}");
    let parts: [&[u8]; 6] = [
        b"bgs-model-gpu",
        KERNEL_SOURCE.as_bytes(),
        OPS_HEADER.as_bytes(),
        opts.as_bytes(),
        device.as_bytes(),
        versions.as_bytes(),
    ];
    use bgs_executor_gpu::compile::fnv1a;
    format!(
        "llm-{:016x}{:016x}",
        fnv1a(0xcbf2_9ce4_8422_2325, &parts),
        fnv1a(0x6c62_272e_07bb_0142, &parts)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_and_cache_keys_follow_dtype_and_device() {
        let o = nvrtc_options(9, 0, GpuDtype::Bf16, 64);
        assert!(o.contains(&"-arch=sm_90".to_string()));
        assert!(o.contains(&"-DBGS_DT=2".to_string()));
        assert!(o.contains(&"-DBGS_HEAD_DIM=64".to_string()));
        assert!(o.contains(&"-DBGS_ATTN_MMA=1".to_string()));
        // Tensor-core attention: 16-bit values, head sizes 16/32/64, sm_80 and later.
        for (major, dtype, hd, built) in [
            (9, GpuDtype::F16, 16, true),
            (8, GpuDtype::Bf16, 32, true),
            (9, GpuDtype::F32, 64, false),
            (9, GpuDtype::Bf16, 128, false),
            (9, GpuDtype::Bf16, 24, false),
            (7, GpuDtype::F16, 64, false),
        ] {
            assert_eq!(
                attention_mma_built(major, dtype, hd),
                built,
                "{major} {dtype:?} {hd}"
            );
        }
        assert!(o.contains(&"-fmad=false".to_string()));
        assert!(!o.iter().any(|x| x.contains("rdc")));
        let k = cache_key(&o, "NVIDIA H200", "driver 13000 nvrtc 13.0");
        assert_eq!(k, cache_key(&o, "NVIDIA H200", "driver 13000 nvrtc 13.0"));
        let f32o = nvrtc_options(9, 0, GpuDtype::F32, 64);
        assert_ne!(
            k,
            cache_key(&f32o, "NVIDIA H200", "driver 13000 nvrtc 13.0")
        );
        // Another head size compiles another attention: another cubin.
        let hd128 = nvrtc_options(9, 0, GpuDtype::Bf16, 128);
        assert_ne!(
            k,
            cache_key(&hd128, "NVIDIA H200", "driver 13000 nvrtc 13.0")
        );
        assert_ne!(k, cache_key(&o, "NVIDIA H100", "driver 13000 nvrtc 13.0"));
        assert_ne!(k, cache_key(&o, "NVIDIA H200", "driver 13010 nvrtc 13.0"));
        // Not the executor's cache entries.
        assert!(k.starts_with("llm-"));
    }

    #[test]
    fn extra_defines_replace_the_hosts() {
        let mut o = nvrtc_options(9, 0, GpuDtype::Bf16, 64);
        let small = format!("-DBGS_TC_SMALL_UNROLL={}", plan::TC_SMALL_UNROLL);
        assert!(o.contains(&small));
        add_defines(&mut o, " BGS_TC_SMALL_UNROLL=7  BGS_ATTN_SCALAR=1 BGS_X");
        assert!(!o.contains(&small));
        let defs = |name: &str| o.iter().filter(|d| d.starts_with(name)).count();
        assert_eq!(defs("-DBGS_TC_SMALL_UNROLL="), 1);
        assert!(o.ends_with(&[
            "-DBGS_TC_SMALL_UNROLL=7".into(),
            "-DBGS_ATTN_SCALAR=1".into(),
            "-DBGS_X".into()
        ]));
        // A longer name sharing the prefix stays.
        assert_eq!(defs("-DBGS_TC_SMALL_TOKENS="), 1);
        assert_eq!(defs("-DBGS_TC_MID_TOKENS="), 1);
        for large in [
            "-DBGS_TC_LARGE_WARP_ROWS=2",
            "-DBGS_TC_LARGE_WARP_TOKENS=16",
            "-DBGS_TC_LARGE_CHUNKS=4",
            "-DBGS_TC_LARGE_STAGES=3",
        ] {
            assert_eq!(defs(large), 1, "{large}");
        }
        // (Not a prefix of another: each name ends at its `=`.)
        assert_eq!(defs("-DBGS_TC_LARGE_"), 4);
        assert!(o.contains(&"-fmad=false".to_string()));
    }
}
