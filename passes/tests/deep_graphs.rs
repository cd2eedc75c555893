//! Graph algorithms must not recurse on graph size: chains of 200,000 nodes go through the
//! parser, the verifier, the printer, the interpreter and every pass up to `memplan`, each on a
//! thread with a 2 MiB stack (the default for spawned threads), where a recursion per node
//! would overflow the stack and abort the test binary.

use std::collections::HashMap;
use std::fmt::Write;

use fusec_ir::interp::{self, run, Tensor};
use fusec_ir::text::{parse, print};
use fusec_ir::verify::verify;
use fusec_ir::{Bindings, Graph, Op};
use fusec_passes::amp::Precision;
use fusec_passes::fuse_elementwise::MAX_RESULTS;
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};

/// Nodes per chain.
const N: usize = 200_000;

/// Runs `f` on a thread with a 2 MiB stack and returns its result.
fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new().stack_size(2 << 20).spawn(f).expect("spawn").join().expect("the thread panicked")
}

/// `graph chain(B) { %0 = <source>; %i = <step(i)> %{i-1} ...; output "<out>" = %last }` with
/// `n` steps; `step(i)` gives the text after `%i = ` with `{prev}` standing for `%{i-1}`.
fn chain(source: &str, n: usize, out: &str, step: impl Fn(usize) -> String) -> String {
    let mut s = String::with_capacity(48 * n);
    let _ = writeln!(s, "graph chain(B) {{\n  %0 = {source}");
    for i in 1..=n {
        let _ = writeln!(s, "  %{i} = {}", step(i).replace("{prev}", &format!("%{}", i - 1)));
    }
    let _ = writeln!(s, "  output \"{out}\" = %{n}\n}}");
    s
}

fn bind() -> Bindings {
    let mut b = Bindings::default();
    b.set("B", 2);
    b
}

/// Compiles `g` to `memplan` and returns the node count of the result.
fn through_memplan(g: &Graph, mode: Mode, no_fusion: bool) -> usize {
    let opts = PipelineOptions { no_fusion, ..PipelineOptions::default() };
    let c = compile(g, "memplan", mode, &opts, &bind()).unwrap_or_else(|e| panic!("compile failed: {e}"));
    assert!(c.plan.is_some(), "memplan ran");
    c.graph.nodes.len()
}

#[test]
fn a_neg_chain_parses_verifies_prints_runs_and_compiles() {
    on_small_stack(|| {
        let src = chain("input \"x\" : f32[B, 4]", N, "y", |_| "neg {prev} : f32[B, 4]".to_string());
        let g = parse(&src, "chain.graph").expect("the chain parses");
        assert_eq!(g.nodes.len(), N + 1);
        verify(&g).expect("the chain verifies");
        assert_eq!(print(&g), src, "the printer gives the text back");

        let feeds = HashMap::from([("x".to_string(), Tensor::from_f32(vec![2, 4], &[1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0]))]);
        let out = run(&g, &bind(), &feeds, interp::Rounding::F32).expect("the interpreter runs the chain");
        // An even number of negations is the identity.
        assert_eq!(out[0].to_f32(), vec![1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -8.0]);

        // Canonicalize cancels the negations in pairs; without fusion every pass sees them all.
        assert_eq!(through_memplan(&g, Mode::Forward, false), 1, "neg(neg(x)) folds to x");
        assert_eq!(through_memplan(&g, Mode::Forward, true), N + 1);
    });
}

#[test]
fn a_tanh_chain_fuses_into_one_kernel() {
    on_small_stack(|| {
        // Half as long: fusion is the most expensive part of the pipeline.
        let n = N / 2;
        let src = chain("input \"x\" : f32[B, 4]", n, "y", |_| "tanh {prev} : f32[B, 4]".to_string());
        let g = parse(&src, "chain.graph").expect("the chain parses");
        // The input and kernels holding every tanh: as few as the result-count limit allows.
        let c = compile(&g, "memplan", Mode::Forward, &PipelineOptions::default(), &bind()).unwrap_or_else(|e| panic!("{e}"));
        let kernels = c.graph.nodes.iter().filter(|n| matches!(n.op, Op::Kernel(_))).count();
        assert_eq!(kernels, n.div_ceil(MAX_RESULTS));
        assert_eq!(c.graph.nodes.len(), kernels + 1);
    });
}

