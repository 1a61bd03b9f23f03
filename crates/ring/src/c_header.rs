//! C headers generated from the Rust definitions: the one source of truth for BPF and CUDA C.
//!
//! [`render_ring`] produces `include/bgs_ring.h` (region layout) and [`render_protocol`]
//! produces `include/bgs_protocol.h` (wire-protocol constants and header layouts). Struct
//! fields, offsets and sizes come from `offset_of!`/`size_of` on the Rust types, and every
//! field gets a `_Static_assert` on its offset, so a C compiler rejects the header if its
//! layout ever differs from Rust's. The rendering itself checks that the field tables cover
//! every byte of each Rust struct, so a field added in Rust but not here fails loudly.
//!
//! The committed files are kept equal to the rendered text by `tests/c_headers.rs`
//! (`BGS_BLESS=1 cargo test -p bgs-ring --test c_headers` rewrites them).

use core::fmt::Write as _;
use core::mem::{offset_of, size_of};

use bgs_protocol::ops::{self, OPS, OpSpec, Reply};
use bgs_protocol::wire::{self, Op, ReplyHeader, RequestHeader, Status};

use crate::layout::{
    CACHE_LINE, COMPLETION_SLOT_SIZE, CompletionEntry, DEFAULT_COMPLETION_SLOTS,
    DEFAULT_REQUEST_SLOTS, HEADER_SIZE, LAYOUT_VERSION, MAX_STREAMS, PAGE_SIZE, REGION_MAGIC,
    REQUEST_SLOT_SIZE, RegionHeader, RequestEntry, SLOT_HEADER_SIZE, SLOT_WORDS, Slot,
};

/// File name of the ring header inside `include/`.
pub const RING_HEADER_NAME: &str = "bgs_ring.h";
/// File name of the protocol header inside `include/`.
pub const PROTOCOL_HEADER_NAME: &str = "bgs_protocol.h";

/// The C type of a field in a generated struct.
#[derive(Clone, Copy, Debug)]
pub enum CType {
    U8,
    U16,
    U32,
    U64,
    /// A nested struct, by its C tag and size.
    Struct(&'static str, usize),
    /// A plain C type spelled as given (`float`, `int`), by name and size.
    Plain(&'static str, usize),
}

impl CType {
    /// The C spelling of the type.
    pub fn name(self) -> String {
        match self {
            CType::U8 => "bgs_u8".into(),
            CType::U16 => "bgs_u16".into(),
            CType::U32 => "bgs_u32".into(),
            CType::U64 => "bgs_u64".into(),
            CType::Struct(tag, _) => format!("struct {tag}"),
            CType::Plain(name, _) => name.into(),
        }
    }

    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            CType::U8 => 1,
            CType::U16 => 2,
            CType::U32 => 4,
            CType::U64 => 8,
            CType::Struct(_, size) | CType::Plain(_, size) => size,
        }
    }
}

/// One field of a generated struct (build it with [`c_field!`](crate::c_field)).
#[derive(Debug)]
pub struct Field {
    /// C (and Rust) field name.
    pub name: &'static str,
    /// Element type.
    pub ty: CType,
    /// Array dimensions, outermost first; empty for a scalar.
    pub dims: Vec<usize>,
    /// Byte offset in the Rust struct.
    pub offset: usize,
    /// `size_of` the Rust field, to check the C type against.
    pub rust_size: usize,
    /// Comment after the declaration; may be empty.
    pub comment: &'static str,
}

impl Field {
    /// Bytes the C declaration takes.
    pub fn c_size(&self) -> usize {
        self.ty.size() * self.dims.iter().product::<usize>()
    }
}

/// A struct to render into a header: emitted with a `_Static_assert` on its size and on
/// every field offset, after [`check_covers`] compared the table with the Rust layout.
#[derive(Debug)]
pub struct StructDesc {
    /// C struct tag.
    pub tag: &'static str,
    /// Comment above the struct.
    pub comment: &'static str,
    /// `size_of` the Rust struct.
    pub size: usize,
    /// Every field, in offset order, covering every byte.
    pub fields: Vec<Field>,
}

/// `size_of` a field's type, given a projection closure (avoids naming the type twice).
#[doc(hidden)]
pub fn field_size<T, F>(_: fn(&T) -> &F) -> usize {
    size_of::<F>()
}

/// A [`Field`] of Rust struct `$t` named `$f` (the C name), its offset and size taken from
/// Rust: `c_field!(T, f, CType::U32, "comment")`, an array `c_field!(T, f, CType::U8; 8, "")`,
/// a multi-dimensional array `c_field!(T, f, CType::U64; [2, 9], "")`.
#[macro_export]
macro_rules! c_field {
    ($t:ty, $f:ident, $ct:expr, $comment:expr) => {
        $crate::c_header::Field {
            name: stringify!($f),
            ty: $ct,
            dims: ::std::vec::Vec::new(),
            offset: ::core::mem::offset_of!($t, $f),
            rust_size: $crate::c_header::field_size(|s: &$t| &s.$f),
            comment: $comment,
        }
    };
    ($t:ty, $f:ident, $ct:expr; [$($n:expr),+], $comment:expr) => {
        $crate::c_header::Field {
            name: stringify!($f),
            ty: $ct,
            dims: ::std::vec![$($n),+],
            offset: ::core::mem::offset_of!($t, $f),
            rust_size: $crate::c_header::field_size(|s: &$t| &s.$f),
            comment: $comment,
        }
    };
    ($t:ty, $f:ident, $ct:expr; $n:expr, $comment:expr) => {
        $crate::c_header::Field {
            name: stringify!($f),
            ty: $ct,
            dims: ::std::vec![$n],
            offset: ::core::mem::offset_of!($t, $f),
            rust_size: $crate::c_header::field_size(|s: &$t| &s.$f),
            comment: $comment,
        }
    };
}
use crate::c_field as field;

