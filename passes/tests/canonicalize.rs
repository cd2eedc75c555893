//! `canonicalize` keeps the interpreter's outputs bit for bit on every filetest input
//! (`filetests/canonicalize`, where each rule fires and the IEEE-unsafe near misses do not),
//! also on infinities, NaN and -0.0; on random graphs the result verifies and computes the same
//! outputs, and the pass is idempotent.

use std::collections::HashMap;

use fusec_ir::interp::{self, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::{random_graph_with, GenOpts};
use fusec_ir::testkit::{assert_same_bits, check_tensor, random_feeds, read_graphs};
use fusec_ir::text::print;
use fusec_ir::verify::verify;
use fusec_ir::{Bindings, DType, Graph};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::canonicalize::canonicalize;

fn bindings() -> Bindings {
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 3).set("N", 2);
    b
}

/// Both graphs' outputs on the same random feeds (F32), plus `extra` feeds overriding them.
fn run_pair(g: &Graph, h: &Graph, seed: u64, extra: &[(&str, Tensor)]) -> Result<(Vec<Tensor>, Vec<Tensor>), String> {
    let b = bindings();
    let mut feeds = random_feeds(g, &b, &mut Rng::new(seed), 2)?;
    for (k, t) in extra {
        feeds.insert(k.to_string(), t.clone());
    }
    let before = interp::run(g, &b, &feeds, Rounding::F32).map_err(|e| format!("before: {e}"))?;
    let after = interp::run(h, &b, &feeds, Rounding::F32).map_err(|e| format!("after: {e}\n{}", print(h)))?;
    Ok((before, after))
}

/// Canonicalizes `g`, checks that the result verifies and gives bit-identical outputs, and
/// returns it.
fn canon_exact(g: &Graph, extra: &[(&str, Tensor)]) -> Graph {
    verify(g).expect("test graph verifies");
    let h = canonicalize(g).expect("canonicalize");
    verify(&h).unwrap_or_else(|e| panic!("{e}\n{}", print(&h)));
    let (a, b) = run_pair(g, &h, 7, extra).unwrap();
    assert_same_bits(&format!("{}\n{}", print(g), print(&h)), &b, &a);
    h
}

fn filetest_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/filetests/canonicalize")
}

#[test]
fn every_filetest_input_keeps_its_bits() {
    let files = read_graphs(&filetest_dir());
    assert!(files.len() >= 8, "{} files", files.len());
    let b = bindings();
    for (name, g) in &files {
        let feeds = random_feeds(g, &b, &mut Rng::new(7), 2).unwrap();
        if interp::run(g, &b, &feeds, Rounding::F32).is_err() {
            // What the interpreter rejects (i32 division by zero) stays rejected.
            let h = canonicalize(g).unwrap();
            assert!(interp::run(&h, &b, &feeds, Rounding::F32).is_err(), "{name}: canonicalize removed a run-time error");
            continue;
        }
        canon_exact(g, &[]);
    }
}

#[test]
fn ieee_unsafe_identities_keep_infinities_nan_and_signed_zeros() {
    let g = read_graphs(&filetest_dir()).into_iter().find(|(n, _)| n == "identities-near-miss-ieee.graph").unwrap().1;
    // x holds inf, -inf, NaN and -0.0: x*0 is NaN there, x+0 is +0.0 for -0.0.
    let mut v = vec![f64::INFINITY, f64::NEG_INFINITY, f64::NAN, -0.0];
    v.extend((0..8).map(|i| i as f64 - 3.5));
    canon_exact(&g, &[("x", Tensor::new(DType::F32, vec![4, 3], v))]);
}

#[test]
fn random_graphs_verify_keep_their_values_and_are_idempotent() {
    let (mut compared, mut changed) = (0, 0);
    for seed in 0..3000u64 {
        // Half the graphs also hold extreme constants (infinities, subnormals, -0.0, 1e300).
        let opts = GenOpts { extreme_consts: seed % 2 == 1, ..GenOpts::default() };
        let g = random_graph_with(&mut Rng::new(seed), &opts);
        let h = canonicalize(&g).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        verify(&h).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", print(&h)));
        let h2 = canonicalize(&h).unwrap();
        assert_eq!(print(&h2), print(&h), "seed {seed}: not idempotent\n{}", print(&g));
        changed += (print(&h) != print(&g)) as usize;
        // Graphs the interpreter rejects (bad gather indices, i32 division by zero) are skipped.
        let b = bindings();
        let Ok(feeds) = random_feeds(&g, &b, &mut Rng::new(seed), 2) else {
            continue;
        };
        let Ok(before) = interp::run(&g, &b, &feeds, Rounding::F32) else {
            continue;
        };
        let after = interp::run(&h, &b, &feeds, Rounding::F32).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", print(&h)));
        for (i, (x, y)) in after.iter().zip(&before).enumerate() {
            if let Err(e) = check_tensor(x, y, 1e-30, 1e-6) {
                panic!("seed {seed}, output {i}: {e}\n{}\n{}", print(&g), print(&h));
            }
        }
        compared += 1;
    }
    assert!(compared > 1000 && changed > 600, "compared {compared}, changed {changed}");
}

#[test]
fn gpt2_tiny_is_canonical_after_one_run() {
    let g = build_gpt2(&Gpt2Config::preset("tiny").unwrap(), "t");
    let h = canonicalize(&g).unwrap();
    verify(&h).unwrap();
    assert!(h.nodes.len() < g.nodes.len());
    assert_eq!(print(&canonicalize(&h).unwrap()), print(&h));
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 4);
    let feeds: HashMap<String, Tensor> = random_feeds(&g, &b, &mut Rng::new(1), 250).unwrap();
    let x = interp::run(&g, &b, &feeds, Rounding::F32).unwrap();
    let y = interp::run(&h, &b, &feeds, Rounding::F32).unwrap();
    assert_eq!(x[0].data[0].to_bits(), y[0].data[0].to_bits());
}
