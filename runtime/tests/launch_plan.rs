//! The backend-neutral launch plan of the tiny GPT-2's programs: one launch per node that runs
//! (every node but parameters, inputs and reshapes), every offset inside the planned bytes,
//! persistent tensors at one place in every program, and the counts both executors rely on.

use std::collections::HashMap;

use fusec_ir::{DType, Op};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_passes::amp::Precision;
use fusec_runtime::launches::{sums_columns, LaunchOp, LaunchPlan};
use fusec_runtime::programs::{Program, RunPrograms};

fn tiny_run() -> RunPrograms {
    let fwd = build_gpt2(&Gpt2Config::preset("tiny").unwrap(), "tiny");
    RunPrograms::compile(&fwd, &PipelineOptions::default(), &RunPrograms::bindings(2, 16), true).unwrap()
}

#[test]
fn one_launch_per_running_node_with_offsets_inside_the_plan() {
    let run = tiny_run();
    let plan = LaunchPlan::new(&run).unwrap();
    let order: Vec<Program> = plan.programs.iter().map(|(p, _, _)| *p).collect();
    assert_eq!(order, [Program::Eval, Program::Grad, Program::Step, Program::Logits]);
    for (p, launches, io) in &plan.programs {
        let g = &run.graphs[p];
        let running: Vec<usize> = g
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| !matches!(n.op, Op::Param { .. } | Op::Input { .. } | Op::Reshape { .. }))
            .map(|(i, _)| i)
            .collect();
        assert_eq!(launches.iter().map(|l| l.node).collect::<Vec<_>>(), running, "{p:?}");
        let products = g.nodes.iter().filter(|n| matches!(n.op, Op::MatMul { .. } | Op::Gemm(_))).count();
        assert_eq!(launches.iter().filter(|l| matches!(l.op, LaunchOp::Product(_))).count(), products, "{p:?}");
        for l in launches {
            assert!(l.bytes > 0, "{p:?} {}", l.name);
            let offsets: Vec<u64> = match &l.op {
                LaunchOp::Product(pr) => [pr.a, pr.b, pr.y].into_iter().chain(pr.bias).chain(pr.acc).chain(pr.pre).collect(),
                LaunchOp::Kernel { ins, outs, .. } => ins.iter().chain(outs).copied().collect(),
                LaunchOp::Gather(g) => vec![g.table, g.idx, g.out],
                LaunchOp::ScatterAdd(s) => vec![s.src, s.idx, s.out],
                LaunchOp::Attention(a) => [a.at.qkv, a.at.out, a.at.lse].into_iter().chain(a.at.dout).chain(a.at.dqkv).collect(),
                LaunchOp::Iota(i) => vec![i.out],
                LaunchOp::Fill(f) => vec![f.out],
                LaunchOp::Collective(parts) => parts.iter().flat_map(|r| [r.x, r.y]).collect(),
            };
            for o in offsets {
                assert!(o < plan.planned_bytes && o % 4 == 0, "{p:?} {}: offset {o} of {}", l.name, plan.planned_bytes);
            }
        }
        if *p != Program::Logits {
            let (_, off, _) = io.scalars.iter().find(|(n, _, _)| n == "loss").expect("a loss output");
            assert!(*off < plan.planned_bytes);
        }
    }
    // Parameters and gradients live in the persistent prefix, named, inside the plan.
    for (name, _) in run.step().unwrap().params() {
        let (off, bytes) = plan.layout.named[name];
        assert!(off + bytes <= plan.layout.persistent_bytes, "{name}");
        assert!(plan.tensors.contains_key(name), "{name}");
    }
    let (goff, gbytes) = plan.layout.grads;
    assert!(gbytes > 0 && goff + gbytes <= plan.layout.persistent_bytes);
}

#[test]
fn a_plan_that_does_not_fit_says_both_numbers() {
    let run = tiny_run();
    let plan = LaunchPlan::new(&run).unwrap();
    let msg = plan.too_large();
    assert!(msg.contains("the memory plan needs") && msg.contains("persistent") && msg.contains("activations"), "{msg}");
}