const REQUEST_ENTRY_TAG: &str = "bgs_request_entry";
const COMPLETION_ENTRY_TAG: &str = "bgs_completion_entry";

/// The structs of `include/bgs_ring.h`, in the order they are emitted.
pub fn ring_structs() -> Vec<StructDesc> {
    use CType::{U8, U16, U32, U64};
    type H = RegionHeader;
    type R = RequestEntry;
    type C = CompletionEntry;
    type RS = Slot<RequestEntry>;
    type CS = Slot<CompletionEntry>;
    type TH = crate::tx::TxHeader;
    type TE = crate::tx::TxEntry;
    let line = CACHE_LINE - 8;
    let sleep_pad = CACHE_LINE - 8;
    vec![
        StructDesc {
            tag: "bgs_ring_header",
            comment: "Region header at offset 0. Counters, waiters and doorbells are accessed \
                      atomically only.",
            size: size_of::<H>(),
            fields: vec![
                field!(
                    H,
                    magic,
                    U64,
                    "BGS_RING_MAGIC, stored last (release) by the initializer"
                ),
                field!(H, version, U32, "BGS_RING_LAYOUT_VERSION"),
                field!(H, request_capacity, U32, "request slots, a power of two"),
                field!(
                    H,
                    completion_capacity,
                    U32,
                    "completion slots, a power of two"
                ),
                field!(H, slot_words, U32, "BGS_RING_SLOT_WORDS"),
                field!(H, request_slot_size, U32, "BGS_RING_REQUEST_SLOT_SIZE"),
                field!(
                    H,
                    completion_slot_size,
                    U32,
                    "BGS_RING_COMPLETION_SLOT_SIZE"
                ),
                field!(
                    H,
                    request_slots_offset,
                    U64,
                    "byte offset of request slot 0"
                ),
                field!(
                    H,
                    completion_slots_offset,
                    U64,
                    "byte offset of completion slot 0"
                ),
                field!(H, total_size, U64, "bytes of the region, page multiple"),
                field!(H, reserved0, U8; 8, ""),
                field!(H, request_tail, U64, "next request position to claim (CAS)"),
                field!(H, pad_request_tail, U8; line, ""),
                field!(
                    H,
                    request_head,
                    U64,
                    "next request position to consume (CAS)"
                ),
                field!(H, pad_request_head, U8; line, ""),
                field!(
                    H,
                    completion_tail,
                    U64,
                    "next completion position to claim (CAS)"
                ),
                field!(H, pad_completion_tail, U8; line, ""),
                field!(
                    H,
                    completion_head,
                    U64,
                    "next completion position to consume (CAS)"
                ),
                field!(H, pad_completion_head, U8; line, ""),
                field!(H, request_waiters, U32, "sleeping request consumers"),
                field!(H, request_doorbell, U32, "request futex word"),
                field!(H, pad_request_sleep, U8; sleep_pad, ""),
                field!(H, completion_waiters, U32, "sleeping completion consumers"),
                field!(H, completion_doorbell, U32, "completion futex word"),
                field!(H, pad_completion_sleep, U8; sleep_pad, ""),
                field!(H, reserved1, U8; CACHE_LINE, ""),
                field!(
                    H,
                    stream_acks,
                    U32; MAX_STREAMS,
                    "per-stream credit returns (consumer adds 1 per acked completion)"
                ),
                field!(H, reserved2, U8; HEADER_SIZE - 8 * CACHE_LINE - 4 * MAX_STREAMS, ""),
            ],
        },
        StructDesc {
            tag: REQUEST_ENTRY_TAG,
            comment: "A request: a request slot minus its leading seq (slot offset 8).",
            size: size_of::<R>(),
            fields: vec![
                field!(
                    R,
                    conn,
                    U64,
                    "opaque connection token chosen by the transport"
                ),
                field!(R, conn_seq, U32, "per-connection request index"),
                field!(R, op, U16, "BGS_OP_*"),
                field!(R, version, U16, "wire protocol version"),
                field!(R, request_id, U32, "client-chosen id"),
                field!(R, words, U32, "valid payload words"),
                field!(R, param, U32, "repeat count / max new tokens"),
                field!(R, flags, U32, "request flags"),
                field!(R, publish_ns, U64, "CLOCK_MONOTONIC ns at publish"),
                field!(R, route, U32, "BGS_ROUTE_* bits"),
                field!(R, reserved, U32; 3, "zero"),
                field!(R, payload, U32; SLOT_WORDS, "payload words"),
            ],
        },
        StructDesc {
            tag: COMPLETION_ENTRY_TAG,
            comment: "A completion: a completion slot minus its leading seq (slot offset 8).",
            size: size_of::<C>(),
            fields: vec![
                field!(C, conn, U64, "the request's connection token"),
                field!(C, conn_seq, U32, "the request's per-connection index"),
                field!(C, status, U16, "BGS_STATUS_*"),
                field!(C, final_, U16, "1 when this completion ends its request"),
                field!(C, request_id, U32, "the request's id"),
                field!(C, words, U32, "valid payload words"),
                field!(C, stream_seq, U32, "token index of a streamed completion"),
                field!(C, route, U32, "BGS_ROUTE_* bits"),
                field!(
                    C,
                    stream,
                    U32,
                    "credit stream index + 1 (0: no credit taken)"
                ),
                field!(
                    C,
                    op,
                    U32,
                    "the request's op (BGS_OP_*, 0xffff: rejection; 0: marker)"
                ),
                field!(
                    C,
                    publish_ns,
                    U64,
                    "the request's publish_ns (0: marker / unstamped)"
                ),
                field!(C, reserved, U32; 2, "zero"),
                field!(C, payload, U32; SLOT_WORDS, "payload words"),
            ],
        },
        StructDesc {
            tag: "bgs_request_slot",
            comment: "A request slot. seq: pos = free for position pos; pos + 1 = published; \
                      the consumer frees it with pos + capacity.",
            size: size_of::<RS>(),
            fields: vec![
                field!(RS, seq, U64, "sequence word: acquire loads, release stores"),
                field!(
                    RS,
                    entry,
                    CType::Struct(REQUEST_ENTRY_TAG, size_of::<R>()),
                    "written by the claiming producer, read by the claiming consumer"
                ),
            ],
        },
        StructDesc {
            tag: "bgs_completion_slot",
            comment: "A completion slot (same seq protocol as a request slot).",
            size: size_of::<CS>(),
            fields: vec![
                field!(CS, seq, U64, "sequence word: acquire loads, release stores"),
                field!(
                    CS,
                    entry,
                    CType::Struct(COMPLETION_ENTRY_TAG, size_of::<C>()),
                    "written by the claiming producer, read by the claiming consumer"
                ),
            ],
        },
        StructDesc {
            tag: "bgs_tx_header",
            comment: "GPU send table header (crates/ring/src/tx.rs). Geometry: host, once; \
                      gpu_sends_paused: host; counters: GPU only.",
            size: size_of::<TH>(),
            fields: vec![
                field!(TH, capacity, U32, "entries, a power of two"),
                field!(TH, probes, U32, "BGS_TX_PROBES"),
                field!(TH, buf_bytes, U32, "BGS_TX_BUF_BYTES"),
                field!(TH, capacity_log2, U32, "log2(capacity)"),
                field!(TH, entries_offset, U64, "entry array offset"),
                field!(TH, bufs_offset, U64, "send buffers offset"),
                field!(TH, total_size, U64, "bytes of the block"),
                field!(
                    TH,
                    gpu_sends_paused,
                    U32,
                    "host: nonzero: hand every reply to the stage"
                ),
                field!(TH, pad0, U8; 20, ""),
                field!(TH, gpu_sends, U64, "replies the GPU queued a SEND for"),
                field!(TH, gpu_completed, U64, "SEND completions the GPU reaped"),
                field!(TH, gpu_send_errors, U64, "of those, errors or short sends"),
                field!(TH, gpu_deferred, U64, "replies handed to the host stage"),
                field!(TH, gpu_wakes, U64, "futex wakes queued for the host stage"),
                field!(TH, gpu_sq_full, U64, "waits for submission queue room"),
                field!(TH, gpu_other_cqes, U64, "other completions reaped"),
                field!(TH, gpu_wake_errors, U64, "of those, failed futex wakes"),
            ],
        },
        StructDesc {
            tag: "bgs_tx_entry",
            comment: "One connection of the GPU send table; next_seq is the turn (tx.rs).",
            size: size_of::<TE>(),
            fields: vec![
                field!(
                    TE,
                    cookie,
                    U64,
                    "socket cookie; 0 empty, ~0 tombstone; host, stored last"
                ),
                field!(TE, fd, U32, "descriptor (an int); host"),
                field!(
                    TE,
                    next_seq,
                    U32,
                    "conn_seq of the next reply to send; its holder writes"
                ),
                field!(TE, gpu_sends, U32, "GPU: SENDs completed"),
                field!(TE, gpu_errors, U32, "GPU: SEND errors"),
                field!(TE, reserved, U32; 10, "[0]: GPU: length of its SEND in flight"),
            ],
        },
    ]
}

