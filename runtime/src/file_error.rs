//! Errors from reading and writing the llm.c data files (checkpoints, token files), plus the
//! small I/O helpers that the file formats share.
//!
//! Every failure names the file and says what is wrong with it in words a user can act on;
//! bad input never panics.

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Magic number in slot 0 of an llm.c checkpoint header.
pub const CHECKPOINT_MAGIC: i32 = 20240326;
/// Magic number in slot 0 of an llm.c token file header.
pub const TOKENS_MAGIC: i32 = 20240520;

/// Size in bytes of the llm.c file header: 256 little-endian int32 values.
pub const HEADER_BYTES: usize = 1024;

/// A failure to read or write a file: which file, and what is wrong with it.
/// Displays as `PATH: msg`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    /// The file concerned.
    pub path: PathBuf,
    /// What is wrong, in words (no path; `Display` adds it).
    pub msg: String,
}

impl FileError {
    /// An error about `path` with the message `msg`.
    pub fn new(path: &Path, msg: impl Into<String>) -> FileError {
        FileError { path: path.to_path_buf(), msg: msg.into() }
    }

    /// An I/O failure: `doing` says what was attempted ("cannot open"), `err` is appended.
    pub fn io(path: &Path, doing: &str, err: &std::io::Error) -> FileError {
        FileError::new(path, format!("{doing}: {err}"))
    }
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.msg)
    }
}

impl std::error::Error for FileError {}

/// The message as the CLI prints it (`PATH: msg`), so that `?` turns a [`FileError`] into the
/// `String` errors of the training code.
impl From<FileError> for String {
    fn from(e: FileError) -> String {
        e.to_string()
    }
}

/// Opens `path` for reading and returns the file with its length in bytes.
pub(crate) fn open_with_len(path: &Path) -> Result<(File, u64), FileError> {
    let file = File::open(path).map_err(|e| FileError::io(path, "cannot open", &e))?;
    let len = file.metadata().map_err(|e| FileError::io(path, "cannot read the file size", &e))?.len();
    Ok((file, len))
}

/// Reads the 256-int32 header of a file of `len` bytes; `what` names the kind of file
/// ("checkpoint", "token file") for the truncation message.
pub(crate) fn read_header(path: &Path, file: &mut File, len: u64, what: &str) -> Result<[i32; 256], FileError> {
    if len < HEADER_BYTES as u64 {
        return Err(FileError::new(
            path,
            format!(
                "truncated header: the file has {len} bytes, but a {what} header alone is \
                 {HEADER_BYTES} bytes (256 int32)"
            ),
        ));
    }
    let mut bytes = [0u8; HEADER_BYTES];
    file.read_exact(&mut bytes).map_err(|e| FileError::io(path, "cannot read the header", &e))?;
    let mut header = [0i32; 256];
    for (slot, chunk) in header.iter_mut().zip(bytes.chunks_exact(4)) {
        *slot = i32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
    }
    Ok(header)
}

/// Reads exactly `out.len()` bytes following the header, in bounded chunks so that
/// `convert` can turn them into values without a second full-size copy.
pub(crate) fn read_body(path: &Path, file: &mut File, total: usize, mut convert: impl FnMut(&[u8])) -> Result<(), FileError> {
    const CHUNK: usize = 1 << 20;
    let mut buf = vec![0u8; CHUNK.min(total)];
    let mut left = total;
    while left > 0 {
        let n = CHUNK.min(left);
        file.read_exact(&mut buf[..n]).map_err(|e| FileError::io(path, "cannot read the data after the header", &e))?;
        convert(&buf[..n]);
        left -= n;
    }
    Ok(())
}

/// Writes `path` atomically ([`crate::atomic`]): `header` (256 int32 LE) followed by the body
/// produced by `body`, which appends little-endian bytes to the buffer it is given (called once
/// per chunk, until it returns false).
pub(crate) fn write_file(path: &Path, header: &[i32; 256], mut body: impl FnMut(&mut Vec<u8>) -> bool) -> Result<(), FileError> {
    crate::atomic::write_atomic(path, |f| {
        let mut buf: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
        loop {
            let more = body(&mut buf);
            f.write(&buf)?;
            buf.clear();
            if !more {
                return Ok(());
            }
        }
    })
}

/// A message for a size mismatch between the bytes after the header and what the header
/// promises: `what` describes the data ("bytes of parameters ... for config X").
pub(crate) fn size_mismatch(expected: u64, found: u64, what: &str) -> String {
    if found < expected {
        format!("truncated data: expected {expected} {what}, found {found}")
    } else {
        format!("trailing bytes: expected {expected} {what}, found {found} ({} trailing bytes)", found - expected)
    }
}

/// The little-endian bytes of `v`: a view of the values on a little-endian host, a copy
/// otherwise.
pub(crate) fn f32_le_bytes(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: any f32 is 4 initialized bytes; u8 has alignment 1.
        std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) })
    } else {
        std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Fills `out` with little-endian f32 values read from `r` (one read on a little-endian host)
/// and feeds the bytes to `crc`.
pub(crate) fn read_f32s(r: &mut impl Read, out: &mut [f32], crc: &mut crc32fast::Hasher) -> std::io::Result<()> {
    // SAFETY: every bit pattern is a valid f32; the byte view covers exactly `out`.
    let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(out)) };
    r.read_exact(bytes)?;
    crc.update(bytes);
    if cfg!(target_endian = "big") {
        out.iter_mut().for_each(|x| *x = f32::from_bits(x.to_bits().swap_bytes()));
    }
    Ok(())
}
