//! Compiled CPU kernels against the reference interpreter.
//!
//! Every kernel form is checked on random non-zero inputs with `|a - b| <= atol + rtol |ref|`
//! (1e-5 for f32 results, 1e-2 for bf16; NaN never passes): hand-built kernels for each form,
//! and every kernel `fuse-elementwise` produces for the tiny GPT-2 training graph. Also: the
//! kernel cache, thread-count determinism, and the ulp error of the `exp`/`log`/`tanh` routines.

#[path = "kernels/harness.rs"]
mod harness;
#[path = "kernels/math.rs"]
mod math;
#[path = "kernels/rows.rs"]
mod rows;
#[path = "kernels/adamw.rs"]
mod adamw;

use std::collections::HashMap;
use std::time::Instant;

use fusec_codegen_cpu::{CompiledKernel, KernelCompiler};
use fusec_ir::{BinaryOp, Bindings, CmpOp, DType, Graph, Kernel, Op, ReduceOp, Shape, Type, UnaryOp, ValueId};
use harness::*;

// ---- hand-built kernels, one per form ---------------------------------------------------------

/// Pointwise chain with every kind of broadcast (per-column vector, per-row value, scalar) and
/// the transcendental functions; C = 37 exercises the scalar tail.
#[test]
fn pointwise_chain_with_broadcasts() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(37)];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let w = k.input(DType::F32, &[l(37)]);
    let r = k.input(DType::F32, &[s("B"), s("T")]);
    let sc = k.input(DType::F32, &[]);
    let wb = k.bcast(w, &[2], &d);
    let rb = k.bcast(r, &[0, 1], &d);
    let sb = k.bcast(sc, &[], &d);
    let a = k.bin(BinaryOp::Add, x, wb);
    let t = k.un(UnaryOp::Tanh, a);
    let m = k.bin(BinaryOp::Mul, t, sb);
    let e = k.un(UnaryOp::Exp, m);
    let xx = k.bin(BinaryOp::Mul, x, x);
    let one = k.constant(1.0, DType::F32, &d);
    let xx1 = k.bin(BinaryOp::Add, xx, one);
    let lg = k.un(UnaryOp::Log, xx1);
    let z = k.bin(BinaryOp::Sub, e, lg);
    let q = k.bin(BinaryOp::Div, z, rb);
    let mx = k.bin(BinaryOp::Max, q, x);
    let mn = k.bin(BinaryOp::Min, mx, rb);
    let sq = k.un(UnaryOp::Sqrt, xx1);
    let rs = k.un(UnaryOp::Rsqrt, xx1);
    let rc = k.un(UnaryOp::Recip, sq);
    let ng = k.un(UnaryOp::Neg, rc);
    let y = k.bin(BinaryOp::Add, ng, rs);
    let kernel = k.kernel("pointwise", &[t, z, mn, y]);
    let b = bind(2, 3);
    for seed in 0..3 {
        check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, seed, 1, &[]));
    }
}

/// Operand layouts: a `[T, C]` table broadcast over the batch (a strided row term), a `[B, 1, C]`
/// operand (size-1 axis), a reshaped `[B*T, C]` operand, and a result read back as an output.
#[test]
fn operand_layouts() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(12)];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let pos = k.input(DType::F32, &[s("T"), l(12)]);
    let per_b = k.input(DType::F32, &[s("B"), l(1), l(12)]);
    let flat = k.input(DType::F32, &[s("B").mul(&s("T")), l(12)]);
    let pb = k.bcast(pos, &[1, 2], &d);
    let bb = k.bcast(per_b, &[0, 1, 2], &d);
    let fr = k.op(Op::Reshape { shape: Shape::from(d.to_vec()) }, &[flat]);
    let a = k.bin(BinaryOp::Add, x, pb);
    let m = k.bin(BinaryOp::Mul, a, bb);
    let y = k.bin(BinaryOp::Sub, m, fr);
    let kernel = k.kernel("layouts", &[y, x]);
    let b = bind(3, 5);
    check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 16, 1, &[]));
}