/// Panics unless the fields tile the struct exactly (no gap, no overlap, right sizes).
pub fn check_covers(s: &StructDesc) {
    let mut at = 0;
    for f in &s.fields {
        let c_size = f.c_size();
        assert_eq!(
            f.offset, at,
            "{}.{}: field table has a gap or overlap (a Rust field missing from c_header?)",
            s.tag, f.name
        );
        assert_eq!(
            c_size, f.rust_size,
            "{}.{}: C type size differs from Rust",
            s.tag, f.name
        );
        at += c_size;
    }
    assert_eq!(
        at, s.size,
        "{}: fields do not cover the whole struct",
        s.tag
    );
}

const PRELUDE: &str = r#"/* Fixed-width types and helpers shared by the generated bgs_*.h headers. */
#ifndef BGS_FIXED_TYPES
#define BGS_FIXED_TYPES
#if defined(__bpf__) || defined(__BPF__)
/* BPF C: include vmlinux.h or <linux/types.h> first; they define __u8 .. __u64. */
typedef __u8 bgs_u8;
typedef __u16 bgs_u16;
typedef __u32 bgs_u32;
typedef __u64 bgs_u64;
#elif defined(__CUDACC_RTC__)
/* NVRTC has no system headers. */
typedef unsigned char bgs_u8;
typedef unsigned short bgs_u16;
typedef unsigned int bgs_u32;
typedef unsigned long long bgs_u64;
#else
#include <stdint.h>
typedef uint8_t bgs_u8;
typedef uint16_t bgs_u16;
typedef uint32_t bgs_u32;
typedef uint64_t bgs_u64;
#endif
#if defined(__CUDACC_RTC__)
/* NVRTC has no __builtin_offsetof: the layout asserts are skipped there (the GPU executor
 * checks the offsets against Rust at start-up; every other compiler checks them here). */
