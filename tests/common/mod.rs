//! What the CLI tests that can run a prebuilt binary share.

use std::path::{Path, PathBuf};

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
