//! The tokenizer: a thin wrapper over the `tokenizers` crate reading a Hugging Face
//! `tokenizer.json` (byte-level BPE for every Qwen model), plus the per-token byte table the
//! streaming detokenizer needs.
//!
//! It must not apply chat templates or know about roles; special tokens written in the text
//! (`<|im_start|>`) are matched by the added-token table exactly as transformers does. Ids match
//! transformers' `PreTrainedTokenizerFast` because it is the same Rust code underneath.

use std::path::Path;

use tokenizers::DecoderWrapper;

use super::{Result, TextError};

/// One past the largest token id accepted (2^24: 64 times the largest real vocabulary), so a
/// hostile id near 2^32 cannot make the byte table allocate gigabytes.
const MAX_ID_BOUND: u32 = 1 << 24;

/// A loaded `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Ids of added tokens marked `special: true`, sorted (skipped by `decode(.., true)`).
    special_ids: Vec<u32>,
    /// Raw bytes of every token, for the streaming detokenizer. Built at load: built lazily,
    /// the first generated token paid for it (75 ms for Qwen3.6's 248k ids on dev-2c).
    pieces: TokenPieces,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special_ids", &self.special_ids.len())
            .finish()
    }
}

/// The bytes each id decodes to, flat: id `i` is `bytes[offsets[i]..offsets[i + 1]]`.
struct TokenPieces {
    bytes: Vec<u8>,    // [sum of token lengths] u8
    offsets: Vec<u32>, // [id_bound + 1]
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = super::read_file(path, crate::util::MAX_TOKENIZER)?;
        Self::from_bytes_named(&bytes, path)
    }

    /// Loads a tokenizer from the bytes of a `tokenizer.json` (for embedded or compressed
    /// copies).
    pub fn from_bytes(json: &[u8]) -> Result<Self> {
        Self::from_bytes_named(json, Path::new("<memory>"))
    }

    /// Loads `model_dir/tokenizer.json`; `Ok(None)` when the checkpoint ships no tokenizer
    /// (brook can still run on ids).
    pub fn from_dir(model_dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let path = model_dir.as_ref().join("tokenizer.json");
        if !path.is_file() {
            return Ok(None);
        }
        Self::from_file(&path).map(Some)
    }

    fn from_bytes_named(json: &[u8], path: &Path) -> Result<Self> {
        let load_error = |message: String| TextError::TokenizerLoad {
            path: path.to_path_buf(),
            message,
        };
        // The tokenizers crate panics on some malformed files (an `expect` while it reads a
        // decoder; found by fuzzing): a bad file must be an error, not a crash.
        let inner = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(json))
            .map_err(|_| {
                load_error(
                    "the tokenizers library could not read this file (it failed inside); the file is malformed".into(),
                )
            })?
            .map_err(|e| load_error(e.to_string()))?;
        let added = inner.get_added_tokens_decoder();
        let mut special_ids: Vec<u32> = added
            .iter()
            .filter(|(_, tok)| tok.special)
            .map(|(id, _)| *id)
            .collect();
        special_ids.sort_unstable();
        let vocab = inner.get_vocab(false);
        let max_vocab = vocab.values().copied().max();
        let max_added = added.keys().copied().max();
        let id_bound = max_vocab.max(max_added).map_or(0, |m| m.saturating_add(1));
        if id_bound > MAX_ID_BOUND {
            return Err(TextError::TokenizerLoad {
                path: path.to_path_buf(),
                message: format!(
                    "token id {} is beyond the largest vocabulary brook accepts ({MAX_ID_BOUND} ids); the file is corrupt or not a language model's tokenizer",
                    id_bound - 1
                ),
            });
        }
        let pieces = build_pieces(&inner, &vocab, &added, id_bound);
        Ok(Self {
            inner,
            special_ids,
            pieces,
        })
    }

    /// Encodes `text`. Special tokens written in the text (`<|im_start|>`) become their ids.
    /// `add_special_tokens` runs the post-processor (Qwen's adds nothing: no BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TextError::Tokenizer {
                op: "encode",
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes `ids`; `skip_special` drops added tokens marked special (`<|im_end|>`), but not
    /// `<think>` or `<tool_call>`, which Qwen marks non-special. Invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TextError::Tokenizer {
                op: "decode",
                message: e.to_string(),
            })
    }

    /// The id of a token string as it appears in the vocabulary (byte-level form for BPE
    /// pieces, e.g. `"Ġworld"`), or of an added token (`"<|im_end|>"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary string of an id (byte-level form for BPE pieces).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of tokens including added tokens (151,669 for Qwen3). The model's embedding is
    /// usually padded beyond this (151,936).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether `id` is an added token marked `special: true`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.binary_search(&id).is_ok()
    }

    /// The raw bytes `id` stands for (an emoji may be split over several ids, each holding part
    /// of its UTF-8 encoding). Empty for ids outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let p = &self.pieces;
        let i = id as usize;
        match (p.offsets.get(i), p.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => &p.bytes[a as usize..b as usize],
            _ => &[],
        }
    }
}