/// Bias add + GELU (both results), and the GELU gradient.
#[test]
fn bias_gelu_and_gelu_grad() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(64)];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let bias = k.input(DType::F32, &[l(64)]);
    let bb = k.bcast(bias, &[2], &d);
    let h = k.bin(BinaryOp::Add, x, bb);
    let g = k.op(Op::Gelu, &[h]);
    let kernel = k.kernel("bias_gelu", &[h, g]);
    let b = bind(2, 5);
    check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 1, 1, &[]));
    // Wider inputs reach the tanh saturation and the cancellation region of GELU.
    let mut ins = random_inputs(&kernel, &b, 2, 1, &[]);
    ins[0].data.iter_mut().for_each(|v| *v *= 4.0);
    check(&mut c, &kernel, &b, &ins);

    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let dy = k.input(DType::F32, &d);
    let g = k.op(Op::GeluGrad, &[x, dy]);
    let kernel = k.kernel("gelu_grad", &[g]);
    let mut ins = random_inputs(&kernel, &b, 3, 1, &[]);
    check(&mut c, &kernel, &b, &ins);
    ins[0].data.iter_mut().for_each(|v| *v *= 4.0);
    check(&mut c, &kernel, &b, &ins);
}

/// Row reductions (sum and max) with a prologue and an epilogue on the reduced shape.
#[test]
fn row_reduction_with_epilogue() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(30)];
    let r = [s("B"), s("T")];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let extra = k.input(DType::F32, &r);
    let xx = k.bin(BinaryOp::Mul, x, x);
    let ss = k.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![2] }, &[xx]);
    let mx = k.op(Op::Reduce { op: ReduceOp::Max, axes: vec![2] }, &[x]);
    let inv = k.constant(1.0 / 30.0, DType::F32, &r);
    let ms = k.bin(BinaryOp::Mul, ss, inv);
    let eps = k.constant(1e-5, DType::F32, &r);
    let v = k.bin(BinaryOp::Add, ms, eps);
    let rs = k.un(UnaryOp::Rsqrt, v);
    let o2 = k.bin(BinaryOp::Sub, mx, extra);
    let kernel = k.kernel("reduce_rows", &[xx, rs, o2]);
    for (bb, t) in [(2, 3), (1, 1), (3, 7)] {
        let b = bind(bb, t);
        check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 4, 1, &[]));
    }
}

/// Column reductions (bias-gradient form: sum over all rows, then `grad + sum`) and a full
/// reduction to a scalar (the mean loss), over enough rows for several chunks.
#[test]
fn column_and_full_reductions() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(24)];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let gin = k.input(DType::F32, &[l(24)]);
    let w = k.input(DType::F32, &[l(24)]);
    let wb = k.bcast(w, &[2], &d);
    let xw = k.bin(BinaryOp::Mul, x, wb);
    let cs = k.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1] }, &[xw]);
    let cm = k.op(Op::Reduce { op: ReduceOp::Max, axes: vec![0, 1] }, &[x]);
    let acc = k.bin(BinaryOp::Add, gin, cs);
    let acc2 = k.bin(BinaryOp::Mul, acc, cm);
    let kernel = k.kernel("colsum", &[acc2]);
    for (bb, t) in [(2, 3), (4, 600)] {
        let b = bind(bb, t);
        check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 5, 1, &[]));
    }

    let r = [s("B"), s("T")];
    let mut k = Body::new();
    let loss = k.input(DType::F32, &r);
    let tot = k.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1] }, &[loss]);
    let n = k.constant(32.0, DType::F32, &[]);
    let mean = k.bin(BinaryOp::Div, tot, n);
    let kernel = k.kernel("mean_loss", &[mean]);
    for (bb, t) in [(2, 16), (4, 5000)] {
        let b = bind(bb, t);
        check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 6, 1, &[]));
    }
}

