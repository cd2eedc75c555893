//! The `fuse-elementwise` pass keeps the interpreter's values on every filetest input
//! (`filetests/fuse-elementwise`, where each kernel form fires and each legality rule refuses its
//! near misses), on random graphs and on the GPT-2 training graphs; identical layers get
//! identical kernels; a snapshot of the fused tiny GPT-2 step's launches.

use std::collections::HashMap;

use fusec_ir::interp::{self, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::{random_graph_with, GenOpts};
use fusec_ir::testkit::{check_tensor, random_feeds, read_graphs, training_feeds};
use fusec_ir::text::print;
use fusec_ir::verify::verify;
use fusec_ir::{Bindings, Graph, Op, ValueId};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::explain::FusionLog;
use fusec_passes::fuse_elementwise::{fuse_elementwise, launches};
use fusec_passes::optimizer::{optimizer, AdamWConfig};

fn fuse(g: &Graph) -> (Graph, FusionLog) {
    let mut log = FusionLog::default();
    let f = fuse_elementwise(g, &mut log).unwrap_or_else(|e| panic!("{e}\n{}", print(g)));
    verify(&f).unwrap_or_else(|e| panic!("{e}\n{}", print(&f)));
    (f, log)
}

/// Kernel names in launch order.
fn kernels(g: &Graph) -> Vec<&str> {
    g.nodes.iter().filter_map(|n| if let Op::Kernel(k) = &n.op { Some(k.name.as_str()) } else { None }).collect()
}

/// The rule names of the refusals, in order.
fn rules(log: &FusionLog) -> Vec<&'static str> {
    log.of("fuse-elementwise").iter().map(|r| r.rule).collect()
}

/// One line per launch: the kernel name (or op) with operand and result types.
fn launch_list(g: &Graph) -> String {
    let mut s = String::new();
    for n in &g.nodes {
        if matches!(n.op, Op::Param { .. } | Op::Input { .. } | Op::Reshape { .. }) {
            continue;
        }
        let name = if let Op::Kernel(k) = &n.op { format!("kernel {}", k.name) } else { n.op.mnemonic().to_string() };
        // Runs of one type are written once with a count (the AdamW kernel has ~150 operands).
        let tys = |vs: &[ValueId]| {
            let mut runs: Vec<(String, usize)> = Vec::new();
            for v in vs {
                let t = g.ty(*v).to_string();
                match runs.last_mut() {
                    Some((last, k)) if *last == t => *k += 1,
                    _ => runs.push((t, 1)),
                }
            }
            runs.iter().map(|(t, k)| if *k == 1 { t.clone() } else { format!("{t} x{k}") }).collect::<Vec<_>>().join(", ")
        };
        s.push_str(&format!("{name}({}) -> ({})\n", tys(&n.inputs), tys(&n.results)));
    }
    s
}

/// Runs both graphs on the same feeds (F32) and compares every output.
fn assert_same_values(g: &Graph, f: &Graph, b: &Bindings, feeds: &HashMap<String, Tensor>) {
    let x = interp::run(g, b, feeds, Rounding::F32).unwrap_or_else(|e| panic!("before: {e}"));
    let y = interp::run(f, b, feeds, Rounding::F32).unwrap_or_else(|e| panic!("after: {e}\n{}", print(f)));
    for (i, (p, q)) in y.iter().zip(&x).enumerate() {
        if let Err(e) = check_tensor(p, q, 0.0, 1e-6) {
            panic!("output {} ({i}) differs: {e}\n{}", g.outputs[i].0, print(f));
        }
    }
}

#[test]
fn every_filetest_input_keeps_its_values() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/filetests/fuse-elementwise");
    let files = read_graphs(std::path::Path::new(dir));
    assert!(files.len() >= 15, "{} files in {dir}", files.len());
    let b = Bindings::default();
    for (name, g) in &files {
        let (f, _) = fuse(g);
        assert!(f.nodes.iter().any(|n| matches!(n.op, Op::Kernel(_))), "{name}: no kernel");
        assert_same_values(g, &f, &b, &training_feeds(g, &b, 7, 2));
    }
}

