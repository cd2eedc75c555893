//! In-process fuzzing of the `.graph` parser: mutated printed graphs and random token soup.
//! The parser must never panic, every error must carry a sane position, and every input that
//! does parse must round-trip through the printer.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::{random_graph_with, GenOpts};
use fusec_ir::text::{parse, print};

/// Inputs per run; `FUSEC_FUZZ_INPUTS` overrides (and `FUSEC_FUZZ_SEED` picks another stream)
/// for longer soak runs.
const INPUTS: usize = 120_000;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Fragments worth inserting: punctuation, numbers at the edges of their ranges, keywords.
const TOKENS: &[&str] = &[
    "%",
    "%0",
    "%1",
    "%99999999999999999999",
    "[",
    "]",
    "*",
    "\"",
    "{",
    "}",
    "(",
    ")",
    ",",
    ":",
    "=",
    "#",
    "\\",
    "\n",
    " ",
    "\t",
    "-",
    "0",
    "1",
    "7",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999",
    "1e309",
    "-inf",
    "inf",
    "nan",
    "5e-324",
    "-0.0",
    "1.",
    "e",
    "E+",
    "é",
    "☃",
    "\u{0}",
    "\r",
    "graph",
    "output",
    "param",
    "input",
    "const",
    "iota",
    "add",
    "concat",
    "slice",
    "matmul",
    "layernorm",
    "adamw",
    "scatter_add",
    "f32",
    "i32",
    "bf16",
    "f16",
    "f64",
    "B",
    "T",
    "N",
    "B*T",
    "axis",
    "dims",
    "perm",
    "axes",
    "start",
    "end",
    "eps",
    "vocab",
    "scale",
    "true",
    "false",
    "trans_a",
    "{axis = 0}",
    " : f32[]",
    "f32[B, 4]",
    "\"x\\q\"",
    "gemm",
    "kernel",
    "kernel \"k\" %0 : f32[] {\n",
    "bias",
    "gelu",
    "accumulate",
    "output \"y\" = %0\n  }\n",
];

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.below(xs.len() as u64) as usize]
}

/// Applies one random mutation to `b`.
fn mutate(rng: &mut Rng, b: &mut Vec<u8>) {
    let n = b.len();
    let at = |rng: &mut Rng| rng.below(n as u64 + 1) as usize;
    match rng.below(10) {
        0 if n > 0 => {
            let i = at(rng).min(n - 1);
            b[i] ^= 1 << rng.below(8);
        }
        1 if n > 0 => {
            let i = at(rng).min(n - 1);
            b[i] = rng.below(128) as u8;
        }
        2 => {
            let (i, len) = (at(rng), 1 + rng.below(8) as usize);
            b.drain(i..(i + len).min(n));
        }
        3 | 4 => {
            let i = at(rng);
            let t = pick(rng, TOKENS).as_bytes().to_vec();
            b.splice(i..i, t);
        }
        5 => b.truncate(at(rng)),
        6 | 7 => {
            // Duplicate, delete or swap whole lines.
            let text = String::from_utf8_lossy(b).into_owned();
            let mut lines: Vec<&str> = text.split('\n').collect();
            let (i, j) = (rng.below(lines.len() as u64) as usize, rng.below(lines.len() as u64) as usize);
            match rng.below(3) {
                0 => lines.insert(j, lines[i]),
                1 => {
                    lines.remove(i);
                }
                _ => lines.swap(i, j),
            }
            *b = lines.join("\n").into_bytes();
        }
        8 | 9 if n > 0 => {
            // Replace the next run of digits with another number: keeps the syntax, tests types.
            let from = at(rng).min(n - 1);
            if let Some(i) = (from..n).find(|&i| b[i].is_ascii_digit()) {
                let j = (i..n).find(|&j| !b[j].is_ascii_digit()).unwrap_or(n);
                let nums = ["0", "1", "2", "3", "5", "4294967296", "65535", "18446744073709551615", "12345678901234567890123"];
                b.splice(i..j, pick(rng, &nums).bytes());
            }
        }
        _ => b.extend_from_slice(pick(rng, TOKENS).as_bytes()),
    }
}

/// A line of random tokens from [`TOKENS`] and random characters.
fn soup(rng: &mut Rng) -> String {
    let mut s = String::new();
    if rng.chance(0.5) {
        s.push_str("graph g(B, T) {\n");
    }
    for _ in 0..rng.below(60) {
        if rng.chance(0.8) {
            s.push_str(pick(rng, TOKENS));
        } else {
            s.push(char::from_u32(rng.below(0x3000) as u32).unwrap_or('?'));
        }
        if rng.chance(0.5) {
            s.push(' ');
        }
    }
    s
}

/// Parses `src`, failing the test with the input on a panic or a malformed diagnostic.
fn check(src: &str) -> bool {
    let r = catch_unwind(AssertUnwindSafe(|| parse(src, "fuzz")));
    let r = r.unwrap_or_else(|_| panic!("parse panicked on input {src:?}"));
    match r {
        Ok(g) => {
            let p = print(&g);
            let again = parse(&p, "fuzz").unwrap_or_else(|e| panic!("printed text of {src:?} does not parse: {e}\n{p}"));
            assert_eq!(print(&again), p, "round trip of {src:?}");
            true
        }
        Err(e) => {
            let lines = src.lines().count();
            assert!(e.line >= 1 && e.col >= 1, "position {}:{} for {src:?}", e.line, e.col);
            assert!(e.line <= lines + 1, "line {} past the {lines} lines of {src:?}", e.line);
            assert!(!e.msg.is_empty());
            false
        }
    }
}

#[test]
fn parser_survives_mutated_and_random_inputs() {
    let t0 = Instant::now();
    let inputs = env_or("FUSEC_FUZZ_INPUTS", INPUTS as u64) as usize;
    let mut rng = Rng::new(env_or("FUSEC_FUZZ_SEED", 0xF0CC));
    let opts = GenOpts { max_ops: 8, ..GenOpts::default() };
    let corpus: Vec<String> = (0..200).map(|s| print(&random_graph_with(&mut Rng::new(s), &opts))).collect();
    let (mut ok, mut bytes) = (0usize, 0usize);
    for i in 0..inputs {
        let src = if i % 10 == 9 {
            soup(&mut rng)
        } else {
            let mut b = corpus[rng.below(corpus.len() as u64) as usize].clone().into_bytes();
            for _ in 0..1 + rng.below(4) {
                mutate(&mut rng, &mut b);
            }
            String::from_utf8_lossy(&b).into_owned()
        };
        bytes += src.len();
        ok += check(&src) as usize;
    }
    let dt = t0.elapsed();
    eprintln!("parser fuzz: {inputs} inputs, {} MB, {ok} parsed, in {dt:?}", bytes / 1_000_000);
    // Some mutations (e.g. a flipped bit in a name, a deleted comment-free space) leave valid text.
    assert!(ok > inputs / 1000, "only {ok} inputs parsed: the mutations are too destructive to test round trips");
}
