//! Reading the CUDA libraries into the page cache ahead of their use. On a freshly started
//! machine, libnvrtc (109 MB) and libcuda (96 MB) come from a cold disk while the NVRTC worker
//! processes and the driver map them and fault their pages in a few at a time; one sequential
//! read per file, started first, turns that into large reads (on the H100 host with the guest's
//! page cache dropped: compile 0.74 → 0.53–0.55 s). With warm caches it costs a copy of each
//! file on a background thread.

use std::io::Read;
use std::path::PathBuf;

/// Where the dynamic loader looks: `LD_LIBRARY_PATH`, then the usual system and CUDA folders.
fn search_dirs() -> Vec<PathBuf> {
    let env = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&env).filter(|d| !d.as_os_str().is_empty()).collect();
    for d in ["/usr/local/cuda/lib64", "/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/wsl/lib"] {
        dirs.push(d.into());
    }
    dirs
}

/// The library file each of `names` (e.g. `libnvrtc.so`) resolves to in the first of `dirs`
/// that has one (`name`, `name.13`, ...; not NVRTC's `.alt` builds), links followed, each file
/// once.
fn library_files(names: &[&str], dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut files = vec![];
    for name in names {
        let found = dirs.iter().find_map(|d| {
            let mut hits: Vec<PathBuf> = std::fs::read_dir(d)
                .ok()?
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_str().is_some_and(|f| f == *name || f.starts_with(&format!("{name}."))))
                .filter_map(|e| std::fs::canonicalize(e.path()).ok())
                .collect();
            hits.sort();
            hits.pop()
        });
        if let Some(f) = found.filter(|f| !files.contains(f)) {
            files.push(f);
        }
    }
    files
}

/// Starts reading the libraries `names` (e.g. `libnvrtc.so`) resolve to on the loader's path,
/// one background thread a file; errors are ignored (the loader reports a missing library).
pub fn start(names: &[&str]) {
    for f in library_files(names, &search_dirs()) {
        std::thread::spawn(move || {
            let Ok(mut file) = std::fs::File::open(&f) else { return };
            let mut buf = vec![0u8; 4 << 20];
            while matches!(file.read(&mut buf), Ok(n) if n > 0) {}
        });
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn finds_each_library_once_in_the_first_folder_that_has_it() {
        let dir = std::env::temp_dir().join(format!("fusec-readahead-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libfoo.so.3.1"), b"x").unwrap();
        std::fs::write(dir.join("libfoobar.so"), b"x").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(dir.join("libfoo.so.3.1"), dir.join("libfoo.so.3")).unwrap();
        let dirs = [dir.join("missing"), dir.clone()];
        let got = super::library_files(&["libfoo.so", "libfoo.so", "libmissing-xyz.so"], &dirs);
        assert_eq!(got, vec![std::fs::canonicalize(dir.join("libfoo.so.3.1")).unwrap()]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
