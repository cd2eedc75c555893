//! The `fuse-elementwise` pass: each kernel form (pointwise, reduction, composite, AdamW) fires
//! and keeps the interpreter's values; each legality rule refuses its case and says so in the
//! `FusionLog`; random graphs and the GPT-2 training graph keep their values; a snapshot of the
//! fused tiny GPT-2 step's launches.

use std::collections::HashMap;

use fusec_ir::interp::{self, Precision, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::{random_graph_with, GenOpts};
use fusec_ir::text::print;
use fusec_ir::verify::verify;
use fusec_ir::{BinaryOp, Bindings, DType, Graph, Op, ReduceOp, Shape, Type, UnaryOp, ValueId};
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

fn f32t(dims: &[u64]) -> Type {
    Type::new(DType::F32, Shape::lits(dims))
}

fn input(g: &mut Graph, name: &str, ty: Type) -> ValueId {
    g.add1(Op::Input { name: name.into(), ty }, &[])
}

fn bin(g: &mut Graph, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
    g.add1(Op::Binary(op), &[a, b])
}

fn un(g: &mut Graph, op: UnaryOp, a: ValueId) -> ValueId {
    g.add1(Op::Unary(op), &[a])
}

/// Within 1e-6 relative; NaN only where the reference is NaN.
fn close(a: &Tensor, b: &Tensor) -> bool {
    a.shape == b.shape
        && a.dtype == b.dtype
        && a.data.iter().zip(&b.data).all(|(&p, &q)| p == q || (p.is_nan() && q.is_nan()) || (p - q).abs() <= 1e-6 * q.abs())
}

/// Runs both graphs on the same feeds (F32) and compares every output.
fn assert_same_values(g: &Graph, f: &Graph, b: &Bindings, feeds: &HashMap<String, Tensor>) {
    let x = interp::run(g, b, feeds, Precision::F32).unwrap_or_else(|e| panic!("before: {e}"));
    let y = interp::run(f, b, feeds, Precision::F32).unwrap_or_else(|e| panic!("after: {e}\n{}", print(f)));
    for (i, (p, q)) in y.iter().zip(&x).enumerate() {
        assert!(close(p, q), "output {} ({i}) differs\n{}", g.outputs[i].0, print(f));
    }
}

/// Fuses and checks values on random feeds (F32); returns the fused graph and the log.
fn fuse_checked(g: &Graph) -> (Graph, FusionLog) {
    let (f, log) = fuse(g);
    let b = Bindings::default();
    let feeds = interp::random_feeds(g, &b, &mut Rng::new(7), 2).unwrap();
    assert_same_values(g, &f, &b, &feeds);
    (f, log)
}

// ---- the forms fire ------------------------------------------------------------------------

#[test]
fn pointwise_chain_is_one_kernel_exporting_what_is_used_later() {
    let mut g = Graph::new("pw", &[]);
    let x = input(&mut g, "x", f32t(&[4, 8]));
    let y = input(&mut g, "y", f32t(&[4, 8]));
    let w = input(&mut g, "w", f32t(&[8]));
    let a = bin(&mut g, BinaryOp::Add, x, y);
    let e = un(&mut g, UnaryOp::Exp, a);
    let wb = g.add1(Op::Broadcast { dims: vec![1], shape: Shape::lits(&[4, 8]) }, &[w]);
    let c = bin(&mut g, BinaryOp::Mul, e, wb);
    let one = g.add1(Op::Const { value: 1.0, ty: f32t(&[4, 8]) }, &[]);
    let d = bin(&mut g, BinaryOp::Sub, c, one);
    g.output("a", a);
    g.output("d", d);
    let (f, log) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["add_exp_mul_sub"], "{}", print(&f));
    assert_eq!(launches(&f), 1);
    assert!(rules(&log).is_empty());
    let Op::Kernel(k) = &f.nodes.iter().find(|n| matches!(n.op, Op::Kernel(_))).unwrap().op else { unreachable!() };
    assert_eq!(k.body.inputs().len(), 3, "x, y, w");
    assert_eq!(k.body.outputs.len(), 2, "a and d");
}

