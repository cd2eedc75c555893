//! The `optimizer` pass: AdamW updates (PyTorch / llm.c formula) checked in the interpreter
//! (F64) against the formula computed here from the gradients of the `autodiff` graph, with and
//! without weight decay and global-norm clipping; and the runtime scalars (`lr`, `bc1`, `bc2`,
//! `grad_clip`) never change the graph.

use std::collections::HashMap;

use fusec_ir::interp::{self, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::{BinaryOp, Bindings, DType, Graph, Op, ReduceOp, Shape, Type, UnaryOp};
use fusec_passes::autodiff::{autodiff, grad_name, DLOSS};
use fusec_passes::optimizer::{optimizer, state_names, AdamWConfig};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};

const PARAMS: [(&str, &[u64]); 2] = [("w1", &[2, 3]), ("b1", &[3])];

/// `loss = sum(tanh(x @ w1 + b1) * lw)` with inputs `x: [4, 2]`, `lw: [4, 3]` and parameters
/// `w1: [2, 3]`, `b1: [3]`.
fn forward() -> Graph {
    let mut g = Graph::new("two_params", &[]);
    let f32t = |d: &[u64]| Type::new(DType::F32, Shape::lits(d));
    let w1 = g.add1(Op::Param { name: "w1".into(), ty: f32t(&[2, 3]) }, &[]);
    let b1 = g.add1(Op::Param { name: "b1".into(), ty: f32t(&[3]) }, &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32t(&[4, 2]) }, &[]);
    let lw = g.add1(Op::Input { name: "lw".into(), ty: f32t(&[4, 3]) }, &[]);
    let h = g.add1(Op::MatMul { trans_a: false, trans_b: false }, &[x, w1]);
    let bb = g.add1(Op::Broadcast { dims: vec![1], shape: Shape::lits(&[4, 3]) }, &[b1]);
    let h = g.add1(Op::Binary(BinaryOp::Add), &[h, bb]);
    let y = g.add1(Op::Unary(UnaryOp::Tanh), &[h]);
    let yw = g.add1(Op::Binary(BinaryOp::Mul), &[y, lw]);
    let loss = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1] }, &[yw]);
    g.output("loss", loss);
    g
}

fn tensor(rng: &mut Rng, shape: &[u64], f: impl Fn(&mut Rng) -> f64) -> Tensor {
    let s: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let n = s.iter().product();
    Tensor::new(DType::F32, s, (0..n).map(|_| f(rng)).collect())
}

fn scalar(v: f64) -> Tensor {
    Tensor::scalar(DType::F32, v)
}

/// Feeds of the autodiff graph: params, inputs, `dloss` and random nonzero accumulators.
fn ad_feeds(seed: u64) -> HashMap<String, Tensor> {
    let mut rng = Rng::new(seed);
    let mut f = HashMap::new();
    for (p, s) in PARAMS {
        f.insert(p.to_string(), tensor(&mut rng, s, |r| r.normal()));
        f.insert(grad_name(p), tensor(&mut rng, s, |r| 0.5 * r.normal()));
    }
    f.insert("x".into(), tensor(&mut rng, &[4, 2], |r| r.normal()));
    f.insert("lw".into(), tensor(&mut rng, &[4, 3], |r| r.normal()));
    f.insert(DLOSS.into(), scalar(0.75));
    f
}

fn run_named(g: &Graph, feeds: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let outs = interp::run(g, &Bindings::default(), feeds, Rounding::F64).unwrap_or_else(|e| panic!("`{}` failed: {e}", g.name));
    g.outputs.iter().map(|(n, _)| n.clone()).zip(outs).collect()
}

/// The runtime scalars of one step.
#[derive(Clone, Copy, Debug)]
struct Step {
    lr: f64,
    t: i32,
    /// `grad_clip` as a multiple of the actual global norm (only with `clip`).
    clip_factor: f64,
}

