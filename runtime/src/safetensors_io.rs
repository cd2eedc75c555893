//! Safetensors files (Hugging Face's weight format), one tensor at a time.
//!
//! Format: an 8-byte little-endian header length N, N bytes of JSON naming each tensor's dtype,
//! shape and `data_offsets` (from the end of the header; optional `__metadata__` strings), then
//! the data, row-major and little-endian. The `safetensors` crate parses, checks and prints the
//! header (offsets contiguous, sizes matching dtype and shape, no overflow); the data is read
//! and written here, one tensor at a time, so no whole model is ever in memory:
//! [`SafetensorsReader`] reads any F32, F16, BF16 or F64 tensor as f32, and
//! [`SafetensorsWriter`] writes f32 tensors in a declared order through an atomic file
//! ([`crate::atomic`]). Every error names the file, and the tensor where there is one.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, TensorInfo};

use crate::atomic::PendingFile;
use crate::file_error::{self, FileError};

/// The largest header accepted (the `safetensors` crate's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// Whether [`SafetensorsReader::read_f32`] reads tensors of this dtype.
pub fn readable(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64)
}

/// An open safetensors file whose header has been read and checked against the file's size.
pub struct SafetensorsReader {
    path: PathBuf,
    file: File,
    /// Byte offset of the data: 8 + the header length.
    data_start: u64,
    meta: Metadata,
}

impl SafetensorsReader {
    /// Opens `path` and reads its header; the file must hold exactly the data the header
    /// describes (a truncated file or trailing bytes are errors).
    pub fn open(path: &Path) -> Result<SafetensorsReader, FileError> {
        let (mut file, len) = file_error::open_with_len(path)?;
        let not_st = |msg: String| FileError::new(path, format!("not a safetensors file: {msg}"));
        if len < 8 {
            return Err(not_st(format!("it has {len} bytes, fewer than the 8 of the header length")));
        }
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(|e| FileError::io(path, "cannot read the header length", &e))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || n > len - 8 {
            return Err(not_st(format!("the header length {n} is larger than the file ({len} bytes) or than {MAX_HEADER}")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header).map_err(|e| FileError::io(path, "cannot read the header", &e))?;
        let text = std::str::from_utf8(&header).map_err(|_| not_st("the header is not UTF-8 text".into()))?;
        let meta: Metadata = serde_json::from_str(text).map_err(|e| not_st(format!("bad header: {e}")))?;
        let want = 8 + n + meta.data_len() as u64;
        if want != len {
            let what = if want > len { "truncated" } else { "trailing bytes" };
            return Err(FileError::new(path, format!("{what}: the header describes {want} bytes, the file has {len}")));
        }
        Ok(SafetensorsReader { path: path.to_path_buf(), file, data_start: 8 + n, meta })
    }

    /// The tensor names, in the order of their data in the file.
    pub fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }

    /// The dtype, shape and data offsets of a tensor, if the file has it.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.meta.info(name)
    }

    /// The header's `__metadata__` strings.
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.meta.metadata().as_ref()
    }

    /// Reads tensor `name` into `out` as f32 (F16, BF16 exactly, F64 rounded to nearest).
    pub fn read_f32(&mut self, name: &str, out: &mut Vec<f32>) -> Result<(), FileError> {
        let info = self.meta.info(name).ok_or_else(|| FileError::new(&self.path, format!("no tensor `{name}`")))?;
        let (dtype, (begin, end)) = (info.dtype, info.data_offsets);
        let decode: fn(&[u8]) -> f32 = match dtype {
            Dtype::F32 => |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Dtype::F16 => |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
            Dtype::BF16 => |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            Dtype::F64 => |b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32,
            other => {
                return Err(FileError::new(
                    &self.path,
                    format!("tensor `{name}` is stored as {other}; only F32, F16, BF16 and F64 can be read"),
                ))
            }
        };
        let width = dtype.bitsize() / 8;
        out.clear();
        out.reserve((end - begin) / width);
        self.file
            .seek(SeekFrom::Start(self.data_start + begin as u64))
            .map_err(|e| FileError::io(&self.path, &format!("cannot seek to tensor `{name}`"), &e))?;
        // Chunks of the reader are multiples of 8 bytes: no value straddles two.
        file_error::read_body(&self.path, &mut self.file, end - begin, |chunk| out.extend(chunk.chunks_exact(width).map(decode)))
    }
}

/// A safetensors file being written: f32 tensors declared up front (the header comes first),
/// then their data in the declared order.
pub struct SafetensorsWriter {
    out: PendingFile,
    path: PathBuf,
    /// The declared tensors, and how many of them were written.
    tensors: Vec<(String, Vec<usize>)>,
    written: usize,
}

