//! Every benchmark binary answers `--help` with its usage (and runs no benchmark), and rejects
//! an unknown flag with clap's usage-error code, 2.

use std::process::{Command, Output};

/// Each binary and a flag (or subcommand) its help must name.
const BINS: [(&str, &str); 4] = [
    (env!("CARGO_BIN_EXE_gemm_bench"), "--products"),
    (env!("CARGO_BIN_EXE_train_step"), "--precision"),
    (env!("CARGO_BIN_EXE_attention_bench"), "--variant"),
    (env!("CARGO_BIN_EXE_init_bench"), "check"),
];

fn run(bin: &str, arg: &str) -> Output {
    Command::new(bin).arg(arg).output().unwrap_or_else(|e| panic!("{bin}: {e}"))
}

#[test]
fn help_prints_usage() {
    for (bin, flag) in BINS {
        let out = run(bin, "--help");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{bin} --help: {:?}\n{stdout}", out.status);
        assert!(stdout.contains("Usage:"), "{bin} --help:\n{stdout}");
        assert!(stdout.contains(flag), "{bin} --help does not name {flag}:\n{stdout}");
    }
}

#[test]
fn unknown_flag_is_a_usage_error() {
    for (bin, _) in BINS {
        let out = run(bin, "--no-such-flag");
        assert_eq!(out.status.code(), Some(2), "{bin} --no-such-flag: {}", String::from_utf8_lossy(&out.stderr));
    }
}
