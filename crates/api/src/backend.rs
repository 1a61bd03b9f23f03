//! The API's client of the binary protocol: one loopback TCP connection per API request to
//! the server's own binary listener, carrying one generate request and its token stream.
//!
//! Going through the transport (instead of publishing into the request ring from here) keeps
//! one admission, ordering and cancellation path for every transport, the BPF one included:
//! dropping the connection is the cancel (the transport publishes the cancel marker and the
//! executor frees the sequence's KV blocks). The price is one loopback hop per API request,
//! small next to generating tokens.

use std::net::SocketAddr;

use bgs_protocol::{
    FINISH_EOS, FLAG_IGNORE_EOS, HEADER_LEN, Op, ReplyHeader, RequestHeader, Status, encode_request,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// One event of a generation stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A generated token.
    Token(u32),
    /// The stream ended: `eos` is true when the model produced an end-of-sequence token
    /// (finish reason "stop"), false when it reached the token limit ("length").
    End {
        /// Ended by an EOS token.
        eos: bool,
    },
}

/// Why a generation could not run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendError {
    /// The server refused or failed the request with this status.
    Status(Status),
    /// The binary listener could not be reached or broke the stream.
    Io(String),
    /// The server sent something that is not a valid reply stream.
    Protocol(String),
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendError::Status(s) => {
                write!(f, "the server answered status {} ({s:?})", *s as u16)
            }
            BackendError::Io(e) => write!(f, "backend connection: {e}"),
            BackendError::Protocol(e) => write!(f, "backend protocol: {e}"),
        }
    }
}

/// An open generation stream. Dropping it closes the connection, which cancels the
/// generation on the server.
#[derive(Debug)]
pub struct Generation {
    reader: BufReader<TcpStream>,
    next_seq: u32,
    done: bool,
    payload: Vec<u8>,
}

impl Generation {
    /// Connect to the binary listener at `addr` and send one generate request.
    pub async fn start(
        addr: SocketAddr,
        prompt: &[u32],
        max_tokens: u32,
        ignore_eos: bool,
    ) -> Result<Generation, BackendError> {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| BackendError::Io(format!("connect {addr}: {e}")))?;
        stream
            .set_nodelay(true)
            .map_err(|e| BackendError::Io(e.to_string()))?;
        let mut header = RequestHeader::new(Op::Generate, 1, prompt.len() as u32, max_tokens);
        if ignore_eos {
            header.flags = FLAG_IGNORE_EOS;
        }
        let mut frame = Vec::with_capacity(HEADER_LEN + 4 * prompt.len());
        encode_request(&mut frame, &header, prompt);
        stream
            .write_all(&frame)
            .await
            .map_err(|e| BackendError::Io(format!("send: {e}")))?;
        Ok(Generation {
            reader: BufReader::new(stream),
            next_seq: 0,
            done: false,
            payload: Vec::new(),
        })
    }

    /// The next event; `Ok(None)` after the end of the stream.
    pub async fn next(&mut self) -> Result<Option<Event>, BackendError> {
        if self.done {
            return Ok(None);
        }
        let mut head = [0u8; HEADER_LEN];
        self.reader
            .read_exact(&mut head)
            .await
            .map_err(|e| BackendError::Io(format!("receive: {e}")))?;
        let h = ReplyHeader::decode(&head);
        if h.magic != bgs_protocol::REPLY_MAGIC || h.words > 256 {
            return Err(BackendError::Protocol(format!(
                "bad reply header (magic {:#x}, words {})",
                h.magic, h.words
            )));
        }
        self.payload.resize(h.words as usize * 4, 0);
        self.reader
            .read_exact(&mut self.payload)
            .await
            .map_err(|e| BackendError::Io(format!("receive: {e}")))?;
        let word = |i: usize| {
            self.payload
                .get(i * 4..i * 4 + 4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        match Status::from_u16(h.status) {
            Some(Status::Token) => {
                if h.seq != self.next_seq {
                    return Err(BackendError::Protocol(format!(
                        "token frame seq {} where {} was due",
                        h.seq, self.next_seq
                    )));
                }
                self.next_seq += 1;
                let id = word(0)
                    .ok_or_else(|| BackendError::Protocol("token frame without a token".into()))?;
                Ok(Some(Event::Token(id)))
            }
            Some(Status::EndOfStream) => {
                self.done = true;
                Ok(Some(Event::End {
                    eos: word(0) == Some(FINISH_EOS),
                }))
            }
            Some(s) => {
                self.done = true;
                Err(BackendError::Status(s))
            }
            None => Err(BackendError::Protocol(format!(
                "unknown reply status {}",
                h.status
            ))),
        }
    }
}