/// Runs one optimizer step and checks every output against the formula; returns the outputs.
fn check_step(cfg: &AdamWConfig, step: Step, seed: u64) -> HashMap<String, Tensor> {
    let fwd = forward();
    let ad = autodiff(&fwd).unwrap();
    let opt = optimizer(&ad, cfg).unwrap();

    // Output names and order.
    let mut want = vec!["loss".to_string()];
    for (p, _) in PARAMS {
        let [m, v] = state_names(p);
        want.extend([p.to_string(), m, v]);
    }
    if cfg.clip {
        want.push("grad_norm".into());
    }
    let have: Vec<String> = opt.outputs.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(have, want);
    // One AdamW node per parameter, with the configured constants.
    let adamw: Vec<&Op> = opt.nodes.iter().map(|n| &n.op).filter(|op| matches!(op, Op::AdamW { .. })).collect();
    assert_eq!(adamw.len(), PARAMS.len());
    for op in adamw {
        assert_eq!(*op, Op::AdamW { beta1: cfg.beta1, beta2: cfg.beta2, eps: cfg.eps, weight_decay: cfg.weight_decay });
    }

    // The gradients, from the autodiff graph alone (accumulator + dloss * dP).
    let mut feeds = ad_feeds(seed);
    let ad_out = run_named(&ad, &feeds);
    let grads: Vec<Vec<f64>> = PARAMS.iter().map(|(p, _)| ad_out[&grad_name(p)].data.clone()).collect();
    let norm = grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
    assert!(norm > 0.1, "the test needs nonzero gradients");

    let (b1, b2) = (cfg.beta1, cfg.beta2);
    let bc1 = 1.0 - b1.powi(step.t);
    let bc2 = 1.0 - b2.powi(step.t);
    let mut rng = Rng::new(seed ^ 0x0f7);
    for (p, s) in PARAMS {
        let [m, v] = state_names(p);
        feeds.insert(m, tensor(&mut rng, s, |r| 0.1 * r.normal()));
        feeds.insert(v, tensor(&mut rng, s, |r| 0.01 * r.normal().powi(2)));
    }
    feeds.insert("lr".into(), scalar(step.lr));
    feeds.insert("bc1".into(), scalar(bc1));
    feeds.insert("bc2".into(), scalar(bc2));
    let clip = step.clip_factor * norm;
    if cfg.clip {
        feeds.insert("grad_clip".into(), scalar(clip));
    }
    let out = run_named(&opt, &feeds);

    assert_eq!(out["loss"].data, ad_out["loss"].data, "loss");
    let scale = if cfg.clip { (clip / (norm + 1e-6)).min(1.0) } else { 1.0 };
    if cfg.clip {
        let got = out["grad_norm"].data[0];
        assert!((got - norm).abs() <= 1e-12 * norm, "grad_norm is {got}, the global L2 norm is {norm}");
        assert_eq!(out["grad_norm"].shape, Vec::<usize>::new());
    }

    // PyTorch's AdamW, written independently: decoupled decay first, then the Adam step with
    // step_size = lr / bc1 and denominator sqrt(v) / sqrt(bc2) + eps.
    for ((p, _), g) in PARAMS.iter().zip(&grads) {
        let [mn, vn] = state_names(p);
        let (p0, m0, v0) = (&feeds[*p].data, &feeds[&mn].data, &feeds[&vn].data);
        for i in 0..g.len() {
            let gi = g[i] * scale;
            let m1 = b1 * m0[i] + (1.0 - b1) * gi;
            let v1 = b2 * v0[i] + (1.0 - b2) * gi * gi;
            let decayed = p0[i] * (1.0 - step.lr * cfg.weight_decay);
            let denom = v1.sqrt() / bc2.sqrt() + cfg.eps;
            let p1 = decayed - (step.lr / bc1) * m1 / denom;
            for (what, got, want) in
                [(p.to_string(), out[*p].data[i], p1), (mn.clone(), out[&mn].data[i], m1), (vn.clone(), out[&vn].data[i], v1)]
            {
                assert!(
                    (got - want).abs() <= 1e-13 + 1e-11 * want.abs(),
                    "{what}[{i}] is {got}, expected {want} (cfg {cfg:?}, step {step:?}, clip scale {scale})"
                );
            }
        }
    }
    out
}