/// Residual add feeding LayerNorm (all four results out), at an even and an odd width.
#[test]
fn add_layernorm() {
    let mut c = KernelCompiler::new().unwrap();
    for cols in [64, 50, 3] {
        let d = [s("B"), s("T"), l(cols)];
        let mut k = Body::new();
        let a = k.input(DType::F32, &d);
        let r = k.input(DType::F32, &d);
        let w = k.input(DType::F32, &[l(cols)]);
        let bias = k.input(DType::F32, &[l(cols)]);
        let x = k.bin(BinaryOp::Add, a, r);
        let ln = k.g.add(Op::LayerNorm { eps: 1e-5 }, &[x, w, bias]);
        let kernel = k.kernel("add_layernorm", &[x, ln[0], ln[1], ln[2]]);
        let b = bind(2, 7);
        check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 7, 1, &[]));
    }
}

/// LayerNorm backward with the residual-gradient add and the dw/db accumulation adds.
#[test]
fn layernorm_grad_with_accumulation() {
    let mut c = KernelCompiler::new().unwrap();
    let kernel = ln_grad_kernel(64);
    for (bb, t) in [(2, 7), (4, 256)] {
        let b = bind(bb, t);
        check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 8, 1, &[4]));
    }
}

fn ln_grad_kernel(cols: u64) -> Kernel {
    let d = [s("B"), s("T"), l(cols)];
    let r = [s("B"), s("T")];
    let mut k = Body::new();
    let dy = k.input(DType::F32, &d);
    let x = k.input(DType::F32, &d);
    let w = k.input(DType::F32, &[l(cols)]);
    let mean = k.input(DType::F32, &r);
    let rstd = k.input(DType::F32, &r);
    let dres = k.input(DType::F32, &d);
    let gw = k.input(DType::F32, &[l(cols)]);
    let gb = k.input(DType::F32, &[l(cols)]);
    let lg = k.g.add(Op::LayerNormGrad, &[dy, x, w, mean, rstd]);
    let dx = k.bin(BinaryOp::Add, dres, lg[0]);
    let dw = k.bin(BinaryOp::Add, gw, lg[1]);
    let db = k.bin(BinaryOp::Add, gb, lg[2]);
    k.kernel("layernorm_grad", &[dx, dw, db])
}

/// Softmax and its gradient.
#[test]
fn softmax_and_grad() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(33)];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let sc = k.input(DType::F32, &[]);
    let sb = k.bcast(sc, &[], &d);
    let xs = k.bin(BinaryOp::Mul, x, sb);
    let y = k.op(Op::Softmax, &[xs]);
    let kernel = k.kernel("softmax", &[y]);
    let b = bind(3, 4);
    check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 9, 1, &[]));

    let mut k = Body::new();
    let y = k.input(DType::F32, &d);
    let dy = k.input(DType::F32, &d);
    let dx = k.op(Op::SoftmaxGrad, &[y, dy]);
    let kernel = k.kernel("softmax_grad", &[dx]);
    check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 10, 1, &[]));
}

/// Cross-entropy and its gradient over a padded vocabulary (padding columns hold garbage).
#[test]
fn cross_entropy_padded() {
    let mut c = KernelCompiler::new().unwrap();
    let (vocab, vp) = (33u64, 40u64);
    let d = [s("B"), s("T"), l(vp)];
    let r = [s("B"), s("T")];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let t = k.input(DType::I32, &r);
    let loss = k.op(Op::CrossEntropy { vocab }, &[x, t]);
    let kernel = k.kernel("cross_entropy", &[loss]);
    let b = bind(2, 9);
    let mut ins = random_inputs(&kernel, &b, 11, vocab, &[]);
    for (i, v) in ins[0].data.iter_mut().enumerate() {
        if i as u64 % vp >= vocab {
            *v = 1e30; // never read by the reference
        }
    }
    check(&mut c, &kernel, &b, &ins);

    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let t = k.input(DType::I32, &r);
    let dl = k.input(DType::F32, &r);
    let g = k.op(Op::CrossEntropyGrad { vocab }, &[x, t, dl]);
    let kernel = k.kernel("cross_entropy_grad", &[g]);
    let mut ins2 = random_inputs(&kernel, &b, 12, vocab, &[]);
    ins2[0] = ins[0].clone();
    check(&mut c, &kernel, &b, &ins2);
}

