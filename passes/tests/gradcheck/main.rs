//! Gradient checks of every backward rule of `autodiff` against central finite differences,
//! both computed with the reference interpreter in `Rounding::F64`.
//!
//! Each case builds a small forward graph: the differentiable operands are `Param`s, the op's
//! result is reduced to the scalar `loss = reduce_sum(result * loss_weights)`, where
//! `loss_weights` is an `Input` fed with random values (so the loss is a random linear functional of the result). The analytic
//! gradient (`dloss = 1`, `grad.P = 0`) must match `(L(p+h) - L(p-h)) / 2h` for every element of
//! every parameter, and a second run with `dloss = 0.5` and random `grad.P` must output
//! `grad.P + 0.5 * analytic` (accumulation).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use fusec_ir::interp::{self, concrete_shape, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::{BinaryOp, Bindings, CmpOp, DType, Dim, Graph, Op, ReduceOp, Shape, Type, UnaryOp, ValueId};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::autodiff::{autodiff, grad_name, DLOSS};

/// Finite-difference step.
const H: f64 = 1e-6;
/// `|analytic - fd| <= ATOL + RTOL * |fd|` (NaN never passes).
const ATOL: f64 = 1e-6;
const RTOL: f64 = 1e-5;

fn lit(n: u64) -> Dim {
    Dim::lit(n)
}
fn sym(s: &str) -> Dim {
    Dim::sym(s)
}
fn shp(d: &[Dim]) -> Shape {
    Shape::from(d.to_vec())
}
fn ls(d: &[u64]) -> Shape {
    Shape::lits(d)
}

/// How a parameter's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Init {
    /// `std * N(0, 1)`.
    Normal(f64),
    /// Uniform in `[0.5, 2]` (log, sqrt, rsqrt, recip, divisors).
    Pos,
    /// Distinct values at least 0.3 apart in random order (no ties, for maxima).
    Distinct,
}

/// A forward graph under construction, with its bindings and feeds.
struct Case {
    g: Graph,
    b: Bindings,
    feeds: HashMap<String, Tensor>,
    rng: Rng,
}

impl Case {
    /// A graph with symbols `B = 2`, `T = 3`.
    fn new(name: &str, seed: u64) -> Case {
        let mut b = Bindings::default();
        b.set("B", 2).set("T", 3);
        Case { g: Graph::new(name, &["B", "T"]), b, feeds: HashMap::new(), rng: Rng::new(seed) }
    }

    fn numel(&self, shape: &Shape) -> (Vec<usize>, usize) {
        let s = concrete_shape(&Type::new(DType::F32, shape.clone()), &self.b).expect("bound shape");
        let n = s.iter().product();
        (s, n)
    }

    fn draw(&mut self, n: usize, init: Init) -> Vec<f64> {
        match init {
            Init::Normal(std) => (0..n).map(|_| std * self.rng.normal()).collect(),
            Init::Pos => (0..n).map(|_| self.rng.range(0.5, 2.0)).collect(),
            Init::Distinct => {
                let mut v: Vec<f64> = (0..n).map(|i| 0.3 * i as f64 - 0.15 * n as f64 + 0.05 * self.rng.uniform()).collect();
                for i in (1..n).rev() {
                    let j = self.rng.below(i as u64 + 1) as usize;
                    v.swap(i, j);
                }
                v
            }
        }
    }

    fn param_data(&mut self, name: &str, shape: Shape, data: Vec<f64>) -> ValueId {
        let (s, n) = self.numel(&shape);
        assert_eq!(n, data.len());
        self.feeds.insert(name.to_string(), Tensor::new(DType::F32, s, data));
        self.g.add1(Op::Param { name: name.to_string(), ty: Type::new(DType::F32, shape) }, &[])
    }

    fn param(&mut self, name: &str, shape: Shape, init: Init) -> ValueId {
        let (_, n) = self.numel(&shape);
        let data = self.draw(n, init);
        self.param_data(name, shape, data)
    }

    /// An i32 input with the given values.
    fn ints(&mut self, name: &str, shape: Shape, data: &[i32]) -> ValueId {
        let (s, n) = self.numel(&shape);
        assert_eq!(n, data.len());
        self.feeds.insert(name.to_string(), Tensor::from_i32(s, data));
        self.g.add1(Op::Input { name: name.to_string(), ty: Type::new(DType::I32, shape) }, &[])
    }

