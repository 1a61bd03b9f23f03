//! `include/bgs_llm_step.h`, generated from the Rust definitions: the GPU model's step-input
//! buffer layout ([`StepGeometry`]'s word offsets, [`pack_step`](crate::host::pack_step)'s
//! padding values, the token-count buckets) for C code that writes that buffer itself — the
//! portable step loop (`include/bgs_gen_loop.h`, `bgs_gl_pack`), and later the GPU-resident
//! dispatcher.
//!
//! Every offset of [`StepGeometry`] is a linear function of its sizes (`max_tokens`,
//! `max_samples`, `max_seqs`, `max_blocks_per_seq`). The generator measures each one's
//! coefficients by evaluating the Rust function at unit geometries, checks linearity at other
//! geometries, and renders the formula as a C function: no number is typed twice.
//!
//! The committed file is kept equal to [`render_llm_step`] by `tests/c_header.rs`
//! (`BGS_BLESS=1 cargo test -p bgs-model-gpu --test c_header` rewrites it).

use core::fmt::Write as _;
use core::mem::size_of;

use bgs_ring::c_field as field;
use bgs_ring::c_header::{CType, StructDesc, banner_with, define, emit_struct};

use crate::host::{BUCKETS, PAD_POS, PAD_ROW, PAD_SEQ, PAD_SLOT, PAD_TOKEN, StepGeometry};

/// File name of the header inside `include/`.
pub const LLM_STEP_HEADER_NAME: &str = "bgs_llm_step.h";

/// [`StepGeometry`] as C sees it (`struct bgs_llm_step_geometry`, 32-bit words). Defined
/// next to the C step loop that reads it (`bgs_llm::gen_loop`), rendered here.
pub use bgs_llm::gen_loop::CStepGeometry;

/// The C view of `g`; the message names a size that does not fit 32 bits.
pub fn c_geometry(g: &StepGeometry) -> Result<CStepGeometry, String> {
    let w = |name: &str, v: usize| {
        u32::try_from(v).map_err(|_| format!("step geometry: {name} {v} does not fit u32"))
    };
    Ok(CStepGeometry {
        max_tokens: w("max_tokens", g.max_tokens)?,
        max_samples: w("max_samples", g.max_samples)?,
        max_seqs: w("max_seqs", g.max_seqs)?,
        max_blocks_per_seq: w("max_blocks_per_seq", g.max_blocks_per_seq)?,
        block_size: w("block_size", g.block_size)?,
        num_blocks: w("num_blocks", g.num_blocks)?,
    })
}

fn geometry_struct() -> StructDesc {
    use CType::U32;
    type G = CStepGeometry;
    StructDesc {
        tag: "bgs_llm_step_geometry",
        comment: "The step's sizes (bgs_model_gpu::StepGeometry): the buffer holds \
                  bgs_llm_step_words() 32-bit words.",
        size: size_of::<G>(),
        fields: vec![
            field!(G, max_tokens, U32, "token capacity (a bucket)"),
            field!(G, max_samples, U32, "sampled rows capacity (a bucket)"),
            field!(G, max_seqs, U32, "items per step"),
            field!(G, max_blocks_per_seq, U32, "block-table entries per item"),
            field!(G, block_size, U32, "positions per KV block"),
            field!(G, num_blocks, U32, "blocks in the KV pool"),
        ],
    }
}

/// The terms an offset may depend on, in [`Linear::coef`] order: the four sizes and the
/// block tables' total (`max_seqs * max_blocks_per_seq`).
const TERMS: [&str; 5] = [
    "g->max_tokens",
    "g->max_samples",
    "g->max_seqs",
    "g->max_blocks_per_seq",
    "g->max_seqs * g->max_blocks_per_seq",
];

fn geo(sizes: [usize; 4]) -> StepGeometry {
    StepGeometry {
        max_tokens: sizes[0],
        max_samples: sizes[1],
        max_seqs: sizes[2],
        max_blocks_per_seq: sizes[3],
        block_size: 16,
        num_blocks: 1024,
    }
}

/// `constant + Σ coef[i] × TERMS[i]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear {
    /// The offset at all sizes 0.
    pub constant: usize,
    /// Words per unit of each term.
    pub coef: [usize; 5],
}

