//! The kernel source, checked without a GPU:
//! - through NVRTC's real front end and code generator (`-arch=sm_90 -rdc=true`), and linked
//!   with `libcudadevrt.a` by nvJitLink, when the CUDA 13.0 wheels are installed
//!   (`pip install 'nvidia-cuda-nvrtc==13.0.*' 'nvidia-cuda-runtime==13.0.*'
//!   'nvidia-nvjitlink==13.0.*'`, or `BGS_CUDA_LIB_DIR` naming a directory with those files);
//! - with clang-19 in CUDA mode (`-fsyntax-only`, stub prelude), where the generated headers'
//!   static asserts on every ring and GPU struct offset (`bgs_ring.h`, `bgs_gpu.h`) are
//!   evaluated (NVRTC has no `__builtin_offsetof`).
//!
//! Each check prints a notice and passes when its tool is missing, except under CI (`CI` set),
//! which installs every tool (scripts/setup.sh, scripts/test.sh) and fails instead: a check
//! that silently stops running is worse than a failing one.

use std::path::Path;
use std::process::Command;

use bgs_executor_gpu::tool_checks::{clang, missing, wheel_lib_dir};
use bgs_executor_gpu::{compile, libs};

#[test]
fn kernels_compile_with_nvrtc_and_link_with_nvjitlink() {
    let Some(dir) = wheel_lib_dir() else {
        missing(
            "NVRTC 13 not found (pip install 'nvidia-cuda-nvrtc==13.0.*' \
             'nvidia-cuda-runtime==13.0.*' 'nvidia-nvjitlink==13.0.*'); NVRTC check skipped",
        );
        return;
    };
    let dirs = vec![dir.clone()];
    libs::load(&libs::NVRTC_BUILTINS, &dirs).expect("libnvrtc-builtins");
    libs::load(&libs::NVRTC, &dirs).expect("libnvrtc");
    // SAFETY: only dlopens NVRTC, which was loaded above.
    assert!(unsafe { cudarc::nvrtc::sys::is_culib_present() });
    println!("NVRTC {}", compile::nvrtc_version().unwrap());
    let cubin =
        compile::nvrtc_compile(&compile::nvrtc_options(9, 0)).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        cubin.starts_with(b"\x7fELF"),
        "NVRTC -rdc output is a relocatable ELF cubin"
    );
    match libs::load(&libs::NVJITLINK, &dirs) {
        Ok(jl) => {
            let devrt = libs::find_cudadevrt(&dirs, "").expect("libcudadevrt.a next to NVRTC");
            let linked =
                compile::nvjitlink(&jl, "sm_90", &cubin, &devrt).unwrap_or_else(|e| panic!("{e}"));
            assert!(linked.starts_with(b"\x7fELF"));
            println!("linked cubin: {} bytes", linked.len());
        }
        Err(e) => missing(&format!("nvJitLink not found ({e}); link check skipped")),
    }
}

/// The generation step policy (portable C, run by the host engine today) compiles for the
/// GPU's step loop too: NVRTC, device functions called from a kernel.
#[test]
fn step_policy_compiles_with_nvrtc() {
    let Some(dir) = wheel_lib_dir() else {
        missing("NVRTC 13 not found; step policy NVRTC check skipped");
        return;
    };
    let dirs = vec![dir];
    libs::load(&libs::NVRTC_BUILTINS, &dirs).expect("libnvrtc-builtins");
    libs::load(&libs::NVRTC, &dirs).expect("libnvrtc");
    let header = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include/bgs_step_policy.h"),
    )
    .unwrap();
    let source = r#"
#define BGS_STEP_POLICY_API __device__
#define BGS_STEP_POLICY_IMPL
#include "bgs_step_policy.h"
extern "C" __global__ void plan_once(const struct bgs_sp_limits *l,
                                     const struct bgs_sp_seq *s, unsigned n,
                                     struct bgs_sp_out *o, int *r) {
    *r = bgs_step_plan(l, s, n, o);
}
"#;
    let cubin = compile::nvrtc_compile_source(
        "step_policy.cu",
        source,
        &[("bgs_step_policy.h", &header)],
        &compile::nvrtc_options(9, 0),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(cubin.starts_with(b"\x7fELF"));
}

