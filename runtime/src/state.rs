//! The training-state file (`state.bin`): everything besides the parameters that a resumed run
//! needs to continue bit for bit — a few named scalars and the optimizer's tensors.
//!
//! Format, all integers little-endian:
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | magic `FUSECSTA` |
//! | 4 | version (u32, [`STATE_VERSION`]) |
//! | 4 + n | meta: length (u32), then UTF-8 `key=value` lines ([`Meta`]) |
//! | 4 | tensor count (u32) |
//! | per tensor | name length (u16), name (UTF-8), dtype (u8: 0 f32, 1 bf16), rank (u8), dims (u64 each), the values (f32 or bf16 bits, little-endian) |
//! | 4 | CRC-32 of every byte before it |
//! | 8 | end mark `FUSECEND` |
//!
//! A torn, truncated or corrupted file fails the checksum or the structure checks with an error
//! naming the file; nothing is allocated from a size before it is checked against the file's
//! length.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use fusec_ir::DType;

use crate::atomic::PendingFile;
use crate::file_error::{self, FileError};

/// The first 8 bytes of a state file.
pub const STATE_MAGIC: [u8; 8] = *b"FUSECSTA";
/// The last 8 bytes of a state file.
const END_MARK: [u8; 8] = *b"FUSECEND";
/// The state file version this build writes and reads.
pub const STATE_VERSION: u32 = 1;
/// Bounds that keep a corrupt header from asking for absurd allocations.
const MAX_META: u32 = 1 << 20;
const MAX_RANK: u8 = 8;

/// The scalar part of a state file: `key=value` pairs in the order they were set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Meta {
    pairs: Vec<(String, String)>,
}

impl Meta {
    /// Sets `key` (letters, digits, `_`, `.`, `-`) to `value` (one line), replacing an old value.
    pub fn set(&mut self, key: &str, value: impl std::fmt::Display) {
        let value = value.to_string().replace('\n', " ");
        match self.pairs.iter_mut().find(|(k, _)| k == key) {
            Some(p) => p.1 = value,
            None => self.pairs.push((key.to_string(), value)),
        }
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// The value of `key` parsed as a `T`; the error names the key.
    pub fn parse<T: FromStr>(&self, key: &str) -> Result<T, String> {
        let v = self.get(key).ok_or_else(|| format!("the state has no `{key}`"))?;
        v.parse().map_err(|_| format!("the state's `{key}` is `{v}`, not a valid value"))
    }

    /// Every pair, in order.
    pub fn pairs(&self) -> &[(String, String)] {
        &self.pairs
    }

    fn to_text(&self) -> String {
        self.pairs.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
    }

    fn from_text(text: &str) -> Result<Meta, String> {
        let mut m = Meta::default();
        for line in text.lines() {
            let (k, v) = line.split_once('=').ok_or_else(|| format!("meta line `{line}` is not `key=value`"))?;
            m.set(k, v);
        }
        Ok(m)
    }
}

/// Puts the values of one state tensor, by name, into the buffer it is given.
pub type TensorFetch<'a> = dyn FnMut(&str, &mut Vec<f32>) -> Result<(), String> + 'a;

/// Receives one state tensor at a time: name, dtype, shape, values widened to f32.
pub type TensorSink<'a> = dyn FnMut(&str, DType, &[usize], &[f32]) -> Result<(), String> + 'a;

/// The dtypes a state tensor may have, with their codes.
fn dtype_code(d: DType) -> Result<u8, String> {
    match d {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        d => Err(format!("a state file holds f32 and bf16 tensors, not {d}")),
    }
}

/// Writes a state file into `out`: `meta`, then each of `tensors` (name, dtype, shape) with the
/// values `fetch(name, buffer)` puts in one buffer, then the checksum.
pub fn write_state(
    out: &mut PendingFile,
    meta: &Meta,
    tensors: &[(String, DType, Vec<usize>)],
    fetch: &mut TensorFetch,
) -> Result<(), String> {
    let text = meta.to_text();
    let mut head = STATE_MAGIC.to_vec();
    head.extend(STATE_VERSION.to_le_bytes());
    head.extend((text.len() as u32).to_le_bytes());
    head.extend(text.as_bytes());
    head.extend((tensors.len() as u32).to_le_bytes());
    let w = |out: &mut PendingFile, b: &[u8]| out.write(b).map_err(String::from);
    w(out, &head)?;
    let mut v = vec![];
    for (name, dtype, shape) in tensors {
        let mut rec = (name.len() as u16).to_le_bytes().to_vec();
        rec.extend(name.as_bytes());
        rec.push(dtype_code(*dtype)?);
        rec.push(shape.len() as u8);
        shape.iter().for_each(|&d| rec.extend((d as u64).to_le_bytes()));
        w(out, &rec)?;
        fetch(name, &mut v)?;
        if v.len() != shape.iter().product::<usize>() {
            return Err(format!("state tensor `{name}` has {} values for shape {shape:?}", v.len()));
        }
        match dtype {
            DType::BF16 => w(
                out,
                &v.iter().flat_map(|&x| ((fusec_ir::interp::bf16_of_f32(x).to_bits() >> 16) as u16).to_le_bytes()).collect::<Vec<u8>>(),
            )?,
            _ => w(out, &file_error::f32_le_bytes(&v))?,
        }
    }
    let crc = out.crc();
    w(out, &crc.to_le_bytes())?;
    w(out, &END_MARK)
}

/// An open state file, read up to its tensors.
pub struct StateReader {
    path: PathBuf,
    r: BufReader<File>,
    /// Bytes not yet read.
    left: u64,
    crc: crc32fast::Hasher,
    count: u32,
    /// The scalars.
    pub meta: Meta,
}

impl StateReader {
    /// Opens `path` and reads its header and scalars (checking magic and version).
    pub fn open(path: &Path) -> Result<StateReader, String> {
        let (file, len) = file_error::open_with_len(path)?;
        let mut s = StateReader {
            path: path.to_path_buf(),
            r: BufReader::with_capacity(1 << 20, file),
            left: len,
            crc: Default::default(),
            count: 0,
            meta: Meta::default(),
        };
        let mut magic = [0u8; 8];
        s.bytes(&mut magic, "magic")?;
        if magic != STATE_MAGIC {
            return Err(s.err(format!("not a fusec state file (magic {magic:?}, expected `FUSECSTA`)")));
        }
        let version = s.u32("version")?;
        if version != STATE_VERSION {
            return Err(s.err(format!("state file version {version}: this fusec reads version {STATE_VERSION}")));
        }
        let n = s.u32("meta length")?;
        if n > MAX_META {
            return Err(s.err(format!("meta of {n} bytes (at most {MAX_META})")));
        }
        let mut text = vec![0u8; n as usize];
        s.bytes(&mut text, "meta")?;
        let text = String::from_utf8(text).map_err(|_| s.err("the meta is not UTF-8"))?;
        s.meta = Meta::from_text(&text).map_err(|e| s.err(e))?;
        s.count = s.u32("tensor count")?;
        Ok(s)
    }

