//! Flash attention on bf16 storage against the interpreter (the oracle): outputs, `lse` and
//! gradients for head sizes 32, 64, 128 (bf16 tensor-core kernels) and 48 (TF32 kernels on
//! widened bf16 tiles), sequence lengths 1, 17, 100 and 1024 (none or some a multiple of the
//! tiles) and several batch × head counts; the same bits on a second run; the qkv bias gradient
//! that the Hopper backward sums itself. Needs a GPU: run with `--ignored` on the device.

use std::collections::HashMap;

use fusec_ir::interp::{self, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit;
use fusec_models::bf16_attention_graph;
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_runtime::cuda::{CudaExecutor, CudaOptions};
use fusec_runtime::executor::Executor;
use fusec_runtime::programs::{Program, RunPrograms};

/// The attention graph's Step program for `heads` heads of `d` columns, batch `b`, length `t`.
fn attention_run(heads: usize, d: usize, b: usize, t: usize) -> (fusec_ir::Graph, RunPrograms) {
    let g = bf16_attention_graph(heads, d);
    let bind = RunPrograms::bindings(b, t);
    let opts = PipelineOptions::default();
    let step = compile(&g, "schedule", Mode::Forward, &opts, &bind).unwrap().graph;
    (g, RunPrograms { graphs: HashMap::from([(Program::Step, step)]), bind, opts, pass_runs: vec![] })
}

/// `out`, `lse` and `dqkv` of one run on the GPU.
fn run_gpu(gpu: &mut CudaExecutor, feeds: &HashMap<String, Tensor>) -> Vec<Vec<f64>> {
    for name in ["qkv", "dout"] {
        gpu.set(name, feeds[name].clone()).unwrap();
    }
    gpu.run(Program::Step).unwrap();
    ["out", "lse", "dqkv"].iter().map(|n| gpu.output(Program::Step, n).unwrap().data).collect()
}

/// What the attention summary adds where the kernels run on Hopper's warpgroup MMAs.
const HOPPER: &str = "; on Hopper warpgroup MMAs (wgmma)";

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn bf16_flash_attention_matches_the_interpreter_and_repeats_bit_for_bit() {
    // (head size, the kernels it runs on).
    let heads = [(32, "bf16 tensor cores"), (64, "bf16 tensor cores"), (128, "bf16 tensor cores"), (48, "TF32 tensor cores")];
    check_bf16_flash(&heads);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn the_hopper_kernels_give_the_mma_sync_kernels_bits() {
    // On sm_90a the head size 64 kernels run on warpgroup MMAs; `FUSEC_FLASH_WGMMA=0` keeps the
    // `mma.sync` ones. Both sum the same products in the same order, so every output is the
    // same bits. Elsewhere both runs take the `mma.sync` kernels. Run with `--test-threads 1`:
    // the variable is the process's.
    let mut failures = vec![];
    for (b, h, t) in [(3, 2, 1), (2, 3, 17), (2, 2, 100), (2, 3, 1024)] {
        let (g, run) = attention_run(h, 64, b, t);
        let mut feeds = testkit::random_feeds(&g, &run.bind, &mut Rng::new(5 + t as u64), 1).unwrap();
        feeds.get_mut("qkv").unwrap().data.iter_mut().for_each(|x| *x *= 2.0);
        let mut outputs = vec![];
        for wgmma in ["1", "0"] {
            std::env::set_var("FUSEC_FLASH_WGMMA", wgmma);
            let (mut gpu, build) = CudaExecutor::new(&run, &CudaOptions::default()).unwrap_or_else(|e| panic!("{e}"));
            eprintln!("B {b}, H {h}, T {t}, FUSEC_FLASH_WGMMA={wgmma}: {}", build.attention);
            outputs.push(run_gpu(&mut gpu, &feeds));
        }
        std::env::remove_var("FUSEC_FLASH_WGMMA");
        for (i, name) in ["out", "lse", "dqkv"].into_iter().enumerate() {
            let (a, b2) = (&outputs[0][i], &outputs[1][i]);
            let differ = a.iter().zip(b2).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
            if differ > 0 {
                failures.push(format!("B {b}, H {h}, T {t}: {name}: {differ} of {} values differ", a.len()));
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn the_column_sums_of_dqkv_folded_into_the_hopper_backward_match() {
    // `reduce_sum` of `dqkv` over its rows (the qkv bias gradient): on sm_90a the backward
    // kernels write partial sums per 64-row tile and `fusec_sum_rows` adds them; elsewhere (and
    // with `FUSEC_FLASH_WGMMA=0`) a fused kernel reads `dqkv` again. Against the interpreter,
    // and against the unfolded GPU path, whose `dqkv` is the same bits (only the order of the
    // sums differs). Run with `--test-threads 1`: the variable is the process's.
    let (d, mut failures) = (64, vec![]);
    for (b, h, t) in [(3, 2, 1), (2, 3, 17), (2, 2, 100), (2, 3, 1024)] {
        let (c, c3, scale) = (h * d, 3 * h * d, 1.0 / (d as f64).sqrt());
        let src = format!(
            "graph colsum(B, T) {{
  %0 = input \"qkv\" : f32[B, T, {c3}]
  %1 = input \"dout\" : f32[B, T, {c}]
  %2 = cast %0 : bf16[B, T, {c3}]
  %3, %4 = attention %2 {{heads = {h}, scale = {scale:?}}} : bf16[B, T, {c}], f32[B, {h}, T]
  %5 = cast %1 : bf16[B, T, {c}]
  %6 = attention_grad %2, %3, %4, %5 {{heads = {h}, scale = {scale:?}}} : bf16[B, T, {c3}]
  %7 = cast %6 : f32[B, T, {c3}]
  %8 = reduce_sum %7 {{axes = [0, 1]}} : f32[{c3}]
  output \"dbias\" = %8
}}
"
        );
        let g = fusec_ir::text::parse(&src, "colsum.graph").unwrap();
        let bind = RunPrograms::bindings(b, t);
        let opts = PipelineOptions::default();
        let step = compile(&g, "schedule", Mode::Forward, &opts, &bind).unwrap().graph;
        let run = RunPrograms { graphs: HashMap::from([(Program::Step, step)]), bind, opts, pass_runs: vec![] };
        let mut feeds = testkit::random_feeds(&g, &run.bind, &mut Rng::new(3 + t as u64), 1).unwrap();
        feeds.get_mut("qkv").unwrap().data.iter_mut().for_each(|x| *x *= 2.0);
        let want = interp::run(&g, &run.bind, &feeds, Rounding::F32).unwrap().remove(0).data;
        let mut got = vec![];
        for wgmma in ["1", "0"] {
            std::env::set_var("FUSEC_FLASH_WGMMA", wgmma);
            let (mut gpu, build) = CudaExecutor::new(&run, &CudaOptions::default()).unwrap_or_else(|e| panic!("{e}"));
            let folded = build.attention.contains("(wgmma)");
            eprintln!("B {b}, H {h}, T {t}, FUSEC_FLASH_WGMMA={wgmma}: {} ({} folded)", build.attention, build.column_sums);
            if build.column_sums != folded as usize {
                failures.push(format!("B {b}, H {h}, T {t}, wgmma {wgmma}: {} column sums folded", build.column_sums));
            }
            let mut once = vec![];
            for _ in 0..2 {
                for name in ["qkv", "dout"] {
                    gpu.set(name, feeds[name].clone()).unwrap();
                }
                gpu.run(Program::Step).unwrap();
                once.push(gpu.output(Program::Step, "dbias").unwrap().data);
            }
            if !once[0].iter().zip(&once[1]).all(|(x, y)| x.to_bits() == y.to_bits()) {
                failures.push(format!("B {b}, H {h}, T {t}, wgmma {wgmma}: two runs differ"));
            }
            got.push(once.remove(0));
        }
        std::env::remove_var("FUSEC_FLASH_WGMMA");
        let peak = testkit::max_abs(&want);
        for (g, what) in got.iter().zip(["folded", "unfolded"]) {
            let rel = testkit::rel_l2(g, &want);
            eprintln!("B {b}, H {h}, T {t}: {what} against the interpreter: relative L2 {rel:e}");
            if let Err(e) = testkit::check_slice(g, &want, 1e-2 * peak, 2e-2) {
                failures.push(format!("B {b}, H {h}, T {t}: {what}: {e}"));
            }
        }
        // The same bf16 values summed in another order.
        let rel = testkit::rel_l2(&got[0], &got[1]);
        if rel.is_nan() || rel > 1e-5 {
            failures.push(format!("B {b}, H {h}, T {t}: folded against unfolded: relative L2 {rel:e}"));
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// Each head size against the interpreter at several shapes, then the same inputs again for
/// the same bits; every case runs and the failures are listed at the end.
fn check_bf16_flash(heads: &[(usize, &str)]) {
    // (batch, heads, length).
    let shapes = [(3, 2, 1), (2, 3, 17), (2, 2, 100), (1, 3, 1024)];
    let mut failures = vec![];
    for &(d, kernels) in heads {
        for (b, h, t) in shapes {
            if d == 48 && t == 1024 {
                continue; // the TF32 kernels have their own tests; keep the interpreter's time down
            }
            let what = format!("head size {d}, B {b}, H {h}, T {t}");
            let (g, run) = attention_run(h, d, b, t);
            let mut feeds = testkit::random_feeds(&g, &run.bind, &mut Rng::new(17 + (d * t) as u64), 1).unwrap();
            // Scores of standard deviation about 4 (peaked rows, as in a trained model).
            feeds.get_mut("qkv").unwrap().data.iter_mut().for_each(|x| *x *= 2.0);
            // The interpreter computes in f64 and rounds `out` and `dqkv` to bf16, `lse` to f32.
            let want = interp::run(&g, &run.bind, &feeds, Rounding::F32).unwrap();
            let (mut gpu, build) = CudaExecutor::new(&run, &CudaOptions::default()).unwrap_or_else(|e| panic!("{e}"));
            // On Hopper (sm_90a) the head size 64 kernels run on warpgroup MMAs, and say so.
            let summary = format!("flash on bf16 storage ({kernels}, head size {d})");
            assert!(build.attention == summary || build.attention == summary.clone() + HOPPER, "{}", build.attention);
            let got = run_gpu(&mut gpu, &feeds);
            for (i, name) in ["out", "lse", "dqkv"].into_iter().enumerate() {
                let w = &want[i].data;
                let (rel, peak) = (testkit::rel_l2(&got[i], w), testkit::max_abs(w));
                eprintln!(
                    "{what}: {name}: relative L2 {rel:e}, max abs difference {:e} (max |want| {peak:e})",
                    testkit::max_abs_diff(&got[i], w)
                );
                // `out` and `dqkv` are rounded to bf16 on both sides (one bf16 ulp, 2^-8
                // relative, where the two fall on either side of a rounding boundary), and the
                // kernels round the probabilities and `ds` to bf16 for the products (2^-9 of
                // each term: the absolute part, relative to the largest value). `lse` is f32
                // from exact bf16 products with f32 sums.
                let (atol, rtol, max_rel) = if name == "lse" { (1e-4, 1e-5, 1e-5) } else { (1e-2 * peak, 2e-2, 1e-2) };
                if let Err(e) = testkit::check_slice(&got[i], w, atol, rtol) {
                    failures.push(format!("{what}: {name}: {e}"));
                }
                if rel.is_nan() || rel > max_rel {
                    failures.push(format!("{what}: {name}: relative L2 {rel:e} over {max_rel:e}"));
                }
            }
            // Deterministic: the same inputs again (after other inputs) give the same bits.
            let mut other = feeds.clone();
            other.get_mut("qkv").unwrap().data.iter_mut().for_each(|x| *x *= -0.5);
            let _ = run_gpu(&mut gpu, &other);
            let again = run_gpu(&mut gpu, &feeds);
            for (i, name) in ["out", "lse", "dqkv"].into_iter().enumerate() {
                if !got[i].iter().zip(&again[i]).all(|(a, b)| a.to_bits() == b.to_bits()) {
                    failures.push(format!("{what}: {name} differs between two runs on the same inputs"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}
