//! Bad input to the passes gets a clear error, never a panic: AdamW constants out of range,
//! sizes that overflow 64 bits, graphs that do not verify, names that collide with the ones the
//! passes add; and valid graphs that look like fusion candidates but are not (a cast to an
//! integer after a matmul, a bias broadcast from one element) compile.

use fusec_ir::text::parse;
use fusec_ir::{Bindings, DType, Graph, Op, Shape, Type};
use fusec_passes::memplan::{memplan, MemplanOptions};
use fusec_passes::optimizer::{optimizer, AdamWConfig};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_passes::schedule::schedule_with;

const TINY: &str = include_str!("../../models/gpt2-tiny.graph");

fn tiny() -> Graph {
    parse(TINY, "gpt2-tiny.graph").expect("the shipped graph parses")
}

fn bind(b: u64, t: u64) -> Bindings {
    let mut x = Bindings::default();
    x.set("B", b).set("T", t);
    x
}

/// Compiles `g` to `memplan` and returns the error, failing if it compiles.
fn compile_err(g: &Graph, mode: Mode, opts: &PipelineOptions, b: &Bindings) -> String {
    match compile(g, "memplan", mode, opts, b) {
        Ok(_) => panic!("compiled, but an error was expected"),
        Err(e) => e,
    }
}

fn with_adamw(adamw: AdamWConfig) -> PipelineOptions {
    PipelineOptions { adamw, ..PipelineOptions::default() }
}

#[test]
fn adamw_config_validation_names_the_field_and_the_range() {
    assert_eq!(AdamWConfig::default().validate(), Ok(()));
    let d = AdamWConfig::default;
    let cases = [
        (AdamWConfig { weight_decay: f64::NAN, ..d() }, "AdamW weight_decay must be a finite number >= 0, found NaN"),
        (AdamWConfig { weight_decay: -0.1, ..d() }, "AdamW weight_decay must be a finite number >= 0, found -0.1"),
        (AdamWConfig { weight_decay: f64::INFINITY, ..d() }, "AdamW weight_decay must be a finite number >= 0, found inf"),
        (AdamWConfig { eps: -1e-8, ..d() }, "AdamW eps must be a finite number >= 0, found -0.00000001"),
        (AdamWConfig { beta1: 1.0, ..d() }, "AdamW beta1 must be in [0, 1), found 1"),
        (AdamWConfig { beta2: f64::NAN, ..d() }, "AdamW beta2 must be in [0, 1), found NaN"),
    ];
    for (cfg, want) in cases {
        assert_eq!(cfg.validate(), Err(want.to_string()), "{cfg:?}");
    }
}

#[test]
fn an_out_of_range_weight_decay_is_an_error_not_a_panic() {
    for wd in [f64::NAN, -1.0, f64::INFINITY] {
        let cfg = AdamWConfig { weight_decay: wd, ..AdamWConfig::default() };
        let e = compile_err(&tiny(), Mode::Step, &with_adamw(cfg.clone()), &bind(2, 8));
        assert!(e.starts_with("optimizer: AdamW weight_decay must be a finite number >= 0, found"), "{e}");
        // The pass itself, called directly, refuses too.
        let g = fusec_passes::autodiff::autodiff(&tiny()).unwrap();
        assert!(optimizer(&g, &cfg).is_err());
    }
}

#[test]
fn a_non_f32_parameter_cannot_be_updated() {
    let src = "graph g() {\n  %0 = param \"w\" : bf16[4]\n  %1 = cast %0 : f32[4]\n  %2 = reduce_sum %1 {axes = [0]} : f32[]\n  output \"loss\" = %2\n}\n";
    let g = parse(src, "g.graph").unwrap();
    let e = compile_err(&g, Mode::Step, &PipelineOptions::default(), &Bindings::default());
    assert_eq!(e, "optimizer: parameter \"w\" is bf16[4]: AdamW updates only f32 parameters");
    // With clipping, the norm of a bf16 gradient would not type either.
    let clip = with_adamw(AdamWConfig { clip: true, ..AdamWConfig::default() });
    assert!(compile_err(&g, Mode::Step, &clip, &Bindings::default()).contains("AdamW updates only f32 parameters"));
}

#[test]
fn clipping_without_parameters_gives_a_zero_norm() {
    let src = "graph g() {\n  %0 = input \"x\" : f32[]\n  output \"loss\" = %0\n}\n";
    let g = parse(src, "g.graph").unwrap();
    let clip = with_adamw(AdamWConfig { clip: true, ..AdamWConfig::default() });
    let c = compile(&g, "optimizer", Mode::Step, &clip, &Bindings::default()).expect("nothing to update is fine");
    let norm = c.graph.output_named("grad_norm").expect("the norm is an output");
    assert!(matches!(c.graph.producer(norm).op, Op::Const { value, .. } if value == 0.0));
}