impl Linear {
    /// Value at `g`.
    pub fn eval(&self, g: &StepGeometry) -> usize {
        let t = [
            g.max_tokens,
            g.max_samples,
            g.max_seqs,
            g.max_blocks_per_seq,
            g.max_seqs * g.max_blocks_per_seq,
        ];
        self.constant + (0..5).map(|i| self.coef[i] * t[i]).sum::<usize>()
    }

    /// Measure `f`'s coefficients and check the form at other geometries (panics, naming
    /// `what`, when a layout change made it otherwise: the generator then needs a new term).
    pub fn measure(what: &str, f: fn(&StepGeometry) -> usize) -> Linear {
        let at = |s: [usize; 4]| f(&geo(s)) as i128;
        let constant = at([0; 4]);
        let mut coef = [0i128; 5];
        for (i, c) in coef.iter_mut().take(4).enumerate() {
            let mut s = [0; 4];
            s[i] = 1;
            *c = at(s) - constant;
        }
        coef[4] = at([0, 0, 1, 1]) - constant - coef[2] - coef[3];
        assert!(
            constant >= 0 && coef.iter().all(|&c| c >= 0),
            "{what}: a negative coefficient"
        );
        let l = Linear {
            constant: constant as usize,
            coef: coef.map(|c| c as usize),
        };
        for s in [
            [512, 256, 256, 512],
            [1, 1, 1, 1],
            [32, 4, 3, 64],
            [8, 8, 5, 7],
        ] {
            let g = geo(s);
            assert_eq!(l.eval(&g), f(&g), "{what}: not of the generated form");
        }
        l
    }

    /// The C expression (over `g`, a `const struct bgs_llm_step_geometry *`).
    pub fn c_expr(&self) -> String {
        let mut terms: Vec<String> = (0..5)
            .filter(|&i| self.coef[i] != 0)
            .map(|i| format!("{}u * {}", self.coef[i], TERMS[i]))
            .collect();
        if self.constant != 0 || terms.is_empty() {
            terms.push(format!("{}u", self.constant));
        }
        terms.join(" + ")
    }
}

/// The offsets of the buffer, by C function name suffix, with their comments.
pub fn offsets() -> Vec<(&'static str, Linear, &'static str)> {
    vec![
        (
            "tok",
            Linear::measure("tok", |_| StepGeometry::TOK),
            "token ids (max_tokens words)",
        ),
        (
            "pos",
            Linear::measure("pos", StepGeometry::pos),
            "positions (max_tokens words)",
        ),
        (
            "seq",
            Linear::measure("seq", StepGeometry::seq),
            "item index of each token (max_tokens words)",
        ),
        (
            "slot",
            Linear::measure("slot", StepGeometry::slot),
            "KV slot of each token: block * block_size + offset (max_tokens words)",
        ),
        (
            "rows",
            Linear::measure("rows", StepGeometry::rows),
            "token row of each sampled item (max_samples words)",
        ),
        (
            "bt_off",
            Linear::measure("bt_off", StepGeometry::bt_off),
            "each item's offset into the packed block tables (max_seqs words)",
        ),
        (
            "bt",
            Linear::measure("bt", StepGeometry::bt),
            "packed block tables (max_seqs * max_blocks_per_seq words)",
        ),
        (
            "words",
            Linear::measure("words", StepGeometry::words),
            "words of the whole buffer",
        ),
    ]
}

