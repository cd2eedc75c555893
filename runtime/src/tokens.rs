//! llm.c token files (`*.bin` from the data scripts, version 1 = uint16 GPT-2 tokens).
//!
//! Format (all little-endian): a header of 256 int32 — magic 20240520, version 1, the token
//! count N, the rest 0 — then N uint16 token ids. The file is exactly 1024 + 2N bytes.

use std::path::Path;

pub use crate::file_error::TOKENS_MAGIC;
use crate::file_error::{self, FileError, CHECKPOINT_MAGIC, HEADER_BYTES};

/// The only supported token file version (uint16 ids).
pub const TOKENS_VERSION: i32 = 1;

/// Reads a token file, checking magic, version and that the file holds exactly N tokens
/// (errors on truncation and on trailing bytes).
pub fn read_tokens(path: &Path) -> Result<Vec<u16>, FileError> {
    let (mut file, len) = file_error::open_with_len(path)?;
    let h = file_error::read_header(path, &mut file, len, "token file")?;
    if h[0] != TOKENS_MAGIC {
        let hint = if h[0] == CHECKPOINT_MAGIC { " (that is the magic of a checkpoint, not a token file)" } else { "" };
        return Err(FileError::new(path, format!("wrong magic number: expected {TOKENS_MAGIC} (llm.c token file), found {}{hint}", h[0])));
    }
    if h[1] != TOKENS_VERSION {
        let hint = if h[1] == 2 { " (version 2 holds uint32 LLaMA-3 tokens)" } else { "" };
        return Err(FileError::new(
            path,
            format!(
                "unsupported token file version {}{hint}: only version {TOKENS_VERSION} \
                 (uint16 tokens) is supported",
                h[1]
            ),
        ));
    }
    let n = usize::try_from(h[2])
        .map_err(|_| FileError::new(path, format!("bad header: the token count is {} (header slot 2); it must be >= 0", h[2])))?;
    let expected = 2 * n as u64;
    let found = len - HEADER_BYTES as u64;
    if found != expected {
        let what = format!("bytes of tokens after the header for {n} tokens");
        return Err(FileError::new(path, file_error::size_mismatch(expected, found, &what)));
    }
    let mut tokens = Vec::with_capacity(n);
    file_error::read_body(path, &mut file, 2 * n, |bytes| {
        tokens.extend(bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])));
    })?;
    Ok(tokens)
}

/// Writes `tokens` as a version-1 llm.c token file. Fails if there are more than
/// `i32::MAX` tokens (the header cannot count them).
pub fn write_tokens(path: &Path, tokens: &[u16]) -> Result<(), FileError> {
    let n = i32::try_from(tokens.len()).map_err(|_| {
        FileError::new(path, format!("cannot write token file: {} tokens do not fit the int32 count in the header", tokens.len()))
    })?;
    let mut header = [0i32; 256];
    header[0] = TOKENS_MAGIC;
    header[1] = TOKENS_VERSION;
    header[2] = n;
    let mut chunks = tokens.chunks(1 << 19);
    file_error::write_file(path, &header, |buf| match chunks.next() {
        Some(c) => {
            buf.extend(c.iter().flat_map(|t| t.to_le_bytes()));
            true
        }
        None => false,
    })
}
