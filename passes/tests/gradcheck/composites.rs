//! Gradient checks of the composites (LayerNorm, softmax, cross-entropy, attention), graph-level behaviour and the tiny GPT-2.

use super::*;

// ---- composites ----------------------------------------------------------------------------

#[test]
fn layernorm() {
    for (k, shape) in [ls(&[3, 5]), ls(&[2, 3, 4]), shp(&[sym("B"), sym("T"), lit(6)])].into_iter().enumerate() {
        let mut c = Case::new(&format!("layernorm_{k}"), 200 + k as u64);
        let cdim = shape.0.last().unwrap().as_lit().unwrap();
        let x = c.param("x", shape, Init::Normal(1.0));
        let w = c.param("w", ls(&[cdim]), Init::Normal(1.0));
        let b = c.param("b", ls(&[cdim]), Init::Normal(1.0));
        let r = c.ops(Op::LayerNorm { eps: 1e-5 }, &[x, w, b]);
        gradcheck(&c.finish(r[0]));
    }
}

#[test]
fn softmax() {
    for (k, shape) in [ls(&[3, 5]), ls(&[2, 2, 4]), ls(&[6])].into_iter().enumerate() {
        let mut c = Case::new(&format!("softmax_{k}"), 210 + k as u64);
        let x = c.param("x", shape, Init::Normal(1.0));
        let y = c.op(Op::Softmax, &[x]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn cross_entropy() {
    {
        // vocab 6 < padded 8: the padding columns get exactly zero gradient.
        let mut c = Case::new("cross_entropy", 220);
        let l = c.param("logits", ls(&[5, 8]), Init::Normal(1.0));
        let t = c.rand_ints("targets", ls(&[5]), 6);
        let y = c.op(Op::CrossEntropy { vocab: 6 }, &[l, t]);
        let g = gradcheck(&c.finish(y));
        for r in 0..5 {
            assert!(g["logits"].data[r * 8 + 6..r * 8 + 8].iter().all(|v| *v == 0.0), "padding columns of row {r}");
        }
    }
    {
        let mut c = Case::new("cross_entropy_rank3", 221);
        let l = c.param("logits", ls(&[2, 3, 7]), Init::Normal(1.0));
        let t = c.rand_ints("targets", ls(&[2, 3]), 7);
        let y = c.op(Op::CrossEntropy { vocab: 7 }, &[l, t]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn attention() {
    for (k, (shape, heads)) in [(ls(&[4, 6]), 1), (ls(&[2, 4, 12]), 2), (ls(&[2, 3, 18]), 3)].into_iter().enumerate() {
        let mut c = Case::new(&format!("attention_{k}"), 230 + k as u64);
        let qkv = c.param("qkv", shape, Init::Normal(1.0));
        let r = c.ops(Op::Attention { heads, scale: 0.7 }, &[qkv]);
        gradcheck(&c.finish(r[0]));
    }
}

// ---- graph-level behaviour -----------------------------------------------------------------

#[test]
fn params_without_a_path_to_the_loss() {
    // `unused` never reaches the loss; `cmp_only` reaches it only through a comparison (no
    // gradient). Both get exactly the accumulator back (zero here), and both still have outputs.
    let mut c = Case::new("no_path", 240);
    let x = c.param("x", ls(&[4]), Init::Normal(1.0));
    let _unused = c.param("unused", ls(&[3]), Init::Normal(1.0));
    let cmp_only = c.param_data("cmp_only", ls(&[4]), vec![0.5, -0.5, 1.5, -1.5]);
    let zero = c.op(Op::Const { value: 0.0, ty: Type::new(DType::F32, ls(&[4])) }, &[]);
    let cond = c.op(Op::Compare(CmpOp::Gt), &[cmp_only, zero]);
    let e = c.op(Op::Unary(UnaryOp::Exp), &[x]);
    let y = c.op(Op::Select, &[cond, e, x]);
    let g = gradcheck(&c.finish(y));
    assert!(g["unused"].data.iter().all(|v| *v == 0.0));
    assert!(g["cmp_only"].data.iter().all(|v| *v == 0.0));
}

#[test]
fn small_mlp_chain() {
    // A composition of many rules: linear (shared rank-2 weight), gelu, layernorm, softmax.
    let mut c = Case::new("mlp", 250);
    let x = c.param("x", shp(&[sym("B"), sym("T"), lit(4)]), Init::Normal(1.0));
    let w1 = c.param("w1", ls(&[6, 4]), Init::Normal(0.5));
    let b1 = c.param("b1", ls(&[6]), Init::Normal(0.5));
    let lw = c.param("lw", ls(&[6]), Init::Normal(1.0));
    let lb = c.param("lb", ls(&[6]), Init::Normal(1.0));
    let h = c.op(Op::MatMul { trans_a: false, trans_b: true }, &[x, w1]);
    let bb = c.op(Op::Broadcast { dims: vec![2], shape: shp(&[sym("B"), sym("T"), lit(6)]) }, &[b1]);
    let h = c.bin(BinaryOp::Add, h, bb);
    let h = c.op(Op::Gelu, &[h]);
    let h = c.ops(Op::LayerNorm { eps: 1e-5 }, &[h, lw, lb])[0];
    let s = c.op(Op::Softmax, &[h]);
    gradcheck(&c.finish(s));
}

#[test]
fn loss_that_is_a_parameter() {
    // loss = p (a scalar parameter): dloss/dp = 1, so grad.p must come back as grad.p + dloss.
    let mut c = Case::new("loss_is_param", 260);
    let p = c.param_data("p", ls(&[]), vec![0.75]);
    c.g.output("loss", p);
    let ad = differentiate(&c);
    let mut grads = HashMap::new();
    grads.insert("p".to_string(), Tensor::scalar(DType::F32, 0.25));
    let outs = run_named(&ad, &c.b, &ad_feeds(&c, 1.0, &grads));
    let got = outs[&grad_name("p")].data[0];
    assert_eq!(got, 1.25, "loss = p: grad.p should be 0.25 + 1 * 1 = 1.25, got {got}");
}

/// Runs autodiff and expects an `Err` (not a panic, not a graph).
fn expect_err(g: &Graph, what: &str) -> String {
    match catch_unwind(AssertUnwindSafe(|| autodiff(g))) {
        Ok(Err(e)) => e,
        Ok(Ok(_)) => panic!("{what}: autodiff accepted the graph"),
        Err(_) => panic!("{what}: autodiff panicked instead of returning Err"),
    }
}

#[test]
fn errors_instead_of_panics() {
    let x_ty = Type::new(DType::F32, ls(&[3]));
    // No `loss` output.
    let mut g = Graph::new("no_loss", &[]);
    let x = g.add1(Op::Param { name: "x".into(), ty: x_ty.clone() }, &[]);
    let s = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0] }, &[x]);
    g.output("total", s);
    let e = expect_err(&g, "no loss output");
    assert!(e.contains("loss"), "{e}");
    // No outputs at all.
    let mut g0 = g.clone();
    g0.outputs.clear();
    expect_err(&g0, "no outputs");
    // Non-scalar loss.
    let mut g1 = Graph::new("vector_loss", &[]);
    let x = g1.add1(Op::Param { name: "x".into(), ty: x_ty.clone() }, &[]);
    let y = g1.add1(Op::Unary(UnaryOp::Exp), &[x]);
    g1.output("loss", y);
    expect_err(&g1, "non-scalar loss");
    // Symbolic non-scalar loss.
    let mut gs = Graph::new("sym_loss", &["B"]);
    let x = gs.add1(Op::Param { name: "x".into(), ty: Type::new(DType::F32, shp(&[sym("B")])) }, &[]);
    gs.output("loss", x);
    expect_err(&gs, "symbolic non-scalar loss");
    // Scalar loss of the wrong dtype.
    for dt in [DType::I32, DType::BF16, DType::F16] {
        let mut g2 = Graph::new("wrong_dtype_loss", &[]);
        let x = g2.add1(Op::Param { name: "x".into(), ty: x_ty.clone() }, &[]);
        let s = g2.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0] }, &[x]);
        let c = g2.add1(Op::Cast { to: dt }, &[s]);
        g2.output("loss", c);
        expect_err(&g2, &format!("{dt} loss"));
    }
    // Gradient through LayerNorm's saved statistics (unsupported).
    let mut g3 = Graph::new("ln_stats", &[]);
    let x = g3.add1(Op::Param { name: "x".into(), ty: Type::new(DType::F32, ls(&[2, 3])) }, &[]);
    let w = g3.add1(Op::Param { name: "w".into(), ty: x_ty.clone() }, &[]);
    let b = g3.add1(Op::Param { name: "b".into(), ty: x_ty.clone() }, &[]);
    let r = g3.add(Op::LayerNorm { eps: 1e-5 }, &[x, w, b]);
    let s = g3.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0] }, &[r[1]]);
    g3.output("loss", s);
    expect_err(&g3, "layernorm mean used");
    // Gradient through attention's log-sum-exp (unsupported).
    let mut g4 = Graph::new("attn_lse", &[]);
    let q = g4.add1(Op::Param { name: "q".into(), ty: Type::new(DType::F32, ls(&[3, 6])) }, &[]);
    let r = g4.add(Op::Attention { heads: 1, scale: 1.0 }, &[q]);
    let s = g4.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0] }, &[r[1]]);
    g4.output("loss", s);
    expect_err(&g4, "attention lse used");
}

