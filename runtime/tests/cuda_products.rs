//! Products of bf16 operands with fused epilogues on the CUDA target, against the interpreter
//! (issue 12): every combination of result type, bias, GELU, accumulation and batching the bf16
//! training step needs, as one-node `.graph` programs on small shapes, through cuBLASLt where
//! it applies and through the epilogue kernel (cuBLASLt off, or a batch with an epilogue).
//!
//! Without a GPU only the graphs are checked (they parse, the interpreter runs them, the
//! launch plan accepts them). With one: `cargo test -p fusec-runtime --test cuda_products --
//! --ignored --test-threads 1`.
//!
//! Tolerances. The interpreter rounds after every epilogue step to the operands' dtype (the
//! product to bf16, then `+ bias` to bf16, then GELU to bf16; an f32 result is that bf16 value
//! widened); the GPU accumulates in f32 and rounds once, at the store. With bf16's unit
//! roundoff `u = 2^-8`, the two differ by at most about `u |p|` (the interpreter's rounding of
//! the product `p`, which cancellation against the bias can leave larger than the result),
//! GELU's slope (≤ 1.13) times that, and one or two bf16 ulps of the result (`2u |y|` each:
//! both sides round, maybe to different neighbours). f32 accumulation order differences
//! (`K · 2^-24`) are far below. So an element passes when `|got - want| ≤ 4u · scale + 4u
//! |want|`, where `scale` is the largest magnitude of the case's reference outputs (bounding
//! `|p|`): a wrong bias, transpose, row stride or type is off by O(scale), far outside.

use std::collections::HashMap;

