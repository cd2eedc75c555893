//! Causal attention on the CPU target against the interpreter (the oracle), on f32 and bf16
//! storage: outputs, `lse` and gradients at sequence lengths that cross the causal row blocks of
//! `runtime/src/cpu/attention.rs` (1, 17, 100 and 200 rows against blocks of 64), with one and
//! two threads giving the same bits, and the backward both when it reads the probabilities its
//! forward kept and when it recomputes them (`FUSEC_CPU_KEEP_SCORES_MIB=0`; this file's one test
//! sets the variable, so no other test in the process sees it). The two differ in the last bits:
//! the forward's `p` is `exp(s - max) / sum`, the recomputed one `exp(s - lse)`.

use std::collections::HashMap;

use fusec_ir::interp::{self, Rounding};
use fusec_ir::rng::Rng;
use fusec_ir::testkit;
use fusec_models::{bf16_attention_graph, f32_attention_graph};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_runtime::cpu::CpuExecutor;
use fusec_runtime::executor::Executor;
use fusec_runtime::programs::{Program, RunPrograms};

#[test]
fn cpu_attention_matches_the_interpreter_across_causal_blocks() {
    let mut failures = vec![];
    for bf16 in [false, true] {
        for (b, h, t) in [(2, 2, 1), (2, 3, 17), (1, 2, 100), (1, 2, 200)] {
            let d = 32;
            let what = format!("{} storage, B {b}, H {h}, T {t}", if bf16 { "bf16" } else { "f32" });
            let g = if bf16 { bf16_attention_graph(h, d) } else { f32_attention_graph(h, d) };
            let bind = RunPrograms::bindings(b, t);
            let opts = PipelineOptions::default();
            let step = compile(&g, "schedule", Mode::Forward, &opts, &bind).unwrap().graph;
            let run = RunPrograms { graphs: HashMap::from([(Program::Step, step)]), bind, opts, pass_runs: vec![] };
            let mut feeds = testkit::random_feeds(&g, &run.bind, &mut Rng::new(31 + t as u64), 1).unwrap();
            feeds.get_mut("qkv").unwrap().data.iter_mut().for_each(|x| *x *= 2.0);
            let want = interp::run(&g, &run.bind, &feeds, Rounding::F32).unwrap();
            let mut runs = vec![];
            // One and two threads keeping the probabilities, then one thread recomputing them.
            for (threads, keep) in [(1, true), (2, true), (1, false)] {
                if keep {
                    std::env::remove_var("FUSEC_CPU_KEEP_SCORES_MIB");
                } else {
                    std::env::set_var("FUSEC_CPU_KEEP_SCORES_MIB", "0");
                }
                let (mut cpu, _) = CpuExecutor::new(&run, threads, false).unwrap_or_else(|e| panic!("{what}: {e}"));
                std::env::remove_var("FUSEC_CPU_KEEP_SCORES_MIB");
                let stages = cpu.launch_flops(Program::Step).iter().filter(|(n, _)| n.starts_with("gemm_attn_scores")).count();
                if stages != if keep { 1 } else { 2 } {
                    failures.push(format!("{what}: {stages} score products with keeping {keep}"));
                }
                for name in ["qkv", "dout"] {
                    cpu.set(name, feeds[name].clone()).unwrap();
                }
                cpu.run(Program::Step).unwrap();
                runs.push(["out", "lse", "dqkv"].map(|n| cpu.output(Program::Step, n).unwrap().data));
            }
            for (i, name) in ["out", "lse", "dqkv"].into_iter().enumerate() {
                for (got, how) in [(&runs[0][i], "kept"), (&runs[2][i], "recomputed")] {
                    let rel = testkit::rel_l2(got, &want[i].data);
                    // f32: products in f32 against the interpreter's f64; bf16: as
                    // `cuda_attention` (results rounded to bf16 on both sides, probabilities
                    // rounded for products).
                    let limit = if bf16 && name != "lse" { 1e-2 } else { 1e-5 };
                    if rel.is_nan() || rel > limit {
                        failures.push(format!("{what}: {name} ({how} probabilities): relative L2 {rel:e} over {limit:e}"));
                    }
                }
                if !runs[0][i].iter().zip(&runs[1][i]).all(|(a, b)| a.to_bits() == b.to_bits()) {
                    failures.push(format!("{what}: {name} differs between one and two threads"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
