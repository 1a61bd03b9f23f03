//! Compiles `src/bpf/*.bpf.c` with clang-19 and generates libbpf-rs skeletons into `OUT_DIR`.

use std::path::{Path, PathBuf};
use std::process::Command;

use libbpf_cargo::SkeletonBuilder;

const INSTALL_HINT: &str = "apt-get install clang-19 llvm-19 libelf-dev zlib1g-dev pkg-config make";

fn main() {
    let clang = std::env::var("BGS_BPF_CLANG").unwrap_or_else(|_| "clang-19".to_string());
    match Command::new(&clang).arg("--version").output() {
        Ok(out) if out.status.success() => {}
        _ => panic!(
            "\n\nbgs-bpf: `{clang}` was not found (or does not run). The eBPF programs of the kernel \
             transport are compiled with clang 19. Install it with:\n\n    {INSTALL_HINT}\n\n\
             (set BGS_BPF_CLANG to use another clang >= 19)\n"
        ),
    }
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let include = manifest.join("../../include");
    // `<linux/bpf.h>` and friends come from the system's kernel UAPI headers (linux-libc-dev,
    // always present where a C toolchain is); `<asm/types.h>` lives in the multiarch directory,
    // which `-target bpf` does not search by itself. `<bpf/bpf_helpers.h>` comes from the libbpf
    // vendored by libbpf-sys (libbpf-cargo adds that include path).
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_else(|_| "x86_64".into());
    let multiarch = format!("/usr/include/{arch}-linux-gnu");
    let src_dir = manifest.join("src/bpf");
    println!("cargo:rerun-if-env-changed=BGS_BPF_CLANG");
    println!(
        "cargo:rerun-if-changed={}",
        include.join("bgs_ring.h").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        include.join("bgs_protocol.h").display()
    );
    println!("cargo:rerun-if-changed={}", src_dir.display());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&src_dir)
        .expect("read src/bpf")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".bpf.c"))
        .collect();
    sources.sort();
    for src in sources {
        println!("cargo:rerun-if-changed={}", src.display());
        let stem = stem(&src);
        let skel = out.join(format!("{stem}.skel.rs"));
        let obj = out.join(format!("{stem}.bpf.o"));
        SkeletonBuilder::new()
            .source(&src)
            .obj(&obj)
            .clang(&clang)
            .clang_args([
                "-mcpu=v3".to_string(),
                "-Wall".to_string(),
                "-Werror".to_string(),
                format!("-I{}", include.display()),
                format!("-I{}", src_dir.display()),
                format!("-I{multiarch}"),
            ])
            .build_and_generate(&skel)
            .unwrap_or_else(|e| {
                panic!(
                    "bgs-bpf: compiling {} failed: {e:#}\n(needs: {INSTALL_HINT})",
                    src.display()
                )
            });
    }
}

fn stem(p: &Path) -> String {
    let name = p.file_name().unwrap().to_string_lossy();
    name.trim_end_matches(".bpf.c").to_string()
}