/// The text of `include/bgs_llm_step.h`.
pub fn render_llm_step() -> String {
    let mut out = String::new();
    banner_with(
        &mut out,
        LLM_STEP_HEADER_NAME,
        "the GPU model's step-input buffer layout",
        "bgs_model_gpu::c_header",
        "BGS_BLESS=1 cargo test -p bgs-model-gpu --test c_header",
        "Usable from C11, C++ (CUDA, NVRTC). See docs/gpu-model.md and docs/generation.md.",
    );
    out.push_str(
        "/* Signed 32-bit words: the buffer's element type (a KV slot of -1 writes nothing). */\n\
         #ifndef BGS_I32_DEFINED\n\
         #define BGS_I32_DEFINED\n\
         typedef int bgs_i32;\n\
         BGS_STATIC_ASSERT(sizeof(bgs_i32) == 4, \"bgs_i32\");\n\
         #endif\n\n",
    );
    out.push_str(
        "/* __CUDACC__: NVRTC and nvcc; __CUDA__: clang -x cuda without the CUDA headers. */\n\
         #if defined(__CUDACC__) || defined(__CUDA__)\n\
         #define BGS_LLM_STEP_FN static __device__ __forceinline__\n\
         #else\n\
         #define BGS_LLM_STEP_FN static inline\n\
         #endif\n\n",
    );
    out.push_str("/* Padding tokens (up to the bucket) and padding sampled rows. */\n");
    for (name, v, c) in [
        ("BGS_LLM_STEP_PAD_TOKEN", PAD_TOKEN, "token id"),
        ("BGS_LLM_STEP_PAD_POS", PAD_POS, "position"),
        ("BGS_LLM_STEP_PAD_SEQ", PAD_SEQ, "item index"),
        ("BGS_LLM_STEP_PAD_SLOT", PAD_SLOT, "KV slot: none"),
        ("BGS_LLM_STEP_PAD_ROW", PAD_ROW, "sampled row"),
    ] {
        define(&mut out, name, format!("({v})"), c);
    }
    out.push('\n');
    out.push_str("/* Token-count buckets: one captured step graph each (also the LM head's). */\n");
    define(
        &mut out,
        "BGS_LLM_STEP_N_BUCKETS",
        format!("{}u", BUCKETS.len()),
        "",
    );
    define(
        &mut out,
        "BGS_LLM_STEP_MAX_BUCKET",
        format!("{}u", BUCKETS[BUCKETS.len() - 1]),
        "",
    );
    out.push_str("/* Bucket i (i < BGS_LLM_STEP_N_BUCKETS), ascending; 0 past the end. */\n");
    out.push_str("BGS_LLM_STEP_FN bgs_u32 bgs_llm_step_bucket(bgs_u32 i) {\n");
    for (i, b) in BUCKETS.iter().enumerate() {
        let _ = writeln!(out, "    if (i == {i}u) return {b}u;");
    }
    out.push_str("    return 0u;\n}\n\n");
    emit_struct(&mut out, &geometry_struct());
    out.push_str("/* Word offsets of the buffer's regions (StepGeometry's methods). */\n");
    for (name, l, comment) in offsets() {
        let _ = writeln!(out, "/* {comment} */");
        let _ = writeln!(
            out,
            "BGS_LLM_STEP_FN bgs_u32 bgs_llm_step_{name}(const struct bgs_llm_step_geometry *g) {{"
        );
        if l.coef.iter().all(|&c| c == 0) {
            // The offset is a constant: `g` is unused.
            out.push_str("    (void)g;\n");
        }
        let _ = writeln!(out, "    return {};\n}}", l.c_expr());
    }
    out.push_str("\n#endif /* BGS_LLM_STEP_H */\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_match_the_rust_geometry() {
        let g = geo([32, 4, 3, 64]);
        let by: std::collections::HashMap<_, _> =
            offsets().into_iter().map(|(n, l, _)| (n, l)).collect();
        assert_eq!(by["tok"].eval(&g), StepGeometry::TOK);
        assert_eq!(by["pos"].eval(&g), g.pos());
        assert_eq!(by["rows"].eval(&g), g.rows());
        assert_eq!(by["bt"].eval(&g), g.bt());
        assert_eq!(by["words"].eval(&g), g.words());
        assert_eq!(
            by["words"].c_expr(),
            "4u * g->max_tokens + 1u * g->max_samples + 1u * g->max_seqs + \
             1u * g->max_seqs * g->max_blocks_per_seq"
        );
        assert_eq!(by["tok"].c_expr(), "0u");
    }

    #[test]
    fn a_nonlinear_offset_is_refused() {
        let r =
            std::panic::catch_unwind(|| Linear::measure("square", |g| g.max_tokens * g.max_tokens));
        assert!(r.is_err());
    }

    #[test]
    fn geometry_converts_and_names_overflow() {
        let g = geo([32, 4, 3, 64]);
        let c = c_geometry(&g).unwrap();
        assert_eq!((c.max_tokens, c.max_samples, c.max_seqs), (32, 4, 3));
        let mut big = g;
        big.num_blocks = usize::MAX;
        let e = c_geometry(&big).unwrap_err();
        assert!(e.contains("num_blocks"), "{e}");
    }
}
