//! `src/llm_kernels.cu`, checked without a GPU, for every dtype:
//! - through NVRTC's real front end and code generator (`-arch=sm_90`) when the CUDA 13.0
//!   wheels are installed (`pip install 'nvidia-cuda-nvrtc==13.0.*'`, or `BGS_CUDA_LIB_DIR`
//!   naming a directory with `libnvrtc.so.13` and its builtins), the same discovery as
//!   bgs-executor-gpu's kernel test;
//! - with clang-19 in CUDA mode (`-fsyntax-only -Wall -Werror`, stub prelude).
//!
//! `BGS_DUMP_CUBINS=<dir>` writes each NVRTC cubin there (`<dtype>-<head_dim>.cubin`) for
//! `cuobjdump --dump-resource-usage` (`bench/gpu/kernel-resources.sh`): registers and shared
//! memory a thread and a block, hence blocks per SM, without a GPU.
//!
//! Each check prints a notice and passes when its tool is missing, except under CI (`CI` set),
//! which installs every tool and fails instead: a check that silently stops running is worse
//! than a failing one.

use std::process::Command;

use bgs_executor_gpu::tool_checks::{clang, missing, wheel_lib_dir};
use bgs_executor_gpu::{compile, libs};
use bgs_model_gpu::{GpuDtype, KERNEL_SOURCE, kernel_headers, nvrtc_options};

const DTYPES: [GpuDtype; 3] = [GpuDtype::F32, GpuDtype::F16, GpuDtype::Bf16];

/// Head sizes the kernels are compiled for (`-DBGS_HEAD_DIM`): every form of attention.
const HEAD_DIMS: [usize; 4] = [16, 64, 128, 24];

/// The kernels the model looks up by name.
const ENTRY_POINTS: [&str; 27] = [
    "bgs_embed",
    "bgs_add_rmsnorm",
    "bgs_rope_kv",
    "bgs_attention",
    "bgs_attention_mma",
    "bgs_silu_mul",
    "bgs_gather_rows",
    "bgs_argmax",
    "bgs_proj",
    "bgs_proj_add",
    "bgs_proj_norm_silu",
    "bgs_proj_norm_rope_kv",
    "bgs_gemm_tc",
    "bgs_gemm_tc_silu",
    "bgs_gemm_tc_add_norm",
    "bgs_gemm_tc_rope_kv",
    "bgs_gemm_tc_small",
    "bgs_gemm_tc_silu_small",
    "bgs_gemm_tc_add_norm_small",
    "bgs_gemm_tc_rope_kv_small",
    "bgs_gemm_tc_mid",
    "bgs_gemm_tc_silu_mid",
    "bgs_gemm_tc_add_norm_mid",
    "bgs_gemm_tc_rope_kv_mid",
    "bgs_gemm_tc_large",
    "bgs_gemm_tc_silu_large",
    "bgs_persistent",
];

