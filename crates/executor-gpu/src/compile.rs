//! Kernel compilation: NVRTC (`-rdc=true`, for the device's architecture) then nvJitLink against
//! `libcudadevrt.a` (device-side graph launch), with an on-disk cubin cache.

use std::ffi::{CStr, CString, c_char, c_void};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::sys as nvrtc;

use crate::GpuError;

/// The kernels' CUDA C++ source.
pub const KERNEL_SOURCE: &str = include_str!("kernels.cu");
/// The generated ring header (one source of truth for the layout).
pub const RING_HEADER: &str = include_str!("../../../include/bgs_ring.h");
/// The generated protocol header (ops, statuses).
pub const PROTOCOL_HEADER: &str = include_str!("../../../include/bgs_protocol.h");
/// The generated header of the executor's device structs and the io_uring ABI
/// (`crate::c_header`).
pub const GPU_HEADER: &str = include_str!("../../../include/bgs_gpu.h");

/// NVRTC options for compute capability `major.minor`.
pub fn nvrtc_options(major: i32, minor: i32) -> Vec<String> {
    vec![
        format!("-arch=sm_{major}{minor}"),
        "-rdc=true".into(),
        "-std=c++17".into(),
        format!(
            "-DBGS_VALID_STATUS_MASK={:#x}u",
            crate::plan::valid_status_mask()
        ),
    ]
}

/// 64-bit FNV-1a over `parts` (each followed by a 0xff separator), from `seed`; also keys
/// other crates' kernel caches (bgs-model-gpu).
pub fn fnv1a(seed: u64, parts: &[&[u8]]) -> u64 {
    let mut h = seed;
    for p in parts {
        for b in p.iter().chain(&[0xffu8]) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The cache key: a 128-bit hash of source, headers, options, device name and arch, and the
/// driver, NVRTC and nvJitLink versions.
pub fn cache_key(options: &[String], device: &str, arch: &str, versions: &str) -> String {
    let opts = options.join("\u{1}");
    let parts: [&[u8]; 8] = [
        KERNEL_SOURCE.as_bytes(),
        RING_HEADER.as_bytes(),
        PROTOCOL_HEADER.as_bytes(),
        GPU_HEADER.as_bytes(),
        opts.as_bytes(),
        device.as_bytes(),
        arch.as_bytes(),
        versions.as_bytes(),
    ];
    format!(
        "{:016x}{:016x}",
        fnv1a(0xcbf2_9ce4_8422_2325, &parts),
        fnv1a(0x6c62_272e_07bb_0142, &parts)
    )
}

/// The cache directory: the configured one, else `$XDG_CACHE_HOME/bgs`, else `~/.cache/bgs`.
pub fn cache_dir(configured: Option<&Path>) -> Option<PathBuf> {
    if let Some(d) = configured {
        return Some(d.to_path_buf());
    }
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return Some(PathBuf::from(x).join("bgs"));
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("bgs"))
}

fn nvrtc_check(r: nvrtc::nvrtcResult, what: &str) -> Result<(), GpuError> {
    if r == nvrtc::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Compile(format!("{what}: {r:?}")))
    }
}

/// NVRTC version as "major.minor". NVRTC must be loaded.
pub fn nvrtc_version() -> Result<String, GpuError> {
    let (mut a, mut b) = (0, 0);
    nvrtc_check(
        // SAFETY: NVRTC is loaded (the caller checked `is_culib_present`); out-pointers are valid.
        unsafe { nvrtc::nvrtcVersion(&mut a, &mut b) },
        "nvrtcVersion",
    )?;
    Ok(format!("{a}.{b}"))
}

/// Compile the kernel source to a relocatable cubin. NVRTC must be loaded.
pub fn nvrtc_compile(options: &[String]) -> Result<Vec<u8>, GpuError> {
    nvrtc_compile_source(
        "bgs_kernels.cu",
        KERNEL_SOURCE,
        &[
            ("bgs_ring.h", RING_HEADER),
            ("bgs_protocol.h", PROTOCOL_HEADER),
            (crate::c_header::GPU_HEADER_NAME, GPU_HEADER),
        ],
        options,
    )
}