use fusec_ir::interp::{self, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::{assert_close, max_abs};
use fusec_ir::{Bindings, Graph};
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::cuda::{CudaExecutor, CudaOptions};
use fusec_runtime::executor::Executor;
use fusec_runtime::launches::{LaunchOp, LaunchPlan};
use fusec_runtime::programs::{Program, RunPrograms};

/// bf16's unit roundoff.
const U: f64 = 1.0 / 256.0;

/// One product as a program: its name, its `.graph` text, and whether cuBLASLt must take it
/// when cuBLASLt is on (a bias without accumulation into a bf16 result, one product, sizes
/// multiples of 8).
struct Case {
    name: &'static str,
    src: String,
    lt: bool,
}

/// `y = gemm(a[m, k], w[n, k]^T (+ bias))` with the given result dtype and flags; `acc` adds
/// into an input `acc` of the result's type, written back as the output `acc`.
fn linear(name: &'static str, (m, n, k): (usize, usize, usize), bias: bool, gelu: bool, out: &str, acc: bool) -> Case {
    let mut lines = vec![format!("  %0 = input \"a\" : bf16[{m}, {k}]"), format!("  %1 = input \"w\" : bf16[{n}, {k}]")];
    let mut operands = vec!["%0".to_string(), "%1".to_string()];
    if bias {
        lines.push(format!("  %{} = input \"bias\" : bf16[{n}]", lines.len()));
        operands.push(format!("%{}", lines.len() - 1));
    }
    if acc {
        lines.push(format!("  %{} = input \"acc\" : {out}[{m}, {n}]", lines.len()));
        operands.push(format!("%{}", lines.len() - 1));
    }
    let y = lines.len();
    let results = if gelu { format!("%{y}, %{}", y + 1) } else { format!("%{y}") };
    let types = if gelu { format!("{out}[{m}, {n}], bf16[{m}, {n}]") } else { format!("{out}[{m}, {n}]") };
    lines.push(format!(
        "  {results} = gemm {} {{trans_a = false, trans_b = true, bias = {bias}, gelu = {gelu}, accumulate = {acc}}} : {types}",
        operands.join(", ")
    ));
    // An accumulated result is written back over its input (in place, as gradients are).
    lines.push(format!("  output \"{}\" = %{y}", if acc { "acc" } else { "y" }));
    if gelu {
        lines.push(format!("  output \"pre\" = %{}", y + 1));
    }
    // bf16 results are what cuBLASLt's bf16 epilogues are for; whether it also takes a bf16
    // bias into an f32 result is printed, not required.
    let lt = bias && !acc && out == "bf16" && m % 8 == 0 && n % 8 == 0 && k % 8 == 0;
    Case { name, src: format!("graph {name}() {{\n{}\n}}\n", lines.join("\n")), lt }
}

/// A program of its own `.graph` text (no cuBLASLt expectation).
fn raw(name: &'static str, body: &str) -> Case {
    Case { name, src: format!("graph {name}() {{\n{body}\n}}\n"), lt: false }
}

/// Odd sizes (no multiple of 8 anywhere) and aligned ones (cuBLASLt's bf16 fast path).
const ODD: (usize, usize, usize) = (7, 13, 37);
const EVEN: (usize, usize, usize) = (24, 48, 40);

/// Item 1: bf16 results without an epilogue (activation gradients, logits), one and batched.
fn plain_cases() -> Vec<Case> {
    vec![
        linear("bf16_out_odd", ODD, false, false, "bf16", false),
        linear("bf16_out_even", EVEN, false, false, "bf16", false),
        raw(
            "bf16_matmul_tn",
            "  %0 = input \"a\" : bf16[37, 7]\n  %1 = input \"b\" : bf16[37, 13]\n  %2 = matmul %0, %1 {trans_a = true, trans_b = false} : bf16[7, 13]\n  output \"y\" = %2",
        ),
        // Strided batches (both operands batched, as attention's products).
        raw(
            "bf16_out_batched",
            "  %0 = input \"a\" : bf16[3, 5, 11]\n  %1 = input \"b\" : bf16[3, 9, 11]\n  %2 = gemm %0, %1 {trans_a = false, trans_b = true, bias = false, gelu = false, accumulate = false} : bf16[3, 5, 9]\n  output \"y\" = %2",
        ),
    ]
}

/// Items 2 and 3: a bf16 bias, GELU with a bf16 pre-activation; bf16 and f32 results.
fn epilogue_cases() -> Vec<Case> {
    vec![
        linear("bias_bf16_even", EVEN, true, false, "bf16", false),
        linear("bias_bf16_odd", ODD, true, false, "bf16", false),
        linear("bias_gelu_bf16_even", EVEN, true, true, "bf16", false),
        linear("bias_gelu_bf16_odd", ODD, true, true, "bf16", false),
        linear("bias_f32_even", EVEN, true, false, "f32", false),
        linear("bias_gelu_f32_odd", ODD, true, true, "f32", false),
    ]
}

/// Item 4: weight gradients (`a^T b`, bf16 operands) accumulated into f32, and f32 results
/// without a bias.
fn gradient_cases() -> Vec<Case> {
    vec![
        raw(
            "weight_grad_acc_f32",
            "  %0 = input \"dout\" : bf16[37, 13]\n  %1 = input \"x\" : bf16[37, 7]\n  %2 = input \"acc\" : f32[13, 7]\n  %3 = gemm %0, %1, %2 {trans_a = true, trans_b = false, bias = false, gelu = false, accumulate = true} : f32[13, 7]\n  output \"acc\" = %3",
        ),
        linear("f32_out_odd", ODD, false, false, "f32", false),
        linear("f32_out_acc_even", EVEN, false, false, "f32", true),
    ]
}

/// Item 5: what only the epilogue kernel does (with cuBLASLt on): a batch with bias + GELU,
/// accumulation with a bias, a bf16 accumulator, f32 operands with a bf16 result.
fn fallback_cases() -> Vec<Case> {
    vec![
        raw(
            "batched_bias_gelu_bf16",
            "  %0 = input \"a\" : bf16[2, 5, 11]\n  %1 = input \"b\" : bf16[2, 9, 11]\n  %2 = input \"bias\" : bf16[9]\n  %3, %4 = gemm %0, %1, %2 {trans_a = false, trans_b = true, bias = true, gelu = true, accumulate = false} : bf16[2, 5, 9], bf16[2, 5, 9]\n  output \"y\" = %3\n  output \"pre\" = %4",
        ),
        linear("bias_acc_f32", ODD, true, false, "f32", true),
        linear("acc_bf16", ODD, false, false, "bf16", true),
        raw(
            "f32_operands_bf16_out",
            "  %0 = input \"a\" : f32[7, 37]\n  %1 = input \"w\" : f32[13, 37]\n  %2 = input \"bias\" : f32[13]\n  %3 = gemm %0, %1, %2 {trans_a = false, trans_b = true, bias = true, gelu = false, accumulate = false} : bf16[7, 13]\n  output \"y\" = %3",
        ),
    ]
}

fn all_cases() -> Vec<Case> {
    [plain_cases(), epilogue_cases(), gradient_cases(), fallback_cases()].into_iter().flatten().collect()
}

fn parse(c: &Case) -> Graph {
    fusec_ir::text::parse(&c.src, c.name).unwrap_or_else(|e| panic!("{}: {e}\n{}", c.name, c.src))
}

/// The case's graph as the Step program of a run (no passes: the graph is already one launch
/// per product).
fn program(g: Graph) -> RunPrograms {
    RunPrograms {
        graphs: HashMap::from([(Program::Step, g)]),
        bind: Bindings::default(),
        opts: PipelineOptions::default(),
        pass_runs: vec![],
    }
}

/// Random standard-normal feeds (rounded to each input's dtype) and the interpreter's outputs.
fn reference(g: &Graph, seed: u64) -> (HashMap<String, Tensor>, Vec<(String, Tensor)>) {
    let feeds = interp::random_feeds(g, &Bindings::default(), &mut Rng::new(seed), 1).unwrap();
    let outs = interp::run(g, &Bindings::default(), &feeds, Rounding::F32).unwrap_or_else(|e| panic!("{e}"));
    (feeds, g.outputs.iter().map(|(n, _)| n.clone()).zip(outs).collect())
}

#[test]
fn the_product_cases_are_valid_programs_with_one_product_launch() {
    for c in all_cases() {
        let g = parse(&c);
        let (_, outs) = reference(&g, 1);
        assert!(outs.iter().all(|(_, t)| t.data.iter().all(|x| x.is_finite())), "{}", c.name);
        let run = program(g);
        let plan = LaunchPlan::new(&run).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let (_, launches, _) = &plan.programs[0];
        let products: Vec<_> = launches.iter().filter_map(|l| if let LaunchOp::Product(p) = &l.op { Some(p) } else { None }).collect();
        assert_eq!(products.len(), 1, "{}", c.name);
        // cuBLASLt's bf16 plans need 16-byte aligned pointers: the plan gives every buffer 256.
        let p = products[0];
        for o in [Some(p.a), Some(p.b), Some(p.y), p.bias, p.pre].into_iter().flatten() {
            assert_eq!(o % 256, 0, "{}: offset {o}", c.name);
        }
    }
}

/// Runs every case on the GPU with `opts` and compares with the interpreter (see the module
/// docs for the tolerance); `lt_expected`: whether cases marked `lt` must use cuBLASLt.
fn check_on_gpu(cases: &[Case], opts: &CudaOptions, lt_expected: bool) {
    for c in cases {
        let g = parse(c);
        let (feeds, want) = reference(&g, 7);
        let run = program(g);
        let (mut ex, build) = CudaExecutor::new(&run, opts).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        for (name, t) in &feeds {
            ex.set(name, t.clone()).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        }
        ex.run(Program::Step).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let scale = want.iter().map(|(_, t)| max_abs(&t.data)).fold(0.0, f64::max);
        eprintln!("{}: {} cuBLASLt launch(es), reference scale {scale:.3}", c.name, build.lt_epilogues);
        if lt_expected && c.lt {
            assert_eq!(build.lt_epilogues, 1, "{}: cuBLASLt offered no plan for an aligned bf16 product", c.name);
        }
        if !opts.lt_epilogues {
            assert_eq!(build.lt_epilogues, 0, "{}", c.name);
        }
        for (name, w) in &want {
            let got = ex.output(Program::Step, name).unwrap_or_else(|e| panic!("{}: {e}", c.name));
            assert_close(&format!("{} `{name}`", c.name), &got, w, 4.0 * U * scale, 4.0 * U);
        }
    }
}

/// TF32 on (so cuBLASLt is open), cuBLASLt epilogues `lt`.
fn opts(lt: bool) -> CudaOptions {
    CudaOptions { lt_epilogues: lt, ..CudaOptions::default() }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_results_without_an_epilogue_match_the_interpreter() {
    check_on_gpu(&plain_cases(), &opts(true), true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_bias_and_gelu_epilogues_in_cublaslt_match_the_interpreter() {
    check_on_gpu(&epilogue_cases(), &opts(true), true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_weight_gradients_accumulate_into_f32() {
    check_on_gpu(&gradient_cases(), &opts(true), true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_epilogues_fall_back_to_the_epilogue_kernel() {
    // Cases only the kernel handles, with cuBLASLt on; then every case with cuBLASLt off.
    check_on_gpu(&fallback_cases(), &opts(true), true);
    check_on_gpu(&all_cases(), &opts(false), false);
    // Without TF32 no cuBLASLt handle is opened: the kernel again.
    check_on_gpu(&epilogue_cases(), &CudaOptions { tf32: false, ..opts(true) }, false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn independent_products_of_one_shape_run_as_one_batched_call() {
    // Three weight-gradient-like products (bf16 operands, f32 results) that share no buffer run
    // as one batched cuBLAS call (`gemm_batch3`) and match the interpreter (which products may
    // merge: the unit tests of `batch.rs`).
    let (mut src, mut outputs) = (String::new(), String::new());
    for i in 0..3 {
        let (x, d, w) = (3 * i, 3 * i + 1, 3 * i + 2);
        src += &format!("  %{x} = input \"x{i}\" : bf16[64, 24]\n  %{d} = input \"d{i}\" : bf16[64, 40]\n");
        src += &format!(
            "  %{w} = gemm %{x}, %{d} {{trans_a = true, trans_b = false, bias = false, gelu = false, accumulate = false}} : f32[24, 40]\n"
        );
        outputs += &format!("  output \"w{i}\" = %{w}\n");
    }
    let c = raw("batched", &(src + &outputs));
    check_on_gpu(std::slice::from_ref(&c), &opts(true), false);
    let g = parse(&c);
    let (feeds, _) = reference(&g, 5);
    let (mut ex, _) = CudaExecutor::new(&program(g), &CudaOptions { profile: true, ..opts(true) }).unwrap();
    for (name, t) in &feeds {
        ex.set(name, t.clone()).unwrap();
    }
    // The first run is the profile's warm-up; the second is timed.
    ex.run(Program::Step).unwrap();
    ex.run(Program::Step).unwrap();
    let names: Vec<String> = ex.profile().unwrap().rows().iter().map(|(n, _)| n.to_string()).collect();
    assert!(names.iter().any(|n| n == "gemm_batch3"), "no batched launch: {names:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tuned_products_match_the_interpreter_and_a_second_build_reuses_the_choice_bit_for_bit() {
    // Tuning is on by default: each case's one bf16 product is timed on cuBLAS's choice and
    // cuBLASLt's candidates at the first build (or found in the cache), and taken from the
    // cache at the second, which must then give the same bits.
    let tuned = opts(true);
    assert!(tuned.tune_products);
    let cases: Vec<Case> = plain_cases().into_iter().chain(epilogue_cases()).chain(gradient_cases()).collect();
    check_on_gpu(&cases, &tuned, true);
    let mut tuned_somewhere = false;
    for c in &cases {
        let g = parse(c);
        let (feeds, _) = reference(&g, 11);
        let run = program(g);
        let mut outs = vec![];
        for build_no in 0..2 {
            let (mut ex, build) = CudaExecutor::new(&run, &tuned).unwrap_or_else(|e| panic!("{}: {e}", c.name));
            let t = &build.tuning;
            assert!(t.products <= 1, "{}: {} products tuned", c.name, t.products);
            if build_no == 1 && t.note.is_none() {
                assert_eq!(t.cached, t.products, "{}: the second build timed again", c.name);
            }
            tuned_somewhere |= t.products == 1;
            for (name, v) in &feeds {
                ex.set(name, v.clone()).unwrap();
            }
            ex.run(Program::Step).unwrap();
            let names: Vec<String> = run.graphs[&Program::Step].outputs.iter().map(|(n, _)| n.clone()).collect();
            outs.push(names.iter().map(|n| ex.output(Program::Step, n).unwrap().data).collect::<Vec<_>>());
        }
        assert_eq!(outs[0], outs[1], "{}: the two builds differ", c.name);
    }
    assert!(tuned_somewhere, "no case had a bf16 product to tune");
}