impl SafetensorsWriter {
    /// Starts `dest` (as its temporary file) with the header for `tensors`, all F32, stored in
    /// this order, and the `__metadata__` strings `metadata`.
    pub fn create(
        dest: &Path,
        tensors: Vec<(String, Vec<usize>)>,
        metadata: HashMap<String, String>,
    ) -> Result<SafetensorsWriter, FileError> {
        let bad = |m: String| FileError::new(dest, format!("cannot write a safetensors file: {m}"));
        let mut infos = Vec::with_capacity(tensors.len());
        let mut offset = 0usize;
        for (name, shape) in &tensors {
            let bytes = shape.iter().try_fold(4usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad(format!("`{name}` is too large")))?;
            let end = offset.checked_add(bytes).ok_or_else(|| bad("the tensors are too large".into()))?;
            infos.push((name.clone(), TensorInfo { dtype: Dtype::F32, shape: shape.clone(), data_offsets: (offset, end) }));
            offset = end;
        }
        let meta = Metadata::new(Some(metadata), infos).map_err(|e| bad(e.to_string()))?;
        let mut header = serde_json::to_string(&meta).map_err(|e| bad(e.to_string()))?.into_bytes();
        // The data starts 8-byte aligned, as the `safetensors` crate writes it.
        header.resize(header.len().next_multiple_of(8), b' ');
        let mut out = PendingFile::create(dest)?;
        out.write(&(header.len() as u64).to_le_bytes())?;
        out.write(&header)?;
        Ok(SafetensorsWriter { out, path: dest.to_path_buf(), tensors, written: 0 })
    }

    /// Writes the next declared tensor: `name` and the number of values must be its.
    pub fn write(&mut self, name: &str, data: &[f32]) -> Result<(), FileError> {
        let Some((want, shape)) = self.tensors.get(self.written) else {
            return Err(FileError::new(&self.path, format!("internal: tensor `{name}` was not declared")));
        };
        let n: usize = shape.iter().product();
        if want != name || data.len() != n {
            return Err(FileError::new(
                &self.path,
                format!("internal: wrote `{name}` ({} values) where `{want}` ({n} values) was declared", data.len()),
            ));
        }
        self.out.write(&file_error::f32_le_bytes(data))?;
        self.written += 1;
        Ok(())
    }

    /// Flushes the file to disk and renames it over its destination; every declared tensor
    /// must have been written.
    pub fn finish(self) -> Result<(), FileError> {
        if let Some((name, _)) = self.tensors.get(self.written) {
            return Err(FileError::new(&self.path, format!("internal: tensor `{name}` was declared but not written")));
        }
        self.out.finish()?.commit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("fusec-st-{}-{name}", std::process::id()))
    }

    #[test]
    fn written_files_read_back_and_the_crate_agrees() {
        let p = tmp("rt.safetensors");
        let tensors = vec![("b".to_string(), vec![2, 3]), ("a".to_string(), vec![4])];
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let mut w = SafetensorsWriter::create(&p, tensors, meta).unwrap();
        w.write("b", &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]).unwrap();
        w.write("a", &[-1.0, 0.25, 1e-30, 7.0]).unwrap();
        w.finish().unwrap();
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("b").unwrap().shape(), &[2, 3]);
        let mut r = SafetensorsReader::open(&p).unwrap();
        assert_eq!(r.names(), ["b", "a"]);
        assert_eq!(r.metadata().unwrap()["format"], "pt");
        let mut v = vec![];
        r.read_f32("a", &mut v).unwrap();
        assert_eq!(v, [-1.0, 0.25, 1e-30, 7.0]);
        r.read_f32("b", &mut v).unwrap();
        assert_eq!(v, [1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn bad_files_are_named_errors() {
        let p = tmp("bad.safetensors");
        for (bytes, want) in [
            (vec![1u8, 2, 3], "fewer than the 8"),
            (u64::MAX.to_le_bytes().to_vec(), "header length"),
            ([&4u64.to_le_bytes()[..], b"{]]]"].concat(), "bad header"),
            ([&2u64.to_le_bytes()[..], b"{}", b"xx"].concat(), "trailing bytes"),
        ] {
            std::fs::write(&p, &bytes).unwrap();
            let e = SafetensorsReader::open(&p).err().unwrap().to_string();
            assert!(e.contains(want) && e.contains("bad.safetensors"), "{e}");
        }
        let _ = std::fs::remove_file(p);
    }
}
