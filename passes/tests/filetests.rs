//! Filetests: one pass on a graph written as text, and its expected output, in one file (like
//! Cranelift's filetests). Every `*.graph` file under `passes/tests/filetests/` is one test:
//!
//! ```text
//! # pass: fuse-epilogue              (required: the pass to run; the file's directory has its name)
//! # bind: B=2 T=3                    (optional: symbol bindings, for `schedule` and `memplan`)
//! # Free text: what the file checks. (any other comment lines before the graph)
//! graph mlp() {                      (the input graph, in `.graph` text)
//!   ...
//! }
//! # expect:                          (from here to the end: written by FUSEC_BLESS=1)
//! # graph mlp() {                    (the graph after the pass, as `fusec_ir::text::print`s it,
//! #   ...                             each line prefixed `# `; `memplan` prints its annotation)
//! # }
//! # refusals:                        (the pass's `--explain-fusion` lines, `Refusal`'s Display,
//! # fuse-epilogue: %3 (matmul epilogue) refused by `bias-is-row-vector`: ...   in order;
//! #                                   `# refusals: none` when the pass refused nothing)
//! ```
//!
//! The `.graph` lexer treats `#` to the end of the line as a comment, so a filetest is itself a
//! valid `.graph` file: the whole file parses to its input graph. The harness runs exactly the
//! one pass ([`fusec_passes::pipeline::run_pass`], default options), verifies the input and the
//! result, prints the expectation block and compares it with the file's, line for line. It runs
//! every file, prints a line diff for each mismatch, and fails naming every failing file.
//!
//! `FUSEC_BLESS=1 cargo test -p fusec-passes --test filetests` rewrites the expectation blocks
//! (everything from `# expect:` on; a file without one gets it appended) instead of comparing.
//! It never writes when `CI` is set. Blessed output must be read before it is committed: a
//! `*-fires.graph` file must show the fused op, a `*-near-miss-*.graph` file must not, and show
//! the refusal where the pass logs one.

use std::path::{Path, PathBuf};

use fusec_ir::text::{parse, print};
use fusec_ir::verify::verify;
use fusec_ir::Bindings;
use fusec_passes::explain::FusionLog;
use fusec_passes::pipeline::{run_pass, PipelineOptions, PASSES};

/// The line that starts the expectation block.
const EXPECT: &str = "# expect:";

/// One filetest file, split into its parts.
#[derive(Debug)]
struct FileTest {
    /// The pass to run (`# pass:`).
    pass: String,
    /// The symbol bindings (`# bind:`).
    bind: Bindings,
    /// Everything before the expectation block: the header and the input graph.
    source: String,
    /// The expectation block (from `# expect:` to the end), if the file has one.
    expect: Option<String>,
}

/// Splits a filetest's text into its header fields, its source and its expectation block.
fn split(text: &str) -> Result<FileTest, String> {
    let (source, expect) = match text.find(&format!("\n{EXPECT}\n")) {
        Some(i) => (&text[..=i], Some(text[i + 1..].to_string())),
        None if text.starts_with(&format!("{EXPECT}\n")) => ("", Some(text.to_string())),
        None => (text, None),
    };
    let (mut pass, mut bind) = (None, Bindings::default());
    for line in source.lines().take_while(|l| l.starts_with('#')) {
        if let Some(p) = line.strip_prefix("# pass:") {
            pass = Some(p.trim().to_string());
        } else if let Some(b) = line.strip_prefix("# bind:") {
            for kv in b.split_whitespace() {
                let (k, v) = kv.split_once('=').ok_or_else(|| format!("`# bind:` wants NAME=VALUE pairs, got `{kv}`"))?;
                bind.set(k, v.parse().map_err(|e| format!("`# bind:` value of `{k}`: {e}"))?);
            }
        }
    }
    let pass = pass.ok_or("no `# pass: NAME` line in the header (the comment lines before the graph)")?;
    Ok(FileTest { pass, bind, source: source.to_string(), expect })
}

/// Runs the file's pass on its input and returns the expectation block it produces.
fn expectation(ft: &FileTest, path: &Path) -> Result<String, String> {
    let g = parse(&ft.source, &path.display().to_string()).map_err(|e| format!("input: {e}"))?;
    verify(&g).map_err(|e| format!("input does not verify: {e}"))?;
    let mut log = FusionLog::default();
    let (h, plan) = run_pass(&ft.pass, &g, &PipelineOptions::default(), &ft.bind, &mut log)?;
    verify(&h).map_err(|e| format!("result of `{}` does not verify: {e}\n{}", ft.pass, print(&h)))?;
    let text = match plan {
        Some(p) => p.annotate(&h),
        None => print(&h),
    };
    let mut out = format!("{EXPECT}\n");
    for line in text.lines() {
        out.push_str(&comment(line));
    }
    if log.refusals.is_empty() {
        out.push_str("# refusals: none\n");
    } else {
        out.push_str("# refusals:\n");
        for r in &log.refusals {
            out.push_str(&comment(&r.to_string().replace('\n', "\\n")));
        }
    }
    Ok(out)
}