#[test]
fn a_chain_of_layout_ops_is_absorbed_into_the_kernel_that_reads_it() {
    on_small_stack(|| {
        // broadcast [B, 4] -> [1, B, 4], reshape back, ... then one tanh: the whole chain of
        // absorbable nodes is copied into the tanh's kernel. Half as long, as above.
        let n = N / 2;
        let mut src = chain("input \"x\" : f32[B, 4]", n, "z", |i| {
            if i % 2 == 1 {
                "broadcast {prev} {dims = [1, 2]} : f32[1, B, 4]".to_string()
            } else {
                "reshape {prev} : f32[B, 4]".to_string()
            }
        });
        let tail = format!("  %{} = tanh %{n} : f32[B, 4]\n  output \"y\" = %{}\n", n + 1, n + 1);
        let at = src.find("  output \"z\"").expect("the output line");
        src.insert_str(at, &tail);
        let g = parse(&src, "chain.graph").expect("the chain parses");
        let c = compile(&g, "memplan", Mode::Forward, &PipelineOptions::default(), &bind()).unwrap_or_else(|e| panic!("{e}"));
        let kernel = c.graph.nodes.iter().find_map(|n| if let Op::Kernel(k) = &n.op { Some(k) } else { None }).expect("a kernel");
        assert!(kernel.body.nodes.len() > n, "the chain is in the body: {} nodes", kernel.body.nodes.len());
    });
}

#[test]
fn a_chain_from_a_parameter_is_differentiated_and_updated() {
    on_small_stack(|| {
        // Shorter: the backward keeps every forward value alive, and placing buffers whose lives
        // all overlap costs `memplan` quadratic time. 20,000 nodes still overflow a 2 MiB stack
        // if anything recurses per node.
        let n = N / 10;
        let src = chain("param \"w\" : f32[]", n, "loss", |_| "tanh {prev} : f32[]".to_string());
        let g = parse(&src, "chain.graph").expect("the chain parses");
        // Forward, a backward chain as long, and the AdamW update of `w`, fused.
        let c = compile(&g, "memplan", Mode::Step, &PipelineOptions::default(), &bind()).unwrap_or_else(|e| panic!("compile failed: {e}"));
        assert!(c.graph.nodes.iter().any(|n| matches!(n.op, Op::Kernel(_))));
        let body_nodes: usize = c.graph.nodes.iter().map(|n| if let Op::Kernel(k) = &n.op { k.body.nodes.len() } else { 1 }).sum();
        assert!(body_nodes > 2 * n, "forward and backward: {body_nodes} nodes");
    });
}

#[test]
fn a_reshape_chain_into_a_matmul_is_cast_to_bf16_once() {
    on_small_stack(|| {
        // `amp` casts the start of the chain and rebuilds the reshapes on the bf16 copy. Without
        // fusion (`canonicalize` would merge the reshapes), half as long as above.
        let n = N / 2;
        let mut src = chain("input \"x\" : f32[B, 4]", n, "z", |i| {
            let shape = if i % 2 == 1 { "f32[4, B]" } else { "f32[B, 4]" };
            format!("reshape {{prev}} : {shape}")
        });
        let tail = format!(
            "  %{w} = param \"w\" : f32[4, 4]\n  %{y} = matmul %{n}, %{w} {{trans_a = false, trans_b = false}} : f32[B, 4]\n  output \"y\" = %{y}\n",
            w = n + 1,
            y = n + 2
        );
        let at = src.find("  output \"z\"").expect("the output line");
        src.insert_str(at, &tail);
        let g = parse(&src, "chain.graph").expect("the chain parses");
        let opts = PipelineOptions { no_fusion: true, precision: Precision::Bf16, ..PipelineOptions::default() };
        let c = compile(&g, "memplan", Mode::Forward, &opts, &bind()).unwrap_or_else(|e| panic!("{e}"));
        let casts = c.graph.nodes.iter().filter(|n| matches!(n.op, Op::Cast { .. })).count();
        assert_eq!(casts, 2, "x and w to bf16");
        let f32_products = c.graph.nodes.iter().filter(|n| matches!(&n.op, Op::Gemm(gm) if gm.out == fusec_ir::DType::F32)).count();
        assert_eq!(f32_products, 1, "the output product accumulates and stays f32");
        assert!(c.graph.nodes.len() > 2 * n, "both reshape chains: {} nodes", c.graph.nodes.len());
    });
}
