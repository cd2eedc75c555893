//! The lexer of the `.graph` text: characters to tokens with line:col positions.
//!
//! Newlines are ordinary whitespace (statements are recognized by their first token), `#`
//! starts a comment to the end of the line, and every position is 1-based and counted in
//! characters, not bytes. The lexer never panics: bad input becomes a [`Diagnostic`].

use super::Diagnostic;

/// A 1-based `line:col` position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pos {
    pub line: usize,
    pub col: usize,
}

/// What a token is.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok {
    /// `[A-Za-z_][A-Za-z0-9_.-]*`.
    Ident(String),
    /// A numeric literal, kept as written: `12`, `-0.5`, `1e-5`, `-inf`.
    Num(String),
    /// A quoted string, escapes resolved.
    Str(String),
    /// `%N`, the digits kept as written.
    Value(String),
    /// One of `( ) { } [ ] , : = *`.
    Punct(char),
    /// End of input.
    Eof,
}

/// A token and where it starts.
#[derive(Clone, Debug)]
pub(crate) struct Token {
    pub tok: Tok,
    pub pos: Pos,
}

/// The longest literal text quoted back in a message.
const QUOTE_MAX: usize = 40;

/// Shortens `s` to at most [`QUOTE_MAX`] characters for a message.
pub(crate) fn clip(s: &str) -> String {
    if s.chars().count() <= QUOTE_MAX {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(QUOTE_MAX).collect();
        t.push_str("...");
        t
    }
}

impl Tok {
    /// How the token is quoted in "found ..." messages.
    pub(crate) fn describe(&self) -> String {
        match self {
            Tok::Ident(s) | Tok::Num(s) => format!("`{}`", clip(s)),
            Tok::Str(s) => format!("string {}", super::quote(&clip(s))),
            Tok::Value(d) => format!("`%{}`", clip(d)),
            Tok::Punct(c) => format!("`{c}`"),
            Tok::Eof => "end of input".to_string(),
        }
    }
}

/// Whether `c` can start an identifier.
pub(crate) fn ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

/// Whether `c` can continue an identifier.
pub(crate) fn ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
}

struct Lexer<'a> {
    chars: std::iter::Peekable<std::str::Chars<'a>>,
    pos: Pos,
    file: &'a str,
}

impl<'a> Lexer<'a> {
    fn peek(&mut self) -> Option<char> {
        self.chars.peek().copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.chars.next()?;
        if c == '\n' {
            self.pos.line = self.pos.line.saturating_add(1);
            self.pos.col = 1;
        } else {
            self.pos.col = self.pos.col.saturating_add(1);
        }
        Some(c)
    }

    fn err(&self, pos: Pos, msg: String) -> Diagnostic {
        Diagnostic { file: self.file.to_string(), line: pos.line, col: pos.col, msg }
    }

    fn take_while(&mut self, out: &mut String, f: impl Fn(char) -> bool) {
        while let Some(c) = self.peek() {
            if !f(c) {
                break;
            }
            out.push(c);
            self.bump();
        }
    }

    /// Digits, an optional fraction and an optional exponent; `out` may hold a leading `-`.
    fn number(&mut self, out: &mut String, start: Pos) -> Result<(), Diagnostic> {
        self.take_while(out, |c| c.is_ascii_digit());
        if self.peek() == Some('.') {
            out.push('.');
            self.bump();
            self.take_while(out, |c| c.is_ascii_digit());
        }
        if matches!(self.peek(), Some('e' | 'E')) {
            out.push('e');
            self.bump();
            if let Some(c @ ('+' | '-')) = self.peek() {
                out.push(c);
                self.bump();
            }
            let before = out.len();
            self.take_while(out, |c| c.is_ascii_digit());
            if out.len() == before {
                return Err(self.err(start, format!("expected digits in the exponent of `{}`", clip(out))));
            }
        }
        if let Some(c) = self.peek() {
            if ident_char(c) {
                return Err(self.err(self.pos, format!("unexpected character `{c}` after number `{}`", clip(out))));
            }
        }
        Ok(())
    }

