//! Support for the tests that check GPU code without a GPU (this crate's and bgs-model-gpu's):
//! where the CUDA 13.0 pip wheels put NVRTC, which clang can compile CUDA for a syntax check,
//! and what to do when a tool is missing. Not used by the server.

use std::path::PathBuf;
use std::process::Command;

/// A tool a check needs is missing: a notice for developers, a failure under CI (`CI` set),
/// which installs every tool (scripts/setup.sh, scripts/test.sh): a check that silently stops
/// running is worse than a failing one.
pub fn missing(what: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "{what}; CI installs it (scripts/test.sh), so the check must run there"
    );
    println!("NOTICE: {what}");
}

/// The directory with `libnvrtc.so.13` (and its builtins, nvJitLink, `libcudadevrt.a`):
/// `BGS_CUDA_LIB_DIR`, or the `nvidia.cu13` wheels' `lib` seen by `python3`.
pub fn wheel_lib_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("BGS_CUDA_LIB_DIR") {
        return Some(PathBuf::from(d));
    }
    let out = Command::new("python3")
        .args(["-c", "import nvidia.cu13 as m; print(list(m.__path__)[0])"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let d = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("lib");
    d.join("libnvrtc.so.13").is_file().then_some(d)
}

/// A clang that runs (`clang-19` first, as CI installs it).
pub fn clang() -> Option<&'static str> {
    ["clang-19", "clang"].into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}
