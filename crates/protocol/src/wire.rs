//! Constants and fixed-size headers. All integers are little-endian on the wire.

/// `BGS1` read as a little-endian u32.
pub const REQUEST_MAGIC: u32 = 0x3153_4742;
/// `BGR1` read as a little-endian u32.
pub const REPLY_MAGIC: u32 = 0x3152_4742;
/// The only protocol version.
pub const VERSION: u16 = 1;
/// Size of both the request and the reply header.
pub const HEADER_LEN: usize = 24;
/// Default limit on payload words per request.
pub const DEFAULT_MAX_WORDS: u32 = 64;
/// Largest repeat count accepted by gemm8 and fft32.
pub const MAX_REPEAT: u32 = 256;
/// Payload words of a gemm8 or fft32 request and reply.
pub const ONE_SHOT_WORDS: u32 = 64;

/// Request operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Op {
    /// Return the payload unchanged.
    Echo = 0,
    /// 8x8 f32 matrix product with the server's fixed matrix B, `param` times.
    Gemm8 = 1,
    /// 32-point complex64 forward DFT (unnormalized), `param` times.
    Fft32 = 2,
    /// LLM generation: prompt token ids in, a stream of token frames out.
    Generate = 3,
}

impl Op {
    /// The op for a wire value, if it is known (an entry of [`crate::ops::OPS`]).
    pub fn from_u16(v: u16) -> Option<Op> {
        crate::ops::spec_of(v).map(|s| s.op)
    }

    /// Lower-case name used by the CLI and reports.
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// This op's rules (its entry of [`crate::ops::OPS`]).
    pub fn spec(self) -> &'static crate::ops::OpSpec {
        &crate::ops::OPS[self as usize]
    }
}

/// Reply statuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Status {
    /// Success; the final frame of a reply.
    Ok = 0,
    /// A streamed, non-final frame (one generated token).
    Token = 1,
    /// End of a stream.
    EndOfStream = 2,
    /// The request magic was not `BGS1` (connection closed).
    BadMagic = 16,
    /// The version was not 1 (connection closed).
    BadVersion = 17,
    /// The op is unknown, or not served by this executor (connection stays open).
    UnknownOp = 18,
    /// More payload words than the server's limit (connection closed).
    PayloadTooLarge = 19,
    /// The param or payload size is outside the op's range (connection stays open).
    BadParam = 20,
    /// Admission refused: the request ring is full (connection stays open).
    Busy = 21,
    /// The server failed to execute the request.
    Internal = 22,
    /// A flag bit the op does not allow (connection closed).
    BadFlags = 23,
    /// The request was cancelled because its connection ended (EOF, reset or close) while
    /// it was queued or streaming; the final frame of such a request.
    Cancelled = 24,
}

impl Status {
    /// The status for a wire value, if it is known.
    pub fn from_u16(v: u16) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::Token,
            2 => Status::EndOfStream,
            16 => Status::BadMagic,
            17 => Status::BadVersion,
            18 => Status::UnknownOp,
            19 => Status::PayloadTooLarge,
            20 => Status::BadParam,
            21 => Status::Busy,
            22 => Status::Internal,
            23 => Status::BadFlags,
            24 => Status::Cancelled,
            _ => return None,
        })
    }

    /// True for the framing errors after which the server closes the connection.
    pub fn closes_connection(self) -> bool {
        matches!(
            self,
            Status::BadMagic | Status::BadVersion | Status::PayloadTooLarge | Status::BadFlags
        )
    }

    /// True for statuses that end a request (everything but a streamed token).
    pub fn is_final(self) -> bool {
        self != Status::Token
    }

    /// The HTTP status code used for this frame status in HTTP mode.
    pub fn http_status(self) -> u16 {
        match self {
            Status::Ok | Status::Token | Status::EndOfStream => 200,
            Status::BadMagic
            | Status::BadVersion
            | Status::BadFlags
            | Status::UnknownOp
            | Status::BadParam => 400,
            Status::PayloadTooLarge => 413,
            Status::Busy => 503,
            Status::Internal => 500,
            // nginx's "client closed request": only a half-closed client can still read it.
            Status::Cancelled => 499,
        }
    }
}

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// A request header as it appears on the wire (not validated).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RequestHeader {
    /// Must be [`REQUEST_MAGIC`].
    pub magic: u32,
    /// Must be [`VERSION`].
    pub version: u16,
    /// Wire value of an [`Op`].
    pub op: u16,
    /// Chosen by the client, echoed in every reply frame.
    pub request_id: u32,
    /// Number of 32-bit payload words that follow.
    pub words: u32,
    /// Repeat count (gemm8/fft32) or max new tokens (generate).
    pub param: u32,
    /// Request flags: only the bits the op allows (`OpSpec::flags`).
    pub flags: u32,
}