#define BGS_STATIC_ASSERT(cond, msg)
#elif defined(__cplusplus)
#define BGS_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define BGS_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif
/* __builtin_offsetof works in GCC, Clang (including -target bpf) and nvcc without
 * <stddef.h>. */
#define BGS_OFFSETOF(type, field) __builtin_offsetof(type, field)
BGS_STATIC_ASSERT(sizeof(bgs_u8) == 1, "bgs_u8");
BGS_STATIC_ASSERT(sizeof(bgs_u16) == 2, "bgs_u16");
BGS_STATIC_ASSERT(sizeof(bgs_u32) == 4, "bgs_u32");
BGS_STATIC_ASSERT(sizeof(bgs_u64) == 8, "bgs_u64");
#endif /* BGS_FIXED_TYPES */
"#;

fn banner(out: &mut String, file: &str, what: &str) {
    banner_with(
        out,
        file,
        what,
        "bgs_ring::c_header",
        "BGS_BLESS=1 cargo test -p bgs-ring --test c_headers",
        "Usable from C11, C++ (CUDA, NVRTC) and BPF C. See docs/ring.md.",
    );
}

/// The opening of a generated header: what it is, who generates it (`generator`, a Rust
/// path), how to regenerate it (`regen`, a command), a usage note, the include guard and the
/// fixed-width type prelude. Close the guard with `#endif` after the body.
pub fn banner_with(
    out: &mut String,
    file: &str,
    what: &str,
    generator: &str,
    regen: &str,
    note: &str,
) {
    let guard = file.to_uppercase().replace('.', "_");
    let _ = writeln!(out, "/* {file}: {what}.");
    let _ = writeln!(out, " *");
    let _ = writeln!(
        out,
        " * GENERATED by {generator} from the Rust definitions; do not edit."
    );
    let _ = writeln!(out, " * Regenerate with: {regen}");
    let _ = writeln!(out, " * {note}");
    let _ = writeln!(out, " */");
    let _ = writeln!(out, "#ifndef {guard}");
    let _ = writeln!(out, "#define {guard}\n");
    out.push_str(PRELUDE);
    out.push('\n');
}

/// `#define name value`, with the comment (if any) aligned after it.
pub fn define(out: &mut String, name: &str, value: String, comment: &str) {
    let line = format!("#define {name} {value}");
    if comment.is_empty() {
        let _ = writeln!(out, "{line}");
    } else {
        let _ = writeln!(out, "{line:<56} /* {comment} */");
    }
}

/// The struct's C definition and its static asserts (panics if [`check_covers`] fails).
pub fn emit_struct(out: &mut String, s: &StructDesc) {
    check_covers(s);
    let _ = writeln!(out, "/* {} */", s.comment);
    let _ = writeln!(out, "struct {} {{", s.tag);
    for f in &s.fields {
        let dims: String = f.dims.iter().map(|n| format!("[{n}]")).collect();
        let decl = format!("    {} {}{dims};", f.ty.name(), f.name);
        let comment = if f.comment.is_empty() {
            format!("/* {:4} */", f.offset)
        } else {
            format!("/* {:4}: {} */", f.offset, f.comment)
        };
        let _ = writeln!(out, "{decl:<44} {comment}");
    }
    let _ = writeln!(out, "}};");
    let _ = writeln!(
        out,
        "BGS_STATIC_ASSERT(sizeof(struct {0}) == {1}, \"sizeof {0}\");",
        s.tag, s.size
    );
    for f in &s.fields {
        let _ = writeln!(
            out,
            "BGS_STATIC_ASSERT(BGS_OFFSETOF(struct {0}, {1}) == {2}, \"{0}.{1}\");",
            s.tag, f.name, f.offset
        );
    }
    out.push('\n');
}