#[test]
fn reduction_with_prologue_epilogue_and_a_sibling_reduction() {
    let mut g = Graph::new("red", &[]);
    let x = input(&mut g, "x", f32t(&[4, 8]));
    let sq = bin(&mut g, BinaryOp::Mul, x, x);
    let s = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![1] }, &[sq]);
    let k = g.add1(Op::Const { value: 0.125, ty: f32t(&[4]) }, &[]);
    let m = bin(&mut g, BinaryOp::Mul, s, k);
    let r = un(&mut g, UnaryOp::Rsqrt, m);
    let mx = g.add1(Op::Reduce { op: ReduceOp::Max, axes: vec![1] }, &[x]);
    let out = bin(&mut g, BinaryOp::Add, r, mx);
    g.output("out", out);
    let (f, _) = fuse_checked(&g);
    // The max starts its own group (it reads only x); the add joins both reductions.
    assert_eq!(kernels(&f), ["mul_reduce_sum_rsqrt_reduce_max_add"], "{}", print(&f));
}

#[test]
fn siblings_and_independent_epilogue_ops_join_a_reduction() {
    // Both sums read x (horizontal fusion reads it once); neg(y) is on the reduced shape, so it
    // is evaluated in the epilogue next to the sums it is added to.
    let mut g = Graph::new("sib", &[]);
    let x = input(&mut g, "x", f32t(&[4, 8]));
    let y = input(&mut g, "y", f32t(&[4]));
    let s1 = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![1] }, &[x]);
    let sq = bin(&mut g, BinaryOp::Mul, x, x);
    let s2 = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![1] }, &[sq]);
    let ny = un(&mut g, UnaryOp::Neg, y);
    let t = bin(&mut g, BinaryOp::Add, s1, ny);
    let out = bin(&mut g, BinaryOp::Mul, t, s2);
    g.output("out", out);
    let (f, log) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["reduce_sum_mul_neg_add"], "{}", print(&f));
    assert!(rules(&log).is_empty());
    let Op::Kernel(k) = &f.nodes.iter().find(|n| matches!(n.op, Op::Kernel(_))).unwrap().op else { unreachable!() };
    assert_eq!(k.body.inputs().len(), 2, "x and y");
}

#[test]
fn reduction_result_broadcast_back_starts_a_new_kernel() {
    // mean = sum(x)/n; y = x - mean: the subtraction needs the finished reduction.
    let mut g = Graph::new("center", &[]);
    let x = input(&mut g, "x", f32t(&[4, 8]));
    let e = un(&mut g, UnaryOp::Exp, x);
    let s = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![1] }, &[e]);
    let sb = g.add1(Op::Broadcast { dims: vec![0], shape: Shape::lits(&[4, 8]) }, &[s]);
    let y = bin(&mut g, BinaryOp::Sub, e, sb);
    let t = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0] }, &[s]);
    g.output("y", y);
    g.output("t", t);
    let (f, log) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["exp_reduce_sum", "sub", "reduce_sum"], "{}", print(&f));
    let r = rules(&log);
    assert!(r.contains(&"recompute-in-reduction"), "{r:?}");
}