/// bf16 storage: bf16 operands and results, bf16-typed arithmetic, casts both ways.
#[test]
fn bf16_storage() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(19)];
    let mut k = Body::new();
    let x = k.input(DType::BF16, &d);
    let y = k.input(DType::BF16, &d);
    let w = k.input(DType::F32, &[l(19)]);
    let s_ = k.bin(BinaryOp::Add, x, y); // bf16 arithmetic: rounded to bf16
    let xf = k.op(Op::Cast { to: DType::F32 }, &[s_]);
    let wb = k.bcast(w, &[2], &d);
    let p = k.bin(BinaryOp::Mul, xf, wb);
    let pb = k.op(Op::Cast { to: DType::BF16 }, &[p]);
    let g = k.op(Op::Gelu, &[pb]);
    let i = k.op(Op::Cast { to: DType::I32 }, &[p]);
    let kernel = k.kernel("bf16_cast", &[s_, p, pb, g, i]);
    let b = bind(2, 3);
    check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 14, 1, &[]));
}

/// Masks from comparisons against iota, selects, and i32 arithmetic.
#[test]
fn iota_compare_select() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(21)];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let t = k.input(DType::I32, &[s("B"), s("T")]);
    let ic = k.op(Op::Iota { axis: 2, ty: Type::new(DType::I32, Shape::from(d.to_vec())) }, &[]);
    let ir = k.op(Op::Iota { axis: 1, ty: Type::new(DType::I32, Shape::from(d.to_vec())) }, &[]);
    let tb = k.bcast(t, &[0, 1], &d);
    let sum = k.bin(BinaryOp::Add, ic, ir);
    let eq = k.op(Op::Compare(CmpOp::Eq), &[sum, tb]);
    let zero = k.constant(0.0, DType::F32, &d);
    let sel = k.op(Op::Select, &[eq, x, zero]);
    let ge = k.op(Op::Compare(CmpOp::Ge), &[x, zero]);
    let sel2 = k.op(Op::Select, &[ge, sel, x]);
    let fi = k.op(Op::Iota { axis: 0, ty: Type::new(DType::F32, Shape::from(d.to_vec())) }, &[]);
    let out = k.bin(BinaryOp::Add, sel2, fi);
    let kernel = k.kernel("masks", &[eq, out, sum]);
    let b = bind(3, 5);
    check(&mut c, &kernel, &b, &random_inputs(&kernel, &b, 15, 25, &[]));
}

// ---- every kernel of the GPT-2 training graph -----------------------------------------------------

/// The training graph (forward, backward, AdamW) after `fuse-elementwise`, optionally with
/// `fuse-layernorm` first (so that the composite kernel forms appear).
fn fused_training_graph(fwd: &Graph, composites: bool) -> Graph {
    use fusec_passes::explain::FusionLog;
    let mut log = FusionLog::default();
    let g = if composites { fusec_passes::fuse_layernorm::fuse_layernorm(fwd, &mut log).unwrap() } else { fwd.clone() };
    let g = fusec_passes::autodiff::autodiff(&g).unwrap();
    let g = fusec_passes::optimizer::optimizer(&g, &Default::default()).unwrap();
    fusec_passes::fuse_elementwise::fuse_elementwise(&g, &mut log).unwrap()
}

fn kernels_of(g: &Graph) -> Vec<Kernel> {
    g.nodes.iter().filter_map(|n| if let Op::Kernel(k) = &n.op { Some((**k).clone()) } else { None }).collect()
}

