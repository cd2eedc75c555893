//! Writing to standard output and standard error without panicking: `println!` panics when
//! the reader of a pipe goes away (`fusec run ... | head -1`). [`outln!`] and [`out!`] return
//! an error instead (callers stop cleanly, after anything that must be saved is saved), and
//! [`errln!`] ignores errors (diagnostics are best effort). `main` exits quietly with code 0
//! on [`STDOUT_CLOSED`]: the reader chose to stop reading.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set on the ranks of a data-parallel run other than rank 0: they print nothing but their
/// final error ([`set_quiet`]).
static QUIET: AtomicBool = AtomicBool::new(false);

/// Silences standard output and standard error, or (`false`) gives them back.
pub fn set_quiet(quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
}

/// The error of a write to a closed standard output.
pub const STDOUT_CLOSED: &str = "standard output was closed";

/// Writes `s` to standard output and flushes it.
pub fn write_stdout(s: &str) -> Result<(), String> {
    if QUIET.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    out.write_all(s.as_bytes()).and_then(|_| out.flush()).map_err(|e| match e.kind() {
        std::io::ErrorKind::BrokenPipe => STDOUT_CLOSED.to_string(),
        _ => format!("writing to standard output: {e}"),
    })
}

/// Writes `s` to standard error, ignoring errors.
pub fn write_stderr(s: &str) {
    if QUIET.load(Ordering::Relaxed) {
        return;
    }
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(s.as_bytes()).and_then(|_| err.flush());
}

/// `print!` returning `Result<(), String>` instead of panicking.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => { $crate::out::write_stdout(&format!($($t)*)) };
}

/// `println!` returning `Result<(), String>` instead of panicking.
#[macro_export]
macro_rules! outln {
    ($($t:tt)*) => { $crate::out::write_stdout(&(format!($($t)*) + "\n")) };
}

/// `eprintln!` that never panics.
#[macro_export]
macro_rules! errln {
    () => { $crate::out::write_stderr("\n") };
    ($($t:tt)*) => { $crate::out::write_stderr(&(format!($($t)*) + "\n")) };
}

/// `eprint!` that never panics.
#[macro_export]
macro_rules! err {
    ($($t:tt)*) => { $crate::out::write_stderr(&format!($($t)*)) };
}