#[test]
fn residual_add_joins_layernorm_and_exports_the_sum() {
    let mut g = Graph::new("add_ln", &[]);
    let x = input(&mut g, "x", f32t(&[4, 8]));
    let h = input(&mut g, "h", f32t(&[4, 8]));
    let w = input(&mut g, "w", f32t(&[8]));
    let b = input(&mut g, "b", f32t(&[8]));
    let sum = bin(&mut g, BinaryOp::Add, x, h);
    let ln = g.add(Op::LayerNorm { eps: 1e-5 }, &[sum, w, b]);
    let two = g.add1(Op::Const { value: 2.0, ty: f32t(&[4, 8]) }, &[]);
    let y2 = bin(&mut g, BinaryOp::Mul, ln[0], two);
    g.output("sum", sum);
    g.output("y", y2);
    g.output("mean", ln[1]);
    g.output("rstd", ln[2]);
    let (f, _) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["add_layernorm_mul"], "{}", print(&f));
    let kn = f.nodes.iter().find(|n| matches!(n.op, Op::Kernel(_))).unwrap();
    assert_eq!(kn.results.len(), 4, "sum, y, mean, rstd");
}

#[test]
fn layernorm_grad_takes_the_residual_and_accumulate_adds() {
    let mut g = Graph::new("ln_grad", &[]);
    let dy = input(&mut g, "dy", f32t(&[4, 8]));
    let x = input(&mut g, "x", f32t(&[4, 8]));
    let w = input(&mut g, "w", f32t(&[8]));
    let mean = input(&mut g, "mean", f32t(&[4]));
    let rstd = input(&mut g, "rstd", f32t(&[4]));
    let dres = input(&mut g, "dres", f32t(&[4, 8]));
    let gw = input(&mut g, "grad.w", f32t(&[8]));
    let gb = input(&mut g, "grad.b", f32t(&[8]));
    let r = g.add(Op::LayerNormGrad, &[dy, x, w, mean, rstd]);
    let dx = bin(&mut g, BinaryOp::Add, dres, r[0]);
    let gw2 = bin(&mut g, BinaryOp::Add, gw, r[1]);
    let gb2 = bin(&mut g, BinaryOp::Add, gb, r[2]);
    g.output("dx", dx);
    g.output("grad.w", gw2);
    g.output("grad.b", gb2);
    let (f, _) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["layernorm_grad_add"], "{}", print(&f));
    assert_eq!(launches(&f), 1);
}

/// Two parameters trained by `optimizer` on a graph whose gradients are plain inputs.
fn adamw_graph(clip: bool) -> Graph {
    let mut g = Graph::new("opt", &[]);
    let mut grads = vec![];
    for (p, dims) in [("w", &[4u64, 3][..]), ("b", &[3][..])] {
        g.add1(Op::Param { name: p.into(), ty: f32t(dims) }, &[]);
        let d = input(&mut g, &format!("d.{p}"), f32t(dims));
        let acc = input(&mut g, &format!("grad.{p}"), f32t(dims));
        grads.push((p, bin(&mut g, BinaryOp::Add, acc, d)));
    }
    let z = input(&mut g, "z", Type::scalar(DType::F32));
    g.output("loss", z);
    for (p, v) in grads {
        g.output(&format!("grad.{p}"), v);
    }
    optimizer(&g, &AdamWConfig { clip, weight_decay: 0.1, ..AdamWConfig::default() }).unwrap()
}

fn adamw_feeds(g: &Graph) -> HashMap<String, Tensor> {
    let mut feeds = interp::random_feeds(g, &Bindings::default(), &mut Rng::new(3), 2).unwrap();
    for (name, t) in feeds.iter_mut() {
        match name.as_str() {
            "lr" => *t = Tensor::scalar(DType::F32, 1e-3),
            "bc1" => *t = Tensor::scalar(DType::F32, 0.1),
            "bc2" => *t = Tensor::scalar(DType::F32, 0.001),
            "grad_clip" => *t = Tensor::scalar(DType::F32, 0.5),
            "dloss" => *t = Tensor::scalar(DType::F32, 1.0),
            n if n.starts_with("v.") => t.data.iter_mut().for_each(|x| *x = x.abs()),
            _ => {}
        }
    }
    feeds
}