/// Body inputs that must be non-negative for finite results: AdamW's second moment, learning
/// rate and bias corrections, and direct operands of log/sqrt/rsqrt.
fn positive_inputs(k: &Kernel) -> Vec<usize> {
    let g = &k.body;
    let mut input_index = HashMap::new();
    for n in &g.nodes {
        if let Op::Input { .. } = n.op {
            let i = input_index.len();
            input_index.insert(n.results[0], i);
        }
    }
    let mut out = vec![];
    for n in &g.nodes {
        let picks: Vec<ValueId> = match &n.op {
            Op::AdamW { .. } => n.inputs[3..7].to_vec(),
            Op::Unary(UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt) => n.inputs.to_vec(),
            _ => vec![],
        };
        out.extend(picks.iter().filter_map(|v| input_index.get(v)));
    }
    out
}

fn check_graph_kernels(c: &mut KernelCompiler, g: &Graph, b: &Bindings, int_hi: u64) -> usize {
    let ks = kernels_of(g);
    assert!(!ks.is_empty(), "no kernels in the fused graph");
    for (i, k) in ks.iter().enumerate() {
        let ins = random_inputs(k, b, 1000 + i as u64, int_hi, &positive_inputs(k));
        check(c, k, b, &ins);
    }
    ks.len()
}

/// The whole pipeline up to the last fusion pass (`fusec dump --pass fuse`), for a training step.
fn pipeline_graph(fwd: &Graph, precision: fusec_passes::amp::Precision, b: &Bindings) -> Graph {
    use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
    let opts = PipelineOptions { precision, ..Default::default() };
    compile(fwd, "fuse", Mode::Step, &opts, b).unwrap_or_else(|e| panic!("pipeline: {e}")).graph
}

/// The fused training graphs the tests compile: `fuse-elementwise` right after `optimizer`
/// (primitive LayerNorm and cross-entropy: reduction kernels), with `fuse-layernorm` first
/// (composite kernels), and the whole pipeline in f32 and in bf16 mixed precision.
fn training_graphs(fwd: &Graph, b: &Bindings) -> Vec<(&'static str, Graph)> {
    use fusec_passes::amp::Precision as P;
    vec![
        ("optimizer + fuse-elementwise", fused_training_graph(fwd, false)),
        ("fuse-layernorm .. fuse-elementwise", fused_training_graph(fwd, true)),
        ("pipeline f32", pipeline_graph(fwd, P::F32, b)),
        ("pipeline bf16", pipeline_graph(fwd, P::Bf16, b)),
    ]
}

/// Every kernel `fuse-elementwise` makes of the tiny GPT-2 training graph (B=2, T=16) compiles
/// and matches the interpreter; the second layer's kernels come from the cache.
#[test]
fn gpt2_tiny_training_kernels() {
    let cfg = fusec_models::Gpt2Config::preset("tiny").unwrap();
    let fwd = fusec_models::build_gpt2(&cfg, "t");
    let b = bind(2, 16);
    for (label, g) in training_graphs(&fwd, &b) {
        let mut c = KernelCompiler::new().unwrap();
        let n = check_graph_kernels(&mut c, &g, &b, cfg.vocab as u64);
        let (compiled, hits) = c.stats();
        println!("tiny GPT-2 ({label}): {n} kernels, {compiled} compiled, {hits} cache hits, {} functions", c.functions());
        assert_eq!(compiled + hits, n);
        assert!(hits > 0, "the two layers' identical kernels should hit the cache");
    }
}