#[test]
fn adamw_without_weight_decay() {
    let cfg = AdamWConfig::default();
    assert_eq!(cfg.weight_decay, 0.0);
    check_step(&cfg, Step { lr: 1e-3, t: 1, clip_factor: 0.0 }, 1);
    check_step(&cfg, Step { lr: 3e-2, t: 7, clip_factor: 0.0 }, 2);
}

#[test]
fn adamw_with_weight_decay() {
    let cfg = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
    check_step(&cfg, Step { lr: 1e-3, t: 1, clip_factor: 0.0 }, 3);
    check_step(&cfg, Step { lr: 5e-2, t: 12, clip_factor: 0.0 }, 4);
}

#[test]
fn adamw_with_other_constants() {
    // Distinct betas and a large eps, so that swapping or dropping one shows.
    let cfg = AdamWConfig { beta1: 0.8, beta2: 0.95, eps: 1e-3, weight_decay: 0.1, clip: false, fresh_grads: false, shard: None };
    check_step(&cfg, Step { lr: 2e-2, t: 3, clip_factor: 0.0 }, 5);
}

#[test]
fn clipping_active() {
    for wd in [0.0, 0.1] {
        let cfg = AdamWConfig { weight_decay: wd, clip: true, ..AdamWConfig::default() };
        // grad_clip = 0.3 * norm: gradients are scaled by about 0.3.
        let clipped = check_step(&cfg, Step { lr: 1e-2, t: 2, clip_factor: 0.3 }, 6);
        // The same step without clipping gives a different first moment.
        let plain = check_step(&AdamWConfig { clip: false, ..cfg.clone() }, Step { lr: 1e-2, t: 2, clip_factor: 0.0 }, 6);
        assert_ne!(clipped["m.w1"].data, plain["m.w1"].data, "clipping changed nothing");
    }
}

#[test]
fn clipping_inactive() {
    for wd in [0.0, 0.1] {
        let cfg = AdamWConfig { weight_decay: wd, clip: true, ..AdamWConfig::default() };
        // grad_clip = 5 * norm: scale = min(1, ...) = 1, identical to the unclipped update.
        let clipped = check_step(&cfg, Step { lr: 1e-2, t: 4, clip_factor: 5.0 }, 7);
        let plain = check_step(&AdamWConfig { clip: false, ..cfg.clone() }, Step { lr: 1e-2, t: 4, clip_factor: 0.0 }, 7);
        for name in ["w1", "m.w1", "v.w1", "b1", "m.b1", "v.b1"] {
            assert_eq!(clipped[name].data, plain[name].data, "{name}: an inactive clip changed the update");
        }
    }
}

#[test]
fn runtime_scalars_never_change_the_graph() {
    let fwd = forward();
    for clip in [false, true] {
        let cfg = AdamWConfig { weight_decay: 0.1, clip, ..AdamWConfig::default() };
        let ad = autodiff(&fwd).unwrap();
        let text = fusec_ir::text::print(&optimizer(&ad, &cfg).unwrap());
        // The same graph through the pipeline.
        let opts = PipelineOptions { adamw: cfg.clone(), no_fusion: true, ..PipelineOptions::default() };
        let piped = compile(&fwd, "optimizer", Mode::Step, &opts, &fusec_ir::Bindings::default()).unwrap().graph;
        assert_eq!(fusec_ir::text::print(&piped), text);
        // Scalars are f32[] inputs of the graph.
        let opt = optimizer(&ad, &cfg).unwrap();
        let inputs: HashMap<&str, _> = opt.inputs().into_iter().collect();
        let mut names = vec!["lr", "bc1", "bc2"];
        if clip {
            names.push("grad_clip");
        } else {
            assert!(!inputs.contains_key("grad_clip"));
        }
        for n in names {
            let v = inputs.get(n).unwrap_or_else(|| panic!("no input `{n}`"));
            assert_eq!(*opt.ty(*v), Type::scalar(DType::F32), "type of `{n}`");
        }
        // Different schedules run on this one graph (rebuilt each time, always the same text)
        // and each gives the formula's result.
        let mut results = vec![];
        for (k, step) in [
            Step { lr: 1e-3, t: 1, clip_factor: 0.5 },
            Step { lr: 6e-4, t: 100, clip_factor: 2.0 },
            Step { lr: 1.0, t: 3, clip_factor: 0.01 },
        ]
        .into_iter()
        .enumerate()
        {
            let again = fusec_ir::text::print(&optimizer(&autodiff(&fwd).unwrap(), &cfg).unwrap());
            assert_eq!(again, text, "the graph changed for step {k}");
            results.push(check_step(&cfg, step, 9)["w1"].data.clone());
        }
        assert_ne!(results[0], results[1]);
        assert_ne!(results[1], results[2]);
    }
}

