//! Snapshots of `fusec dump --pass X` for every pass on one tiny GPT-2 block's training step:
//! a reviewer reads these diffs to see what a change did to fusion and memory planning.

use fusec_ir::Bindings;
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::amp::Precision;
use fusec_passes::pipeline::{compile, Mode, PipelineOptions, PASSES};
use fusec_passes::recompute::Recompute;

fn block() -> fusec_ir::Graph {
    let cfg = Gpt2Config { layers: 1, heads: 2, channels: 8, vocab: 10, padded_vocab: 16, max_seq: 8 };
    build_gpt2(&cfg, "gpt2_block")
}

fn dump(pass: &str, opts: &PipelineOptions) -> String {
    let mut bind = Bindings::default();
    bind.set("B", 2).set("T", 4);
    let out = compile(&block(), pass, Mode::Step, opts, &bind).unwrap();
    match &out.plan {
        Some(plan) => plan.annotate(&out.graph),
        None => fusec_ir::text::print(&out.graph),
    }
}

#[test]
fn every_pass_on_one_block() {
    // `amp` and `recompute` at their default policies change nothing: their snapshots would
    // repeat `optimizer`'s; `data-parallel` runs only in data-parallel runs.
    for pass in PASSES.iter().filter(|p| !["parse", "fuse", "amp", "recompute", "data-parallel"].contains(p)) {
        insta::assert_snapshot!(format!("block_{pass}"), dump(pass, &PipelineOptions::default()));
    }
    for pass in ["amp", "recompute"] {
        assert_eq!(dump(pass, &PipelineOptions::default()), dump("optimizer", &PipelineOptions::default()));
    }
    assert_eq!(dump("data-parallel", &PipelineOptions::default()), dump("autodiff", &PipelineOptions::default()));
}

#[test]
fn data_parallel_on_one_block() {
    let opts = PipelineOptions { data_parallel: true, ..PipelineOptions::default() };
    insta::assert_snapshot!("block_data_parallel", dump("data-parallel", &opts));
    insta::assert_snapshot!("block_schedule_data_parallel", dump("schedule", &opts));
}

#[test]
fn zero_1_on_one_block() {
    // Rank 1 of 2: AdamW for the parameters it owns, `from_owners` for all of them.
    let shard = Some(fusec_passes::zero::Shard { rank: 1, world: 2 });
    let adamw = fusec_passes::optimizer::AdamWConfig { shard, ..Default::default() };
    let opts = PipelineOptions { data_parallel: true, adamw, ..PipelineOptions::default() };
    let text = dump("optimizer", &opts);
    // The text parses back to the same graph.
    assert_eq!(fusec_ir::text::print(&fusec_ir::text::parse(&text, "zero").unwrap()), text);
    insta::assert_snapshot!("block_optimizer_zero_rank1", text);
}

#[test]
fn recompute_gelu_on_one_block() {
    let opts = PipelineOptions { recompute: Recompute::Gelu, ..PipelineOptions::default() };
    insta::assert_snapshot!("block_recompute_gelu", dump("recompute", &opts));
}

#[test]
fn amp_bf16_on_one_block() {
    let opts = PipelineOptions { precision: Precision::Bf16, ..PipelineOptions::default() };
    insta::assert_snapshot!("block_amp_bf16", dump("amp", &opts));
    insta::assert_snapshot!("block_fuse_bf16", dump("fuse", &opts));
}

#[test]
fn bf16_residual_narrows_the_residual_streams_gradient() {
    // Under `bf16+residual` LayerNorm's input gradient (the residual stream's gradient) is read
    // only through its bf16 cast; under `bf16` it stays f32 and is added in f32.
    let mut bind = Bindings::default();
    bind.set("B", 2).set("T", 4);
    for (precision, narrowed) in [(Precision::Bf16Residual, true), (Precision::Bf16, false)] {
        let opts = PipelineOptions { precision, ..PipelineOptions::default() };
        let g = compile(&block(), "amp", Mode::Step, &opts, &bind).unwrap().graph;
        let mut seen = 0;
        for n in g.nodes.iter().filter(|n| n.op == fusec_ir::Op::LayerNormGrad) {
            let mut users = g.nodes.iter().filter(|u| u.inputs.contains(&n.results[0])).peekable();
            assert!(users.peek().is_some());
            let all_bf16_casts = users.all(|u| u.op == fusec_ir::Op::Cast { to: fusec_ir::DType::BF16 });
            assert_eq!(all_bf16_casts, narrowed, "{precision:?}: users of a layernorm_grad result");
            seen += 1;
        }
        assert_eq!(seen, 3, "two LayerNorms of the block and the final one");
    }
    insta::assert_snapshot!("block_fuse_bf16_residual", dump("fuse", &PipelineOptions { precision: Precision::Bf16Residual, ..PipelineOptions::default() }));
}