// ---- whole graphs --------------------------------------------------------------------------

fn tiny_training_graph() -> Graph {
    let g = build_gpt2(&Gpt2Config::preset("tiny").unwrap(), "t");
    let g = fusec_passes::autodiff::autodiff(&g).unwrap();
    optimizer(&g, &AdamWConfig::default()).unwrap()
}

#[test]
fn tiny_gpt2_training_step_keeps_its_values() {
    let g = tiny_training_graph();
    let (f, log) = fuse(&g);
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 5);
    assert_same_values(&g, &f, &b, &training_feeds(&g, &b, 11, 250));
    // One AdamW kernel for all 28 parameters.
    let names = kernels(&f);
    assert_eq!(names.iter().filter(|n| **n == "adamw").count(), 1, "{names:?}");
    let adamw = f.nodes.iter().find_map(|n| match &n.op {
        Op::Kernel(k) if k.name == "adamw" => Some(k),
        _ => None,
    });
    let count = adamw.unwrap().body.nodes.iter().filter(|n| matches!(n.op, Op::AdamW { .. })).count();
    assert_eq!(count, g.params().len());
    assert!(!f.nodes.iter().any(|n| matches!(n.op, Op::AdamW { .. })));
    // Every elementwise op, reduction and composite is inside a kernel.
    assert!(!f.nodes.iter().any(|n| n.op.is_elementwise() || matches!(n.op, Op::Reduce { .. })), "{}", print(&f));
    assert!(rules(&log)
        .iter()
        .all(|r| ["not-fusible", "cycle", "domain-mismatch", "recompute-in-reduction", "read-count-limit"].contains(r)));
    eprintln!("tiny: {} launches before, {} after, {} kernels", launches(&g), launches(&f), names.len());
    insta::assert_snapshot!("tiny_gpt2_training_launches", launch_list(&f));
}

#[test]
fn identical_layers_get_identical_kernel_bodies() {
    let (f, _) = fuse(&tiny_training_graph());
    let mut by_name: HashMap<&str, Vec<String>> = HashMap::new();
    for n in &f.nodes {
        if let Op::Kernel(k) = &n.op {
            by_name.entry(k.name.as_str()).or_default().push(print(&k.body));
        }
    }
    // The two blocks' LayerNorm kernels have the same name and bodies.
    let ln = &by_name["sub_mul_reduce_sum_add_rsqrt"];
    assert!(ln.len() >= 4, "{}", ln.len());
    assert!(ln.iter().all(|b| *b == ln[0]));
}

#[test]
fn random_graphs_verify_and_keep_their_values() {
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 3).set("N", 2);
    let (mut compared, mut fused) = (0, 0);
    for seed in 0..300u64 {
        let opts = GenOpts { extreme_consts: false, ..GenOpts::default() };
        let g = random_graph_with(&mut Rng::new(seed), &opts);
        let mut log = FusionLog::default();
        let f = fuse_elementwise(&g, &mut log).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", print(&g)));
        verify(&f).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}", print(&f)));
        fused += f.nodes.iter().filter(|n| matches!(n.op, Op::Kernel(_))).count();
        let Ok(feeds) = random_feeds(&g, &b, &mut Rng::new(seed), 2) else {
            continue;
        };
        let Ok(before) = interp::run(&g, &b, &feeds, Rounding::F32) else {
            continue;
        };
        let after = interp::run(&f, &b, &feeds, Rounding::F32).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}\n{}", print(&g), print(&f)));
        for (i, (x, y)) in after.iter().zip(&before).enumerate() {
            if let Err(e) = check_tensor(x, y, 0.0, 1e-6) {
                panic!("seed {seed}, output {i}: {e}\n{}\n{}", print(&g), print(&f));
            }
        }
        compared += 1;
    }
    assert!(compared > 250 && fused > 150, "compared {compared}, kernels {fused}");
}

