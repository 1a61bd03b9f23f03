//! The committed C headers in `include/` must equal what the Rust definitions render, and a C
//! compiler must accept them (their `_Static_assert`s compare C's layout with Rust's).
//!
//! Regenerate after a layout change: `BGS_BLESS=1 cargo test -p bgs-ring --test c_headers`.

use std::path::{Path, PathBuf};
use std::process::Command;

use bgs_ring::c_header;

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include")
}

fn check_committed(name: &str, rendered: &str) {
    let path = include_dir().join(name);
    if std::env::var_os("BGS_BLESS").is_some() {
        std::fs::create_dir_all(include_dir()).unwrap();
        std::fs::write(&path, rendered).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == rendered,
        "include/{name} differs from the header rendered from the Rust definitions; \
         regenerate it with `BGS_BLESS=1 cargo test -p bgs-ring --test c_headers` and commit it"
    );
}

#[test]
fn committed_ring_header_is_current() {
    check_committed(c_header::RING_HEADER_NAME, &c_header::render_ring());
}

#[test]
fn committed_protocol_header_is_current() {
    check_committed(c_header::PROTOCOL_HEADER_NAME, &c_header::render_protocol());
}

/// A translation unit that includes both headers (in both orders across the two compilers)
/// and touches a few fields, so unused-declaration quirks cannot hide anything.
const PROBE: &str = r#"
#include "bgs_ring.h"
#include "bgs_protocol.h"
#include "bgs_ring.h"

BGS_STATIC_ASSERT(sizeof(struct bgs_request_slot) == BGS_RING_REQUEST_SLOT_SIZE, "req slot");
BGS_STATIC_ASSERT(sizeof(struct bgs_completion_slot) == BGS_RING_COMPLETION_SLOT_SIZE, "comp slot");
BGS_STATIC_ASSERT(BGS_OFFSETOF(struct bgs_request_slot, entry.payload) == BGS_RING_SLOT_HEADER_SIZE, "payload");
BGS_STATIC_ASSERT(sizeof(struct bgs_ring_header) == BGS_RING_HEADER_SIZE, "header");
BGS_STATIC_ASSERT(sizeof(struct bgs_wire_request_header) == BGS_HEADER_LEN, "wire");

bgs_u32 bgs_probe(const struct bgs_request_slot *s, const struct bgs_ring_header *h) {
    return s->entry.payload[BGS_RING_SLOT_WORDS - 1] + (bgs_u32)h->request_capacity + BGS_OP_ECHO +
           bgs_op_check(s->entry.op, s->entry.words, s->entry.param) +
           bgs_op_allowed_flags(s->entry.op) + bgs_op_param_value(s->entry.op, s->entry.param) +
           bgs_op_reply_words(s->entry.op, s->entry.words) + bgs_op_streaming(s->entry.op);
}
"#;