/// The byte table of every id below `id_bound`, from the vocabulary map (one pass over it,
/// no per-id lookups).
fn build_pieces<'a>(
    inner: &tokenizers::Tokenizer,
    vocab: &'a std::collections::HashMap<String, u32>,
    added: impl IntoIterator<Item = (&'a u32, &'a tokenizers::AddedToken)>,
    id_bound: u32,
) -> TokenPieces {
    let byte_level = matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
    // Each id's vocabulary piece, or its added token's text (`true`: taken as it is).
    let mut by_id: Vec<Option<(&str, bool)>> = vec![None; id_bound as usize];
    for (piece, &id) in vocab {
        if let Some(slot) = by_id.get_mut(id as usize) {
            *slot = Some((piece.as_str(), false));
        }
    }
    for (&id, tok) in added {
        if let Some(slot) = by_id.get_mut(id as usize) {
            *slot = Some((tok.content.as_str(), true));
        }
    }
    let mut bytes = Vec::with_capacity(id_bound as usize * 8);
    let mut offsets = Vec::with_capacity(id_bound as usize + 1);
    offsets.push(0u32);
    let table = byte_level_table();
    for (id, piece) in (0..id_bound).zip(&by_id) {
        match *piece {
            Some((text, true)) => bytes.extend_from_slice(text.as_bytes()),
            Some((piece, false)) => {
                if byte_level {
                    bytes.extend(piece.chars().map(|c| byte_level_char_to_byte(&table, c)));
                } else if let Ok(text) = inner.decode(&[id], false) {
                    // Not byte-level (no Qwen model): a lone piece's text is the best we have.
                    bytes.extend_from_slice(text.as_bytes());
                }
            }
            None => {}
        }
        offsets.push(u32::try_from(bytes.len()).unwrap_or(u32::MAX));
    }
    TokenPieces { bytes, offsets }
}

/// Inverse of GPT-2's `bytes_to_unicode`, indexed by code point: printable Latin-1 bytes stand
/// for themselves, the other 68 bytes were shifted to U+0100..U+0143 in order.
fn byte_level_table() -> [u8; 324] {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut table = [0u8; 324];
    let mut shifted = 256usize;
    for b in 0u8..=255 {
        if printable(u32::from(b)) {
            table[usize::from(b)] = b;
        } else {
            table[shifted] = b;
            shifted += 1;
        }
    }
    table
}

fn byte_level_char_to_byte(table: &[u8; 324], c: char) -> u8 {
    // A character outside the table is not byte-level output: keep its low byte rather than
    // fail a stream.
    table
        .get(c as usize)
        .copied()
        .unwrap_or((c as u32 & 0xff) as u8)
}

#[cfg(test)]
mod tests {
    use super::{byte_level_char_to_byte, byte_level_table};

    #[test]
    fn byte_level_map_inverts_gpt2_table() {
        let t = byte_level_table();
        assert_eq!(byte_level_char_to_byte(&t, 'A'), b'A');
        assert_eq!(byte_level_char_to_byte(&t, 'Ġ'), b' ');
        assert_eq!(byte_level_char_to_byte(&t, 'Ċ'), b'\n');
        assert_eq!(byte_level_char_to_byte(&t, '\u{100}'), 0);
        assert_eq!(byte_level_char_to_byte(&t, 'ÿ'), 0xff);
    }
}
