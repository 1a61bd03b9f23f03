//! Tokenizers: a thin wrapper over the `tokenizers` crate, byte-level BPE construction (for
//! GGUF vocabularies and synthetic checkpoints) and incremental detokenization for streaming.

use serde_json::{Value, json};

/// A tokenizer error (the underlying library's message).
#[derive(Debug, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizerError(pub String);

/// A model's tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Parse a `tokenizer.json` document.
    pub fn from_json(json: &str) -> Result<Tokenizer, TokenizerError> {
        let inner: tokenizers::Tokenizer =
            json.parse().map_err(|e| TokenizerError(format!("{e}")))?;
        Ok(Tokenizer { inner })
    }

    /// The underlying `tokenizers` object.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids for `text`; `add_special_tokens` applies the post-processor (e.g. a BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizerError(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text for `ids`; `skip_special_tokens` drops special tokens (e.g. `<|im_end|>`).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError(e.to_string()))
    }

    /// The id of a token string (including added/special tokens).
    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.inner.token_to_id(s)
    }

    /// The token string of an id.
    pub fn id_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids the tokenizer knows, added tokens included (may be smaller than the
    /// model's embedding rows, which are often padded).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// GPT-2's byte → printable character map used by byte-level BPE vocabularies.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
        map[b as usize] = if printable {
            char::from_u32(b).unwrap_or('?')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('?')
        };
    }
    map
}

/// Pre-tokenization of a byte-level BPE tokenizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's regex split (llama.cpp `default`/`gpt2`).
    Gpt2,
    /// Digits split one by one, then GPT-2's split (SmolLM2; llama.cpp `smollm`).
    SmolLm,
    /// Qwen2's split regex (llama.cpp `qwen2`).
    Qwen2,
}

impl PreTokenizer {
    /// From GGUF `tokenizer.ggml.pre` (unknown names fall back to GPT-2's split).
    pub fn from_gguf(pre: Option<&str>) -> PreTokenizer {
        match pre {
            Some("smollm") => PreTokenizer::SmolLm,
            Some("qwen2") => PreTokenizer::Qwen2,
            _ => PreTokenizer::Gpt2,
        }
    }

    fn json(self) -> Value {
        let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
        match self {
            PreTokenizer::Gpt2 => byte_level(true),
            PreTokenizer::SmolLm => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            PreTokenizer::Qwen2 => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ]}),
        }
    }
}

const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// One added (whole-string matched) token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddedToken {
    /// Its id.
    pub id: u32,
    /// Its text.
    pub content: String,
    /// Special (control) tokens are dropped by `decode(.., skip_special_tokens = true)`.
    pub special: bool,
}

/// Assemble a byte-level BPE `tokenizer.json` document.
///
/// `vocab` holds every token string by id (byte-level characters, see [`bytes_to_unicode`]),
/// `merges` the merge rules `"a b"` by priority, `added` the tokens matched whole, and `bos`
/// a token the post-processor prepends when `encode(.., add_special_tokens = true)`.
pub fn byte_level_bpe_json(
    vocab: &[String],
    merges: &[String],
    added: &[AddedToken],
    pre: PreTokenizer,
    bos: Option<u32>,
) -> Value {
    let mut v = serde_json::Map::with_capacity(vocab.len());
    for (id, tok) in vocab.iter().enumerate() {
        // A repeated string keeps its first id, as llama.cpp's lookup does.
        v.entry(tok.clone()).or_insert(json!(id));
    }
    let added: Vec<Value> = added
        .iter()
        .map(|a| {
            json!({"id": a.id, "content": a.content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": a.special})
        })
        .collect();
    let post = match bos.and_then(|id| vocab.get(id as usize).map(|s| (id, s))) {
        Some((id, s)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": s, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": s, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": s, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {s.as_str(): {"id": s, "ids": [id], "tokens": [s]}},
        }),
        None => {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true})
        }
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre.json(),
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": Value::Object(v),
            "merges": merges,
        },
    })
}

