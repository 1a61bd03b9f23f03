//! Generation streams: the parameters, the golden pass that records each prompt's stream, and
//! the checks a stream must pass.
//!
//! A generate request's reply is a stream: token frames (status 1, one word, `seq` = token
//! index from 0) and one final frame, either end of stream (status 2, `seq` = number of token
//! frames, payload `[finish_reason, generated_tokens]`) or an error status. Greedy decoding is
//! deterministic and batch-invariant on the server, so a prompt's stream is the same whatever
//! else runs: every stream of the run is compared token by token with the golden one.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use bgs_protocol::{HEADER_LEN, Op, RequestHeader, Status};
use serde::Serialize;

use crate::client::{FrameClient, Reply, decode_reply};

pub use bgs_protocol::{FINISH_EOS, FINISH_LENGTH, FLAG_IGNORE_EOS, MAX_NEW_TOKENS};
/// Most prompt tokens a request may carry (a ring slot holds 256 words).
pub const MAX_PROMPT_TOKENS: u32 = 256;

/// What the generate op asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GenerateConfig {
    /// Prompt tokens per request (1..=256).
    pub prompt_tokens: u32,
    /// Max new tokens per request (the request param, 1..=4096).
    pub max_tokens: u32,
    /// Set flag bit 0: generation only stops at `max_tokens` (or the context limit).
    pub ignore_eos: bool,
    /// Prompt token ids are drawn from `0..token_range` (every served model has at least 256
    /// tokens, the default).
    pub token_range: u32,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        GenerateConfig {
            prompt_tokens: 16,
            max_tokens: 64,
            ignore_eos: false,
            token_range: 256,
        }
    }
}

impl GenerateConfig {
    /// `Err` with a one-line reason when a value is out of range.
    pub fn validate(&self) -> anyhow::Result<()> {
        ensure!(
            (1..=MAX_PROMPT_TOKENS).contains(&self.prompt_tokens),
            "prompt tokens must be 1..={MAX_PROMPT_TOKENS}, not {}",
            self.prompt_tokens
        );
        ensure!(
            (1..=MAX_NEW_TOKENS).contains(&self.max_tokens),
            "max tokens must be 1..={MAX_NEW_TOKENS}, not {}",
            self.max_tokens
        );
        ensure!(self.token_range >= 1, "token range must be at least 1");
        Ok(())
    }

    /// Request flags.
    pub fn flags(&self) -> u32 {
        if self.ignore_eos { FLAG_IGNORE_EOS } else { 0 }
    }

    /// The request header of prompt `words` long with request id `id`.
    pub fn header(&self, id: u32, words: u32) -> RequestHeader {
        let mut h = RequestHeader::new(Op::Generate, id, words, self.max_tokens);
        h.flags = self.flags();
        h
    }
}

/// The recorded stream of one prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GoldenStream {
    /// The token ids, in order.
    pub tokens: Vec<u32>,
    /// The end-of-stream payload `[finish_reason, generated_tokens]`, as wire bytes.
    pub final_bytes: [u8; 8],
}

impl GoldenStream {
    pub(crate) fn final_words(&self) -> [u32; 2] {
        let b = &self.final_bytes;
        [
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        ]
    }
}

/// A status for messages: its name when known.
pub(crate) fn status_name(s: u16) -> String {
    match Status::from_u16(s) {
        Some(st) => format!("{st:?} ({s})"),
        None => format!("unknown status {s}"),
    }
}

/// Accumulates one stream's frames in the golden pass, checking the stream format.
struct Collect {
    id: u32,
    tokens: Vec<u32>,
}

/// How a golden attempt ended.
enum Ended {
    Done([u32; 2]),
    Busy,
}

impl Collect {
    /// Take one frame: `Ok(Some)` when it was the final one.
    fn push(&mut self, r: &Reply) -> anyhow::Result<Option<Ended>> {
        let h = &r.header;
        ensure!(
            h.request_id == self.id,
            "frame for request id {} (expected {})",
            h.request_id,
            self.id
        );
        match Status::from_u16(h.status) {
            Some(Status::Token) => {
                ensure!(
                    h.words == 1,
                    "token frame {} carries {} words",
                    h.seq,
                    h.words
                );
                ensure!(
                    h.seq as usize == self.tokens.len(),
                    "token frame seq {} where {} was due",
                    h.seq,
                    self.tokens.len()
                );
                self.tokens.push(r.words[0]);
                Ok(None)
            }
            Some(Status::EndOfStream) => {
                ensure!(
                    h.words == 2,
                    "end-of-stream frame carries {} words",
                    h.words
                );
                ensure!(
                    h.seq as usize == self.tokens.len(),
                    "end-of-stream seq {} after {} token frames",
                    h.seq,
                    self.tokens.len()
                );
                Ok(Some(Ended::Done([r.words[0], r.words[1]])))
            }
            Some(Status::Busy) if self.tokens.is_empty() => Ok(Some(Ended::Busy)),
            Some(Status::UnknownOp) if self.tokens.is_empty() => bail!(
                "the server does not serve generate (status {})",
                status_name(h.status)
            ),
            _ => bail!(
                "status {} after {} token(s)",
                status_name(h.status),
                self.tokens.len()
            ),
        }
    }
}