/// The generation step loop (portable C, `include/bgs_gen_loop.h`, run by the host's
/// `CGenEngine` today) compiles as device code for the GPU-resident dispatcher: NVRTC, with
/// the step policy and the generated protocol and step-layout headers, every entry point
/// called from a kernel.
const GEN_LOOP_DEVICE_SOURCE: &str = r#"
#define BGS_GEN_LOOP_API __device__
#define BGS_GEN_LOOP_IMPL
#define BGS_STEP_POLICY_IMPL
#include "bgs_gen_loop.h"
extern "C" __global__ void gen_loop_once(unsigned *state, const struct bgs_gl_limits *l,
                                         const unsigned *eos, const struct bgs_gl_request *r,
                                         const unsigned *credit, const unsigned *next,
                                         struct bgs_gl_frame *frames,
                                         const struct bgs_llm_step_geometry *geo, int *buf,
                                         struct bgs_gl_packed *packed, unsigned *out) {
    struct bgs_gl_item item;
    unsigned a, b, c, d, e, f;
    out[0] = (unsigned)bgs_gl_init(state, l, eos, 1u);
    out[1] = bgs_gl_admit(state, r);
    out[2] = (unsigned)bgs_gl_plan(state, credit);
    out[3] = (unsigned)bgs_gl_item(state, 0u, &item);
    out[4] = (unsigned)bgs_gl_pack(state, geo, buf, packed);
    out[5] = (unsigned)bgs_gl_finish(state, next, frames);
    bgs_gl_delivered(state, frames[0].slot, 1u);
    out[6] = bgs_gl_owed(state, frames);
    out[7] = bgs_gl_cancel(state, r->conn);
    bgs_gl_fail_step(state);
    out[8] = bgs_gl_check(state) + bgs_gl_live(state) + bgs_gl_running(state) +
             bgs_gl_free_blocks(state) + bgs_gl_holds(state, r->stream) +
             bgs_gl_slot_stream(state, 0u) + bgs_gl_step_words(geo) +
             (unsigned)bgs_gl_state_bytes(l) + bgs_gl_abi(&a, &b, &c, &d, &e, &f) + item.tokens;
}
"#;

fn gen_loop_headers() -> Vec<(&'static str, String)> {
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include");
    [
        "bgs_gen_loop.h",
        "bgs_step_policy.h",
        "bgs_protocol.h",
        "bgs_ring.h",
        "bgs_llm_step.h",
    ]
    .into_iter()
    .map(|h| (h, std::fs::read_to_string(include.join(h)).unwrap()))
    .collect()
}

#[test]
fn gen_loop_compiles_with_nvrtc() {
    let Some(dir) = wheel_lib_dir() else {
        missing("NVRTC 13 not found; step loop NVRTC check skipped");
        return;
    };
    let dirs = vec![dir];
    libs::load(&libs::NVRTC_BUILTINS, &dirs).expect("libnvrtc-builtins");
    libs::load(&libs::NVRTC, &dirs).expect("libnvrtc");
    let headers = gen_loop_headers();
    let refs: Vec<(&str, &str)> = headers.iter().map(|(n, t)| (*n, t.as_str())).collect();
    let cubin = compile::nvrtc_compile_source(
        "gen_loop.cu",
        GEN_LOOP_DEVICE_SOURCE,
        &refs,
        &compile::nvrtc_options(9, 0),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(cubin.starts_with(b"\x7fELF"));
}

/// The same device unit through clang's CUDA front end, where the generated headers' static
/// asserts are evaluated (NVRTC skips them) and warnings are errors.
#[test]
fn gen_loop_passes_clang_cuda_syntax_check() {
    let Some(cc) = clang() else {
        missing("clang-19 not found; step loop CUDA syntax check skipped");
        return;
    };
    let tmp = std::env::temp_dir().join(format!("bgs-gen-loop-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("stub.h"), STUB_PRELUDE).unwrap();
    std::fs::write(tmp.join("gen_loop.cu"), GEN_LOOP_DEVICE_SOURCE).unwrap();
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
            "-Wextra",
            "-Werror",
        ])
        .arg("-include")
        .arg(tmp.join("stub.h"))
        .arg("-I")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include"))
        .arg(tmp.join("gen_loop.cu"))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(
        out.status.success(),
        "clang -x cuda rejected bgs_gen_loop.h as device code:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const STUB_PRELUDE: &str = r#"
/* Stand-ins for what the CUDA headers / NVRTC provide; enough for -fsyntax-only. */
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __forceinline__ __attribute__((always_inline)) inline
struct bgs_stub_dim3 { unsigned x, y, z; };
extern __device__ const bgs_stub_dim3 bgs_stub_tid, bgs_stub_bid, bgs_stub_bdim;
#define threadIdx bgs_stub_tid
#define blockIdx bgs_stub_bid
#define blockDim bgs_stub_bdim
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef struct CUstream_st *cudaStream_t;
typedef enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1 } cudaError_t;
#define cudaStreamGraphTailLaunch (cudaStream_t)0x0100000000000000
#define cudaStreamGraphFireAndForget (cudaStream_t)0x0200000000000000
__device__ cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t);
__device__ void __syncthreads();
__device__ void __threadfence();
__device__ void __threadfence_system();
__device__ void __nanosleep(unsigned);
__device__ unsigned atomicCAS_system(unsigned *, unsigned, unsigned);
__device__ unsigned long long atomicCAS_system(unsigned long long *, unsigned long long, unsigned long long);
__device__ unsigned atomicAdd_system(unsigned *, unsigned);
__device__ unsigned long long atomicAdd_system(unsigned long long *, unsigned long long);
__device__ unsigned atomicExch(unsigned *, unsigned);
__device__ unsigned long long atomicMax_system(unsigned long long *, unsigned long long);
__device__ unsigned long long atomicAdd(unsigned long long *, unsigned long long);
__device__ unsigned long long atomicMax(unsigned long long *, unsigned long long);
__device__ void __syncwarp(unsigned = 0xffffffffu);
__device__ unsigned __ballot_sync(unsigned, int);
__device__ int __any_sync(unsigned, int);
template <typename T> __device__ T __shfl_sync(unsigned, T, int);
__device__ int __popcll(unsigned long long);
__device__ int __popc(unsigned);
__device__ int __ffs(int);
__device__ int __clz(int);
__device__ unsigned atomicAdd(unsigned *, unsigned);
"#;

/// `clang -x cuda -fsyntax-only` on the kernel source with `extra` appended (after the
/// headers, so it can use their types) and, with `gpu_header`, that text as `bgs_gpu.h`
/// instead of the committed one (a quoted include finds the source's directory first).
fn clang_check(extra: Option<&str>, gpu_header: Option<&str>) -> Option<std::process::Output> {
    let cc = clang()?;
    let tmp = std::env::temp_dir().join(format!(
        "bgs-kernels-{}-{}-{}",
        std::process::id(),
        extra.is_some(),
        gpu_header.is_some()
    ));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("stub.h"), STUB_PRELUDE).unwrap();
    let mut src = compile::KERNEL_SOURCE.to_string();
    if let Some(d) = extra {
        src = format!("{src}\n{d}\n");
    }
    std::fs::write(tmp.join("k.cu"), src).unwrap();
    if let Some(h) = gpu_header {
        std::fs::write(tmp.join(bgs_executor_gpu::c_header::GPU_HEADER_NAME), h).unwrap();
    }
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include");
    let mask = format!(
        "-DBGS_VALID_STATUS_MASK={:#x}u",
        bgs_executor_gpu::plan::valid_status_mask()
    );
    let out = Command::new(cc)
        .args([
            "-x",
            "cuda",
            "--cuda-gpu-arch=sm_90",
            "--cuda-device-only",
            "-nocudainc",
            "-nocudalib",
        ])
        .args([
            "-fsyntax-only",
            "-std=c++17",
            "-Wall",
            "-Werror",
            "-Wno-unused-function",
        ])
        .arg(&mask)
        .arg("-include")
        .arg(tmp.join("stub.h"))
        .arg("-I")
        .arg(&include)
        .arg(tmp.join("k.cu"))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&tmp);
    Some(out)
}