#[test]
fn all_adamw_updates_are_one_kernel_with_their_gradient_adds() {
    for clip in [false, true] {
        let g = adamw_graph(clip);
        let (f, _) = fuse(&g);
        assert_same_values(&g, &f, &Bindings::default(), &adamw_feeds(&g));
        let names = kernels(&f);
        assert_eq!(names.iter().filter(|n| **n == "adamw").count(), 1, "clip {clip}: {names:?}\n{}", print(&f));
        let Op::Kernel(k) = &f.nodes.iter().find(|n| matches!(&n.op, Op::Kernel(k) if k.name == "adamw")).unwrap().op else {
            unreachable!()
        };
        let count = |m: &str| k.body.nodes.iter().filter(|n| n.op.mnemonic() == m).count();
        assert_eq!(count("adamw"), 2);
        if clip {
            // The accumulate adds also feed the norm, so only the clipping multiplies join.
            assert_eq!((count("mul"), count("add")), (2, 0), "{}", print(&f));
        } else {
            assert_eq!(names, ["adamw"]);
            assert_eq!(count("add"), 2);
            // p, d, grad, m, v per parameter, and lr, bc1, bc2 once.
            assert_eq!(k.body.inputs().len(), 2 * 5 + 3);
        }
    }
}

// ---- the rules refuse ----------------------------------------------------------------------

#[test]
fn domain_mismatch_keeps_a_broadcast_member_out() {
    let mut g = Graph::new("dm", &[]);
    let a = input(&mut g, "a", f32t(&[4]));
    let x = input(&mut g, "x", f32t(&[3, 4]));
    let s = un(&mut g, UnaryOp::Exp, a);
    let sb = g.add1(Op::Broadcast { dims: vec![1], shape: Shape::lits(&[3, 4]) }, &[s]);
    let c = bin(&mut g, BinaryOp::Mul, sb, x);
    g.output("c", c);
    let (f, log) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["exp", "mul"], "{}", print(&f));
    assert_eq!(rules(&log), ["domain-mismatch"]);
    assert_eq!(log.of("fuse-elementwise")[0].at, "%2 (exp)");
}

#[test]
fn read_count_limit_splits_a_kernel_reading_nine_operands() {
    let mut g = Graph::new("reads", &[]);
    let xs: Vec<ValueId> = (0..9).map(|i| input(&mut g, &format!("x{i}"), f32t(&[5]))).collect();
    let mut acc = bin(&mut g, BinaryOp::Add, xs[0], xs[1]);
    for &x in &xs[2..] {
        acc = bin(&mut g, BinaryOp::Add, acc, x);
    }
    g.output("sum", acc);
    let (f, log) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["add", "add"], "{}", print(&f));
    assert_eq!(rules(&log), ["read-count-limit"]);
    let Op::Kernel(k) = &f.nodes.iter().find(|n| matches!(n.op, Op::Kernel(_))).unwrap().op else { unreachable!() };
    assert_eq!(k.body.inputs().len(), 8);
}

#[test]
fn no_kernel_around_a_matmul_between_its_ops() {
    // a = exp(x); y = matmul(a, w); b = add(a, y): a and b in one kernel would need the
    // kernel both before and after the matmul.
    let mut g = Graph::new("cyc", &[]);
    let x = input(&mut g, "x", f32t(&[4, 4]));
    let w = input(&mut g, "w", f32t(&[4, 4]));
    let a = un(&mut g, UnaryOp::Exp, x);
    let y = g.add1(Op::MatMul { trans_a: false, trans_b: false }, &[a, w]);
    let b = bin(&mut g, BinaryOp::Add, a, y);
    g.output("b", b);
    let (f, log) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["exp", "add"], "{}", print(&f));
    assert_eq!(launches(&f), 3);
    assert_eq!(rules(&log), ["not-fusible", "cycle"]);
    let cyc = &log.of("fuse-elementwise")[1];
    assert_eq!(cyc.at, "%2 (exp)");
    assert!(cyc.detail.contains("would create a cycle"), "{}", cyc.detail);
}