/// The text of `include/bgs_ring.h`.
pub fn render_ring() -> String {
    let mut out = String::new();
    banner(
        &mut out,
        RING_HEADER_NAME,
        "layout of the bpf-gpu-server ring region",
    );
    out.push_str("/* Constants. */\n");
    define(
        &mut out,
        "BGS_RING_MAGIC",
        format!("{REGION_MAGIC:#018x}ULL"),
        "\"BGSRING1\" as a little-endian u64",
    );
    let u = |v: usize| format!("{v}u");
    define(
        &mut out,
        "BGS_RING_LAYOUT_VERSION",
        format!("{LAYOUT_VERSION}u"),
        "",
    );
    define(
        &mut out,
        "BGS_RING_SLOT_WORDS",
        u(SLOT_WORDS),
        "payload u32 words per slot",
    );
    define(
        &mut out,
        "BGS_RING_HEADER_SIZE",
        u(HEADER_SIZE),
        "request slots start here",
    );
    define(
        &mut out,
        "BGS_RING_PAGE_SIZE",
        u(PAGE_SIZE),
        "slot arrays are page aligned",
    );
    define(&mut out, "BGS_RING_CACHE_LINE", u(CACHE_LINE), "");
    define(
        &mut out,
        "BGS_RING_SLOT_HEADER_SIZE",
        u(SLOT_HEADER_SIZE),
        "payload offset in a slot",
    );
    define(
        &mut out,
        "BGS_RING_ENTRY_OFFSET",
        u(offset_of!(Slot<RequestEntry>, entry)),
        "entry offset in a slot",
    );
    define(
        &mut out,
        "BGS_RING_REQUEST_SLOT_SIZE",
        u(REQUEST_SLOT_SIZE),
        "",
    );
    define(
        &mut out,
        "BGS_RING_COMPLETION_SLOT_SIZE",
        u(COMPLETION_SLOT_SIZE),
        "",
    );
    define(
        &mut out,
        "BGS_RING_DEFAULT_REQUEST_SLOTS",
        format!("{DEFAULT_REQUEST_SLOTS}u"),
        "",
    );
    define(
        &mut out,
        "BGS_RING_DEFAULT_COMPLETION_SLOTS",
        format!("{DEFAULT_COMPLETION_SLOTS}u"),
        "",
    );
    define(
        &mut out,
        "BGS_RING_MAX_STREAMS",
        format!("{MAX_STREAMS}u"),
        "stream credit counters in the header",
    );
    define(
        &mut out,
        "BGS_RING_OP_CANCEL",
        format!("{:#x}u", crate::layout::OP_CANCEL),
        "request entry saying a connection ended (no reply)",
    );
    define(
        &mut out,
        "BGS_RING_OP_REJECT",
        format!("{:#x}u", crate::layout::OP_REJECT),
        "request entry carrying a framer rejection; status in param",
    );
    {
        use crate::layout::route;
        for (name, v, c) in [
            ("BGS_ROUTE_HTTP", route::HTTP, "reply as an HTTP response"),
            ("BGS_ROUTE_CLOSE", route::CLOSE, "close after this reply"),
            (
                "BGS_ROUTE_NO_FRAME",
                route::NO_FRAME,
                "HTTP error without a frame body",
            ),
            (
                "BGS_ROUTE_EOF",
                route::EOF,
                "completion marker: peer ended its stream",
            ),
            (
                "BGS_ROUTE_RESET",
                route::RESET,
                "completion marker: connection failed",
            ),
            (
                "BGS_ROUTE_HTTP_STATUS_SHIFT",
                route::HTTP_STATUS_SHIFT,
                "HTTP status override shift",
            ),
            (
                "BGS_ROUTE_HTTP_STATUS_MASK",
                route::HTTP_STATUS_MASK,
                "HTTP status override mask",
            ),
        ] {
            define(&mut out, name, format!("{v:#x}u"), c);
        }
    }
    {
        use crate::tx;
        let d = |v: usize| format!("{v}u");
        define(
            &mut out,
            "BGS_TX_HEADER_BYTES",
            d(tx::TX_HEADER_BYTES),
            "GPU send table",
        );
        define(&mut out, "BGS_TX_ENTRY_BYTES", d(tx::TX_ENTRY_BYTES), "");
        define(
            &mut out,
            "BGS_TX_BUF_BYTES",
            d(tx::TX_BUF_BYTES),
            "send buffer per entry",
        );
        define(
            &mut out,
            "BGS_TX_PROBES",
            format!("{}u", tx::TX_PROBES),
            "lookup window",
        );
        define(
            &mut out,
            "BGS_TX_TOMBSTONE",
            format!("{:#x}ULL", tx::TX_TOMBSTONE),
            "",
        );
        define(
            &mut out,
            "BGS_TX_UD_SEND",
            format!("{:#x}ULL", tx::TX_UD_SEND),
            "user_data kind << 56",
        );
        define(
            &mut out,
            "BGS_TX_UD_WAKE",
            format!("{:#x}ULL", tx::TX_UD_WAKE),
            "user_data kind << 56",
        );
        define(
            &mut out,
            "BGS_TX_HASH_MUL",
            format!("{:#x}ULL", tx::TX_HASH_MUL),
            "cookie hash",
        );
    }
    out.push('\n');
    for s in ring_structs() {
        emit_struct(&mut out, &s);
    }
    let _ = writeln!(out, "#endif /* BGS_RING_H */");
    out
}

/// Upper snake case of a Rust variant name: `EndOfStream` -> `END_OF_STREAM`, `Gemm8` -> `GEMM8`.
fn upper_snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Byte offset of a header field, found by encoding a header where only that field is set to
/// `marker` (so the offsets come from the Rust encoder, not from a second hand-written table).
fn probe<H>(
    encode: impl Fn(&H) -> [u8; wire::HEADER_LEN],
    set: impl Fn(&mut H),
    blank: H,
    marker: &[u8],
) -> usize {
    let mut h = blank;
    set(&mut h);
    let bytes = encode(&h);
    let at = bytes
        .windows(marker.len())
        .position(|w| w == marker)
        .expect("marker not found in encoded header");
    assert!(
        bytes
            .iter()
            .enumerate()
            .all(|(i, &b)| (at..at + marker.len()).contains(&i) || b == 0),
        "encoder wrote outside the probed field"
    );
    at
}