/// Same inputs, 1 and 2 threads: identical bits (column-reduction partials are per chunk, chunks
/// are fixed by the shape, and combined in chunk order).
#[test]
fn threads_do_not_change_bits() {
    let mut c = KernelCompiler::new().unwrap();
    let kernel = ln_grad_kernel(256);
    let b = bind(4, 128);
    let ins = random_inputs(&kernel, &b, 77, 1, &[4]);
    let ck = c.compile(&kernel, &b).unwrap();
    let one = execute(&ck, &kernel, &b, &ins, 1);
    for threads in [2, 3] {
        let many = execute(&ck, &kernel, &b, &ins, threads);
        for (x, y) in one.iter().zip(&many) {
            assert!(x.data.iter().zip(&y.data).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads changed the bits");
        }
    }
    let want = reference(&kernel, &b, &ins);
    for (g, w) in one.iter().zip(&want) {
        g.check_close(w, 1e-5, 1e-5).unwrap();
    }
}

/// Results written in place over operands (as the memory planner arranges for elementwise
/// results): a multi-pass row kernel (LayerNorm, its gradient) and the multi-tensor AdamW kernel.
#[test]
fn in_place_results() {
    let mut c = KernelCompiler::new().unwrap();
    let b = bind(2, 40);
    // add_layernorm: x = a + r over a; y over r.
    let d = [s("B"), s("T"), l(48)];
    let mut k = Body::new();
    let a = k.input(DType::F32, &d);
    let r = k.input(DType::F32, &d);
    let w = k.input(DType::F32, &[l(48)]);
    let bias = k.input(DType::F32, &[l(48)]);
    let x = k.bin(BinaryOp::Add, a, r);
    let ln = k.g.add(Op::LayerNorm { eps: 1e-5 }, &[x, w, bias]);
    let kernel = k.kernel("add_layernorm", &[x, ln[0], ln[1], ln[2]]);
    let ins = random_inputs(&kernel, &b, 21, 1, &[]);
    let ck = c.compile(&kernel, &b).unwrap();
    let want = reference(&kernel, &b, &ins);
    for threads in [1, 2] {
        let got = execute_in_place(&ck, &kernel, &b, &ins, &[(0, 0), (1, 1)], threads);
        for (g, w) in got.iter().zip(&want) {
            g.check_close(w, 1e-5, 1e-5).unwrap();
        }
    }
    // layernorm_grad: dx + dres over dy, dw and db accumulated in place.
    let kernel = ln_grad_kernel(48);
    let ins = random_inputs(&kernel, &b, 22, 1, &[4]);
    let ck = c.compile(&kernel, &b).unwrap();
    let want = reference(&kernel, &b, &ins);
    let got = execute_in_place(&ck, &kernel, &b, &ins, &[(0, 0), (1, 6), (2, 7)], 2);
    for (g, w) in got.iter().zip(&want) {
        g.check_close(w, 1e-5, 1e-5).unwrap();
    }
    // AdamW: p', m', v' over p, m, v for two parameters.
    let mut k = Body::new();
    let lr = k.input(DType::F32, &[]);
    let bc1 = k.input(DType::F32, &[]);
    let bc2 = k.input(DType::F32, &[]);
    let mut outs = vec![];
    for shape in [vec![l(300), l(64)], vec![l(300), l(64)]] {
        let p = k.input(DType::F32, &shape);
        let g = k.input(DType::F32, &shape);
        let m = k.input(DType::F32, &shape);
        let v = k.input(DType::F32, &shape);
        outs.extend(k.g.add(Op::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.1 }, &[p, g, m, v, lr, bc1, bc2]));
    }
    let kernel = k.kernel("adamw", &outs);
    let ins = random_inputs(&kernel, &b, 23, 1, &[1, 2, 6, 10]);
    let ck = c.compile(&kernel, &b).unwrap();
    let want = reference(&kernel, &b, &ins);
    let alias = [(0, 3), (1, 5), (2, 6), (3, 7), (4, 9), (5, 10)];
    let got = execute_in_place(&ck, &kernel, &b, &ins, &alias, 2);
    for (g, w) in got.iter().zip(&want) {
        g.check_close(w, 1e-5, 1e-5).unwrap();
    }
}