impl RequestHeader {
    /// A valid version-1 header.
    pub fn new(op: Op, request_id: u32, words: u32, param: u32) -> Self {
        RequestHeader {
            magic: REQUEST_MAGIC,
            version: VERSION,
            op: op as u16,
            request_id,
            words,
            param,
            flags: 0,
        }
    }

    /// Decode the first 24 bytes of `b`. Panics if `b` is shorter than [`HEADER_LEN`].
    pub fn decode(b: &[u8]) -> Self {
        RequestHeader {
            magic: u32_at(b, 0),
            version: u16_at(b, 4),
            op: u16_at(b, 6),
            request_id: u32_at(b, 8),
            words: u32_at(b, 12),
            param: u32_at(b, 16),
            flags: u32_at(b, 20),
        }
    }

    /// The 24 wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.op.to_le_bytes());
        b[8..12].copy_from_slice(&self.request_id.to_le_bytes());
        b[12..16].copy_from_slice(&self.words.to_le_bytes());
        b[16..20].copy_from_slice(&self.param.to_le_bytes());
        b[20..24].copy_from_slice(&self.flags.to_le_bytes());
        b
    }

    /// The param an executor uses: for gemm8/fft32 the repeat count (0 means 1), see
    /// [`crate::ops::OpSpec::param_value`]; the raw param for an unknown op.
    pub fn repeat(&self) -> u32 {
        crate::ops::spec_of(self.op).map_or(self.param, |s| s.param_value(self.param))
    }
}

/// A reply frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ReplyHeader {
    /// Must be [`REPLY_MAGIC`].
    pub magic: u32,
    /// [`VERSION`].
    pub version: u16,
    /// Wire value of a [`Status`].
    pub status: u16,
    /// The request's id (0 when a framing error made it unknown).
    pub request_id: u32,
    /// Payload words that follow.
    pub words: u32,
    /// Token index for streamed frames, else 0.
    pub seq: u32,
    /// Always 0.
    pub reserved: u32,
}

impl ReplyHeader {
    /// A version-1 reply header.
    pub fn new(status: Status, request_id: u32, words: u32, seq: u32) -> Self {
        ReplyHeader {
            magic: REPLY_MAGIC,
            version: VERSION,
            status: status as u16,
            request_id,
            words,
            seq,
            reserved: 0,
        }
    }

    /// Decode the first 24 bytes of `b`. Panics if `b` is shorter than [`HEADER_LEN`].
    pub fn decode(b: &[u8]) -> Self {
        ReplyHeader {
            magic: u32_at(b, 0),
            version: u16_at(b, 4),
            status: u16_at(b, 6),
            request_id: u32_at(b, 8),
            words: u32_at(b, 12),
            seq: u32_at(b, 16),
            reserved: u32_at(b, 20),
        }
    }

    /// The 24 wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&self.magic.to_le_bytes());
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..12].copy_from_slice(&self.request_id.to_le_bytes());
        b[12..16].copy_from_slice(&self.words.to_le_bytes());
        b[16..20].copy_from_slice(&self.seq.to_le_bytes());
        b[20..24].copy_from_slice(&self.reserved.to_le_bytes());
        b
    }
}

/// Decode little-endian u32 words from `bytes` (length a multiple of 4) into `out`.
pub fn words_from_le(bytes: &[u8], out: &mut [u32]) {
    for (w, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// The fixed server matrix B of gemm8 (row-major 8x8): `B[i][j] = (i*8 + j - 31.5) / 32`.
///
/// Every entry is exactly representable in f32, so clients and references can rebuild it.
pub fn gemm8_b() -> [f32; 64] {
    let mut b = [0f32; 64];
    for (k, v) in b.iter_mut().enumerate() {
        *v = (k as f32 - 31.5) / 32.0;
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magic_bytes_spell_the_names() {
        assert_eq!(&REQUEST_MAGIC.to_le_bytes(), b"BGS1");
        assert_eq!(&REPLY_MAGIC.to_le_bytes(), b"BGR1");
    }

    #[test]
    fn headers_round_trip() {
        let h = RequestHeader {
            magic: 1,
            version: 2,
            op: 3,
            request_id: 4,
            words: 5,
            param: 6,
            flags: 7,
        };
        assert_eq!(RequestHeader::decode(&h.encode()), h);
        let r = ReplyHeader::new(Status::Token, 9, 1, 42);
        assert_eq!(ReplyHeader::decode(&r.encode()), r);
        assert_eq!(&r.encode()[0..4], b"BGR1");
    }

    #[test]
    fn status_wire_values_round_trip() {
        for v in 0..=u16::MAX {
            if let Some(s) = Status::from_u16(v) {
                assert_eq!(s as u16, v);
            }
        }
        assert_eq!(Status::from_u16(23), Some(Status::BadFlags));
        assert_eq!(Status::from_u16(3), None);
    }
}