#[test]
fn c_compiler_accepts_headers() {
    // Compile the rendered text, so this checks layouts even before the files are blessed.
    let dir = std::env::temp_dir().join(format!("bgs-ring-c-headers-{}", std::process::id()));
    let inc = dir.join("include");
    std::fs::create_dir_all(&inc).unwrap();
    std::fs::write(
        inc.join(c_header::RING_HEADER_NAME),
        c_header::render_ring(),
    )
    .unwrap();
    std::fs::write(
        inc.join(c_header::PROTOCOL_HEADER_NAME),
        c_header::render_protocol(),
    )
    .unwrap();
    let probe = dir.join("probe.c");
    std::fs::write(&probe, PROBE).unwrap();

    let mut ran = false;
    // C11 as BPF and host C see it, C++ as CUDA sees it.
    for (compiler, std_flag, lang) in [("cc", "-std=c11", "c"), ("c++", "-std=c++17", "c++")] {
        let Some(out) = compile_with_include(compiler, std_flag, lang, &probe, &inc) else {
            continue;
        };
        ran = true;
        assert!(
            out.status.success(),
            "{compiler} rejected the generated headers (C layout != Rust layout?):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if !ran {
        println!("NOTICE: no C compiler found; the C layout check did not run");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn compile_with_include(
    compiler: &str,
    std_flag: &str,
    lang: &str,
    file: &Path,
    inc: &Path,
) -> Option<std::process::Output> {
    let out = Command::new(compiler)
        .args([
            std_flag,
            "-x",
            lang,
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-c",
            "-o",
        ])
        .arg(file.with_extension(format!("{lang}.o")))
        .arg("-I")
        .arg(inc)
        .arg(file)
        .output();
    match out {
        Ok(o) => Some(o),
        Err(e) => {
            // CI installs every compiler (scripts/setup.sh): a missing one fails there.
            assert!(
                std::env::var_os("CI").is_none(),
                "{compiler} cannot run ({e}); CI must run the C layout check with it"
            );
            println!("NOTICE: skipping the {compiler} check: cannot run it ({e})");
            None
        }
    }
}

/// The op functions of the generated header, compiled and run, agree with `bgs_protocol::ops`
/// on a grid of ops, payload sizes and params around every bound of the table.
#[test]
fn generated_op_functions_agree_with_the_op_table() {
    use bgs_protocol::ops;
    const OPS_TRIED: [u16; 8] = [0, 1, 2, 3, 4, 5, 0xfffe, 0xffff];
    const VALUES: [u32; 11] = [0, 1, 2, 63, 64, 65, 256, 257, 4096, 4097, u32::MAX];
    let dir = std::env::temp_dir().join(format!("bgs-ring-op-table-{}", std::process::id()));
    let inc = dir.join("include");
    std::fs::create_dir_all(&inc).unwrap();
    std::fs::write(
        inc.join(c_header::PROTOCOL_HEADER_NAME),
        c_header::render_protocol(),
    )
    .unwrap();
    let list = |v: &[u32]| {
        v.iter()
            .map(|x| format!("{x}u"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let ops_list = OPS_TRIED.map(u32::from);
    let prog = format!(
        r#"#include <stdio.h>
#include "bgs_protocol.h"
static const bgs_u32 ops[] = {{{}}};
static const bgs_u32 vals[] = {{{}}};
int main(void) {{
    for (unsigned o = 0; o < sizeof ops / sizeof ops[0]; o++)
        for (unsigned w = 0; w < sizeof vals / sizeof vals[0]; w++)
            for (unsigned p = 0; p < sizeof vals / sizeof vals[0]; p++) {{
                bgs_u32 op = ops[o], words = vals[w], param = vals[p];
                printf("%u %u %u %u %u %u %u %u\n", op, words, param,
                       bgs_op_check(op, words, param), bgs_op_allowed_flags(op),
                       bgs_op_param_value(op, param), bgs_op_reply_words(op, words),
                       bgs_op_streaming(op));
            }}
    return 0;
}}
"#,
        list(&ops_list),
        list(&VALUES)
    );
    let src = dir.join("ops.c");
    let exe = dir.join("ops");
    std::fs::write(&src, prog).unwrap();
    let built = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg("-I")
        .arg(&inc)
        .arg(&src)
        .output();
    let built = match built {
        Ok(o) => o,
        Err(e) => {
            println!("NOTICE: skipping the op-table check: cannot run cc ({e})");
            return;
        }
    };
    assert!(
        built.status.success(),
        "cc rejected the op functions:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = Command::new(&exe).output().expect("run the op-table probe");
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    for op in OPS_TRIED {
        let spec = ops::spec_of(op);
        for words in VALUES {
            for param in VALUES {
                let check = match ops::check_request(op, words, param, 0) {
                    Ok(_) => 0,
                    Err(s) => s as u32,
                };
                let want = format!(
                    "{op} {words} {param} {check} {} {} {} {}",
                    ops::allowed_flags(op),
                    spec.map_or(param, |s| s.param_value(param)),
                    spec.map_or(0, |s| s.reply.final_words(words)),
                    u32::from(spec.is_some_and(|s| s.reply.streaming())),
                );
                assert_eq!(lines.next(), Some(want.as_str()));
            }
        }
    }
    assert_eq!(lines.next(), None);
    let _ = std::fs::remove_dir_all(&dir);
}