/// `line` as a comment line: `# line`, or `#` for an empty line.
fn comment(line: &str) -> String {
    if line.is_empty() {
        "#\n".to_string()
    } else {
        format!("# {line}\n")
    }
}

/// A line diff of `want` against `got` (longest common subsequence): changed lines marked `-`
/// (only in `want`) and `+` (only in `got`), with up to two unchanged lines of context around
/// each change and `...` for what is left out. Empty when the texts are equal.
fn line_diff(want: &str, got: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    // lcs[i][j]: the LCS length of a[i..] and b[j..].
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    let mut ops: Vec<(char, &str)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            ops.push((' ', a[i]));
            (i, j) = (i + 1, j + 1);
        } else if i < a.len() && (j == b.len() || lcs[i + 1][j] >= lcs[i][j + 1]) {
            ops.push(('-', a[i]));
            i += 1;
        } else {
            ops.push(('+', b[j]));
            j += 1;
        }
    }
    const CONTEXT: usize = 2;
    let changed: Vec<usize> = ops.iter().enumerate().filter(|(_, (c, _))| *c != ' ').map(|(k, _)| k).collect();
    let near = |k: usize| changed.iter().any(|&c| c.abs_diff(k) <= CONTEXT);
    let mut out = String::new();
    let mut skipped = false;
    for (k, (c, line)) in ops.iter().enumerate() {
        if near(k) {
            out.push_str(&format!("{c} {line}\n"));
            skipped = false;
        } else if !skipped {
            out.push_str("  ...\n");
            skipped = true;
        }
    }
    if changed.is_empty() {
        String::new()
    } else {
        out
    }
}

/// Every `*.graph` file under `dir`, recursively, sorted.
fn graph_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(graph_files(&path));
        } else if path.extension().is_some_and(|e| e == "graph") {
            out.push(path);
        }
    }
    out.sort();
    out
}

fn filetest_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/filetests")
}

/// Whether to rewrite expectations: `FUSEC_BLESS` set (and not `0`), and never under `CI`.
fn bless() -> bool {
    let asked = std::env::var("FUSEC_BLESS").is_ok_and(|v| !v.is_empty() && v != "0");
    if asked && std::env::var_os("CI").is_some() {
        eprintln!("FUSEC_BLESS is ignored because CI is set: comparing instead");
        return false;
    }
    asked
}

/// Checks (or blesses) one file; `Err` holds what to print for a failure.
fn check_file(path: &Path, bless: bool) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let ft = split(&text)?;
    let dir = path.parent().and_then(|d| d.file_name()).and_then(|d| d.to_str()).unwrap_or("");
    if dir != ft.pass {
        return Err(format!("`# pass: {}` in a directory named `{dir}`: files live in the directory of their pass", ft.pass));
    }
    let got = expectation(&ft, path)?;
    if bless {
        if ft.expect.as_deref() != Some(got.as_str()) {
            std::fs::write(path, format!("{}{got}", ft.source)).map_err(|e| e.to_string())?;
        }
        return Ok(());
    }
    match &ft.expect {
        None => Err("no `# expect:` block: run with FUSEC_BLESS=1 to write it, then read it".into()),
        Some(want) if *want == got => Ok(()),
        Some(want) => Err(format!("the expectation differs (- expected, + actual):\n{}", line_diff(want, &got))),
    }
}

#[test]
fn filetests() {
    let files = graph_files(&filetest_dir());
    assert!(files.len() >= 30, "only {} filetests found under {}", files.len(), filetest_dir().display());
    let bless = bless();
    let mut failed = Vec::new();
    for path in &files {
        let rel = path.strip_prefix(filetest_dir()).unwrap_or(path).display().to_string();
        if let Err(e) = check_file(path, bless) {
            eprintln!("FAIL {rel}: {e}");
            failed.push(rel);
        }
    }
    assert!(failed.is_empty(), "{} of {} filetests failed:\n  {}", failed.len(), files.len(), failed.join("\n  "));
}

/// Every refusal rule of the fusion passes, by pass. Each must be named in the refusals of at
/// least one `*-near-miss-*` file of its pass.
const RULES: &[(&str, &[&str])] = &[
    (
        "fuse-layernorm",
        &[
            "dtype-f32",
            "dtype-float",
            "axis-is-last",
            "broadcast-shapes",
            "affine-rank",
            "mean-scale-matches-width",
            "eps-constant",
            "no-outside-uses",
            "slice-from-zero",
            "vocab-constant",
            "onehot-axis",
            "onehot-zero",
            "targets-shape",
        ],
    ),
    ("fuse-classifier", &["no-matching-loss", "dloss-reads-loss"]),
    ("fuse-epilogue", &["bias-is-row-vector", "bf16-bias-left-to-consumer", "pre-gelu-used-before-gelu"]),
    ("fuse-grad-accum", &["no-gelu-epilogue", "product-has-other-users", "acc-has-other-users", "same-type"]),
    (
        "fuse-elementwise",
        &[
            "not-fusible",
            "domain-mismatch",
            "recompute-in-reduction",
            "one-composite-per-kernel",
            "cycle",
            "read-count-limit",
            "result-count-limit",
        ],
    ),
];