#[test]
fn kernels_pass_clang_cuda_syntax_check_with_layout_asserts() {
    let Some(out) = clang_check(None, None) else {
        missing("clang-19 not found; CUDA syntax check skipped");
        return;
    };
    assert!(
        out.status.success(),
        "clang -x cuda failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn clang_check_catches_errors() {
    // The check is real: a layout assertion that does not hold fails it, and the diagnostic is
    // that assertion (not some other error, e.g. a type used before its header).
    let Some(out) = clang_check(
        Some("static_assert(sizeof(struct bgs_request_slot) == 1, \"bgs-drift-check\");"),
        None,
    ) else {
        missing("clang-19 not found; CUDA syntax check skipped");
        return;
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "clang accepted a false static_assert"
    );
    assert!(
        err.contains("static assertion failed") && err.contains("bgs-drift-check"),
        "clang failed for another reason than the injected assert:\n{err}"
    );
    assert_eq!(
        err.matches("error:").count(),
        1,
        "only the injected assert fails:\n{err}"
    );
}

#[test]
fn clang_check_evaluates_the_gpu_header_asserts() {
    // A bgs_gpu.h whose struct no longer matches its asserts (a field widened by hand, as a
    // stale or hand-edited header would have it) must fail the kernels' check on those asserts.
    let rendered = bgs_executor_gpu::c_header::render_gpu();
    let field = "    bgs_u32 sole_producer;";
    assert!(rendered.contains(field), "bgs_gpu.h lost {field:?}");
    let drifted = rendered.replacen(field, "    bgs_u64 sole_producer;", 1);
    let Some(out) = clang_check(None, Some(&drifted)) else {
        missing("clang-19 not found; CUDA syntax check skipped");
        return;
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "clang accepted a drifted bgs_gpu.h");
    let errors = err.matches("error:").count();
    assert!(
        errors > 0 && err.matches("static assertion failed").count() == errors,
        "clang failed for another reason than the layout asserts:\n{err}"
    );
    assert!(err.contains("sizeof bgs_gpu_slot"), "{err}");
    assert!(err.contains("bgs_gpu_slot.input"), "{err}");
}