#[test]
fn optimizer_needs_autodiff() {
    let e = optimizer(&forward(), &AdamWConfig::default()).unwrap_err();
    assert!(e.contains("grad.w1"), "{e}");
}

#[test]
fn repeated_steps_reduce_the_loss() {
    // Outputs named like parameters and state are written back: feed them to the next step.
    let fwd = forward();
    let cfg = AdamWConfig { weight_decay: 0.01, clip: true, ..AdamWConfig::default() };
    let opt = optimizer(&autodiff(&fwd).unwrap(), &cfg).unwrap();
    let mut feeds = ad_feeds(11);
    feeds.insert(DLOSS.into(), scalar(1.0));
    for (p, s) in PARAMS {
        let sh: Vec<usize> = s.iter().map(|&d| d as usize).collect();
        let [m, v] = state_names(p);
        feeds.insert(m, Tensor::zeros(DType::F32, sh.clone()));
        feeds.insert(v, Tensor::zeros(DType::F32, sh));
    }
    feeds.insert("lr".into(), scalar(0.05));
    feeds.insert("grad_clip".into(), scalar(1.0));
    let mut losses = vec![];
    for t in 1..=20 {
        for (p, s) in PARAMS {
            let sh: Vec<usize> = s.iter().map(|&d| d as usize).collect();
            feeds.insert(grad_name(p), Tensor::zeros(DType::F32, sh));
        }
        feeds.insert("bc1".into(), scalar(1.0 - cfg.beta1.powi(t)));
        feeds.insert("bc2".into(), scalar(1.0 - cfg.beta2.powi(t)));
        let out = run_named(&opt, &feeds);
        losses.push(out["loss"].data[0]);
        for (name, t) in out {
            if feeds.contains_key(&name) {
                feeds.insert(name, t);
            }
        }
    }
    assert!(losses[19] < losses[0] - 0.5, "loss did not go down: {losses:?}");
}

/// The GPT-2 `tiny` preset's forward graph, bound to B = 2, T = 8.
fn tiny_gpt2() -> (fusec_models::Gpt2Config, Graph, Bindings) {
    let cfg = fusec_models::Gpt2Config::preset("tiny").unwrap();
    let fwd = fusec_models::build_gpt2(&cfg, "tiny");
    let mut bind = Bindings::default();
    bind.set("B", 2).set("T", 8);
    (cfg, fwd, bind)
}

