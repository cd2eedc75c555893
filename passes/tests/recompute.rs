//! `recompute`: the backward's GELU outputs are recomputed (one `gelu` per layer more, placed
//! in the backward), every output keeps its bits, and the memory plan shrinks by the stored
//! GELU outputs.

use fusec_ir::interp::{self, Rounding};
use fusec_ir::testkit::{assert_same_bits, training_feeds};
use fusec_ir::{Bindings, Graph, Op};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::amp::Precision;
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_passes::recompute::Recompute;

fn tiny() -> (Graph, Gpt2Config) {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    (build_gpt2(&cfg, "tiny"), cfg)
}

fn bind() -> Bindings {
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 8);
    b
}

fn opts(recompute: Recompute, precision: Precision, no_fusion: bool) -> PipelineOptions {
    PipelineOptions { recompute, precision, no_fusion, ..PipelineOptions::default() }
}

fn count(g: &Graph, f: fn(&Op) -> bool) -> usize {
    g.nodes.iter().filter(|n| f(&n.op)).count()
}

#[test]
fn the_backward_recomputes_each_output_once_and_every_output_keeps_its_bits() {
    let (fwd, cfg) = tiny();
    let gelu = |op: &Op| matches!(op, Op::Gelu);
    let layernorm = |op: &Op| matches!(op, Op::LayerNorm { .. });
    for (policy, lns) in [(Recompute::Gelu, 0), (Recompute::GeluLayernorm, 2 * cfg.layers + 1)] {
        for precision in [Precision::F32, Precision::Bf16] {
            for no_fusion in [true, false] {
                let stored = compile(&fwd, "schedule", Mode::Step, &opts(Recompute::None, precision, no_fusion), &bind()).unwrap().graph;
                let again = compile(&fwd, "schedule", Mode::Step, &opts(policy, precision, no_fusion), &bind()).unwrap().graph;
                if no_fusion {
                    // Unfused programs keep LayerNorm as primitives (`fuse-layernorm` is a
                    // fusion pass): only the GELUs are recomputed there.
                    assert_eq!(count(&again, gelu), count(&stored, gelu) + cfg.layers, "{precision:?}: one recomputed gelu per layer");
                } else {
                    let at = |r| compile(&fwd, "recompute", Mode::Step, &opts(r, precision, false), &bind()).unwrap().graph;
                    let (before, after) = (at(Recompute::None), at(policy));
                    assert_eq!(count(&after, gelu), count(&before, gelu) + cfg.layers, "{policy:?} {precision:?}: gelus");
                    assert_eq!(count(&after, layernorm), count(&before, layernorm) + lns, "{policy:?} {precision:?}: layernorms");
                }
                let f = training_feeds(&stored, &bind(), 11, cfg.vocab as u64);
                let want = interp::run(&stored, &bind(), &f, Rounding::F32).unwrap();
                let got = interp::run(&again, &bind(), &f, Rounding::F32).unwrap();
                assert_same_bits(&format!("{policy:?} {precision:?}, no_fusion {no_fusion}"), &got, &want);
            }
        }
    }
}

#[test]
fn the_memory_plan_no_longer_keeps_the_gelu_outputs() {
    let cfg = Gpt2Config::preset("d12").unwrap();
    let fwd = build_gpt2(&cfg, "gpt2_124m");
    let mut b = Bindings::default();
    b.set("B", 16).set("T", 1024);
    let arena = |r| compile(&fwd, "memplan", Mode::Step, &opts(r, Precision::F32, false), &b).unwrap().plan.unwrap().arena_bytes;
    let (stored, again, both) = (arena(Recompute::None), arena(Recompute::Gelu), arena(Recompute::GeluLayernorm));
    // Each layer's [B, T, 4C] f32 GELU output: 12 x 16 x 1024 x 3072 x 4 bytes.
    let gelu_outputs = 12 * 16 * 1024 * 3072 * 4u64;
    assert!(stored - again >= gelu_outputs * 9 / 10, "arena {stored} -> {again}: saved {}", stored - again);
    // And the LayerNorm outputs ([B, T, C] each, two a layer), less what the backward keeps.
    assert!(both < again, "gelu {again} -> gelu+layernorm {both}");
}

#[test]
fn forward_programs_and_the_default_policy_are_unchanged() {
    let (fwd, _) = tiny();
    let print = |m, r| fusec_ir::text::print(&compile(&fwd, "fuse", m, &opts(r, Precision::F32, false), &bind()).unwrap().graph);
    assert_eq!(print(Mode::Forward, Recompute::Gelu), print(Mode::Forward, Recompute::None));
    assert!("attention".parse::<Recompute>().unwrap_err().contains("none, gelu, gelu+layernorm"));
}