    /// An i32 input with random values in `0..hi`.
    fn rand_ints(&mut self, name: &str, shape: Shape, hi: u64) -> ValueId {
        let (_, n) = self.numel(&shape);
        let data: Vec<i32> = (0..n).map(|_| self.rng.below(hi) as i32).collect();
        self.ints(name, shape, &data)
    }

    fn op(&mut self, op: Op, ins: &[ValueId]) -> ValueId {
        self.g.add1(op, ins)
    }

    fn ops(&mut self, op: Op, ins: &[ValueId]) -> Vec<ValueId> {
        self.g.add(op, ins).to_vec()
    }

    fn bin(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        self.op(Op::Binary(op), &[a, b])
    }

    /// Adds `loss = reduce_sum(y * loss_weights)` (a random linear functional of `y`).
    fn finish(mut self, y: ValueId) -> Case {
        let ty = self.g.ty(y).clone();
        assert_eq!(ty.dtype, DType::F32);
        let (s, n) = self.numel(&ty.shape);
        let data = self.draw(n, Init::Normal(1.0));
        self.feeds.insert("loss_weights".into(), Tensor::new(DType::F32, s, data));
        let w = self.g.add1(Op::Input { name: "loss_weights".into(), ty: ty.clone() }, &[]);
        let yw = self.bin(BinaryOp::Mul, y, w);
        let loss =
            if ty.shape.rank() == 0 { yw } else { self.op(Op::Reduce { op: ReduceOp::Sum, axes: (0..ty.shape.rank()).collect() }, &[yw]) };
        self.g.output("loss", loss);
        self
    }
}

/// Runs `g` and returns its outputs by name.
fn run_named(g: &Graph, b: &Bindings, feeds: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let outs = interp::run(g, b, feeds, Rounding::F64).unwrap_or_else(|e| panic!("graph `{}` failed to run: {e}", g.name));
    g.outputs.iter().map(|(n, _)| n.clone()).zip(outs).collect()
}

fn loss_of(g: &Graph, b: &Bindings, feeds: &HashMap<String, Tensor>) -> f64 {
    let l = &run_named(g, b, feeds)["loss"];
    assert!(l.shape.is_empty());
    l.data[0]
}

/// Central difference of the loss in element `i` of parameter `p`.
fn fd(g: &Graph, b: &Bindings, feeds: &mut HashMap<String, Tensor>, p: &str, i: usize) -> f64 {
    let x0 = feeds[p].data[i];
    feeds.get_mut(p).unwrap().data[i] = x0 + H;
    let lp = loss_of(g, b, feeds);
    feeds.get_mut(p).unwrap().data[i] = x0 - H;
    let lm = loss_of(g, b, feeds);
    feeds.get_mut(p).unwrap().data[i] = x0;
    (lp - lm) / (2.0 * H)
}

fn close(a: f64, r: f64, atol: f64, rtol: f64) -> bool {
    // Written so that NaN (in either) fails.
    (a - r).abs() <= atol + rtol * r.abs()
}

/// The autodiff graph of `c.g`, checked for its interface: inputs `dloss` and `grad.P`, outputs
/// `loss` then `grad.P` in parameter order.
fn differentiate(c: &Case) -> Graph {
    let ad = autodiff(&c.g).unwrap_or_else(|e| panic!("autodiff of `{}` failed: {e}", c.g.name));
    let params: Vec<String> = c.g.params().iter().map(|(n, _)| n.to_string()).collect();
    let mut want = vec!["loss".to_string()];
    want.extend(params.iter().map(|p| grad_name(p)));
    let have: Vec<String> = ad.outputs.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(have, want, "outputs of the autodiff graph of `{}`", c.g.name);
    let inputs: HashMap<&str, ValueId> = ad.inputs().into_iter().collect();
    assert_eq!(*ad.ty(inputs[DLOSS]), Type::scalar(DType::F32), "dloss type");
    for (p, v) in c.g.params() {
        let gi = inputs.get(grad_name(p).as_str()).unwrap_or_else(|| panic!("no input {}", grad_name(p)));
        assert_eq!(ad.ty(*gi), c.g.ty(v), "type of {}", grad_name(p));
    }
    ad
}

