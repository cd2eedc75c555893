//! Files that are never torn: written to a temporary file beside the destination (same folder,
//! so the same file system), flushed to disk, renamed over the destination, and the folder
//! flushed, so that at any moment the destination holds either its old or its new contents.
//!
//! Two steps instead of [`write_atomic`]'s one let several files change together
//! ([`PendingFile::finish`] writes and flushes, [`Finished::commit`] renames): see
//! [`crate::savedir`]. Every byte written is counted into a CRC-32 (the checksum a later
//! reader compares). A write that fails (a full disk, a quota, a size limit) is an error naming
//! the file; the temporary file is removed and the destination is untouched.

use std::fs::File;
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};

use crate::file_error::FileError;

/// The temporary file that stands for `dest` until it is committed: `dest` + `.tmp`. A fixed
/// name, so that a save interrupted by a kill leaves at most one such file, which the next save
/// overwrites.
pub fn temp_path(dest: &Path) -> PathBuf {
    let mut s = dest.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// A write error, naming the file; a full disk, a quota or a size limit says so.
pub fn write_error(path: &Path, e: &std::io::Error) -> FileError {
    if matches!(e.kind(), ErrorKind::StorageFull | ErrorKind::QuotaExceeded | ErrorKind::FileTooLarge) {
        FileError::new(path, format!("cannot write: {e} (the disk is full or a size limit was reached)"))
    } else {
        FileError::io(path, "cannot write", e)
    }
}

/// A file being written under its temporary name ([`temp_path`]); removed if dropped unfinished.
pub struct PendingFile {
    dest: PathBuf,
    tmp: PathBuf,
    w: Option<BufWriter<File>>,
    crc: crc32fast::Hasher,
    len: u64,
    exit_at: Option<u64>,
}

impl PendingFile {
    /// Creates (or truncates) the temporary file of `dest`.
    pub fn create(dest: &Path) -> Result<PendingFile, FileError> {
        let tmp = temp_path(dest);
        let f = File::create(&tmp).map_err(|e| FileError::io(&tmp, "cannot create", &e))?;
        Ok(PendingFile {
            dest: dest.to_path_buf(),
            tmp,
            w: Some(BufWriter::with_capacity(1 << 20, f)),
            crc: Default::default(),
            len: 0,
            exit_at: None,
        })
    }

    /// Appends `bytes`.
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), FileError> {
        let w = self.w.as_mut().ok_or_else(|| FileError::new(&self.tmp, "write after finish"))?;
        w.write_all(bytes).map_err(|e| write_error(&self.tmp, &e))?;
        self.crc.update(bytes);
        self.len += bytes.len() as u64;
        if self.exit_at.is_some_and(|at| self.len >= at) {
            let _ = w.flush();
            std::process::exit(137);
        }
        Ok(())
    }

    /// Test hook (the kill tests of [`crate::savedir`]): once `bytes` have been written, flush
    /// them to the temporary file and end the process at once with exit code 137, as a SIGKILL
    /// would (no cleanup): a torn temporary file is left.
    pub fn exit_after(&mut self, bytes: u64) {
        self.exit_at = Some(bytes);
    }

    /// CRC-32 of the bytes written so far.
    pub fn crc(&self) -> u32 {
        self.crc.clone().finalize()
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Flushes the temporary file to disk; the destination is untouched until
    /// [`Finished::commit`].
    pub fn finish(mut self) -> Result<Finished, FileError> {
        let w = self.w.as_mut().ok_or_else(|| FileError::new(&self.tmp, "finished twice"))?;
        // On an error here `self` is dropped with its writer: the temporary file is removed.
        w.flush().map_err(|e| write_error(&self.tmp, &e))?;
        w.get_ref().sync_all().map_err(|e| write_error(&self.tmp, &e))?;
        self.w = None;
        let crc = self.crc();
        Ok(Finished { dest: std::mem::take(&mut self.dest), tmp: std::mem::take(&mut self.tmp), crc, len: self.len, armed: true })
    }
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        if let Some(w) = self.w.take() {
            // Unfinished: whatever the buffer still holds is not written, the file is removed.
            let _ = w.into_parts();
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// A complete temporary file, on disk, waiting to be renamed over its destination; removed if
/// dropped uncommitted.
pub struct Finished {
    dest: PathBuf,
    tmp: PathBuf,
    crc: u32,
    len: u64,
    armed: bool,
}

impl Finished {
    /// CRC-32 of the file's bytes.
    pub fn crc(&self) -> u32 {
        self.crc
    }

    /// The file's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Renames the temporary file over the destination and flushes the folder. On failure the
    /// temporary file stays (it is complete: a reader may still use it).
    pub fn commit(mut self) -> Result<(), FileError> {
        self.armed = false;
        std::fs::rename(&self.tmp, &self.dest)
            .map_err(|e| FileError::io(&self.dest, &format!("cannot rename {} to it", self.tmp.display()), &e))?;
        sync_dir(&self.dest);
        Ok(())
    }
}

impl Drop for Finished {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Flushes the folder holding `path` (its directory entries: a rename is durable after this).
/// Best effort: some file systems refuse to sync a folder, and the data is already on disk.
pub fn sync_dir(path: &Path) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Writes `dest` atomically: `body` writes the contents into a [`PendingFile`], which is then
/// flushed and renamed over `dest`.
pub fn write_atomic<E: From<FileError>>(dest: &Path, body: impl FnOnce(&mut PendingFile) -> Result<(), E>) -> Result<(), E> {
    let mut f = PendingFile::create(dest)?;
    body(&mut f)?;
    Ok(f.finish()?.commit()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> fusec_ir::testkit::TempDir {
        fusec_ir::testkit::TempDir::new(&format!("atomic-{name}"))
    }

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let d = dir("replace");
        let p = d.join("a.bin");
        std::fs::write(&p, b"old").unwrap();
        write_atomic(&p, |f| f.write(b"new contents")).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new contents");
        assert!(!temp_path(&p).exists());
        let names: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn a_failing_write_keeps_the_old_file_and_names_the_full_disk() {
        let d = dir("full");
        let p = d.join("model.bin");
        std::fs::write(&p, b"old").unwrap();
        let err = write_atomic(&p, |f| -> Result<(), FileError> {
            f.write(&[1; 1000])?;
            // What write(2) returns on a full disk.
            Err(write_error(&temp_path(&p), &std::io::Error::from_raw_os_error(28)))
        })
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("model.bin.tmp") && msg.contains("No space left on device") && msg.contains("disk is full"), "{msg}");
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        assert!(!temp_path(&p).exists(), "the temporary file was left behind");
    }

    #[test]
    fn dev_full_gives_the_clear_error() {
        // The device that is always full: writes to it fail with ENOSPC.
        let Ok(f) = std::fs::OpenOptions::new().write(true).open("/dev/full") else { return };
        let mut w = BufWriter::new(f);
        let e = w.write_all(&[0; 1 << 16]).and_then(|_| w.flush()).unwrap_err();
        let msg = write_error(Path::new("/dev/full"), &e).to_string();
        assert!(msg.contains("/dev/full: cannot write") && msg.contains("disk is full"), "{msg}");
    }

    #[test]
    fn crc_and_length_match_the_bytes_and_uncommitted_files_are_removed() {
        let d = dir("crc");
        let p = d.join("s.bin");
        let mut f = PendingFile::create(&p).unwrap();
        f.write(b"hello ").unwrap();
        f.write(b"world").unwrap();
        let done = f.finish().unwrap();
        assert_eq!(done.len(), 11);
        assert_eq!(done.crc(), crc32fast::hash(b"hello world"));
        assert!(temp_path(&p).exists() && !p.exists());
        drop(done);
        assert!(!temp_path(&p).exists());
        let f = PendingFile::create(&p).unwrap();
        drop(f);
        assert!(!temp_path(&p).exists() && !p.exists());
    }
}