/// Compile `source` (named `name`, with `headers` as (include name, text) pairs) to a
/// relocatable cubin. NVRTC must be loaded.
pub fn nvrtc_compile_source(
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    options: &[String],
) -> Result<Vec<u8>, GpuError> {
    let c = |s: &str| CString::new(s).map_err(|e| GpuError::Compile(e.to_string()));
    let src = c(source)?;
    let name = c(name)?;
    let header_text: Vec<CString> = headers.iter().map(|h| c(h.1)).collect::<Result<_, _>>()?;
    let header_names: Vec<CString> = headers.iter().map(|h| c(h.0)).collect::<Result<_, _>>()?;
    let hp: Vec<*const c_char> = header_text.iter().map(|h| h.as_ptr()).collect();
    let hn: Vec<*const c_char> = header_names.iter().map(|h| h.as_ptr()).collect();
    let opts: Vec<CString> = options
        .iter()
        .map(|o| CString::new(o.as_str()).map_err(|e| GpuError::Compile(e.to_string())))
        .collect::<Result<_, _>>()?;
    let op: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    nvrtc_check(
        // SAFETY: all strings are NUL-terminated and outlive the call; counts match the arrays.
        unsafe {
            nvrtc::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                hp.len() as i32,
                hp.as_ptr(),
                hn.as_ptr(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    // SAFETY: `prog` is a valid program; the option pointers are valid C strings.
    let r = unsafe { nvrtc::nvrtcCompileProgram(prog, op.len() as i32, op.as_ptr()) };
    let log = {
        let mut n = 0usize;
        // SAFETY: `prog` is valid; `n` is a valid out-pointer.
        unsafe { nvrtc::nvrtcGetProgramLogSize(prog, &mut n) };
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` holds the `n` bytes NVRTC reported.
        unsafe { nvrtc::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast()) };
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .trim()
            .to_string()
    };
    let out = if r == nvrtc::nvrtcResult::NVRTC_SUCCESS {
        let mut n = 0usize;
        // SAFETY: compiled program; out-pointer valid.
        nvrtc_check(
            unsafe { nvrtc::nvrtcGetCUBINSize(prog, &mut n) },
            "nvrtcGetCUBINSize",
        )
        .and_then(|()| {
            let mut cubin = vec![0u8; n];
            // SAFETY: `cubin` has the size NVRTC reported.
            nvrtc_check(
                unsafe { nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) },
                "nvrtcGetCUBIN",
            )
            .map(|()| cubin)
        })
    } else {
        Err(GpuError::Compile(format!(
            "NVRTC failed ({r:?}) with {}:\n{log}",
            options.join(" ")
        )))
    };
    // SAFETY: `prog` was created above and is destroyed once.
    unsafe { nvrtc::nvrtcDestroyProgram(&mut prog) };
    out
}

type JlHandle = *mut c_void;
type JlCreate = unsafe extern "C" fn(*mut JlHandle, u32, *const *const c_char) -> i32;
type JlDestroy = unsafe extern "C" fn(*mut JlHandle) -> i32;
type JlAddData = unsafe extern "C" fn(JlHandle, i32, *const c_void, usize, *const c_char) -> i32;
type JlAddFile = unsafe extern "C" fn(JlHandle, i32, *const c_char) -> i32;
type JlComplete = unsafe extern "C" fn(JlHandle) -> i32;
type JlSize = unsafe extern "C" fn(JlHandle, *mut usize) -> i32;
type JlGet = unsafe extern "C" fn(JlHandle, *mut c_char) -> i32;

const NVJITLINK_INPUT_CUBIN: i32 = 1;
const NVJITLINK_INPUT_LIBRARY: i32 = 6;

/// Link a relocatable cubin with `libcudadevrt.a` through nvJitLink (loaded from `lib`).
pub fn nvjitlink(
    lib: &str,
    arch: &str,
    cubin: &[u8],
    cudadevrt: &Path,
) -> Result<Vec<u8>, GpuError> {
    let err = |s: String| GpuError::Compile(format!("nvJitLink: {s}"));
    // SAFETY: nvJitLink's initializers only set up its own state; `libs::load` opened it first.
    let l = unsafe { libloading::Library::new(lib) }.map_err(|e| err(e.to_string()))?;
    // SAFETY: the symbol types match nvJitLink.h (CUDA 13.0) for these exported C functions.
    let (create, destroy, add_data, add_file, complete, size, get, log_size, log) = unsafe {
        (
            *l.get::<JlCreate>(b"nvJitLinkCreate\0")
                .map_err(|e| err(e.to_string()))?,
            *l.get::<JlDestroy>(b"nvJitLinkDestroy\0")
                .map_err(|e| err(e.to_string()))?,
            *l.get::<JlAddData>(b"nvJitLinkAddData\0")
                .map_err(|e| err(e.to_string()))?,
            *l.get::<JlAddFile>(b"nvJitLinkAddFile\0")
                .map_err(|e| err(e.to_string()))?,
            *l.get::<JlComplete>(b"nvJitLinkComplete\0")
                .map_err(|e| err(e.to_string()))?,
            *l.get::<JlSize>(b"nvJitLinkGetLinkedCubinSize\0")
                .map_err(|e| err(e.to_string()))?,
            *l.get::<JlGet>(b"nvJitLinkGetLinkedCubin\0")
                .map_err(|e| err(e.to_string()))?,
            *l.get::<JlSize>(b"nvJitLinkGetErrorLogSize\0")
                .map_err(|e| err(e.to_string()))?,
            *l.get::<JlGet>(b"nvJitLinkGetErrorLog\0")
                .map_err(|e| err(e.to_string()))?,
        )
    };
    let opt = CString::new(format!("-arch={arch}")).map_err(|e| err(e.to_string()))?;
    let opts = [opt.as_ptr()];
    let mut h: JlHandle = std::ptr::null_mut();
    // SAFETY: valid out-pointer and one valid option string.
    let r = unsafe { create(&mut h, 1, opts.as_ptr()) };
    if r != 0 {
        return Err(err(format!("create failed ({r})")));
    }
    let path =
        CString::new(cudadevrt.as_os_str().as_encoded_bytes()).map_err(|e| err(e.to_string()))?;
    let result = (|| {
        // SAFETY: `h` is a live handle; the cubin slice and the name outlive the call.
        let r = unsafe {
            add_data(
                h,
                NVJITLINK_INPUT_CUBIN,
                cubin.as_ptr().cast(),
                cubin.len(),
                c"bgs_kernels.cubin".as_ptr(),
            )
        };
        if r != 0 {
            return Err(r);
        }
        // SAFETY: `h` is live; `path` is a NUL-terminated path.
        let r = unsafe { add_file(h, NVJITLINK_INPUT_LIBRARY, path.as_ptr()) };
        if r != 0 {
            return Err(r);
        }
        // SAFETY: `h` is live.
        let r = unsafe { complete(h) };
        if r != 0 {
            return Err(r);
        }
        let mut n = 0usize;
        // SAFETY: `h` is live and completed; out-pointer valid.
        let r = unsafe { size(h, &mut n) };
        if r != 0 {
            return Err(r);
        }
        let mut out = vec![0u8; n];
        // SAFETY: `out` has the size nvJitLink reported.
        let r = unsafe { get(h, out.as_mut_ptr().cast()) };
        if r != 0 {
            return Err(r);
        }
        Ok(out)
    })();
    let out = result.map_err(|code| {
        let mut n = 0usize;
        // SAFETY: `h` is live; out-pointer valid.
        unsafe { log_size(h, &mut n) };
        let mut buf = vec![0u8; n.max(1)];
        // SAFETY: `buf` has the size nvJitLink reported.
        unsafe { log(h, buf.as_mut_ptr().cast()) };
        let text = CStr::from_bytes_until_nul(&buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        err(format!(
            "linking with {} failed ({code}): {text}",
            cudadevrt.display()
        ))
    });
    // SAFETY: `h` was created above and is destroyed once.
    unsafe { destroy(&mut h) };
    out
}

/// Read a cached cubin.
pub fn cache_read(dir: &Path, key: &str) -> Option<Vec<u8>> {
    std::fs::read(dir.join(format!("{key}.cubin")))
        .ok()
        .filter(|b| !b.is_empty())
}

/// Store a cubin (atomically: write a temporary file, then rename). Failures are only logged.
pub fn cache_write(dir: &Path, key: &str, cubin: &[u8]) {
    let go = || -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(format!("{key}.cubin.{}.tmp", std::process::id()));
        std::fs::write(&tmp, cubin)?;
        std::fs::rename(&tmp, dir.join(format!("{key}.cubin")))
    };
    if let Err(e) = go() {
        tracing::warn!("kernel cache {}: {e}", dir.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_keys_change_with_every_input() {
        let o = nvrtc_options(9, 0);
        let k = cache_key(&o, "NVIDIA H200", "sm_90", "driver 13000");
        assert_eq!(k.len(), 32);
        assert_eq!(k, cache_key(&o, "NVIDIA H200", "sm_90", "driver 13000"));
        assert_ne!(
            k,
            cache_key(&nvrtc_options(8, 0), "NVIDIA H200", "sm_90", "driver 13000")
        );
        assert_ne!(k, cache_key(&o, "NVIDIA H100", "sm_90", "driver 13000"));
        assert_ne!(k, cache_key(&o, "NVIDIA H200", "sm_100", "driver 13000"));
        assert_ne!(k, cache_key(&o, "NVIDIA H200", "sm_90", "driver 13010"));
        // Concatenation ambiguity does not collide.
        assert_ne!(
            cache_key(&["ab".into(), "c".into()], "d", "e", "f"),
            cache_key(&["a".into(), "bc".into()], "d", "e", "f")
        );
    }

    #[test]
    fn options_target_the_device() {
        let o = nvrtc_options(9, 0);
        assert!(o.contains(&"-arch=sm_90".to_string()));
        assert!(o.contains(&"-rdc=true".to_string()));
        assert!(o.iter().any(|x| x.starts_with("-DBGS_VALID_STATUS_MASK=")));
    }

    #[test]
    fn cache_round_trip_and_dir_choice() {
        let d = std::env::temp_dir().join(format!("bgs-cache-{}", std::process::id()));
        assert!(cache_read(&d, "k").is_none());
        cache_write(&d, "k", b"cubin");
        assert_eq!(cache_read(&d, "k").unwrap(), b"cubin");
        std::fs::remove_dir_all(&d).unwrap();
        assert_eq!(cache_dir(Some(Path::new("/x"))), Some(PathBuf::from("/x")));
    }

    #[test]
    fn kernels_include_the_generated_headers() {
        assert!(KERNEL_SOURCE.contains("#include \"bgs_ring.h\""));
        assert!(RING_HEADER.contains("struct bgs_request_slot"));
        assert!(KERNEL_SOURCE.contains("#include \"bgs_gpu.h\""));
        assert!(GPU_HEADER.contains("struct bgs_gpu_slot {"));
        // No hand mirror left: the executor's structs are defined only in the generated header.
        for tag in [
            "bgs_gpu_ctl",
            "bgs_gpu_slot_ctl",
            "bgs_gpu_slot",
            "bgs_gpu_sched",
            "bgs_gpu_tx",
            "bgs_io_uring_sqe",
            "bgs_io_uring_cqe",
        ] {
            assert!(
                !KERNEL_SOURCE.contains(&format!("struct {tag} {{")),
                "kernels.cu defines struct {tag} by hand"
            );
        }
    }
}
