//! The committed `include/bgs_llm_step.h` and `include/bgs_llm_ops.h` must equal what the Rust
//! definitions render, and a C compiler must accept them (their `_Static_assert`s compare the
//! C structs with Rust's).
//!
//! Regenerate after a layout change: `BGS_BLESS=1 cargo test -p bgs-model-gpu --test c_header`.

use std::path::{Path, PathBuf};
use std::process::Command;

use bgs_model_gpu::{c_header, persistent};

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include")
}

/// `include/<name>` equals `rendered` (with `BGS_BLESS` set: is rewritten to it).
fn assert_committed(name: &str, rendered: &str) {
    let path = include_dir().join(name);
    if std::env::var_os("BGS_BLESS").is_some() {
        std::fs::write(&path, rendered).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "include/{name} differs from the header rendered from the Rust definitions; regenerate \
         it with `BGS_BLESS=1 cargo test -p bgs-model-gpu --test c_header` and commit it"
    );
}

/// Compile `probe` (C11, every warning an error) beside the header `name` rendered as `text`,
/// run it and return its output; `None` (a notice) without a C compiler outside CI.
fn compile_and_run(name: &str, text: &str, probe: &str) -> Option<std::process::Output> {
    let dir = std::env::temp_dir().join(format!("bgs-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(name), text).unwrap();
    let src = dir.join("probe.c");
    std::fs::write(&src, probe).unwrap();
    let exe = dir.join("probe");
    let out = match Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            assert!(std::env::var_os("CI").is_none(), "cc not found: {e}");
            println!("NOTICE: no C compiler ({e}); the header check did not run");
            return None;
        }
    };
    assert!(
        out.status.success(),
        "cc rejected the generated {name}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    Some(run)
}

#[test]
fn committed_llm_step_header_is_current() {
    assert_committed(c_header::LLM_STEP_HEADER_NAME, &c_header::render_llm_step());
}

#[test]
fn committed_ops_header_is_current() {
    assert_committed(
        persistent::OPS_HEADER_NAME,
        &persistent::render_ops_header(),
    );
}

/// The rendered header compiles as C11 with every static assert on, and its offset
/// functions give the Rust geometry's offsets (checked by a program that prints them).
#[test]
fn c_compiler_accepts_the_rendered_header_and_agrees_on_offsets() {
    let Some(run) = compile_and_run(
        c_header::LLM_STEP_HEADER_NAME,
        &c_header::render_llm_step(),
        "#include <stdio.h>\n#include \"bgs_llm_step.h\"\n\
         int main(void) {\n\
           struct bgs_llm_step_geometry g = {32u, 4u, 3u, 64u, 4u, 64u};\n\
           printf(\"%u %u %u %u %u %u %u %u %u %d\\n\", bgs_llm_step_tok(&g), bgs_llm_step_pos(&g),\n\
                  bgs_llm_step_seq(&g), bgs_llm_step_slot(&g), bgs_llm_step_rows(&g),\n\
                  bgs_llm_step_bt_off(&g), bgs_llm_step_bt(&g), bgs_llm_step_words(&g),\n\
                  bgs_llm_step_bucket(BGS_LLM_STEP_N_BUCKETS - 1u), BGS_LLM_STEP_PAD_SLOT);\n\
           return 0;\n\
         }\n",
    ) else {
        return;
    };
    let g = bgs_model_gpu::StepGeometry {
        max_tokens: 32,
        max_samples: 4,
        max_seqs: 3,
        max_blocks_per_seq: 64,
        block_size: 4,
        num_blocks: 64,
    };
    let want = format!(
        "{} {} {} {} {} {} {} {} {} {}\n",
        bgs_model_gpu::StepGeometry::TOK,
        g.pos(),
        g.seq(),
        g.slot(),
        g.rows(),
        g.bt_off(),
        g.bt(),
        g.words(),
        bgs_model_gpu::host::BUCKETS[bgs_model_gpu::host::BUCKETS.len() - 1],
        bgs_model_gpu::host::PAD_SLOT
    );
    assert_eq!(String::from_utf8_lossy(&run.stdout), want);
}

/// The ops header compiles as C11 with its static asserts on (struct bgs_op's size and every
/// field offset against the Rust record), and C's size is the record's.
#[test]
fn c_compiler_accepts_the_rendered_ops_header() {
    let Some(run) = compile_and_run(
        persistent::OPS_HEADER_NAME,
        &persistent::render_ops_header(),
        "#include <stdio.h>\n#include \"bgs_llm_ops.h\"\n\
         int main(void) { printf(\"%u %u\\n\", (unsigned)sizeof(struct bgs_op), BGS_OP_NOP); \
         return 0; }\n",
    ) else {
        return;
    };
    assert_eq!(
        String::from_utf8_lossy(&run.stdout),
        format!("{} {}\n", persistent::RECORD_BYTES, persistent::NOP_KERNEL)
    );
}