#[test]
fn kernels_compile_with_nvrtc_for_sm90_in_every_dtype() {
    let Some(dir) = wheel_lib_dir() else {
        missing(
            "NVRTC 13 not found (pip install 'nvidia-cuda-nvrtc==13.0.*'); NVRTC check skipped",
        );
        return;
    };
    let dirs = vec![dir];
    libs::load(&libs::NVRTC_BUILTINS, &dirs).expect("libnvrtc-builtins");
    libs::load(&libs::NVRTC, &dirs).expect("libnvrtc");
    // SAFETY: only dlopens NVRTC, which was loaded above.
    assert!(unsafe { cudarc::nvrtc::sys::is_culib_present() });
    // Head sizes 16 and 64 (the tiny and the real models), 128, and 24 (attention's scalar form
    // in every dtype; 128 is the scalar form in f32 too).
    for (dt, head_dim) in DTYPES.into_iter().flat_map(|dt| HEAD_DIMS.map(|h| (dt, h))) {
        let cubin = compile::nvrtc_compile_source(
            "llm_kernels.cu",
            KERNEL_SOURCE,
            &kernel_headers(),
            &nvrtc_options(9, 0, dt, head_dim),
        )
        .unwrap_or_else(|e| panic!("{} head_dim {head_dim}: {e}", dt.name()));
        assert!(cubin.starts_with(b"\x7fELF"), "{}: not a cubin", dt.name());
        if let Some(dir) = std::env::var_os("BGS_DUMP_CUBINS") {
            let path = std::path::Path::new(&dir).join(format!("{}-{head_dim}.cubin", dt.name()));
            std::fs::write(&path, &cubin).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        // Every entry point is in the cubin under its unmangled name (extern "C").
        for name in ENTRY_POINTS {
            assert!(
                cubin
                    .windows(name.len() + 1)
                    .any(|w| &w[..name.len()] == name.as_bytes() && w[name.len()] == 0),
                "{}: kernel {name} missing from the cubin",
                dt.name()
            );
        }
        println!(
            "{} head_dim {head_dim}: cubin {} bytes",
            dt.name(),
            cubin.len()
        );
    }
    // A wrong dtype selector is a compile error, not a silently wrong type.
    let e = compile::nvrtc_compile_source(
        "llm_kernels.cu",
        KERNEL_SOURCE,
        &[],
        &["-arch=sm_90".into(), "-DBGS_DT=7".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("BGS_DT must be 0, 1 or 2"), "{e}");
}

const STUB_PRELUDE: &str = r#"
/* Stand-ins for what NVRTC provides; enough for -fsyntax-only. */
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __forceinline__ __attribute__((always_inline)) inline
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
struct bgs_stub_dim3 { unsigned x, y, z; };
extern __device__ const bgs_stub_dim3 bgs_stub_tid, bgs_stub_bid, bgs_stub_bdim, bgs_stub_gdim;
#define threadIdx bgs_stub_tid
#define blockIdx bgs_stub_bid
#define blockDim bgs_stub_bdim
#define gridDim bgs_stub_gdim
typedef unsigned long size_t;
__device__ void __syncthreads();
__device__ float __shfl_xor_sync(unsigned, float, int);
__device__ float __shfl_sync(unsigned, float, int);
__device__ float __shfl_down_sync(unsigned, float, unsigned);
__device__ void __syncwarp(unsigned = 0xffffffffu);
__device__ int min(int, int);
__device__ float __uint_as_float(unsigned);
__device__ unsigned __float_as_uint(float);
__device__ float __int_as_float(int);
__device__ float sqrtf(float);
__device__ float expf(float);
__device__ float cosf(float);
__device__ float sinf(float);
__device__ float fmaxf(float, float);
__device__ size_t __cvta_generic_to_shared(const void *);
__device__ void __trap();
__device__ unsigned atomicAdd(unsigned *, unsigned);
__device__ void __threadfence();
"#;

fn clang_check(dt: u32, head_dim: usize, extra: &str) -> Option<std::process::Output> {
    let cc = clang()?;
    // The tensor-core attention as NVRTC builds it for sm_90 (`attention_mma_built`).
    let dtype = DTYPES
        .into_iter()
        .find(|d| d.kernel_id() == dt)
        .unwrap_or(GpuDtype::F32);
    let tmp = std::env::temp_dir().join(format!(
        "bgs-llm-kernels-{}-{dt}-{head_dim}-{}",
        std::process::id(),
        extra.len()
    ));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("stub.h"), STUB_PRELUDE).unwrap();
    for (name, text) in kernel_headers() {
        std::fs::write(tmp.join(name), text).unwrap();
    }
    std::fs::write(tmp.join("k.cu"), format!("{KERNEL_SOURCE}\n{extra}\n")).unwrap();
    let out = Command::new(cc)
        .args([
            "-x",
            "cuda",
            "--cuda-gpu-arch=sm_90",
            "--cuda-device-only",
            "-nocudainc",
            "-nocudalib",
            "-fsyntax-only",
            "-std=c++17",
            "-Wall",
            "-Werror",
        ])
        // The definitions NVRTC gets (one source: `nvrtc_options`).
        .args(
            nvrtc_options(9, 0, dtype, head_dim)
                .into_iter()
                .filter(|o| o.starts_with("-D")),
        )
        .arg("-include")
        .arg(tmp.join("stub.h"))
        .arg(tmp.join("k.cu"))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&tmp);
    Some(out)
}

#[test]
fn kernels_pass_clang_cuda_syntax_check_in_every_dtype() {
    for dt in DTYPES {
        for head_dim in HEAD_DIMS {
            let Some(out) = clang_check(dt.kernel_id(), head_dim, "") else {
                missing("clang-19 not found; CUDA syntax check skipped");
                return;
            };
            assert!(
                out.status.success(),
                "clang -x cuda failed for {} head_dim {head_dim}:\n{}",
                dt.name(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn clang_check_catches_errors() {
    // The check is real: an injected error fails it, and it is the only error.
    let Some(out) = clang_check(2, 64, "static_assert(sizeof(wt) == 4, \"bgs-llm-drift\");") else {
        missing("clang-19 not found; CUDA syntax check skipped");
        return;
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "clang accepted a false static_assert"
    );
    assert!(err.contains("bgs-llm-drift"), "{err}");
    assert_eq!(err.matches("error:").count(), 1, "{err}");
}