/// Launches other than matmuls and gemms.
fn non_matmul_launches(g: &Graph) -> usize {
    launches(g) - g.nodes.iter().filter(|n| matches!(n.op, Op::MatMul { .. } | Op::Gemm(_))).count()
}

/// The training graph of a tiny GPT-2 with `layers` blocks, after every pass before this one.
fn tiny_pipeline_graph(layers: usize) -> Graph {
    use fusec_passes::{autodiff, canonicalize, fuse_epilogue, fuse_grad_accum, fuse_layernorm};
    let cfg = Gpt2Config { layers, ..Gpt2Config::preset("tiny").unwrap() };
    let mut log = FusionLog::default();
    let g = canonicalize::canonicalize(&build_gpt2(&cfg, "t")).unwrap();
    let g = fuse_layernorm::fuse_layernorm(&g, &mut log).unwrap();
    let g = optimizer(&autodiff::autodiff(&g).unwrap(), &AdamWConfig::default()).unwrap();
    let g = fuse_epilogue::fuse_epilogue(&g, &mut log).unwrap();
    fuse_grad_accum::fuse_grad_accum(&g, &mut log).unwrap()
}

#[test]
fn after_the_other_passes_a_block_takes_at_most_8_non_matmul_launches() {
    let (one, _) = fuse(&tiny_pipeline_graph(1));
    let g2 = tiny_pipeline_graph(2);
    let (two, _) = fuse(&g2);
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 3);
    assert_same_values(&g2, &two, &b, &training_feeds(&g2, &b, 11, 250));
    let per_block = non_matmul_launches(&two) - non_matmul_launches(&one);
    eprintln!(
        "after the other passes: {} launches before, {} after; {per_block} non-matmul launches per block",
        launches(&g2),
        launches(&two)
    );
    assert!(per_block <= 8, "{per_block}\n{}", launch_list(&two));
    // add + layernorm forward; layernorm_grad with the residual-gradient add backward, and the
    // bias gradient of the projection that produced the residual (except the first block's
    // first LayerNorm: the embeddings have no bias).
    let names = kernels(&two);
    assert_eq!(names.iter().filter(|n| **n == "add_layernorm").count(), 5, "{names:?}");
    assert_eq!(names.iter().filter(|n| **n == "layernorm_grad_add_reduce_sum").count(), 4, "{names:?}");
    assert_eq!(names.iter().filter(|n| **n == "layernorm_grad_add").count(), 1, "{names:?}");
    assert_eq!(names.iter().filter(|n| **n == "adamw").count(), 1, "{names:?}");
}

#[test]
fn gpt2_124m_training_graph_fuses_quickly_with_one_adamw_kernel() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/gpt2-124m.graph");
    let src = std::fs::read_to_string(path).unwrap();
    let g = fusec_ir::text::parse(&src, path).unwrap();
    let g = optimizer(&fusec_passes::autodiff::autodiff(&g).unwrap(), &AdamWConfig::default()).unwrap();
    let t0 = std::time::Instant::now();
    let mut log = FusionLog::default();
    let f = fuse_elementwise(&g, &mut log).unwrap();
    let took = t0.elapsed();
    let t1 = std::time::Instant::now();
    verify(&f).unwrap();
    eprintln!("124M: verifying the input takes about {:?}", t1.elapsed());
    let names = kernels(&f);
    // 148 parameters: one multi-tensor kernel with 444 results.
    assert_eq!(names.iter().filter(|n| **n == "adamw").count(), 1);
    assert!(!rules(&log).contains(&"result-count-limit"));
    eprintln!(
        "124M: {} launches before, {} after ({} kernels, {} refusals) in {took:?}",
        launches(&g),
        launches(&f),
        names.len(),
        log.refusals.len()
    );
}