#[test]
fn attention_launches_carry_the_storage_of_qkv() {
    // f32 in the tiny GPT-2; bf16 where q/k/v are bf16 (`lse` stays f32).
    let plan_dtypes = |run: &RunPrograms| -> Vec<DType> {
        let plan = LaunchPlan::new(run).unwrap();
        let attn = plan.programs.iter().flat_map(|(_, ls, _)| ls).filter_map(|l| match &l.op {
            LaunchOp::Attention(a) => Some((a.dtype, l.dtypes.clone())),
            _ => None,
        });
        attn.map(|(dt, dts)| {
            assert_eq!(dts[0], dt, "qkv's storage");
            dt
        })
        .collect()
    };
    let tiny = plan_dtypes(&tiny_run());
    assert!(!tiny.is_empty() && tiny.iter().all(|d| *d == DType::F32), "{tiny:?}");
    let src = "graph g(B, T) {
  %0 = input \"qkv\" : f32[B, T, 48]
  %1 = input \"dout\" : f32[B, T, 16]
  %2 = cast %0 : bf16[B, T, 48]
  %3, %4 = attention %2 {heads = 2, scale = 0.35355339059327373} : bf16[B, T, 16], f32[B, 2, T]
  %5 = cast %1 : bf16[B, T, 16]
  %6 = attention_grad %2, %3, %4, %5 {heads = 2, scale = 0.35355339059327373} : bf16[B, T, 48]
  %7 = cast %3 : f32[B, T, 16]
  %8 = cast %6 : f32[B, T, 48]
  output \"out\" = %7
  output \"lse\" = %4
  output \"dqkv\" = %8
}
";
    let g = fusec_ir::text::parse(src, "bf16_attention.graph").unwrap();
    let bind = RunPrograms::bindings(2, 5);
    let opts = PipelineOptions::default();
    let step = compile(&g, "schedule", Mode::Forward, &opts, &bind).unwrap().graph;
    let run = RunPrograms { graphs: HashMap::from([(Program::Step, step)]), bind, opts, pass_runs: vec![] };
    assert_eq!(plan_dtypes(&run), [DType::BF16, DType::BF16]);
}

#[test]
fn the_qkv_bias_gradient_sums_dqkv_right_after_the_attention_backward() {
    // What the CUDA target folds into its Hopper backward kernels (`launches::sums_columns`):
    // in bf16, each layer's qkv bias gradient is a kernel that only sums the columns of the
    // `dqkv` that the launch before it wrote (and adds them to the gradient when it accumulates).
    // At the 124M shape the memory-greedy order alone would put the input-gradient product
    // between the two (`schedule_colsum` moves the sum up).
    let cases = [
        ("tiny", (2, 16), Precision::Bf16, true),
        ("tiny", (2, 16), Precision::Bf16Residual, true),
        ("tiny", (2, 16), Precision::Bf16, false),
        ("tiny", (2, 16), Precision::F32, true),
        ("d12", (16, 1024), Precision::Bf16Residual, true),
    ];
    for (preset, (b, t), precision, fresh) in cases {
        let cfg = Gpt2Config::preset(preset).unwrap();
        let fwd = build_gpt2(&cfg, preset);
        let mut opts = PipelineOptions { precision, ..PipelineOptions::default() };
        opts.adamw.fresh_grads = fresh;
        let run = RunPrograms::compile(&fwd, &opts, &RunPrograms::bindings(b, t), true).unwrap();
        let plan = LaunchPlan::new(&run).unwrap();
        let (_, launches, _) = plan.programs.iter().find(|(p, _, _)| *p == Program::Step).unwrap();
        let (mut grads, mut folds) = (0, 0);
        for (i, l) in launches.iter().enumerate() {
            if let LaunchOp::Attention(a) = &l.op {
                if a.forward {
                    continue;
                }
                grads += 1;
                if let Some(LaunchOp::Kernel { kernel, ins, .. }) = launches.get(i + 1).map(|n| &n.op) {
                    // Under gradient accumulation the sum is added to the gradient.
                    if ins[0] == a.at.dqkv.unwrap() && sums_columns(kernel) == Some(!fresh) {
                        folds += 1;
                    }
                }
            }
        }
        let expect = if precision == Precision::F32 { 0 } else { grads };
        assert_eq!((grads, folds), (cfg.layers, expect), "{preset} {precision:?}");
        // No other kernel of the step is such a sum (LayerNorm's gradient sums columns too,
        // beside other work).
        let sums = launches.iter().filter(|l| matches!(&l.op, LaunchOp::Kernel { kernel, .. } if sums_columns(kernel).is_some())).count();
        assert_eq!(sums, expect, "{precision:?}");
    }
}

