//! Benchmarks: training step, compile time and memory, printing ratios against a peer measured in the same run.

/// Reports a bad flag value that clap let through (a list's items, a file that cannot be
/// created) the way clap reports its own errors, `error: --flag: what was wrong` on stderr, and
/// exits with clap's usage-error code, 2.
pub fn arg_error(flag: &str, msg: impl std::fmt::Display) -> ! {
    eprintln!("error: {flag}: {msg}");
    std::process::exit(2)
}

/// A count flag's value parser: a whole number, at least 1.
pub fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        r => r.map_err(|e| e.to_string()),
    }
}
