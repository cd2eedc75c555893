//! End-to-end tests of `fusec prepare`: text → GPT-2 tokens → llm.c train/val token files.

use fusec_ir::testkit::TempDir;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Instant;

use fusec_runtime::tokenizer::Gpt2Tokenizer;
use fusec_runtime::tokens::read_tokens;

fn fusec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fusec")).args(args).output().unwrap()
}

/// A fresh directory for one test.
fn tmp_dir(test: &str) -> TempDir {
    TempDir::new(&format!("prepare-{test}"))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const SAMPLE: &str = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n\
    All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n\n\
    All:\nResolved. resolved — naïve café, 日本語.\n";

/// Prepares `content` and returns (train, val, stdout).
fn prepare(dir: &Path, content: &str, extra: &[&str]) -> (Vec<u16>, Vec<u16>, String) {
    let input = dir.join("input.txt");
    std::fs::write(&input, content).unwrap();
    let prefix = dir.join("out");
    let mut args = vec!["prepare", s(&input), "-o", s(&prefix)];
    args.extend_from_slice(extra);
    let o = fusec(&args);
    assert!(o.status.success(), "stderr: {}", text(&o.stderr));
    let train = read_tokens(&dir.join("out_train.bin")).unwrap();
    let val = read_tokens(&dir.join("out_val.bin")).unwrap();
    (train, val, text(&o.stdout))
}

#[test]
fn prepare_small_text_round_trips() {
    let dir = tmp_dir("small");
    let (train, val, stdout) = prepare(&dir, SAMPLE, &[]);
    let tok = Gpt2Tokenizer::new().unwrap();
    let mut expected = vec![Gpt2Tokenizer::EOT];
    expected.extend(tok.encode(SAMPLE));
    let n = expected.len();
    assert_eq!(train.len() + val.len(), n);
    assert_eq!(val.len(), (0.1 * n as f64).ceil() as usize);
    assert_eq!(train[0], Gpt2Tokenizer::EOT);
    let all: Vec<u16> = train.iter().chain(&val).copied().collect();
    assert_eq!(all, expected);
    assert_eq!(tok.decode(&all[1..]), SAMPLE);
    assert!(stdout.contains(&format!("{n} tokens")), "{stdout}");
    assert!(stdout.contains("out_train.bin") && stdout.contains("out_val.bin"), "{stdout}");
}

#[test]
fn prepare_val_fraction() {
    let dir = tmp_dir("fraction");
    let (train, val, _) = prepare(&dir, SAMPLE, &["--val-fraction", "0"]);
    assert!(val.is_empty());
    let n = train.len();
    let (train, val, _) = prepare(&dir, SAMPLE, &["--val-fraction", "0.5"]);
    assert_eq!(val.len(), n.div_ceil(2));
    assert_eq!(train.len() + val.len(), n);
}

/// Runs `fusec prepare` expecting failure; returns stderr.
fn prepare_fails(args: &[&str]) -> String {
    let o = fusec(args);
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.starts_with("error: "), "{err}");
    err
}

#[test]
fn prepare_errors() {
    let dir = tmp_dir("errors");
    let out = dir.join("out");
    let good = dir.join("good.txt");
    std::fs::write(&good, "hello\n").unwrap();

    let missing = dir.join("missing.txt");
    let err = prepare_fails(&["prepare", s(&missing), "-o", s(&out)]);
    assert!(err.contains("missing.txt") && err.contains("cannot read"), "{err}");

    let binary = dir.join("latin1.txt");
    std::fs::write(&binary, b"caf\xe9 au lait").unwrap();
    let err = prepare_fails(&["prepare", s(&binary), "-o", s(&out)]);
    assert!(err.contains("latin1.txt") && err.contains("not UTF-8") && err.contains("offset 3"), "{err}");

    let empty = dir.join("empty.txt");
    std::fs::write(&empty, b"").unwrap();
    let err = prepare_fails(&["prepare", s(&empty), "-o", s(&out)]);
    assert!(err.contains("empty.txt") && err.contains("empty"), "{err}");

    for f in ["1", "1.5", "-0.1", "NaN"] {
        let err = prepare_fails(&["prepare", s(&good), "-o", s(&out), "--val-fraction", f]);
        assert!(err.contains("--val-fraction"), "{err}");
    }

    let nodir = dir.join("no_such_dir").join("out");
    let err = prepare_fails(&["prepare", s(&good), "-o", s(&nodir)]);
    assert!(err.contains("no_such_dir") && err.contains("does not exist"), "{err}");
    assert!(!dir.join("no_such_dir").exists());

    // Two tokens (EOT + "hi"): 0.9 of them leaves none to train on.
    let err = prepare_fails(&["prepare", s(&good), "-o", s(&out), "--val-fraction", "0.9"]);
    assert!(err.contains("no training tokens"), "{err}");
}

#[test]
fn prepare_tinyshakespeare() {
    let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/data/tinyshakespeare.txt"));
    if !path.exists() {
        println!("skipped: {} not found", path.display());
        return;
    }
    let dir = tmp_dir("shakespeare");
    let prefix = dir.join("tiny_shakespeare");
    let start = Instant::now();
    let o = fusec(&["prepare", s(path), "-o", s(&prefix)]);
    let secs = start.elapsed().as_secs_f64();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let train = read_tokens(&dir.join("tiny_shakespeare_train.bin")).unwrap();
    let val = read_tokens(&dir.join("tiny_shakespeare_val.bin")).unwrap();
    let n = train.len() + val.len();
    println!("tinyshakespeare: {n} tokens ({} train, {} val) in {secs:.2} s", train.len(), val.len());
    print!("{}", text(&o.stdout));
    assert!((300_000..400_000).contains(&n), "{n} tokens");
    assert_eq!(train[0], Gpt2Tokenizer::EOT);
    let original = std::fs::read_to_string(path).unwrap();
    let tok = Gpt2Tokenizer::new().unwrap();
    let all: Vec<u16> = train[1..].iter().chain(&val).copied().collect();
    assert_eq!(tok.decode(&all), original);
}