#[test]
fn collectives_start_after_their_last_gradient_and_their_readers_wait_for_them() {
    let fwd = build_gpt2(&Gpt2Config::preset("tiny").unwrap(), "tiny");
    let opts = PipelineOptions { data_parallel: true, ..PipelineOptions::default() };
    let run = RunPrograms::compile(&fwd, &opts, &RunPrograms::bindings(2, 16), false).unwrap();
    let plan = LaunchPlan::new(&run).unwrap();
    let (_, launches, _) = plan.programs.iter().find(|(p, _, _)| *p == Program::Step).unwrap();
    let g = run.step().unwrap();
    let collectives: Vec<usize> = (0..launches.len()).filter(|&i| launches[i].name == "all_reduce").collect();
    // The loss and at least one bucket of gradients; every parameter's gradient averaged once.
    assert!(collectives.len() >= 2, "{collectives:?}");
    let averaged: usize = collectives.iter().map(|&i| g.nodes[launches[i].node].inputs.len()).sum();
    assert_eq!(averaged, g.params().len() + 1);
    for &j in &collectives {
        let node = &g.nodes[launches[j].node];
        // Right after the launch of its last operand's producer (views have no launch).
        let producers: Vec<usize> = node.inputs.iter().map(|v| g.values[v.0 as usize].node.0 as usize).collect();
        let last = (0..j).rev().find(|&i| producers.contains(&launches[i].node));
        assert_eq!(last.map(|i| i + 1), Some(j), "all_reduce launch {j} is not right after its last gradient");
        // Whoever reads a result waits for it; nobody before it does.
        for (i, l) in launches.iter().enumerate() {
            let reads = g.nodes[l.node].inputs.iter().any(|v| node.results.contains(v));
            assert_eq!(l.waits.contains(&j), reads && i > j, "launch {i} ({}) and all_reduce {j}", l.name);
        }
    }
    // The AdamW kernel waits for every gradient bucket.
    let adamw = launches.iter().find(|l| l.ops.contains(&"adamw")).unwrap();
    assert_eq!(adamw.waits.len(), collectives.len() - 1);
}

/// GPT-2 124M's data-parallel step at a small batch, with ZeRO-1 when `shard` is given.
fn d12_data_parallel(shard: Option<fusec_passes::zero::Shard>) -> RunPrograms {
    let fwd = build_gpt2(&Gpt2Config::preset("d12").unwrap(), "d12");
    let adamw = fusec_passes::optimizer::AdamWConfig { shard, ..Default::default() };
    let opts = PipelineOptions { data_parallel: true, adamw, ..PipelineOptions::default() };
    RunPrograms::compile(&fwd, &opts, &RunPrograms::bindings(1, 16), false).unwrap()
}

#[test]
fn gradient_buckets_are_averaged_while_the_backward_runs() {
    // The weight gradients run as soon as they can, so most buckets start before the backward's
    // last attention: the memory-greedy order had put every weight gradient, and so every
    // all-reduce, after the whole backward (nothing overlapped).
    let run = d12_data_parallel(None);
    let plan = LaunchPlan::new(&run).unwrap();
    let (_, launches, _) = plan.programs.iter().find(|(p, _, _)| *p == Program::Step).unwrap();
    let g = run.step().unwrap();
    let op = |i: usize| g.nodes[launches[i].node].op.mnemonic();
    let last_attention = (0..launches.len()).rfind(|&i| op(i) == "attention_grad").unwrap();
    let buckets: Vec<usize> = (0..launches.len()).filter(|&i| op(i) == "all_reduce").collect();
    let early = buckets.iter().filter(|&&i| i < last_attention).count();
    assert!(buckets.len() >= 15 && early * 4 >= buckets.len() * 3, "{early} of {} buckets before the last attention backward", buckets.len());
    // In place, so that the CUDA executor may run them on a second stream.
    for &i in &buckets {
        let LaunchOp::Collective(parts) = &launches[i].op else { panic!("all_reduce is not a collective") };
        assert!(parts.iter().all(|p| p.x == p.y), "launch {i}: an all-reduce not in place");
    }
}

#[test]
fn zero_1_takes_each_rank_s_parameters_in_one_broadcast() {
    use fusec_passes::zero::Shard;
    for rank in 0..2 {
        let run = d12_data_parallel(Some(Shard { rank, world: 2 }));
        let plan = LaunchPlan::new(&run).unwrap();
        let (_, launches, _) = plan.programs.iter().find(|(p, _, _)| *p == Program::Step).unwrap();
        let g = run.step().unwrap();
        let from_owners: Vec<_> = launches.iter().filter(|l| g.nodes[l.node].op.mnemonic() == "from_owners").collect();
        let [l] = from_owners[..] else { panic!("{} from_owners launches", from_owners.len()) };
        let LaunchOp::Collective(parts) = &l.op else { panic!("from_owners is not a collective") };
        // The owners' contiguous runs of the parameter buffer, one part each, every element once.
        let owners: Vec<Option<usize>> = parts.iter().map(|p| p.owner).collect();
        assert_eq!(owners, [Some(0), Some(1)], "rank {rank}");
        let elements: usize = parts.iter().map(|p| p.n).sum();
        assert_eq!(elements, Gpt2Config::preset("d12").unwrap().num_params(), "rank {rank}");
    }
}