fn wire_structs() -> Vec<StructDesc> {
    use CType::{U16, U32};
    const M16: u16 = 0xA1B2;
    const M32: u32 = 0xA1B2_C3D4;
    let m16 = M16.to_le_bytes();
    let m32 = M32.to_le_bytes();
    let req = |set: fn(&mut RequestHeader), m: &[u8]| {
        probe(RequestHeader::encode, set, RequestHeader::default(), m)
    };
    let rep = |set: fn(&mut ReplyHeader), m: &[u8]| {
        probe(ReplyHeader::encode, set, ReplyHeader::default(), m)
    };
    let f = |name, ty: CType, offset, comment| Field {
        name,
        ty,
        dims: Vec::new(),
        offset,
        rust_size: ty.size(),
        comment,
    };
    let mut request = vec![
        f(
            "magic",
            U32,
            req(|h| h.magic = M32, &m32),
            "BGS_REQUEST_MAGIC",
        ),
        f(
            "version",
            U16,
            req(|h| h.version = M16, &m16),
            "BGS_VERSION",
        ),
        f("op", U16, req(|h| h.op = M16, &m16), "BGS_OP_*"),
        f("request_id", U32, req(|h| h.request_id = M32, &m32), ""),
        f(
            "words",
            U32,
            req(|h| h.words = M32, &m32),
            "payload words that follow",
        ),
        f("param", U32, req(|h| h.param = M32, &m32), ""),
        f(
            "flags",
            U32,
            req(|h| h.flags = M32, &m32),
            "BGS_OP_*_FLAGS bits only",
        ),
    ];
    let mut reply = vec![
        f(
            "magic",
            U32,
            rep(|h| h.magic = M32, &m32),
            "BGS_REPLY_MAGIC",
        ),
        f(
            "version",
            U16,
            rep(|h| h.version = M16, &m16),
            "BGS_VERSION",
        ),
        f("status", U16, rep(|h| h.status = M16, &m16), "BGS_STATUS_*"),
        f("request_id", U32, rep(|h| h.request_id = M32, &m32), ""),
        f(
            "words",
            U32,
            rep(|h| h.words = M32, &m32),
            "payload words that follow",
        ),
        f(
            "seq",
            U32,
            rep(|h| h.seq = M32, &m32),
            "token index of streamed frames",
        ),
        f("reserved", U32, rep(|h| h.reserved = M32, &m32), "0"),
    ];
    request.sort_by_key(|f| f.offset);
    reply.sort_by_key(|f| f.offset);
    vec![
        StructDesc {
            tag: "bgs_wire_request_header",
            comment: "Request frame header on the wire (all fields little-endian).",
            size: wire::HEADER_LEN,
            fields: request,
        },
        StructDesc {
            tag: "bgs_wire_reply_header",
            comment: "Reply frame header on the wire (all fields little-endian).",
            size: wire::HEADER_LEN,
            fields: reply,
        },
    ]
}

/// The C name of an op's constants: `BGS_OP_GEMM8`.
fn op_c_name(spec: &OpSpec) -> String {
    format!("BGS_OP_{}", upper_snake(&format!("{:?}", spec.op)))
}

/// `u32::MAX` as the C sentinel it stands for, other values as decimal.
fn c_u32(v: u32) -> String {
    if v == u32::MAX {
        "0xffffffffu".into()
    } else {
        format!("{v}u")
    }
}

/// Helper functions in the generated header: usable from BPF C, CUDA (device code) and C.
const OP_FN_PRELUDE: &str = r#"/* __CUDACC__: NVRTC and nvcc; __CUDA__: clang -x cuda without the CUDA headers. */
#if defined(__CUDACC__) || defined(__CUDA__)
#define BGS_OP_FN static __device__ __forceinline__
#elif defined(__bpf__) || defined(__BPF__)
#define BGS_OP_FN static inline __attribute__((always_inline))
#else
#define BGS_OP_FN static inline
#endif
"#;