// ---- whole model ---------------------------------------------------------------------------

#[test]
fn tiny_gpt2() {
    let cfg = Gpt2Config { layers: 2, heads: 2, channels: 8, vocab: 11, padded_vocab: 16, max_seq: 8 };
    cfg.validate().unwrap();
    let g = build_gpt2(&cfg, "gpt2_gradcheck");
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 5);
    let mut rng = Rng::new(0x6e2);
    let mut feeds = HashMap::new();
    for (name, v) in g.params() {
        let s = concrete_shape(g.ty(v), &b).unwrap();
        let n: usize = s.iter().product();
        // LayerNorm gains around 1, everything else N(0, 0.3^2).
        let base = if name.starts_with("ln") && name.contains('w') { 1.0 } else { 0.0 };
        let data = (0..n).map(|_| base + 0.3 * rng.normal()).collect();
        feeds.insert(name.to_string(), Tensor::new(DType::F32, s, data));
    }
    for name in ["tokens", "targets"] {
        let data: Vec<i32> = (0..10).map(|_| rng.below(cfg.vocab as u64) as i32).collect();
        feeds.insert(name.to_string(), Tensor::from_i32(vec![2, 5], &data));
    }
    let c = Case { g, b, feeds, rng };
    let n_params = c.g.params().len();
    assert_eq!(n_params, 2 + 12 * cfg.layers + 2);

    let grads = gradcheck_with(&c, Some(8));

    // The padded rows of wte (>= vocab) never receive a gradient, exactly.
    let wte = &grads["wte"];
    assert_eq!(wte.shape, vec![16, 8]);
    let pad = &wte.data[cfg.vocab * 8..];
    assert!(pad.iter().all(|v| *v == 0.0), "padded wte rows got gradient: {pad:?}");
    // The real rows do get one.
    assert!(wte.data[..cfg.vocab * 8].iter().any(|v| *v != 0.0));

    // Also check every padded-row element and a full row of real vocabulary against finite
    // differences, and every entry of the smallest tensors of the last block.
    let mut feeds = c.feeds.clone();
    let mut failures = vec![];
    let mut idx: Vec<(&str, usize)> = (cfg.vocab * 8..16 * 8).step_by(5).map(|i| ("wte", i)).collect();
    idx.extend((0..8).map(|i| ("wte", 3 * 8 + i)));
    idx.extend((0..8).map(|i| ("lnfw", i)));
    idx.extend((0..8).map(|i| ("ln2b.1", i)));
    for (p, i) in idx {
        let num = fd(&c.g, &c.b, &mut feeds, p, i);
        let a = grads[p].data[i];
        if !close(a, num, ATOL, RTOL) {
            failures.push(format!("  grad.{p}[{i}]: analytic {a:e}, finite difference {num:e}"));
        }
    }
    assert!(failures.is_empty(), "tiny GPT-2 gradient check failed:\n{}", failures.join("\n"));
}