/// The autodiff graph's feeds: the forward feeds, `dloss` and `grad.P` for every parameter.
fn ad_feeds(c: &Case, dloss: f64, grads: &HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let mut f = c.feeds.clone();
    f.insert(DLOSS.into(), Tensor::scalar(DType::F32, dloss));
    for (p, _) in c.g.params() {
        f.insert(grad_name(p), grads[p].clone());
    }
    f
}

/// Runs the autodiff graph with `dloss = 1` and zero accumulators: the analytic gradients by
/// parameter name (also checks `loss` against the forward graph and the accumulation form).
fn analytic(c: &Case, ad: &Graph) -> HashMap<String, Tensor> {
    let zeros: HashMap<String, Tensor> =
        c.g.params().iter().map(|(p, _)| (p.to_string(), Tensor::zeros(c.feeds[*p].dtype, c.feeds[*p].shape.clone()))).collect();
    let outs = run_named(ad, &c.b, &ad_feeds(c, 1.0, &zeros));
    let l_fwd = loss_of(&c.g, &c.b, &c.feeds);
    assert_eq!(outs["loss"].data[0], l_fwd, "`{}`: loss of the autodiff graph differs from the forward loss", c.g.name);
    let grads: HashMap<String, Tensor> = c.g.params().iter().map(|(p, _)| (p.to_string(), outs[&grad_name(p)].clone())).collect();

    // Accumulation: grad.P' = grad.P + dloss * dP with dloss = 0.5 and random grad.P.
    let mut rng = Rng::new(0xacc);
    let acc_in: HashMap<String, Tensor> =
        c.g.params()
            .iter()
            .map(|(p, _)| {
                let t = &c.feeds[*p];
                (p.to_string(), Tensor::new(t.dtype, t.shape.clone(), (0..t.numel()).map(|_| rng.normal()).collect()))
            })
            .collect();
    let outs2 = run_named(ad, &c.b, &ad_feeds(c, 0.5, &acc_in));
    for (p, _) in c.g.params() {
        let got = &outs2[&grad_name(p)];
        for i in 0..got.numel() {
            let want = acc_in[p].data[i] + 0.5 * grads[p].data[i];
            assert!(
                close(got.data[i], want, 1e-12, 1e-12),
                "`{}`: accumulated {}[{i}] is {} but grad_in + 0.5 * dP is {want}",
                c.g.name,
                grad_name(p),
                got.data[i]
            );
        }
    }
    grads
}

/// Checks the listed elements of every parameter (all elements when `sample` is `None`).
fn gradcheck_with(c: &Case, sample: Option<usize>) -> HashMap<String, Tensor> {
    let ad = differentiate(c);
    let grads = analytic(c, &ad);
    let mut feeds = c.feeds.clone();
    let mut rng = Rng::new(0x5eed);
    let mut failures = vec![];
    let mut checked = 0;
    let mut worst = 0.0f64;
    for (p, _) in c.g.params() {
        let n = c.feeds[p].numel();
        let idx: Vec<usize> = match sample {
            None => (0..n).collect(),
            Some(k) if k >= n => (0..n).collect(),
            Some(k) => {
                let mut all: Vec<usize> = (0..n).collect();
                for i in 0..k {
                    let j = i + rng.below((n - i) as u64) as usize;
                    all.swap(i, j);
                }
                all.truncate(k);
                all
            }
        };
        for i in idx {
            let num = fd(&c.g, &c.b, &mut feeds, p, i);
            let a = grads[p].data[i];
            checked += 1;
            worst = worst.max((a - num).abs() / (ATOL + RTOL * num.abs()));
            if !close(a, num, ATOL, RTOL) || !num.is_finite() {
                failures.push(format!("  {}[{i}]: analytic {a:e}, finite difference {num:e}", grad_name(p)));
            }
        }
    }
    assert!(checked > 0, "`{}` has nothing to check", c.g.name);
    eprintln!("{}: {checked} elements checked, worst error {worst:.3} of the tolerance", c.g.name);
    assert!(failures.is_empty(), "gradient check of `{}` failed:\n{}", c.g.name, failures.join("\n"));
    grads
}

fn gradcheck(c: &Case) -> HashMap<String, Tensor> {
    gradcheck_with(c, None)
}

mod composites;
mod contractions;
mod elementwise;
mod layout;