    fn string(&mut self, start: Pos) -> Result<String, Diagnostic> {
        let mut s = String::new();
        loop {
            let here = self.pos;
            match self.bump() {
                None | Some('\n') => {
                    return Err(self.err(start, "unterminated string: expected a closing `\"` on the same line".to_string()))
                }
                Some('"') => return Ok(s),
                Some('\\') => match self.bump() {
                    Some('"') => s.push('"'),
                    Some('\\') => s.push('\\'),
                    Some('n') => s.push('\n'),
                    Some('t') => s.push('\t'),
                    Some(c) if c != '\n' => {
                        return Err(self.err(here, format!("unknown escape `\\{c}` in string (expected one of \\\" \\\\ \\n \\t)")))
                    }
                    _ => return Err(self.err(start, "unterminated string: expected a closing `\"` on the same line".to_string())),
                },
                Some(c) => s.push(c),
            }
        }
    }

    fn next(&mut self) -> Result<Token, Diagnostic> {
        // Whitespace and comments.
        loop {
            match self.peek() {
                Some(c) if c.is_whitespace() => {
                    self.bump();
                }
                Some('#') => {
                    while let Some(c) = self.peek() {
                        if c == '\n' {
                            break;
                        }
                        self.bump();
                    }
                }
                _ => break,
            }
        }
        let pos = self.pos;
        let Some(c) = self.peek() else {
            return Ok(Token { tok: Tok::Eof, pos });
        };
        let tok = match c {
            '(' | ')' | '{' | '}' | '[' | ']' | ',' | ':' | '=' | '*' => {
                self.bump();
                Tok::Punct(c)
            }
            '"' => {
                self.bump();
                Tok::Str(self.string(pos)?)
            }
            '%' => {
                self.bump();
                let mut d = String::new();
                self.take_while(&mut d, |c| c.is_ascii_digit());
                if d.is_empty() {
                    let found = self.peek().map_or("end of input".to_string(), |c| format!("`{c}`"));
                    return Err(self.err(pos, format!("expected a value number after `%`, found {found}")));
                }
                Tok::Value(d)
            }
            '-' => {
                self.bump();
                let mut s = String::from("-");
                match self.peek() {
                    Some(c) if c.is_ascii_digit() => self.number(&mut s, pos)?,
                    Some(c) if ident_start(c) => {
                        self.take_while(&mut s, ident_char);
                        if s != "-inf" {
                            return Err(self.err(pos, format!("expected a number after `-`, found `{}`", clip(&s[1..]))));
                        }
                    }
                    other => {
                        let found = other.map_or("end of input".to_string(), |c| format!("`{c}`"));
                        return Err(self.err(pos, format!("expected a number after `-`, found {found}")));
                    }
                }
                Tok::Num(s)
            }
            c if c.is_ascii_digit() => {
                let mut s = String::new();
                self.number(&mut s, pos)?;
                Tok::Num(s)
            }
            c if ident_start(c) => {
                let mut s = String::new();
                self.take_while(&mut s, ident_char);
                Tok::Ident(s)
            }
            c => return Err(self.err(pos, format!("unexpected character `{}`", c.escape_debug()))),
        };
        Ok(Token { tok, pos })
    }
}

/// Splits `src` into tokens, ending with one [`Tok::Eof`].
pub(crate) fn tokenize(src: &str, file: &str) -> Result<Vec<Token>, Diagnostic> {
    let mut lx = Lexer { chars: src.chars().peekable(), pos: Pos { line: 1, col: 1 }, file };
    let mut out = Vec::with_capacity(src.len() / 3 + 1);
    loop {
        let t = lx.next()?;
        let end = t.tok == Tok::Eof;
        out.push(t);
        if end {
            return Ok(out);
        }
    }
}
