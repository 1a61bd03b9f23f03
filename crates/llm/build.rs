//! Compile the portable C step policy (include/bgs_step_policy.h) for the host.

fn main() {
    let manifest = std::path::PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let include = manifest.join("../../include");
    println!("cargo:rerun-if-changed=csrc/step_policy.c");
    println!(
        "cargo:rerun-if-changed={}",
        include.join("bgs_step_policy.h").display()
    );
    cc::Build::new()
        .file("csrc/step_policy.c")
        .include(&include)
        // The header promises portable C99: build it as such, with warnings as errors, so a
        // construct NVRTC or a strict compiler would reject fails here first.
        .flag_if_supported("-std=c99")
        .flag_if_supported("-pedantic")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("bgs_step_policy");
}
