//! `fusec prepare TEXT -o PREFIX`: tokenize a text file with GPT-2's BPE into llm.c token
//! files, `PREFIX_train.bin` and `PREFIX_val.bin`.

use clap::Args;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fusec_runtime::tokenizer::Gpt2Tokenizer;
use fusec_runtime::tokens::write_tokens;

use crate::CliResult;

/// Arguments of `fusec prepare`.
#[derive(Args)]
pub struct PrepareArgs {
    /// The UTF-8 text file to tokenize (one document).
    text: PathBuf,
    /// Output prefix: writes PREFIX_train.bin and PREFIX_val.bin.
    #[arg(short, long, value_name = "PREFIX")]
    output: PathBuf,
    /// Fraction of the tokens, taken from the end, that go to the validation file (0 <= F < 1).
    #[arg(long, default_value_t = 0.1, value_name = "F", allow_negative_numbers = true)]
    val_fraction: f64,
}

/// Runs `fusec prepare`.
pub fn prepare(a: PrepareArgs) -> CliResult {
    if !(0.0..1.0).contains(&a.val_fraction) {
        return Err(format!("--val-fraction {} is out of range: it must be at least 0 and less than 1", a.val_fraction));
    }
    let train_path = with_suffix(&a.output, "_train.bin");
    let val_path = with_suffix(&a.output, "_val.bin");
    check_output_dir(&a.output)?;

    let text = read_text(&a.text)?;
    let start = Instant::now();
    let tok = Gpt2Tokenizer::new()?;
    let mut tokens = Vec::with_capacity(text.len() / 3 + 1);
    // llm.c's data scripts put <|endoftext|> before every document.
    tokens.push(Gpt2Tokenizer::EOT);
    tokens.extend(tok.encode(&text));
    let ms = start.elapsed().as_secs_f64() * 1e3;

    let (n_train, n_val) = split_counts(tokens.len(), a.val_fraction);
    if n_train == 0 {
        return Err(format!(
            "{}: --val-fraction {} leaves no training tokens out of {} (the text is too short)",
            a.text.display(),
            a.val_fraction,
            tokens.len()
        ));
    }
    let (train, val) = tokens.split_at(n_train);
    write_tokens(&train_path, train).map_err(|e| e.to_string())?;
    write_tokens(&val_path, val).map_err(|e| e.to_string())?;

    outln!("tokenized {} bytes into {} tokens (GPT-2 BPE, with a leading <|endoftext|>) in {ms:.0} ms", text.len(), tokens.len())?;
    outln!("train: {n_train} tokens -> {}", train_path.display())?;
    outln!("val:   {n_val} tokens -> {}", val_path.display())?;
    Ok(())
}

/// `PREFIX` followed by `suffix`, as a path (`data/tiny` + `_train.bin`).
fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s: OsString = prefix.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// The training and validation token counts: the validation file gets the last ⌈F·N⌉.
fn split_counts(n: usize, val_fraction: f64) -> (usize, usize) {
    let n_val = ((val_fraction * n as f64).ceil() as usize).min(n);
    (n - n_val, n_val)
}

/// Errors unless the directory that the output prefix points into exists.
fn check_output_dir(prefix: &Path) -> CliResult {
    if prefix.as_os_str().is_empty() {
        return Err("-o PREFIX is empty: give a prefix such as data/tiny".into());
    }
    let dir = match prefix.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(format!("{}: the output directory does not exist (create it first)", dir.display()));
    }
    Ok(())
}

/// Reads a UTF-8 text file; errors name the file and say what is wrong.
fn read_text(path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    if bytes.is_empty() {
        return Err(format!("{}: the file is empty: nothing to tokenize", path.display()));
    }
    String::from_utf8(bytes)
        .map_err(|e| format!("{}: not UTF-8 text (invalid byte sequence at byte offset {})", path.display(), e.utf8_error().valid_up_to()))
}