#[test]
fn fresh_gradients_equal_accumulation_from_zero_without_accumulator_inputs() {
    // `fresh_grads` drops the `grad.P` accumulators: its step must equal the accumulating step
    // fed zero accumulators, on the GPT-2 tiny model through the whole pipeline (fused), with and
    // without clipping (which reads every gradient).
    let (_, fwd, bind) = tiny_gpt2();
    for clip in [false, true] {
        let acc = PipelineOptions { adamw: AdamWConfig { clip, ..AdamWConfig::default() }, ..PipelineOptions::default() };
        let fresh = PipelineOptions { adamw: AdamWConfig { fresh_grads: true, ..acc.adamw.clone() }, ..acc.clone() };
        let a = compile(&fwd, "fuse", Mode::Step, &acc, &bind).unwrap().graph;
        let f = compile(&fwd, "fuse", Mode::Step, &fresh, &bind).unwrap().graph;
        assert!(f.inputs().iter().all(|(n, _)| !n.starts_with("grad.")), "no accumulators");
        assert!(a.inputs().iter().any(|(n, _)| n.starts_with("grad.")));
        let mut feeds = fusec_ir::testkit::random_feeds(&a, &bind, &mut Rng::new(3), 250).unwrap();
        for (name, t) in feeds.iter_mut() {
            match name.as_str() {
                n if n.starts_with("grad.") => t.data.iter_mut().for_each(|x| *x = 0.0),
                n if n.starts_with("v.") => t.data.iter_mut().for_each(|x| *x = x.abs()),
                "bc1" | "bc2" => t.data[0] = 0.5,
                "grad_clip" => t.data[0] = 0.1,
                _ => {}
            }
        }
        let (ra, rf) = (interp::run(&a, &bind, &feeds, Rounding::F32).unwrap(), interp::run(&f, &bind, &feeds, Rounding::F32).unwrap());
        for (((name, _), x), y) in a.outputs.iter().zip(&ra).zip(&rf) {
            assert_eq!(x.data, y.data, "output {name} (clip {clip})");
        }
        // In bf16 (both residual policies), fresh weight gradients stay f32: every add or scale
        // on the way to an update is f32 (a bf16 product is widened right after it).
        for precision in [fusec_passes::amp::Precision::Bf16, fusec_passes::amp::Precision::Bf16Residual] {
            let bf16 = PipelineOptions { precision, ..fresh.clone() };
            let m = compile(&fwd, "amp", Mode::Step, &bf16, &bind).unwrap().graph;
            let mut stack: Vec<_> = m.nodes.iter().filter(|n| matches!(n.op, Op::AdamW { .. })).map(|n| n.inputs[1]).collect();
            while let Some(v) = stack.pop() {
                let p = m.producer(v);
                match p.op {
                    Op::Binary(_) | Op::Reshape { .. } | Op::Broadcast { .. } => {
                        assert_eq!(m.ty(v).dtype, DType::F32, "{precision:?}: a gradient computed in bf16 (clip {clip})");
                        stack.extend(p.inputs.iter().copied());
                    }
                    Op::Cast { .. } => stack.extend(p.inputs.iter().copied()),
                    _ => {}
                }
            }
        }
    }
}

#[test]
fn bf16_residual_stores_fresh_weight_gradients_in_bf16_as_llmc_does() {
    // Under `bf16+residual`, a fresh weight gradient that only its update reads is the product's
    // bf16 result (widened inside the update); a gradient with another contribution (the tied
    // `wte`: the classifier's product plus the embedding's scatter), an accumulated one, a
    // clipped one, or any gradient under `bf16` stays an f32 product.
    let (cfg, fwd, bind) = tiny_gpt2();
    let gradient_gemms = |precision, fresh_grads, clip| {
        let adamw = AdamWConfig { fresh_grads, clip, ..AdamWConfig::default() };
        let opts = PipelineOptions { precision, adamw, ..PipelineOptions::default() };
        let g = compile(&fwd, "amp", Mode::Step, &opts, &bind).unwrap().graph;
        let mut dtypes: Vec<(String, DType)> = vec![];
        for n in g.nodes.iter().filter(|n| matches!(n.op, Op::AdamW { .. })) {
            let Op::Param { name, .. } = &g.producer(n.inputs[0]).op else { continue };
            let mut v = n.inputs[1];
            while matches!(g.producer(v).op, Op::Cast { .. } | Op::Reshape { .. }) {
                v = g.producer(v).inputs[0];
            }
            if let Op::Gemm(gm) = &g.producer(v).op {
                dtypes.push((name.clone(), gm.out));
            }
        }
        dtypes
    };
    use fusec_passes::amp::Precision::{Bf16, Bf16Residual};
    let fresh = gradient_gemms(Bf16Residual, true, false);
    assert_eq!(fresh.len(), 4 * cfg.layers, "one weight-gradient product a layer matrix: {fresh:?}");
    assert!(fresh.iter().all(|(_, d)| *d == DType::BF16), "{fresh:?}");
    for (precision, fresh_grads, clip) in [(Bf16, true, false), (Bf16Residual, false, false), (Bf16Residual, true, true)] {
        let got = gradient_gemms(precision, fresh_grads, clip);
        assert!(got.iter().all(|(_, d)| *d == DType::F32), "{precision:?} fresh {fresh_grads} clip {clip}: {got:?}");
    }
    // The tied embedding's gradient is a sum, so its product stays f32 and is not in the list.
    assert!(!fresh.iter().any(|(n, _)| n == "wte"));
}