    fn err(&self, msg: impl Into<String>) -> String {
        FileError::new(&self.path, msg).to_string()
    }

    /// Reads exactly `out.len()` bytes (checked against the bytes left first).
    fn bytes(&mut self, out: &mut [u8], what: &str) -> Result<(), String> {
        if (out.len() as u64) > self.left {
            return Err(self.err(format!("truncated: {what} needs {} bytes, {} left (a torn or partial file)", out.len(), self.left)));
        }
        self.r.read_exact(out).map_err(|e| self.err(format!("cannot read {what}: {e}")))?;
        self.crc.update(out);
        self.left -= out.len() as u64;
        Ok(())
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let mut b = [0u8; 4];
        self.bytes(&mut b, what)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Reads every tensor, handing each to `sink` (name, dtype, shape, values widened to f32),
    /// then checks the checksum and the end of the file. A sink error stops the reading.
    pub fn read_tensors(mut self, sink: &mut TensorSink) -> Result<(), String> {
        let mut buf: Vec<f32> = vec![];
        for _ in 0..self.count {
            let mut b2 = [0u8; 2];
            self.bytes(&mut b2, "a tensor name's length")?;
            let mut name = vec![0u8; u16::from_le_bytes(b2) as usize];
            self.bytes(&mut name, "a tensor name")?;
            let name = String::from_utf8(name).map_err(|_| self.err("a tensor name is not UTF-8"))?;
            self.bytes(&mut b2, "a tensor's dtype and rank")?;
            let dtype = match b2[0] {
                0 => DType::F32,
                1 => DType::BF16,
                c => return Err(self.err(format!("tensor `{name}` has unknown dtype code {c}"))),
            };
            if b2[1] > MAX_RANK {
                return Err(self.err(format!("tensor `{name}` has rank {} (at most {MAX_RANK})", b2[1])));
            }
            let mut shape = vec![];
            for _ in 0..b2[1] {
                let mut d = [0u8; 8];
                self.bytes(&mut d, "a tensor's dims")?;
                shape.push(usize::try_from(u64::from_le_bytes(d)).map_err(|_| self.err(format!("tensor `{name}` is too large")))?);
            }
            let width = if dtype == DType::BF16 { 2 } else { 4 };
            let n = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).filter(|&n| (n as u64).saturating_mul(width) <= self.left);
            let n = n.ok_or_else(|| {
                self.err(format!("truncated: tensor `{name}` of shape {shape:?} does not fit in the {} bytes left", self.left))
            })?;
            buf.resize(n, 0.0);
            if dtype == DType::BF16 {
                let mut raw = vec![0u8; 2 * n];
                self.bytes(&mut raw, "tensor values")?;
                buf.iter_mut()
                    .zip(raw.chunks_exact(2))
                    .for_each(|(x, b)| *x = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16));
            } else {
                let (r, crc) = (&mut self.r, &mut self.crc);
                file_error::read_f32s(r, &mut buf, crc)
                    .map_err(|e| FileError::new(&self.path, format!("cannot read tensor `{name}`: {e}")).to_string())?;
                self.left -= 4 * n as u64;
            }
            sink(&name, dtype, &shape, &buf)?;
        }
        let want = self.crc.clone().finalize();
        let mut tail = [0u8; 12];
        self.bytes(&mut tail, "the checksum")?;
        let found = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
        if found != want || tail[4..] != END_MARK {
            return Err(self.err(format!("checksum mismatch (stored {found:08x}, computed {want:08x}): the file is torn or corrupt")));
        }
        if self.left != 0 {
            return Err(self.err(format!("{} trailing bytes after the end mark", self.left)));
        }
        Ok(())
    }

