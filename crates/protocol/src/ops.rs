//! The op table: every rule about an op lives in [`OPS`], once.
//!
//! Readers: the Rust framer ([`check_request`], [`allowed_flags`]), [`Op`]'s methods, the
//! executors (reply sizes, what param 0 means), and, through the generated
//! `include/bgs_protocol.h` (constants per op plus `bgs_op_*` helper functions rendered from
//! this table by `bgs_ring::c_header`), the BPF framer and the GPU kernels. `docs/architecture.md`
//! ("Adding an op") lists what each reader needs when an entry is added.

use crate::wire::{MAX_REPEAT, ONE_SHOT_WORDS, Op, Status};

/// `words.max` meaning "up to the server's limit" (`--max-words`, at most the ring slot).
pub const WORDS_SERVER_LIMIT: u32 = u32::MAX;
/// Request flag bit 0 of generate: do not stop at the model's EOS token.
pub const FLAG_IGNORE_EOS: u32 = 1;
/// Every request flag bit that some op allows.
pub const KNOWN_FLAGS: u32 = FLAG_IGNORE_EOS;
/// Largest `param` (max new tokens) of a generate request.
pub const MAX_NEW_TOKENS: u32 = 4096;

/// `finish_reason`, word 0 of a generate stream's final (end of stream) frame: an EOS token
/// was produced (it is not sent as a token frame).
pub const FINISH_EOS: u32 = 0;
/// `finish_reason`: max new tokens or the model's context limit was reached.
pub const FINISH_LENGTH: u32 = 1;

/// How many payload words a request may carry: `min..=max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WordsRule {
    /// Fewest payload words.
    pub min: u32,
    /// Most payload words; [`WORDS_SERVER_LIMIT`] means up to the server's limit (a request
    /// over that limit gets status 19 from the header alone, before this rule runs).
    pub max: u32,
}

/// What `param` may be and what it means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamRule {
    /// Smallest accepted value.
    pub min: u32,
    /// Largest accepted value.
    pub max: u32,
    /// The value an executor uses when the request says 0 (where 0 is accepted).
    pub zero_means: u32,
    /// What the param is, for docs and errors ("ignored", "repeat count", ...).
    pub meaning: &'static str,
}

/// The reply of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// One final frame (status 0) of exactly this many words.
    Fixed(u32),
    /// One final frame (status 0) with as many words as the request (echo).
    AsRequest,
    /// A stream: `token_words` words in each status-1 (token) frame, then one final
    /// status-2 frame of `final_words` words.
    Stream {
        /// Words of each token frame.
        token_words: u32,
        /// Words of the final (end of stream) frame.
        final_words: u32,
    },
}

/// Everything the server knows about one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpSpec {
    /// The op; its discriminant is the wire value and its index in [`OPS`].
    pub op: Op,
    /// Lower-case name used by the CLI, reports and the generated C names.
    pub name: &'static str,
    /// Payload words accepted.
    pub words: WordsRule,
    /// Param accepted.
    pub param: ParamRule,
    /// Request flag bits this op allows; any other bit is status 23 (closes the connection).
    pub flags: u32,
    /// What the reply looks like.
    pub reply: Reply,
}

/// The op table, indexed by wire value.
pub const OPS: [OpSpec; 4] = [
    OpSpec {
        op: Op::Echo,
        name: "echo",
        words: WordsRule {
            min: 0,
            max: WORDS_SERVER_LIMIT,
        },
        param: ParamRule {
            min: 0,
            max: u32::MAX,
            zero_means: 0,
            meaning: "ignored",
        },
        flags: 0,
        reply: Reply::AsRequest,
    },
    OpSpec {
        op: Op::Gemm8,
        name: "gemm8",
        words: WordsRule {
            min: ONE_SHOT_WORDS,
            max: ONE_SHOT_WORDS,
        },
        param: ParamRule {
            min: 0,
            max: MAX_REPEAT,
            zero_means: 1,
            meaning: "repeat count",
        },
        flags: 0,
        reply: Reply::Fixed(ONE_SHOT_WORDS),
    },
    OpSpec {
        op: Op::Fft32,
        name: "fft32",
        words: WordsRule {
            min: ONE_SHOT_WORDS,
            max: ONE_SHOT_WORDS,
        },
        param: ParamRule {
            min: 0,
            max: MAX_REPEAT,
            zero_means: 1,
            meaning: "repeat count",
        },
        flags: 0,
        reply: Reply::Fixed(ONE_SHOT_WORDS),
    },
    OpSpec {
        op: Op::Generate,
        name: "generate",
        words: WordsRule {
            min: 1,
            max: WORDS_SERVER_LIMIT,
        },
        param: ParamRule {
            min: 1,
            max: MAX_NEW_TOKENS,
            zero_means: 0,
            meaning: "max new tokens",
        },
        flags: FLAG_IGNORE_EOS,
        reply: Reply::Stream {
            token_words: 1,
            final_words: 2,
        },
    },
];

