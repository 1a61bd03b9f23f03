//! Finding and loading the CUDA libraries at run time.
//!
//! Search order for each library: `GpuExecutorConfig::cuda_home`, then `$CUDA_HOME`, then
//! `/usr/local/cuda` (each as `DIR`, `DIR/lib64`, `DIR/lib`, `DIR/targets/x86_64-linux/lib`),
//! then the dynamic loader's own path (`LD_LIBRARY_PATH`, the ld.so cache). A library found in
//! a directory is opened by its full path first, so that cudarc's later `dlopen` by soname
//! finds the already-loaded copy. The driver (`libcuda.so.1`) always comes from the loader.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::GpuError;

/// One CUDA library the executor needs.
#[derive(Debug, Clone, Copy)]
pub struct LibSpec {
    /// What to call it in messages.
    pub what: &'static str,
    /// File names to try, most specific first.
    pub names: &'static [&'static str],
}

pub const CUBLASLT: LibSpec = LibSpec {
    what: "cuBLASLt (libcublasLt.so.13)",
    names: &["libcublasLt.so.13", "libcublasLt.so"],
};
pub const CUBLAS: LibSpec = LibSpec {
    what: "cuBLAS (libcublas.so.13)",
    names: &["libcublas.so.13", "libcublas.so"],
};
pub const CUFFT: LibSpec = LibSpec {
    what: "cuFFT (libcufft.so.12)",
    names: &["libcufft.so.12", "libcufft.so"],
};
pub const NVRTC: LibSpec = LibSpec {
    what: "NVRTC (libnvrtc.so.13)",
    names: &["libnvrtc.so.13", "libnvrtc.so"],
};
pub const NVRTC_BUILTINS: LibSpec = LibSpec {
    what: "NVRTC builtins (libnvrtc-builtins.so.13.0)",
    names: &["libnvrtc-builtins.so.13.0", "libnvrtc-builtins.so"],
};
pub const NVJITLINK: LibSpec = LibSpec {
    what: "nvJitLink (libnvJitLink.so.13)",
    names: &["libnvJitLink.so.13", "libnvJitLink.so"],
};

/// Directories to search, in order (existing or not).
pub fn search_dirs(cuda_home: Option<&Path>, env_cuda_home: Option<&str>) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(h) = cuda_home {
        roots.push(h.to_path_buf());
    }
    if let Some(h) = env_cuda_home.filter(|h| !h.is_empty()) {
        roots.push(PathBuf::from(h));
    }
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut dirs = Vec::new();
    for r in roots {
        for sub in ["", "lib64", "lib", "targets/x86_64-linux/lib"] {
            let d = if sub.is_empty() {
                r.clone()
            } else {
                r.join(sub)
            };
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
    }
    dirs
}

/// The first `dir/name` that exists.
pub fn find_in(dirs: &[PathBuf], names: &[&str]) -> Option<PathBuf> {
    dirs.iter()
        .flat_map(|d| names.iter().map(move |n| d.join(n)))
        .find(|p| p.is_file())
}

/// Libraries opened by this process; kept open for its lifetime.
fn keep() -> &'static std::sync::Mutex<Vec<libloading::Library>> {
    static KEEP: OnceLock<std::sync::Mutex<Vec<libloading::Library>>> = OnceLock::new();
    KEEP.get_or_init(Default::default)
}

/// Open `spec` from `dirs` by full path, else through the loader's path. Returns where it came
/// from (a path or the soname).
pub fn load(spec: &LibSpec, dirs: &[PathBuf]) -> Result<String, GpuError> {
    let mut tried = Vec::new();
    let candidates: Vec<String> = find_in(dirs, spec.names)
        .map(|p| p.display().to_string())
        .into_iter()
        .chain(spec.names.iter().map(|s| s.to_string()))
        .collect();
    for c in candidates {
        // SAFETY: loading a CUDA library runs its initializers, which only set up the
        // library's own state; it is kept loaded for the life of the process.
        match unsafe { libloading::Library::new(&c) } {
            Ok(lib) => {
                keep().lock().unwrap_or_else(|e| e.into_inner()).push(lib);
                return Ok(c);
            }
            Err(e) => tried.push(format!("{c}: {e}")),
        }
    }
    Err(GpuError::MissingLibrary {
        what: spec.what.to_string(),
        detail: format!(
            "searched {} and the loader's path ({})",
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            tried.last().cloned().unwrap_or_default()
        ),
    })
}

/// `libcudadevrt.a` (needed to link device-side graph launch): the search directories, then the
/// directory NVRTC was loaded from.
pub fn find_cudadevrt(dirs: &[PathBuf], nvrtc_from: &str) -> Result<PathBuf, GpuError> {
    let mut all = dirs.to_vec();
    if let Some(d) = Path::new(nvrtc_from)
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
    {
        all.push(d.to_path_buf());
    } else if let Some(d) = loaded_dir("libnvrtc") {
        all.push(d);
    }
    find_in(&all, &["libcudadevrt.a"]).ok_or_else(|| GpuError::MissingLibrary {
        what: "the device runtime library (libcudadevrt.a)".into(),
        detail: format!(
            "searched {}",
            all.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

/// The directory of a loaded shared object whose file name starts with `prefix`.
pub fn loaded_dir(prefix: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(Path::new)
        .find(|p| {
            p.file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(prefix))
        })
        .and_then(|p| p.parent().map(Path::to_path_buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_order_is_config_env_default() {
        let d = search_dirs(Some(Path::new("/opt/c")), Some("/env/cuda"));
        assert_eq!(d[0], PathBuf::from("/opt/c"));
        assert_eq!(d[1], PathBuf::from("/opt/c/lib64"));
        let env = d
            .iter()
            .position(|p| p == Path::new("/env/cuda/lib64"))
            .unwrap();
        let def = d
            .iter()
            .position(|p| p == Path::new("/usr/local/cuda/lib64"))
            .unwrap();
        assert!(env < def);
        // Empty CUDA_HOME is ignored.
        let d = search_dirs(None, Some(""));
        assert_eq!(d[0], PathBuf::from("/usr/local/cuda"));
    }

    #[test]
    fn finds_files_in_order() {
        let tmp = std::env::temp_dir().join(format!("bgs-libs-{}", std::process::id()));
        let (a, b) = (tmp.join("a"), tmp.join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(b.join("libx.so.1"), b"").unwrap();
        std::fs::write(b.join("libx.so"), b"").unwrap();
        std::fs::write(a.join("libx.so"), b"").unwrap();
        let dirs = vec![a.clone(), b.clone()];
        // Directory order wins over name order.
        assert_eq!(
            find_in(&dirs, &["libx.so.1", "libx.so"]),
            Some(a.join("libx.so"))
        );
        assert_eq!(find_in(&dirs, &["nope"]), None);
        std::fs::write(b.join("libcudadevrt.a"), b"").unwrap();
        assert_eq!(
            find_cudadevrt(
                std::slice::from_ref(&a),
                &b.join("libnvrtc.so.13").display().to_string()
            )
            .unwrap(),
            b.join("libcudadevrt.a")
        );
        let e = find_cudadevrt(&[a], "libnvrtc.so.13")
            .unwrap_err()
            .to_string();
        assert!(e.contains("libcudadevrt.a"), "{e}");
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn missing_library_is_named() {
        let spec = LibSpec {
            what: "Nothing (libbgs-nonexistent.so)",
            names: &["libbgs-nonexistent.so"],
        };
        let e = load(&spec, &[PathBuf::from("/nonexistent")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("libbgs-nonexistent.so"), "{e}");
    }
}
