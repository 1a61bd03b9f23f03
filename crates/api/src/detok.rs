//! Incremental detokenization: the text each new token adds, without splitting a character
//! that spans several tokens (byte-level BPE) and without re-decoding the whole sequence per
//! token.

use crate::TextCodec;

/// Turns a growing token sequence into text pieces.
///
/// Keeps two offsets into the ids: text up to `read` has been returned; decoding restarts at
/// `prefix` (a few tokens back, so that merges and leading-space rules of the tokenizer see
/// the context they need). A piece is returned only once it no longer ends in U+FFFD (an
/// incomplete UTF-8 sequence).
#[derive(Debug, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    /// Append one token; returns the new text it completes, if any.
    pub fn push(&mut self, codec: &dyn TextCodec, id: u32) -> Result<Option<String>, String> {
        self.ids.push(id);
        let before = codec.decode(&self.ids[self.prefix..self.read])?;
        let after = codec.decode(&self.ids[self.prefix..])?;
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            let piece = match after.get(before.len()..) {
                Some(p) if after.starts_with(&before) => p.to_string(),
                // The tokenizer rewrote earlier text (rare): emit the tail that differs.
                _ => after
                    .char_indices()
                    .zip(before.chars())
                    .find(|((_, a), b)| a != b)
                    .map_or_else(String::new, |((i, _), _)| after[i..].to_string()),
            };
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(Some(piece));
        }
        Ok(None)
    }

    /// Text still held back at the end of the stream (an incomplete character), if any.
    pub fn finish(&mut self, codec: &dyn TextCodec) -> Result<Option<String>, String> {
        if self.read == self.ids.len() {
            return Ok(None);
        }
        let before = codec.decode(&self.ids[self.prefix..self.read])?;
        let after = codec.decode(&self.ids[self.prefix..])?;
        self.read = self.ids.len();
        Ok(after
            .get(before.len()..)
            .map(str::to_string)
            .filter(|s| !s.is_empty()))
    }
}
