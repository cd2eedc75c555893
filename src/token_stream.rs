//! Printing generated tokens as they are made: GPT-2 tokens as text (a multi-byte character
//! split between tokens is printed once complete), other vocabularies' tokens as ids.

use fusec_runtime::tokenizer::{Gpt2Tokenizer, GPT2_VOCAB};

/// Turns tokens into printable text, one token at a time.
pub struct TokenStream {
    /// The GPT-2 tokenizer, for GPT-2 vocabularies; ids are printed otherwise.
    tok: Option<Gpt2Tokenizer>,
    /// Bytes of an incomplete UTF-8 character, waiting for the next token.
    pending: Vec<u8>,
    /// Whether an id was printed (ids are separated by spaces).
    started: bool,
}

impl TokenStream {
    /// A stream for a model of vocabulary `vocab` (text when it is GPT-2's 50257).
    pub fn new(vocab: usize) -> Result<TokenStream, String> {
        let tok = if vocab == GPT2_VOCAB { Some(Gpt2Tokenizer::new()?) } else { None };
        Ok(TokenStream { tok, pending: vec![], started: false })
    }

    /// The text to print for `id`: what is complete so far.
    pub fn push(&mut self, id: u16) -> String {
        let Some(tok) = &self.tok else {
            let sep = if self.started { " " } else { "" };
            self.started = true;
            return format!("{sep}{id}");
        };
        self.pending.extend_from_slice(&tok.token_bytes(id));
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The bytes up to `valid` are UTF-8 (the error says so).
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_space_separated_outside_gpt2() {
        let mut s = TokenStream::new(256).unwrap();
        let text: String = [3u16, 17, 0].iter().map(|&t| s.push(t)).collect();
        assert_eq!(text + &s.finish(), "3 17 0");
    }

    #[test]
    fn streamed_gpt2_text_equals_the_decoded_text() {
        let tok = Gpt2Tokenizer::new().unwrap();
        let ids = tok.encode("naïve café, 日本語 — done");
        let mut s = TokenStream::new(GPT2_VOCAB).unwrap();
        let mut text: String = ids.iter().map(|&t| s.push(t)).collect();
        text += &s.finish();
        assert_eq!(text, tok.decode(&ids));
    }
}