/// Identical kernels compile once; a different binding compiles anew.
#[test]
fn identical_kernels_compile_once() {
    let mut c = KernelCompiler::new().unwrap();
    let k1 = ln_grad_kernel(64);
    let k2 = ln_grad_kernel(64);
    let b = bind(2, 4);
    let a = c.compile(&k1, &b).unwrap();
    let a2 = c.compile(&k2, &b).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a, &a2));
    assert_eq!(c.stats(), (1, 1));
    c.compile(&k1, &bind(2, 8)).unwrap();
    assert_eq!(c.stats(), (2, 1));
    assert!(a.clif.contains("function %layernorm_grad_chunk"), "{}", a.clif);
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CompiledKernel>();
    fn send<T: Send>() {}
    send::<KernelCompiler>();
    assert!(a.bytes_moved() > 0 && a.flops() > 0);
}

/// Every kernel of the GPT-2 124M training graph (B=4, T=64) compiles, the twelve identical
/// layers' kernels come from the cache, and the compile time is printed.
#[test]
fn gpt2_124m_compile_time() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/gpt2-124m.graph");
    let src = std::fs::read_to_string(path).unwrap();
    let fwd = fusec_ir::text::parse(&src, path).unwrap();
    let b = bind(4, 64);
    for (label, g) in training_graphs(&fwd, &b) {
        let ks = kernels_of(&g);
        let mut c = KernelCompiler::new().unwrap();
        let t0 = Instant::now();
        for k in &ks {
            c.compile(k, &b).unwrap_or_else(|e| panic!("{e}"));
        }
        let dt = t0.elapsed();
        let (compiled, hits) = c.stats();
        println!(
            "GPT-2 124M ({label}): {} kernels, {compiled} compiled, {hits} cache hits, {} functions, {:.1} ms",
            ks.len(),
            c.functions(),
            dt.as_secs_f64() * 1e3
        );
        assert_eq!(compiled + hits, ks.len(), "{label}");
        assert!(
            hits > compiled,
            "{label}: the 12 layers' identical kernels should mostly hit the cache ({compiled} compiled, {hits} hits)"
        );
    }
}

/// f32 → bf16 in the generated code, bit for bit against the reference rounding: ties to even
/// both ways, a carry into the exponent, the largest finite value (to infinity), denormals,
/// signed zeros and infinities, quiet and signalling NaNs with payloads (kept, made quiet).
/// C = 37 runs the four-lane loop and the scalar tail.
#[test]
fn bf16_stores_round_bit_for_bit() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(37)];
    let mut k = Body::new();
    let x = k.input(DType::F32, &d);
    let y = k.op(Op::Cast { to: DType::BF16 }, &[x]);
    let kernel = k.kernel("to_bf16", &[y]);
    let b = bind(2, 3);
    let ck = c.compile(&kernel, &b).unwrap();
    let special: [u32; 16] = [
        0x3f80_8000, 0x3f81_8000, 0x3f80_8001, 0x3f80_7fff, 0x3fff_ffff, 0x7f7f_ffff, 0x0000_8000, 0x0001_8000,
        0x8000_0000, 0x0000_0000, 0x7f80_0000, 0xff80_0000, 0x7fc0_0001, 0x7f80_0001, 0xffa1_2345, 0x7fff_ffff,
    ];
    let n = 2 * 3 * 37;
    let mut rng = fusec_ir::rng::Rng::new(3);
    let input: Vec<u32> = (0..n).map(|i| if i % 3 == 0 { special[i / 3 % 16] } else { (rng.normal() as f32 * 3.0).to_bits() }).collect();
    let bytes: Vec<u8> = input.iter().flat_map(|u| u.to_le_bytes()).collect();
    let mut out = vec![0u8; 2 * n];
    // SAFETY: the operand and result cover the kernel's bound shapes.
    unsafe { ck.run(&[bytes.as_ptr()], &[out.as_mut_ptr()], 1) };
    for (i, (u, h)) in input.iter().zip(out.chunks(2)).enumerate() {
        let (got, want) = (u16::from_le_bytes([h[0], h[1]]), fusec_codegen_cpu::gemm::bf16_bits(f32::from_bits(*u)));
        assert_eq!(got, want, "element {i} (column {}): {u:#010x} became {got:#06x}, not {want:#06x}", i % 37);
    }
}
