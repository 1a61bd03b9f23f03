//! The committed `include/bgs_gpu.h` must equal what the Rust definitions render, and a C++
//! compiler must accept it (its `_Static_assert`s compare C's layout with Rust's).
//!
//! Regenerate after a layout change: `BGS_BLESS=1 cargo test -p bgs-executor-gpu --test c_header`.
//! The CUDA-mode check (clang, with the kernels) is in `tests/kernels.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;

use bgs_executor_gpu::c_header;

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include")
}

#[test]
fn committed_gpu_header_is_current() {
    let path = include_dir().join(c_header::GPU_HEADER_NAME);
    let rendered = c_header::render_gpu();
    if std::env::var_os("BGS_BLESS").is_some() {
        std::fs::write(&path, &rendered).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "include/{} differs from the header rendered from the Rust definitions; regenerate it \
         with `BGS_BLESS=1 cargo test -p bgs-executor-gpu --test c_header` and commit it",
        c_header::GPU_HEADER_NAME
    );
}

/// Host C++ sees the structs (the device function is CUDA-only): the rendered text, with the
/// committed ring header, must compile with every static assert on.
#[test]
fn cxx_compiler_accepts_the_rendered_header() {
    let dir = std::env::temp_dir().join(format!("bgs-gpu-c-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(c_header::GPU_HEADER_NAME), c_header::render_gpu()).unwrap();
    let probe = dir.join("probe.cc");
    std::fs::write(
        &probe,
        "#include \"bgs_gpu.h\"\n\
         BGS_STATIC_ASSERT(sizeof(struct bgs_gpu_slot_ctl) > BGS_RING_ENTRY_OFFSET, \"use\");\n",
    )
    .unwrap();
    let out = match Command::new("c++")
        .args([
            "-std=c++17",
            "-x",
            "c++",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
        ])
        .args(["-fsyntax-only", "-I"])
        .arg(&dir)
        .arg("-I")
        .arg(include_dir())
        .arg(&probe)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "c++ not found: {e}");
            println!("NOTICE: no C++ compiler ({e}); the host layout check did not run");
            return;
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "c++ rejected the generated GPU header (C layout != Rust layout?):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