/// Check an end-of-stream payload against the stream and the request.
fn check_final(g: &GenerateConfig, tokens: usize, fin: [u32; 2]) -> anyhow::Result<()> {
    let [reason, n] = fin;
    ensure!(
        n as usize == tokens,
        "end of stream reports {n} generated tokens, {tokens} token frames came"
    );
    ensure!(
        tokens <= g.max_tokens as usize,
        "{tokens} tokens generated, more than the {} asked for",
        g.max_tokens
    );
    match reason {
        FINISH_EOS => ensure!(
            !g.ignore_eos,
            "finish reason EOS although EOS is ignored (flag {FLAG_IGNORE_EOS})"
        ),
        FINISH_LENGTH => {}
        r => bail!("unknown finish reason {r}"),
    }
    Ok(())
}

/// Send every prompt once, sequentially on one connection, and record its stream. Busy
/// answers are retried for a while; any other error status, or a stream that breaks the
/// format, ends the run with an error naming the prompt.
pub(crate) fn golden_pass(
    target: std::net::SocketAddr,
    http: bool,
    g: &GenerateConfig,
    prompts: &[Vec<u32>],
) -> anyhow::Result<Vec<GoldenStream>> {
    let mut c = FrameClient::connect(target)
        .with_context(|| format!("connecting to {target} for the golden pass"))?;
    let mut golden = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let h = g.header(i as u32, p.len() as u32);
        let mut attempts = 0;
        let (tokens, fin) = loop {
            attempts += 1;
            let mut col = Collect {
                id: i as u32,
                tokens: Vec::new(),
            };
            let ended = if http {
                one_http(&mut c, &h, p, &mut col)
            } else {
                one_binary(&mut c, &h, p, &mut col)
            }
            .with_context(|| format!("golden pass, prompt {i}"))?;
            match ended {
                Ended::Done(fin) => break (col.tokens, fin),
                Ended::Busy if attempts < 400 => std::thread::sleep(Duration::from_millis(5)),
                Ended::Busy => bail!("golden pass, prompt {i}: the server stayed busy"),
            }
        };
        check_final(g, tokens.len(), fin)
            .with_context(|| format!("golden pass, prompt {i}: bad stream"))?;
        let mut final_bytes = [0u8; 8];
        final_bytes[..4].copy_from_slice(&fin[0].to_le_bytes());
        final_bytes[4..].copy_from_slice(&fin[1].to_le_bytes());
        golden.push(GoldenStream {
            tokens,
            final_bytes,
        });
    }
    Ok(golden)
}

fn one_binary(
    c: &mut FrameClient,
    h: &RequestHeader,
    p: &[u32],
    col: &mut Collect,
) -> anyhow::Result<Ended> {
    let mut out = Vec::with_capacity(HEADER_LEN + p.len() * 4);
    bgs_protocol::reply::encode_request(&mut out, h, p);
    c.send_raw(&out)?;
    loop {
        let r = c.read_reply(crate::client::DEFAULT_TIMEOUT)?;
        if let Some(e) = col.push(&r)? {
            return Ok(e);
        }
    }
}

fn one_http(
    c: &mut FrameClient,
    h: &RequestHeader,
    p: &[u32],
    col: &mut Collect,
) -> anyhow::Result<Ended> {
    let resp = c.http_request(h, p)?;
    let mut body = resp.body.as_slice();
    while !body.is_empty() {
        let Some((r, n)) = decode_reply(body)? else {
            bail!(
                "HTTP {} body ends in a partial frame ({} bytes left)",
                resp.status,
                body.len()
            );
        };
        body = &body[n..];
        if let Some(e) = col.push(&r)? {
            ensure!(
                body.is_empty(),
                "HTTP {} body continues after the final frame",
                resp.status
            );
            return Ok(e);
        }
    }
    bail!(
        "HTTP {} response ended without a final frame ({} token frames)",
        resp.status,
        col.tokens.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_limits_and_flags() {
        let g = GenerateConfig::default();
        assert!(g.validate().is_ok());
        assert_eq!(g.flags(), 0);
        let h = GenerateConfig {
            ignore_eos: true,
            ..g
        }
        .header(7, 3);
        assert_eq!(
            (h.op, h.request_id, h.words, h.param, h.flags),
            (3, 7, 3, 64, 1)
        );
        for bad in [
            GenerateConfig {
                prompt_tokens: 0,
                ..g
            },
            GenerateConfig {
                prompt_tokens: 257,
                ..g
            },
            GenerateConfig { max_tokens: 0, ..g },
            GenerateConfig {
                max_tokens: 4097,
                ..g
            },
            GenerateConfig {
                token_range: 0,
                ..g
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn final_frame_checks() {
        let g = GenerateConfig::default();
        assert!(check_final(&g, 3, [FINISH_EOS, 3]).is_ok());
        assert!(check_final(&g, 64, [FINISH_LENGTH, 64]).is_ok());
        assert!(check_final(&g, 3, [FINISH_EOS, 4]).is_err());
        assert!(check_final(&g, 65, [FINISH_LENGTH, 65]).is_err());
        assert!(check_final(&g, 3, [2, 3]).is_err());
        let ig = GenerateConfig {
            ignore_eos: true,
            ..g
        };
        assert!(check_final(&ig, 3, [FINISH_EOS, 3]).is_err());
    }
}