/// A synthetic byte-level BPE vocabulary of exactly `vocab_size` entries: the ids in
/// `specials` hold those tokens; the other ids hold, in order, the 256 byte tokens and then
/// merged tokens generated by extending earlier tokens with a lowercase letter (breadth
/// first: `Ġa`, `Ġb`, ..., `ab`, ...), each with its merge rule. Returns (vocab, merges).
pub fn synthetic_bpe(vocab_size: usize, specials: &[(u32, &str)]) -> (Vec<String>, Vec<String>) {
    let bytes = bytes_to_unicode();
    let mut vocab: Vec<Option<String>> = vec![None; vocab_size];
    for &(id, s) in specials {
        if let Some(slot) = vocab.get_mut(id as usize) {
            *slot = Some(s.to_string());
        }
    }
    let mut seen: std::collections::HashSet<String> =
        specials.iter().map(|(_, s)| s.to_string()).collect();
    let mut merges = Vec::new();
    let base: Vec<String> = bytes.iter().map(|c| c.to_string()).collect();
    // Parts to extend, breadth first: the space marker and letters first, then merged tokens.
    let mut frontier: Vec<String> = std::iter::once('Ġ')
        .chain('a'..='z')
        .chain('A'..='Z')
        .map(String::from)
        .collect();
    let mut next_frontier = Vec::new();
    let mut fi = 0;
    let mut base_iter = base.into_iter();
    for slot in vocab.iter_mut().filter(|s| s.is_none()) {
        if let Some(b) = base_iter.next() {
            seen.insert(b.clone());
            *slot = Some(b);
            continue;
        }
        // Next merged token: frontier[fi] + letter, skipping strings already present.
        let tok = loop {
            if fi >= frontier.len() * 26 {
                frontier = std::mem::take(&mut next_frontier);
                fi = 0;
            }
            let (left, c) = (&frontier[fi / 26], (b'a' + (fi % 26) as u8) as char);
            fi += 1;
            let t = format!("{left}{c}");
            if seen.insert(t.clone()) {
                merges.push(format!("{left} {c}"));
                break t;
            }
        };
        next_frontier.push(tok.clone());
        *slot = Some(tok);
    }
    (
        vocab.into_iter().map(Option::unwrap_or_default).collect(),
        merges,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Tokenizer {
        let specials = [
            (509, "<|endoftext|>"),
            (510, "<|im_start|>"),
            (511, "<|im_end|>"),
        ];
        let (vocab, merges) = synthetic_bpe(512, &specials);
        let added: Vec<AddedToken> = specials
            .iter()
            .map(|&(id, s)| AddedToken {
                id,
                content: s.into(),
                special: true,
            })
            .collect();
        let j = byte_level_bpe_json(&vocab, &merges, &added, PreTokenizer::Gpt2, None);
        Tokenizer::from_json(&j.to_string()).unwrap()
    }

    #[test]
    fn bytes_to_unicode_is_a_bijection() {
        let m = bytes_to_unicode();
        let set: std::collections::HashSet<char> = m.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'a' as usize], 'a');
        assert_eq!(m[b'\n' as usize], 'Ċ');
    }

    #[test]
    fn synthetic_bpe_round_trips_text_and_uses_merges() {
        let t = tiny();
        assert_eq!(t.vocab_size(), 512);
        let text = "hello wörld, <|im_start|>user\nabc 123 ünïcode 😀<|im_end|>";
        let ids = t.encode(text, false).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        assert!(ids.contains(&510) && ids.contains(&511));
        // Merges apply: " a" is one token, fewer ids than bytes.
        assert!(ids.len() < text.len());
        assert_eq!(t.encode(" a", false).unwrap().len(), 1);
        assert_eq!(
            t.decode(&ids, true).unwrap(),
            "hello wörld, user\nabc 123 ünïcode 😀"
        );
    }

    #[test]
    fn bos_post_processor() {
        let (vocab, merges) = synthetic_bpe(300, &[(0, "<s>")]);
        let added = [AddedToken {
            id: 0,
            content: "<s>".into(),
            special: true,
        }];
        let j = byte_level_bpe_json(&vocab, &merges, &added, PreTokenizer::SmolLm, Some(0));
        let t = Tokenizer::from_json(&j.to_string()).unwrap();
        let ids = t.encode("a1", true).unwrap();
        assert_eq!(ids[0], 0);
        assert_eq!(t.encode("a1", false).unwrap(), ids[1..]);
        assert_eq!(t.decode(&ids, true).unwrap(), "a1");
    }
}
