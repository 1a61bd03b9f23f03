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

#[cfg(test)]
mod tests {
    use super::Detokenizer;
    use crate::{ChatMessage, TextCodec};

    /// One byte per token: multi-byte characters span several tokens, as in byte-level BPE.
    struct Bytes;

    impl TextCodec for Bytes {
        fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn encode_chat(&self, text: &str) -> Result<Vec<u32>, String> {
            self.encode(text)
        }
        fn decode(&self, ids: &[u32]) -> Result<String, String> {
            let b: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
            Ok(String::from_utf8_lossy(&b).into_owned())
        }
        fn render_chat(&self, _: &[ChatMessage]) -> Result<String, String> {
            Err("none".into())
        }
    }

    #[test]
    fn never_splits_a_character() {
        let text = "ab 😀 ü and ñ";
        let mut d = Detokenizer::default();
        let mut out = String::new();
        let mut silent = 0;
        for id in Bytes.encode(text).unwrap() {
            match d.push(&Bytes, id).unwrap() {
                Some(p) => {
                    assert!(!p.contains('\u{fffd}'), "{p:?}");
                    out.push_str(&p);
                }
                None => silent += 1,
            }
        }
        assert_eq!(d.finish(&Bytes).unwrap(), None);
        assert_eq!(out, text);
        // The emoji is 4 bytes, ü and ñ 2 each: 3 + 1 + 1 pushes complete nothing.
        assert_eq!(silent, 5);
    }

    #[test]
    fn finish_releases_an_incomplete_tail() {
        let mut d = Detokenizer::default();
        assert_eq!(
            d.push(&Bytes, u32::from(b'a')).unwrap().as_deref(),
            Some("a")
        );
        assert_eq!(d.push(&Bytes, 0xF0).unwrap(), None);
        assert_eq!(d.finish(&Bytes).unwrap().as_deref(), Some("\u{fffd}"));
    }
}