/// The op table of `bgs_protocol::ops` as constants per op, compile-time checks of each
/// entry, and the `bgs_op_*` functions the BPF framer and the GPU kernels call, so neither
/// holds a hand-written copy of an op rule.
fn render_op_table(out: &mut String) {
    out.push_str(
        "\n/* Op table (crates/protocol/src/ops.rs). Per op: payload words min/max\n \
         * (BGS_WORDS_SERVER_LIMIT: up to the server's limit), param min/max and the value an\n \
         * executor uses for param 0, allowed request flag bits, words of the final reply frame\n \
         * (BGS_REPLY_WORDS_AS_REQUEST: the request's words), words of each token frame, and\n \
         * whether the reply is a stream. */\n",
    );
    define(
        out,
        "BGS_NUM_OPS",
        format!("{}u", OPS.len()),
        "ops 0 .. BGS_NUM_OPS - 1",
    );
    define(
        out,
        "BGS_WORDS_SERVER_LIMIT",
        c_u32(ops::WORDS_SERVER_LIMIT),
        "words max: the server's --max-words",
    );
    define(
        out,
        "BGS_REPLY_WORDS_AS_REQUEST",
        c_u32(u32::MAX),
        "reply words: as many as the request",
    );
    define(
        out,
        "BGS_FLAG_IGNORE_EOS",
        format!("{:#x}u", ops::FLAG_IGNORE_EOS),
        "generate: do not stop at EOS",
    );
    define(
        out,
        "BGS_KNOWN_FLAGS",
        format!("{:#x}u", ops::KNOWN_FLAGS),
        "every flag bit some op allows",
    );
    define(
        out,
        "BGS_MAX_NEW_TOKENS",
        format!("{}u", ops::MAX_NEW_TOKENS),
        "generate: largest param",
    );
    for spec in &OPS {
        let n = op_c_name(spec);
        let (reply, token, streaming) = match spec.reply {
            Reply::Fixed(w) => (c_u32(w), 0, false),
            Reply::AsRequest => ("BGS_REPLY_WORDS_AS_REQUEST".into(), 0, false),
            Reply::Stream {
                token_words,
                final_words,
            } => (c_u32(final_words), token_words, true),
        };
        let _ = writeln!(out, "/* {} */", spec.name);
        define(out, &format!("{n}_WORDS_MIN"), c_u32(spec.words.min), "");
        define(out, &format!("{n}_WORDS_MAX"), c_u32(spec.words.max), "");
        define(
            out,
            &format!("{n}_PARAM_MIN"),
            c_u32(spec.param.min),
            spec.param.meaning,
        );
        define(out, &format!("{n}_PARAM_MAX"), c_u32(spec.param.max), "");
        define(
            out,
            &format!("{n}_PARAM_ZERO_MEANS"),
            c_u32(spec.param.zero_means),
            "",
        );
        define(
            out,
            &format!("{n}_FLAGS"),
            format!("{:#x}u", spec.flags),
            "",
        );
        define(out, &format!("{n}_REPLY_WORDS"), reply, "final frame");
        define(out, &format!("{n}_TOKEN_WORDS"), format!("{token}u"), "");
        define(
            out,
            &format!("{n}_STREAMING"),
            format!("{}u", u32::from(streaming)),
            "",
        );
        let name = spec.name;
        // Signed compares: an unsigned `0u <= x` would trip -Wtype-limits.
        let _ = writeln!(
            out,
            "BGS_STATIC_ASSERT({n} < BGS_NUM_OPS, \"{name}: op\");\n\
             BGS_STATIC_ASSERT((long long){n}_WORDS_MIN <= (long long){n}_WORDS_MAX, \"{name}: words\");\n\
             BGS_STATIC_ASSERT((long long){n}_PARAM_MIN <= (long long){n}_PARAM_MAX, \"{name}: param\");\n\
             BGS_STATIC_ASSERT(({n}_FLAGS & ~BGS_KNOWN_FLAGS) == 0u, \"{name}: flags\");\n\
             BGS_STATIC_ASSERT({n}_STREAMING == ({n}_TOKEN_WORDS != 0u), \"{name}: stream\");"
        );
    }
    out.push('\n');
    out.push_str(OP_FN_PRELUDE);
    out.push_str(
        "/* One op's payload and param rules (ops.rs `check`): 0 or BGS_STATUS_BAD_PARAM. */\n\
         BGS_OP_FN bgs_u32 bgs_op_rule(bgs_u32 words, bgs_u32 param, bgs_u32 words_min,\n\
         \x20                             bgs_u32 words_max, bgs_u32 param_min, bgs_u32 param_max) {\n\
         \x20   if (words < words_min || words > words_max || param < param_min || param > param_max)\n\
         \x20       return BGS_STATUS_BAD_PARAM;\n\
         \x20   return 0u;\n\
         }\n",
    );
    let per_op =
        |out: &mut String, head: &str, line: &dyn Fn(&OpSpec, &str) -> String, tail: &str| {
            out.push_str(head);
            for spec in &OPS {
                let n = op_c_name(spec);
                let _ = writeln!(out, "    if (op == {n}){}", line(spec, &n));
            }
            out.push_str(tail);
        };
    per_op(
        out,
        "/* Request flag bits an op allows; none for an unknown op (ops.rs `allowed_flags`).\n \
         * Checked as soon as header bytes 20..24 arrive: status 23 when flags has another bit. */\n\
         BGS_OP_FN bgs_u32 bgs_op_allowed_flags(bgs_u32 op) {\n",
        &|_, n| format!(" return {n}_FLAGS;"),
        "    return 0u;\n}\n",
    );
    per_op(
        out,
        "/* The semantic checks of a complete frame whose flags passed (ops.rs `check_request`):\n \
         * 0, BGS_STATUS_UNKNOWN_OP or BGS_STATUS_BAD_PARAM. */\n\
         BGS_OP_FN bgs_u32 bgs_op_check(bgs_u32 op, bgs_u32 words, bgs_u32 param) {\n",
        &|_, n| {
            format!(
                "\n        return bgs_op_rule(words, param, {n}_WORDS_MIN, {n}_WORDS_MAX,\n\
                 \x20                          {n}_PARAM_MIN, {n}_PARAM_MAX);"
            )
        },
        "    return BGS_STATUS_UNKNOWN_OP;\n}\n",
    );
    per_op(
        out,
        "/* The param an executor uses: param, or PARAM_ZERO_MEANS for 0 (ops.rs `param_value`). */\n\
         BGS_OP_FN bgs_u32 bgs_op_param_value(bgs_u32 op, bgs_u32 param) {\n\
         \x20   if (param != 0u) return param;\n",
        &|_, n| format!(" return {n}_PARAM_ZERO_MEANS;"),
        "    return 0u;\n}\n",
    );
    per_op(
        out,
        "/* Words of the final frame of a successful reply (ops.rs `Reply::final_words`). */\n\
         BGS_OP_FN bgs_u32 bgs_op_reply_words(bgs_u32 op, bgs_u32 request_words) {\n",
        &|spec, n| match spec.reply {
            Reply::AsRequest => " return request_words;".into(),
            _ => format!(" return {n}_REPLY_WORDS;"),
        },
        "    (void)request_words;\n    return 0u;\n}\n",
    );
    per_op(
        out,
        "/* 1 when the op's reply is a stream of token frames and an end-of-stream frame. */\n\
         BGS_OP_FN bgs_u32 bgs_op_streaming(bgs_u32 op) {\n",
        &|_, n| format!(" return {n}_STREAMING;"),
        "    return 0u;\n}\n",
    );
}

