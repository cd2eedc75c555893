//! What the CLI tests share.
#![allow(dead_code)] // each test crate uses its part

use std::path::{Path, PathBuf};
use std::process::Output;

/// The `fusec` binary to test: `FUSEC_BIN` (the device runs a prebuilt one), or this build's.
pub fn bin() -> PathBuf {
    std::env::var_os("FUSEC_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_fusec")))
}

/// The shipped tiny GPT-2 graph, from the source tree or (a prebuilt test binary elsewhere)
/// relative to the working folder.
pub fn tiny() -> String {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2-tiny.graph");
    if Path::new(p).exists() {
        p.to_string()
    } else {
        "models/gpt2-tiny.graph".to_string()
    }
}

/// Asserts that a run of `args` was refused: exit code 2, no panic, and every `needle` in its
/// standard error.
pub fn assert_refused(o: &Output, args: &[&str], needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: expected `{n}` in: {err}");
    }
}