    /// Reads the whole file only to check it (structure and checksum); returns its scalars.
    pub fn verify(path: &Path) -> Result<Meta, String> {
        let r = StateReader::open(path)?;
        let meta = r.meta.clone();
        r.read_tensors(&mut |_, _, _, _| Ok(()))?;
        Ok(meta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Tensors = Vec<(String, DType, Vec<usize>, Vec<f32>)>;

    fn sample(path: &Path) -> (Meta, Tensors) {
        let mut meta = Meta::default();
        meta.set("step", 7);
        meta.set("first_loss", 5.531234567891234f64);
        let tensors = vec![
            ("m.wte".to_string(), DType::F32, vec![3, 2], vec![1.0, -2.5, 3.25, f32::MIN_POSITIVE, 0.0, 1e-30]),
            ("v.wte".to_string(), DType::BF16, vec![2], vec![1.5, -0.0078125]),
            ("scalar".to_string(), DType::F32, vec![], vec![42.0]),
        ];
        let specs: Vec<_> = tensors.iter().map(|(n, d, s, _)| (n.clone(), *d, s.clone())).collect();
        let mut f = PendingFile::create(path).unwrap();
        write_state(&mut f, &meta, &specs, &mut |name, v| {
            *v = tensors.iter().find(|t| t.0 == name).unwrap().3.clone();
            Ok(())
        })
        .unwrap();
        f.finish().unwrap().commit().unwrap();
        (meta, tensors)
    }

    fn read_all(path: &Path) -> Result<(Meta, Tensors), String> {
        let r = StateReader::open(path)?;
        let meta = r.meta.clone();
        let mut got = vec![];
        r.read_tensors(&mut |n, d, s, v| {
            got.push((n.to_string(), d, s.to_vec(), v.to_vec()));
            Ok(())
        })?;
        Ok((meta, got))
    }

    #[test]
    fn round_trips_scalars_and_tensors_exactly() {
        let p = std::env::temp_dir().join(format!("fusec-state-rt-{}.bin", std::process::id()));
        let (meta, tensors) = sample(&p);
        let (m, got) = read_all(&p).unwrap();
        assert_eq!(m, meta);
        assert_eq!(m.parse::<f64>("first_loss").unwrap(), 5.531234567891234);
        assert_eq!(m.parse::<usize>("step").unwrap(), 7);
        assert!(m.parse::<usize>("nope").unwrap_err().contains("`nope`"));
        assert_eq!(got, tensors);
        assert_eq!(StateReader::verify(&p).unwrap(), meta);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn every_truncation_and_a_flipped_byte_are_detected() {
        let p = std::env::temp_dir().join(format!("fusec-state-torn-{}.bin", std::process::id()));
        sample(&p);
        let bytes = std::fs::read(&p).unwrap();
        let bad = p.with_extension("bad");
        for cut in 0..bytes.len() {
            std::fs::write(&bad, &bytes[..cut]).unwrap();
            let e = read_all(&bad).expect_err(&format!("cut at {cut} accepted"));
            assert!(e.contains("fusec-state-torn"), "{e}");
        }
        for at in [9, 30, bytes.len() / 2, bytes.len() - 20, bytes.len() - 2] {
            let mut b = bytes.clone();
            b[at] ^= 0x10;
            std::fs::write(&bad, &b).unwrap();
            assert!(read_all(&bad).is_err(), "flip at {at} accepted");
        }
        let mut b = bytes.clone();
        b.push(0);
        std::fs::write(&bad, &b).unwrap();
        assert!(read_all(&bad).unwrap_err().contains("trailing"));
        std::fs::write(&bad, b"garbage garbage garbage").unwrap();
        assert!(read_all(&bad).unwrap_err().contains("not a fusec state file"));
        let _ = std::fs::remove_file(&p);
        let _ = std::fs::remove_file(&bad);
    }
}