// The table is indexed by wire value, and every rule is a non-empty range of known flags.
const _: () = {
    let mut i = 0;
    while i < OPS.len() {
        let s = &OPS[i];
        assert!(s.op as usize == i, "OPS must be indexed by wire value");
        assert!(s.words.min <= s.words.max);
        assert!(s.param.min <= s.param.max);
        assert!(s.flags & !KNOWN_FLAGS == 0);
        i += 1;
    }
};

impl Reply {
    /// True for a streamed reply (token frames, then an end-of-stream frame).
    pub const fn streaming(self) -> bool {
        matches!(self, Reply::Stream { .. })
    }

    /// Words of the final frame of a successful reply to a request of `request_words`.
    pub const fn final_words(self, request_words: u32) -> u32 {
        match self {
            Reply::Fixed(n) => n,
            Reply::AsRequest => request_words,
            Reply::Stream { final_words, .. } => final_words,
        }
    }
}

impl OpSpec {
    /// The wire value (`op` header field).
    pub const fn wire(&self) -> u16 {
        self.op as u16
    }

    /// The param an executor uses: `param`, or [`ParamRule::zero_means`] for 0.
    pub const fn param_value(&self, param: u32) -> u32 {
        if param == 0 {
            self.param.zero_means
        } else {
            param
        }
    }

    /// Whether `flags` holds only bits this op allows.
    pub const fn flags_ok(&self, flags: u32) -> bool {
        flags & !self.flags == 0
    }
}

/// The rules of one op against a request: flags (status 23) first, as on the wire, then payload
/// words and param (status 20). Used by the framer; executors may re-check with `flags = 0`.
pub fn check(spec: &OpSpec, words: u32, param: u32, flags: u32) -> Result<(), Status> {
    if !spec.flags_ok(flags) {
        return Err(Status::BadFlags);
    }
    if words < spec.words.min || words > spec.words.max {
        return Err(Status::BadParam);
    }
    if param < spec.param.min || param > spec.param.max {
        return Err(Status::BadParam);
    }
    Ok(())
}

/// The spec of wire value `op`, if the op is known.
pub fn spec_of(op: u16) -> Option<&'static OpSpec> {
    OPS.get(usize::from(op))
}

/// The flag bits allowed for wire value `op`: none for an unknown op. The framer checks flags
/// as soon as header bytes 20..24 arrive, when the op (bytes 6..8) is already known.
pub fn allowed_flags(op: u16) -> u32 {
    spec_of(op).map_or(0, |s| s.flags)
}

/// All rules for a request, in wire order: flags (23), unknown op (18), words and param (20).
pub fn check_request(
    op: u16,
    words: u32,
    param: u32,
    flags: u32,
) -> Result<&'static OpSpec, Status> {
    if flags & !allowed_flags(op) != 0 {
        return Err(Status::BadFlags);
    }
    let spec = spec_of(op).ok_or(Status::UnknownOp)?;
    check(spec, words, param, flags).map(|()| spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_the_decisions() {
        let g = Op::Generate.spec();
        assert_eq!(g.flags, FLAG_IGNORE_EOS);
        assert_eq!((g.param.min, g.param.max), (1, 4096));
        assert_eq!(g.words.min, 1);
        assert!(g.reply.streaming());
        assert_eq!(g.reply.final_words(7), 2);
        for op in [Op::Gemm8, Op::Fft32] {
            let s = op.spec();
            assert_eq!(s.param_value(0), 1);
            assert_eq!(s.param_value(9), 9);
            assert_eq!(s.reply, Reply::Fixed(64));
            assert_eq!(s.flags, 0);
        }
        assert_eq!(Op::Echo.spec().reply.final_words(5), 5);
    }

    #[test]
    fn check_request_runs_in_wire_order() {
        assert_eq!(check_request(9, 0, 0, 1), Err(Status::BadFlags));
        assert_eq!(check_request(9, 0, 0, 0), Err(Status::UnknownOp));
        assert_eq!(check_request(1, 3, 0, 1), Err(Status::BadFlags));
        assert_eq!(check_request(3, 1, 1, 1).map(|s| s.op), Ok(Op::Generate));
        assert_eq!(check_request(3, 1, 1, 2), Err(Status::BadFlags));
        assert_eq!(check_request(3, 0, 1, 0), Err(Status::BadParam));
        assert_eq!(check_request(3, 1, 0, 0), Err(Status::BadParam));
        assert_eq!(check_request(3, 1, 4097, 0), Err(Status::BadParam));
    }
}
