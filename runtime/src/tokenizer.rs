//! GPT-2's byte-pair encoding (tiktoken's `r50k_base`: 50257 tokens, `<|endoftext|>` = 50256),
//! for turning text into llm.c token files and generated ids back into text.
//!
//! The ranks are bundled in the `tiktoken-rs` crate, so nothing is fetched at run time.

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

/// The size of GPT-2's vocabulary (before padding to a multiple of 128).
pub const GPT2_VOCAB: usize = 50257;

/// GPT-2's byte-pair encoder and decoder.
pub struct Gpt2Tokenizer {
    bpe: CoreBPE,
}

impl Gpt2Tokenizer {
    /// The `<|endoftext|>` token: llm.c's data scripts put it before every document.
    pub const EOT: u16 = 50256;

    /// Builds the tokenizer from the ranks bundled in `tiktoken-rs` (about 50 ms).
    pub fn new() -> Result<Self, String> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| format!("cannot build the GPT-2 tokenizer (r50k_base): {e}"))?;
        Ok(Gpt2Tokenizer { bpe })
    }

    /// Encodes `text` as ordinary text: special tokens such as `<|endoftext|>` written in the
    /// text are encoded as their characters, never as [`Self::EOT`].
    ///
    /// Large texts are split at line starts (where a BPE piece always ends) and encoded on
    /// several threads; the result is the same as encoding the whole text at once.
    pub fn encode(&self, text: &str) -> Vec<u16> {
        const PARALLEL_MIN_BYTES: usize = 256 << 10;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        if threads < 2 || text.len() < PARALLEL_MIN_BYTES {
            return self.encode_serial(text);
        }
        let chunks = split_at_line_starts(text, threads);
        if chunks.len() < 2 {
            return self.encode_serial(text);
        }
        let parts: Vec<Vec<u16>> = std::thread::scope(|s| {
            let handles: Vec<_> = chunks.iter().map(|c| s.spawn(move || self.encode_serial(c))).collect();
            handles.into_iter().map(|h| h.join().expect("tokenizer thread panicked")).collect()
        });
        parts.concat()
    }

    /// Encodes one piece of text on the calling thread.
    fn encode_serial(&self, text: &str) -> Vec<u16> {
        self.bpe.encode_ordinary(text).into_iter().map(|r| u16::try_from(r).expect("GPT-2 token ids fit in u16")).collect()
    }

    /// Decodes `ids` into text. Byte sequences that are not valid UTF-8 (a multi-byte
    /// character cut between tokens) and ids outside the vocabulary become U+FFFD.
    pub fn decode(&self, ids: &[u16]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(&self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes of one token (not always whole UTF-8 characters: a multi-byte character may
    /// span tokens); U+FFFD's bytes for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u16) -> Vec<u8> {
        self.bpe.decode_bytes(&[u32::from(id)]).unwrap_or_else(|_| "\u{FFFD}".as_bytes().to_vec())
    }
}

/// Splits `text` into at most `parts` pieces of similar size, each cut just after a lone `\n`
/// (non-whitespace on both sides). GPT-2's pre-tokenizer makes that newline a piece of its
/// own whether or not the text ends there (no pattern joins a newline to letters, digits or
/// symbols, and `\s+$` at a piece's end then matches the same single newline that `\s`
/// matches in the whole text), so encoding the pieces gives the same ids. A cut after a
/// longer whitespace run would not be safe: at the end of a piece, `\s+$` would take the
/// whole run (`"\n\n"` = 628 instead of 198 198).
fn split_at_line_starts(text: &str, parts: usize) -> Vec<&str> {
    let bytes = text.as_bytes();
    let target = text.len().div_ceil(parts.max(1));
    let mut pieces = Vec::with_capacity(parts);
    let mut start = 0;
    while start < text.len() {
        let mut cut = (start + target).min(text.len());
        while cut < text.len() {
            let safe = bytes[cut - 1] == b'\n'
                && text[..cut - 1].chars().next_back().is_some_and(|c| !c.is_whitespace())
                && text[cut..].chars().next().is_some_and(|c| !c.is_whitespace());
            if safe {
                break;
            }
            cut += 1;
        }
        pieces.push(&text[start..cut]);
        start = cut;
    }
    pieces
}

/// A readable rendering of token ids: GPT-2 text when `vocab` is GPT-2's (50257), otherwise
/// the ids as numbers separated by spaces (models with their own vocabulary, like the tiny
/// demo, whose ids mean nothing to the GPT-2 tokenizer).
pub fn describe_tokens(ids: &[u16], vocab: usize) -> String {
    static TOKENIZER: OnceLock<Option<Gpt2Tokenizer>> = OnceLock::new();
    if vocab == GPT2_VOCAB {
        if let Some(tok) = TOKENIZER.get_or_init(|| Gpt2Tokenizer::new().ok()) {
            return tok.decode(ids);
        }
    }
    ids.iter().map(|id| id.to_string()).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_start_split_covers_the_text() {
        let text = "ab\ncd\n\n  ef\ngh\n".repeat(50);
        for parts in 1..8 {
            let pieces = split_at_line_starts(&text, parts);
            assert_eq!(pieces.concat(), text);
            assert!(pieces.len() <= parts + 1);
            for p in &pieces[1..] {
                assert!(!p.starts_with(char::is_whitespace));
            }
        }
    }

    #[test]
    fn parallel_encoding_matches_serial() {
        let tok = Gpt2Tokenizer::new().unwrap();
        let block = "First Citizen:\nBefore we proceed,  hear me speak.\n\nAll:\nSpeak, speak.\n \n\
                     It's 12 o'clock  \n\tnaïve café — 日本語\n\n\n";
        let mut text = String::new();
        let mut i = 0;
        while text.len() < 600 << 10 {
            text.push_str(&block[..block.len() - (i % 3)]);
            text.push_str(&format!("line {i}\n"));
            i += 1;
        }
        assert!(split_at_line_starts(&text, 4).len() > 1);
        assert_eq!(tok.encode(&text), tok.encode_serial(&text));
        for parts in [2, 3, 7] {
            let joined: Vec<u16> = split_at_line_starts(&text, parts).iter().flat_map(|p| tok.encode_serial(p)).collect();
            assert_eq!(joined, tok.encode_serial(&text), "{parts} parts");
        }
    }

    #[test]
    fn parallel_encoding_matches_serial_on_tinyshakespeare() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/tinyshakespeare.txt");
        let Ok(text) = std::fs::read_to_string(path) else {
            println!("skipped: {path} not found");
            return;
        };
        let tok = Gpt2Tokenizer::new().unwrap();
        assert!(split_at_line_starts(&text, 8).len() > 1);
        let serial = tok.encode_serial(&text);
        let joined: Vec<u16> = split_at_line_starts(&text, 8).iter().flat_map(|p| tok.encode_serial(p)).collect();
        assert_eq!(joined, serial);
        assert_eq!(tok.encode(&text), serial);
    }
}