/// Rules in [`RULES`] that no filetest can show, and why.
const UNCOVERED: &[(&str, &str, &str)] = &[
    ("fuse-layernorm", "dtype-float", "unreachable: the softmax pattern's `exp` only types float operands"),
    ("fuse-grad-accum", "same-type", "unreachable: `add` only types operands of one type"),
    (
        "fuse-elementwise",
        "result-count-limit",
        "needs a kernel of more than 65535 results (about 21846 AdamW updates): far too big for a file",
    ),
];

/// The hyphenated string literals (`"a-b"`) of a Rust source text.
fn hyphenated_literals(src: &str) -> Vec<String> {
    src.split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| s.contains('-') && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_refusal_rule_has_a_near_miss_file() {
    let src_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut sources = String::new();
    let mut files = vec![
        src_dir.join("fuse_layernorm.rs"),
        src_dir.join("fuse_classifier.rs"),
        src_dir.join("fuse_epilogue.rs"),
        src_dir.join("fuse_grad_accum.rs"),
    ];
    // Every file under fuse_elementwise/, folders included.
    let mut dirs = vec![src_dir.join("fuse_elementwise")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else {
                files.push(p);
            }
        }
    }
    files.push(src_dir.join("fuse_elementwise.rs"));
    for f in &files {
        sources.push_str(&std::fs::read_to_string(f).unwrap());
    }
    // The list is complete (every hyphenated literal of the fusion passes that is not a pass
    // name is a listed rule) and real (every listed rule is a literal there).
    let listed: Vec<&str> = RULES.iter().flat_map(|(_, rs)| rs.iter().copied()).collect();
    for lit in hyphenated_literals(&sources) {
        assert!(PASSES.contains(&lit.as_str()) || listed.contains(&lit.as_str()), "rule `{lit}` is missing from RULES");
    }
    for rule in &listed {
        assert!(sources.contains(&format!("\"{rule}\"")), "RULES lists `{rule}`, which no fusion pass names");
    }
    let mut near_misses = String::new();
    for path in graph_files(&filetest_dir()) {
        if path.file_name().unwrap().to_str().unwrap().contains("-near-miss-") {
            near_misses.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
    let mut missing = Vec::new();
    for (pass, rules) in RULES {
        for rule in rules.iter().filter(|r| !UNCOVERED.iter().any(|(p, u, _)| p == pass && u == *r)) {
            let line = format!("refused by `{rule}`:");
            if !near_misses.lines().any(|l| l.starts_with(&format!("# {pass}: ")) && l.contains(&line)) {
                missing.push(format!("{pass}/{rule}"));
            }
        }
    }
    assert!(missing.is_empty(), "refusal rules without a near-miss filetest: {missing:?}");
    for (pass, rule, _) in UNCOVERED {
        assert!(RULES.iter().any(|(p, rs)| p == pass && rs.contains(rule)), "UNCOVERED names `{pass}/{rule}`, which RULES does not list");
    }
}

#[test]
fn the_line_diff_marks_only_what_changed() {
    assert_eq!(line_diff("a\nb\nc\n", "a\nb\nc\n"), "");
    assert_eq!(line_diff("a\nb\nc\n", "a\nx\nc\n"), "  a\n- b\n+ x\n  c\n");
    let want: String = (0..10).map(|i| format!("{i}\n")).collect();
    let got = want.replace("5\n", "5\nnew\n");
    assert_eq!(line_diff(&want, &got), "  ...\n  4\n  5\n+ new\n  6\n  7\n  ...\n");
    assert_eq!(line_diff("", "a\n"), "+ a\n");
}

#[test]
fn the_format_is_split_and_checked() {
    let ft = split("# pass: canonicalize\n# bind: B=2 T=3\ngraph g() {\n}\n# expect:\n# graph g() {\n# }\n").unwrap();
    assert_eq!((ft.pass.as_str(), ft.bind.get("B"), ft.bind.get("T")), ("canonicalize", Some(2), Some(3)));
    assert_eq!(ft.source, "# pass: canonicalize\n# bind: B=2 T=3\ngraph g() {\n}\n");
    assert_eq!(ft.expect.as_deref(), Some("# expect:\n# graph g() {\n# }\n"));
    assert!(split("graph g() {\n}\n").unwrap_err().contains("# pass:"));
    assert!(split("# pass: amp\n# bind: B\ngraph g() {\n}\n").unwrap_err().contains("NAME=VALUE"));
    // A `# pass:` line after the graph is not part of the header.
    assert!(split("graph g() {\n}\n# pass: amp\n").is_err());
    assert_eq!(comment(""), "#\n");
}
