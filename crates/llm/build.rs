//! Compile the portable C step policy (include/bgs_step_policy.h) and step loop
//! (include/bgs_gen_loop.h) for the host.

fn main() {
    let manifest = std::path::PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let include = manifest.join("../../include");
    for f in ["csrc/step_policy.c", "csrc/gen_loop.c"] {
        println!("cargo:rerun-if-changed={f}");
    }
    for h in [
        "bgs_step_policy.h",
        "bgs_gen_loop.h",
        "bgs_protocol.h",
        "bgs_ring.h",
        "bgs_llm_step.h",
    ] {
        println!("cargo:rerun-if-changed={}", include.join(h).display());
    }
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
    cc::Build::new()
        .file("csrc/gen_loop.c")
        .include(&include)
        // The loop's own code is C99 like the policy, but it includes the generated headers
        // (bgs_protocol.h, bgs_llm_step.h), whose layout asserts are C11 `_Static_assert`s.
        .flag_if_supported("-std=c11")
        .flag_if_supported("-pedantic")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("bgs_gen_loop");
}
