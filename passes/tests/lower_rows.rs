//! `lower-rows`: the row programs of every distinct kernel of the tiny GPT-2 training step, as
//! `fusec dump --pass lower-rows` prints them (after `memplan`). Any change to what a kernel is
//! lowered to shows up in review, before either backend's code changes.

use fusec_ir::{Bindings, Op};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::lower_rows::{lower_kernel, print};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};

/// The tiny GPT-2's training step (B=2, T=8) after `memplan`, and its bindings.
fn tiny_step() -> (fusec_ir::Graph, Bindings) {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let g = build_gpt2(&cfg, "tiny");
    let mut bind = Bindings::default();
    bind.set("B", 2).set("T", 8);
    let step = compile(&g, "memplan", Mode::Step, &PipelineOptions::default(), &bind).unwrap().graph;
    (step, bind)
}

#[test]
fn tiny_step_row_programs_snapshot() {
    let (step, bind) = tiny_step();
    let text = print(&step, &bind).unwrap();
    assert_eq!(text, print(&step, &bind).unwrap(), "same graph, same text");
    insta::assert_snapshot!("tiny_step_rows", text);
}

#[test]
fn every_kernel_lowers_to_programs_with_chunks_and_outputs() {
    let (step, bind) = tiny_step();
    let mut kernels = 0;
    for n in &step.nodes {
        if let Op::Kernel(k) = &n.op {
            kernels += 1;
            let progs = lower_kernel(k, &bind).unwrap_or_else(|e| panic!("{}: {e}", k.name));
            assert!(!progs.is_empty(), "{}: no segments", k.name);
            for p in &progs {
                assert!(p.chunks >= 1 && p.chunks <= p.rows.max(1), "{}: {} chunks over {} rows", k.name, p.chunks, p.rows);
                assert!(!p.stores.is_empty(), "{}: a segment without results", k.name);
                // The lowering leaves the CPU-only lists empty.
                assert!(p.offloads.is_empty() && p.native_maxes.is_empty(), "{}", k.name);
            }
        }
    }
    assert!(kernels > 0, "the tiny step has fused kernels");
}
