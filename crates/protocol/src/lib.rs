//! The bpf-gpu-server wire protocol.
//!
//! Pure code, no I/O: constants and header layouts ([`wire`]), a sans-I/O framer that turns a
//! connection's byte stream (binary frames or HTTP POSTs) into requests and documented
//! rejections ([`framer`]), the op table every reader of op rules uses ([`ops`]), and reply
//! encoders ([`reply`]). `docs/protocol.md` is the
//! specification this crate implements; the BPF framer (kernel transport) must agree with it
//! byte for byte, so every rule here is deliberately simple and explicit.

pub mod framer;
pub mod ops;
pub mod reply;
pub mod wire;

pub use framer::{Decoded, Framer, FramerConfig, Framing, Reject, Request};
pub use ops::{FINISH_EOS, FINISH_LENGTH, FLAG_IGNORE_EOS, MAX_NEW_TOKENS, OPS, OpSpec};
pub use reply::{encode_reply, encode_request, http_response_head};
pub use wire::{
    HEADER_LEN, MAX_REPEAT, Op, REPLY_MAGIC, REQUEST_MAGIC, ReplyHeader, RequestHeader, Status,
    VERSION,
};