#[test]
fn a_non_fusible_op_between_splits_the_chain() {
    let mut g = Graph::new("perm", &[]);
    let x = input(&mut g, "x", f32t(&[3, 4]));
    let a = un(&mut g, UnaryOp::Exp, x);
    let p = g.add1(Op::Permute { perm: vec![1, 0] }, &[a]);
    let b = un(&mut g, UnaryOp::Neg, p);
    g.output("b", b);
    let (f, log) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["exp", "neg"], "{}", print(&f));
    assert_eq!(rules(&log), ["not-fusible"]);
    assert_eq!(log.of("fuse-elementwise")[0].at, "%2 (permute)");
}

#[test]
fn one_composite_per_kernel() {
    let mut g = Graph::new("two_sm", &[]);
    let x = input(&mut g, "x", f32t(&[2, 5]));
    let s = g.add1(Op::Softmax, &[x]);
    let t = bin(&mut g, BinaryOp::Mul, s, x);
    let u = g.add1(Op::Softmax, &[t]);
    g.output("u", u);
    let (f, log) = fuse_checked(&g);
    assert_eq!(kernels(&f), ["softmax_mul", "softmax"], "{}", print(&f));
    assert_eq!(rules(&log), ["one-composite-per-kernel"]);
}

// ---- whole graphs --------------------------------------------------------------------------

/// Random feeds for a GPT-2 training graph: tokens below the vocabulary, sane AdamW scalars,
/// nonnegative second moments.
fn gpt2_feeds(g: &Graph, b: &Bindings) -> HashMap<String, Tensor> {
    let mut feeds = interp::random_feeds(g, b, &mut Rng::new(11), 250).unwrap();
    for (name, t) in feeds.iter_mut() {
        match name.as_str() {
            "lr" => *t = Tensor::scalar(DType::F32, 1e-3),
            "bc1" => *t = Tensor::scalar(DType::F32, 0.1),
            "bc2" => *t = Tensor::scalar(DType::F32, 0.001),
            "dloss" => *t = Tensor::scalar(DType::F32, 1.0),
            n if n.starts_with("v.") => t.data.iter_mut().for_each(|x| *x = x.abs()),
            _ => {}
        }
    }
    feeds
}

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
    assert_same_values(&g, &f, &b, &gpt2_feeds(&g, &b));
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
        let Ok(feeds) = interp::random_feeds(&g, &b, &mut Rng::new(seed), 2) else {
            continue;
        };
        let Ok(before) = interp::run(&g, &b, &feeds, Precision::F32) else {
            continue;
        };
        let after =
            interp::run(&f, &b, &feeds, Precision::F32).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{}\n{}", print(&g), print(&f)));
        for (i, (x, y)) in after.iter().zip(&before).enumerate() {
            assert!(close(x, y), "seed {seed}, output {i}:\n{}\n{}", print(&g), print(&f));
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
fn after_the_other_passes_a_block_takes_at_most_12_non_matmul_launches() {
    let (one, _) = fuse(&tiny_pipeline_graph(1));
    let g2 = tiny_pipeline_graph(2);
    let (two, _) = fuse(&g2);
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 3);
    assert_same_values(&g2, &two, &b, &gpt2_feeds(&g2, &b));
    let per_block = non_matmul_launches(&two) - non_matmul_launches(&one);
    eprintln!(
        "after the other passes: {} launches before, {} after; {per_block} non-matmul launches per block",
        launches(&g2),
        launches(&two)
    );
    assert!(per_block <= 12, "{per_block}\n{}", launch_list(&two));
    // add + layernorm forward; layernorm_grad with the residual-gradient add backward.
    let names = kernels(&two);
    assert_eq!(names.iter().filter(|n| **n == "add_layernorm").count(), 5, "{names:?}");
    assert_eq!(names.iter().filter(|n| **n == "layernorm_grad_add").count(), 5, "{names:?}");
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