/// The text of `include/bgs_protocol.h`.
pub fn render_protocol() -> String {
    let mut out = String::new();
    banner(
        &mut out,
        PROTOCOL_HEADER_NAME,
        "bpf-gpu-server wire-protocol constants",
    );
    out.push_str("/* Constants (docs/protocol.md). */\n");
    define(
        &mut out,
        "BGS_REQUEST_MAGIC",
        format!("{:#010x}u", wire::REQUEST_MAGIC),
        "\"BGS1\" little-endian",
    );
    define(
        &mut out,
        "BGS_REPLY_MAGIC",
        format!("{:#010x}u", wire::REPLY_MAGIC),
        "\"BGR1\" little-endian",
    );
    define(&mut out, "BGS_VERSION", format!("{}u", wire::VERSION), "");
    define(
        &mut out,
        "BGS_HEADER_LEN",
        format!("{}u", wire::HEADER_LEN),
        "request and reply header bytes",
    );
    define(
        &mut out,
        "BGS_DEFAULT_MAX_WORDS",
        format!("{}u", wire::DEFAULT_MAX_WORDS),
        "",
    );
    define(
        &mut out,
        "BGS_MAX_REPEAT",
        format!("{}u", wire::MAX_REPEAT),
        "",
    );
    define(
        &mut out,
        "BGS_ONE_SHOT_WORDS",
        format!("{}u", wire::ONE_SHOT_WORDS),
        "",
    );

    // Every value the protocol crate knows, found by asking it about every u16, so a new op or
    // status shows up here (and in the committed-file test) without editing this function.
    out.push_str("\n/* Ops (request header field op). */\n");
    for v in 0..=u16::MAX {
        if let Some(op) = Op::from_u16(v) {
            assert_eq!(op as u16, v);
            define(
                &mut out,
                &format!("BGS_OP_{}", upper_snake(&format!("{op:?}"))),
                format!("{v}u"),
                op.name(),
            );
        }
    }
    out.push_str("\n/* Statuses (reply header field status). */\n");
    for v in 0..=u16::MAX {
        if let Some(status) = Status::from_u16(v) {
            assert_eq!(status as u16, v);
            let mut notes = Vec::new();
            if !status.is_final() {
                notes.push("non-final");
            }
            if status.closes_connection() {
                notes.push("closes the connection");
            }
            define(
                &mut out,
                &format!("BGS_STATUS_{}", upper_snake(&format!("{status:?}"))),
                format!("{v}u"),
                &notes.join(", "),
            );
        }
    }
    // After the statuses: the op functions return them.
    render_op_table(&mut out);
    out.push('\n');
    for s in wire_structs() {
        emit_struct(&mut out, &s);
    }
    let _ = writeln!(out, "#endif /* BGS_PROTOCOL_H */");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_snake_names() {
        assert_eq!(upper_snake("EndOfStream"), "END_OF_STREAM");
        assert_eq!(upper_snake("Gemm8"), "GEMM8");
        assert_eq!(upper_snake("Ok"), "OK");
    }

    #[test]
    fn headers_mention_every_field_and_value() {
        let ring = render_ring();
        for needle in [
            "#define BGS_RING_SLOT_WORDS 256u",
            "BGS_OFFSETOF(struct bgs_request_entry, payload) == 56",
            "BGS_OFFSETOF(struct bgs_completion_entry, final_) == 14",
            "BGS_OFFSETOF(struct bgs_ring_header, completion_doorbell) == 388",
            "sizeof(struct bgs_request_slot) == 1088",
            "0x31474e4952534742ULL",
        ] {
            assert!(ring.contains(needle), "missing {needle:?}");
        }
        let proto = render_protocol();
        for needle in [
            "BGS_OP_GENERATE 3u",
            "BGS_STATUS_END_OF_STREAM 2u",
            "BGS_STATUS_BAD_FLAGS 23u",
            "BGS_REQUEST_MAGIC 0x31534742u",
            "BGS_OFFSETOF(struct bgs_wire_request_header, flags) == 20",
            "BGS_OFFSETOF(struct bgs_wire_reply_header, seq) == 16",
            "#define BGS_OP_GENERATE_FLAGS 0x1u",
            "#define BGS_OP_GENERATE_PARAM_MAX 4096u",
            "#define BGS_OP_GEMM8_PARAM_ZERO_MEANS 1u",
            "#define BGS_OP_ECHO_REPLY_WORDS BGS_REPLY_WORDS_AS_REQUEST",
            "BGS_OP_FN bgs_u32 bgs_op_check(bgs_u32 op, bgs_u32 words, bgs_u32 param)",
        ] {
            assert!(proto.contains(needle), "missing {needle:?}");
        }
    }
}