#[test]
fn names_the_passes_add_must_be_free() {
    // `dloss`, `lr` and `grad.w` are inputs the passes add; `m.w` collides with `w`'s state.
    let cases = [
        ("input \"dloss\" : f32[]", "autodiff: the graph already has a parameter or input named \"dloss\""),
        ("input \"grad.w\" : f32[]", "the graph already has a parameter or input named \"grad.w\""),
        ("input \"lr\" : f32[]", "optimizer: the graph already has a parameter or input named \"lr\""),
        ("param \"m.w\" : f32[]", "optimizer: the graph already has a parameter or input named \"m.w\""),
    ];
    for (decl, want) in cases {
        let src =
            format!("graph g() {{\n  %0 = param \"w\" : f32[]\n  %1 = {decl}\n  %2 = add %0, %1 : f32[]\n  output \"loss\" = %2\n}}\n");
        let g = parse(&src, "g.graph").unwrap();
        let e = compile_err(&g, Mode::Step, &PipelineOptions::default(), &Bindings::default());
        assert!(e.contains(want), "{decl}: {e}");
    }
    // An output named like a parameter the optimizer writes back.
    let src =
        "graph g() {\n  %0 = param \"w\" : f32[]\n  %1 = param \"loss\" : f32[]\n  %2 = add %0, %1 : f32[]\n  output \"loss\" = %2\n}\n";
    let e = compile_err(&parse(src, "g.graph").unwrap(), Mode::Step, &PipelineOptions::default(), &Bindings::default());
    assert_eq!(e, "optimizer: the graph already has an output named \"loss\"");
}

#[test]
fn a_graph_that_does_not_verify_is_refused_up_front() {
    // Two parameters named alike, built in code (the parser refuses them with a position).
    let mut g = Graph::new("g", &[]);
    let t = Type::new(DType::F32, Shape::lits(&[2]));
    let a = g.add1(Op::Param { name: "w".into(), ty: t.clone() }, &[]);
    let b = g.add1(Op::Param { name: "w".into(), ty: Type::new(DType::F32, Shape::lits(&[2])) }, &[]);
    let s = g.add1(Op::Binary(fusec_ir::BinaryOp::Add), &[a, b]);
    let l = g.add1(Op::Reduce { op: fusec_ir::ReduceOp::Sum, axes: vec![0] }, &[s]);
    g.output("loss", l);
    for mode in [Mode::Forward, Mode::Step] {
        let e = compile_err(&g, mode, &PipelineOptions::default(), &Bindings::default());
        assert_eq!(e, "the input graph does not verify: node 1 (`param`): name `w` is already used by node 0");
    }
}

#[test]
fn a_huge_batch_is_an_overflow_error_not_a_wrapped_plan() {
    let opts = PipelineOptions::default();
    for b in [1u64 << 63, u64::MAX, 1 << 50] {
        let e = compile_err(&tiny(), Mode::Step, &opts, &bind(b, 64));
        assert!(e.contains("overflows 64 bits") || e.contains("more than 2^64 bytes"), "B = {b}: {e}");
    }
    // B*T itself overflows: the message shows the product.
    let e = compile_err(&tiny(), Mode::Forward, &opts, &bind(1 << 63, 64));
    assert!(e.contains("= 9223372036854775808*64") && e.contains("overflows 64 bits"), "{e}");
    // Each tensor fits, but not all of them together.
    let e = compile_err(&tiny(), Mode::Forward, &opts, &bind(1 << 26, 1 << 26));
    assert!(e.contains("the program's tensors total more than 2^64 bytes under B = 67108864, T = 67108864"), "{e}");

    // The passes called directly: schedule sizes tensors too.
    let g = tiny();
    assert!(schedule_with(&g, &bind(1 << 63, 64)).unwrap_err().contains("overflows 64 bits"));
    assert!(memplan(&g, &bind(u64::MAX, u64::MAX), &MemplanOptions::default()).unwrap_err().starts_with("memplan: "));
    // A large but representable binding plans fine, and every offset is in the allocation.
    let c = compile(&g, "memplan", Mode::Step, &opts, &bind(1 << 20, 64)).expect("2^20 x 64 tokens fit in 64 bits");
    let plan = c.plan.unwrap();
    assert!(plan.values.iter().all(|v| v.offset.checked_add(v.bytes).is_some_and(|e| e <= plan.total_bytes())));
}

#[test]
fn valid_graphs_that_only_look_like_epilogues_compile() {
    // A matmul whose result is cast to i32 (a gemm's `out` must be a float type), and a bias
    // broadcast from a single element (a gemm's bias must be a whole row).
    let srcs = [
        "graph g(B) {\n  %0 = input \"x\" : f32[B, 4]\n  %1 = param \"w\" : f32[4, 4]\n  %2 = matmul %0, %1 {trans_a = false, trans_b = false} : f32[B, 4]\n  %3 = cast %2 : i32[B, 4]\n  %4 = cast %3 : f32[B, 4]\n  %5 = reduce_sum %4 {axes = [0, 1]} : f32[]\n  output \"loss\" = %5\n}\n",
        "graph g(B) {\n  %0 = input \"x\" : f32[B, 4]\n  %1 = param \"w\" : f32[4, 4]\n  %2 = param \"b\" : f32[1]\n  %3 = matmul %0, %1 {trans_a = false, trans_b = false} : f32[B, 4]\n  %4 = broadcast %2 {dims = [1]} : f32[B, 4]\n  %5 = add %3, %4 : f32[B, 4]\n  %6 = reduce_sum %5 {axes = [0, 1]} : f32[]\n  output \"loss\" = %6\n}\n",
    ];
    let mut b = Bindings::default();
    b.set("B", 3);
    for src in srcs {
        let g = parse(src, "g.graph").unwrap();
        // (`Mode::Step` of the second graph is refused by `memplan`: the AdamW kernel's prologue
        // reshapes the bias gradient, so the kernel does not count as single-phase.)
        for mode in [Mode::Forward, Mode::Grad] {
            compile(&g, "memplan", mode, &PipelineOptions::default(), &b).unwrap_or_else(|e| panic!("{mode:?}: {e}\n{src}"));
        }
    }
}
