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

// ---- elementwise ---------------------------------------------------------------------------

#[test]
fn unary_ops() {
    for (k, u) in Op::UNARY.into_iter().enumerate() {
        let init = match u {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => Init::Pos,
            _ => Init::Normal(1.0),
        };
        let mut c = Case::new(&format!("unary_{u:?}"), 100 + k as u64);
        let x = c.param("x", ls(&[2, 3]), init);
        let y = c.op(Op::Unary(u), &[x]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn unary_on_negative_inputs() {
    // recip on negative values (away from zero).
    let mut c = Case::new("recip_neg", 7);
    let data: Vec<f64> = (0..6).map(|i| if i % 2 == 0 { -0.5 - 0.25 * i as f64 } else { 0.7 + 0.1 * i as f64 }).collect();
    let x = c.param_data("x", ls(&[6]), data);
    let y = c.op(Op::Unary(UnaryOp::Recip), &[x]);
    gradcheck(&c.finish(y));
}

#[test]
fn binary_ops() {
    for (k, op) in Op::BINARY.into_iter().enumerate() {
        let mut c = Case::new(&format!("binary_{op:?}"), 200 + k as u64);
        let a = c.param("a", ls(&[3, 4]), Init::Normal(1.0));
        let b = match op {
            BinaryOp::Div => {
                // Divisors of both signs, |b| in [0.5, 2].
                let data: Vec<f64> = (0..12).map(|i| if i % 3 == 0 { -c.rng.range(0.5, 2.0) } else { c.rng.range(0.5, 2.0) }).collect();
                c.param_data("b", ls(&[3, 4]), data)
            }
            BinaryOp::Max | BinaryOp::Min => {
                // b = a +- [0.1, 1]: no ties, and each side wins somewhere.
                let a0 = c.feeds["a"].data.clone();
                let data: Vec<f64> =
                    a0.iter().enumerate().map(|(i, &x)| x + if i % 2 == 0 { 1.0 } else { -1.0 } * c.rng.range(0.1, 1.0)).collect();
                c.param_data("b", ls(&[3, 4]), data)
            }
            _ => c.param("b", ls(&[3, 4]), Init::Normal(1.0)),
        };
        let y = c.bin(op, a, b);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn binary_ops_with_one_operand_an_input() {
    // Only one side needs a gradient; the other is a per-step input.
    for (k, op) in Op::BINARY.into_iter().enumerate() {
        for param_first in [true, false] {
            let mut c = Case::new(&format!("binary_half_{op:?}_{param_first}"), 300 + k as u64);
            let p = c.param("p", ls(&[5]), Init::Pos);
            let data: Vec<f64> = (0..5).map(|i| 0.3 * i as f64 + 0.55 + if i % 2 == 0 { 2.0 } else { 0.0 }).collect();
            c.feeds.insert("x".into(), Tensor::new(DType::F32, vec![5], data));
            let x = c.g.add1(Op::Input { name: "x".into(), ty: Type::new(DType::F32, ls(&[5])) }, &[]);
            let y = if param_first { c.bin(op, p, x) } else { c.bin(op, x, p) };
            gradcheck(&c.finish(y));
        }
    }
}

#[test]
fn same_operand_twice() {
    // x * x, x / x, x - x, max(x, x) style uses: both contributions reach the accumulator.
    for op in [BinaryOp::Mul, BinaryOp::Add, BinaryOp::Sub, BinaryOp::Div] {
        let mut c = Case::new(&format!("twice_{op:?}"), 11);
        let x = c.param("x", ls(&[2, 3]), Init::Pos);
        let y = c.bin(op, x, x);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn intermediate_used_many_times() {
    // y = exp(x); z = y * tanh(y) + y / x: adjoints of y and x are sums of several contributions.
    let mut c = Case::new("fanout", 12);
    let x = c.param("x", ls(&[4]), Init::Pos);
    let y = c.op(Op::Unary(UnaryOp::Exp), &[x]);
    let t = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
    let a = c.bin(BinaryOp::Mul, y, t);
    let d = c.bin(BinaryOp::Div, y, x);
    let z = c.bin(BinaryOp::Add, a, d);
    gradcheck(&c.finish(z));
}

#[test]
fn select() {
    let mut c = Case::new("select", 13);
    let cond = c.ints("cond", ls(&[3, 4]), &[1, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1]);
    let a = c.param("a", ls(&[3, 4]), Init::Normal(1.0));
    let b = c.param("b", ls(&[3, 4]), Init::Normal(1.0));
    let y = c.op(Op::Select, &[cond, a, b]);
    gradcheck(&c.finish(y));
}

#[test]
fn select_with_condition_computed_from_a_param() {
    // cond = x > 0 depends on a parameter but has no gradient (i32); x still gets its
    // gradient through the selected branch.
    let mut c = Case::new("select_cmp", 14);
    let data = vec![0.7, -0.4, 1.2, -1.5, 0.3, -0.9];
    let x = c.param_data("x", ls(&[6]), data);
    let zero = c.op(Op::Const { value: 0.0, ty: Type::new(DType::F32, ls(&[6])) }, &[]);
    let cond = c.op(Op::Compare(CmpOp::Gt), &[x, zero]);
    let e = c.op(Op::Unary(UnaryOp::Exp), &[x]);
    let n = c.op(Op::Unary(UnaryOp::Neg), &[x]);
    let y = c.op(Op::Select, &[cond, e, n]);
    gradcheck(&c.finish(y));
}

#[test]
fn cast_to_same_dtype() {
    let mut c = Case::new("cast", 15);
    let x = c.param("x", ls(&[2, 3]), Init::Normal(1.0));
    let y = c.op(Op::Cast { to: DType::F32 }, &[x]);
    let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
    gradcheck(&c.finish(z));
}

#[test]
fn cast_round_trip_through_bf16() {
    // F64 mode never rounds floats, so f32 -> bf16 -> f32 is the identity there; the backward
    // casts the adjoint back through each dtype.
    let mut c = Case::new("cast_bf16", 16);
    let x = c.param("x", ls(&[5]), Init::Normal(1.0));
    let y = c.op(Op::Cast { to: DType::BF16 }, &[x]);
    let y = c.op(Op::Unary(UnaryOp::Exp), &[y]);
    let z = c.op(Op::Cast { to: DType::F32 }, &[y]);
    gradcheck(&c.finish(z));
}

#[test]
fn gelu() {
    let mut c = Case::new("gelu", 17);
    let x = c.param("x", ls(&[3, 4]), Init::Normal(1.5));
    let y = c.op(Op::Gelu, &[x]);
    gradcheck(&c.finish(y));
}

// ---- layout --------------------------------------------------------------------------------

#[test]
fn reshape() {
    let cases: Vec<(Shape, Shape)> = vec![
        (ls(&[2, 3, 4]), ls(&[6, 4])),
        (ls(&[4, 6]), ls(&[2, 2, 6])),
        (ls(&[12]), ls(&[3, 1, 4])),
        (ls(&[3, 4]), ls(&[12])),
        // Symbolic dims.
        (shp(&[sym("B"), lit(3), lit(4)]), shp(&[lit(3).mul(&sym("B")), lit(4)])),
        (shp(&[sym("B"), sym("T"), lit(2)]), shp(&[sym("B").mul(&sym("T")), lit(2)])),
        (shp(&[sym("B").mul(&sym("T")), lit(4)]), shp(&[sym("B"), sym("T"), lit(2), lit(2)])),
    ];
    for (k, (from, to)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("reshape_{k}"), 20 + k as u64);
        let x = c.param("x", from, Init::Normal(1.0));
        let y = c.op(Op::Reshape { shape: to }, &[x]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
}

#[test]
fn broadcast() {
    // (operand shape, dims, result shape)
    let cases: Vec<(Shape, Vec<usize>, Shape)> = vec![
        (ls(&[3]), vec![1], ls(&[2, 3])),                        // new leading axis
        (ls(&[3]), vec![0], ls(&[3, 2])),                        // new trailing axis
        (ls(&[3, 1]), vec![0, 1], ls(&[3, 4])),                  // size-1 operand dim
        (ls(&[1, 4]), vec![1, 2], ls(&[2, 3, 4])),               // new axis and size-1 dim
        (ls(&[2, 1, 3]), vec![0, 1, 2], ls(&[2, 5, 3])),         // size-1 in the middle
        (ls(&[1, 1]), vec![0, 2], ls(&[3, 2, 4])),               // all size-1 plus a new axis
        (ls(&[1, 3]), vec![0, 1], ls(&[1, 3, 4])),               // size-1 to size-1 (not reduced)
        (ls(&[2, 3]), vec![0, 1], ls(&[2, 3])),                  // identity
        (ls(&[]), vec![], ls(&[2, 3])),                          // scalar
        (ls(&[4]), vec![2], shp(&[sym("B"), sym("T"), lit(4)])), // symbolic new axes
        (ls(&[1, 4]), vec![0, 1], shp(&[sym("B"), lit(4)])),     // size-1 to symbolic
        (shp(&[sym("B"), lit(1)]), vec![0, 1], shp(&[sym("B"), lit(3)])),
    ];
    for (k, (from, dims, to)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("broadcast_{k}"), 40 + k as u64);
        let x = c.param("x", from, Init::Normal(1.0));
        let y = c.op(Op::Broadcast { dims, shape: to }, &[x]);
        // A nonlinearity after the broadcast so that the adjoint differs per repeated element.
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
}

#[test]
fn permute() {
    let cases: Vec<(Vec<u64>, Vec<usize>)> = vec![
        (vec![2, 3, 4], vec![2, 0, 1]),
        (vec![2, 3, 4], vec![1, 2, 0]),
        (vec![2, 3, 4], vec![0, 2, 1]),
        (vec![3, 4], vec![1, 0]),
        (vec![2, 3, 2, 4], vec![0, 2, 1, 3]),
        (vec![2, 3, 2, 4], vec![3, 1, 0, 2]),
    ];
    for (k, (dims, perm)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("permute_{k}"), 60 + k as u64);
        let x = c.param("x", ls(&dims), Init::Normal(1.0));
        let y = c.op(Op::Permute { perm }, &[x]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn slice() {
    // (shape, axis, start, end)
    let cases: Vec<(Shape, usize, u64, u64)> = vec![
        (ls(&[4, 6]), 1, 0, 2), // start at 0
        (ls(&[4, 6]), 1, 2, 4), // middle
        (ls(&[4, 6]), 1, 4, 6), // end
        (ls(&[4, 6]), 1, 0, 6), // everything
        (ls(&[4, 6]), 0, 1, 3),
        (ls(&[2, 3, 5]), 2, 1, 4),
        (ls(&[5, 2, 3]), 0, 4, 5),
        (shp(&[sym("B"), lit(6)]), 1, 2, 5), // symbolic other dims
    ];
    for (k, (shape, axis, start, end)) in cases.into_iter().enumerate() {
        let mut c = Case::new(&format!("slice_{k}"), 80 + k as u64);
        let x = c.param("x", shape, Init::Normal(1.0));
        let y = c.op(Op::Slice { axis, start, end }, &[x]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn concat() {
    {
        let mut c = Case::new("concat_axis0", 90);
        let a = c.param("a", ls(&[2, 3]), Init::Normal(1.0));
        let b = c.param("b", ls(&[1, 3]), Init::Normal(1.0));
        let d = c.param("d", ls(&[3, 3]), Init::Normal(1.0));
        let y = c.op(Op::Concat { axis: 0 }, &[a, b, d]);
        gradcheck(&c.finish(y));
    }
    {
        let mut c = Case::new("concat_axis1_same_twice", 91);
        let a = c.param("a", ls(&[2, 3]), Init::Normal(1.0));
        let e = c.op(Op::Unary(UnaryOp::Exp), &[a]);
        let y = c.op(Op::Concat { axis: 1 }, &[a, e, a]);
        gradcheck(&c.finish(y));
    }
    {
        let mut c = Case::new("concat_axis2_symbolic", 92);
        let a = c.param("a", shp(&[sym("B"), lit(2), lit(1)]), Init::Normal(1.0));
        let b = c.param("b", shp(&[sym("B"), lit(2), lit(3)]), Init::Normal(1.0));
        let y = c.op(Op::Concat { axis: 2 }, &[a, b]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
    {
        let mut c = Case::new("concat_single", 93);
        let a = c.param("a", ls(&[2, 3]), Init::Normal(1.0));
        let y = c.op(Op::Concat { axis: 1 }, &[a]);
        gradcheck(&c.finish(y));
    }
}

// ---- reductions and contractions -----------------------------------------------------------

#[test]
fn reduce_sum() {
    let axes_list: Vec<Vec<usize>> = vec![vec![0], vec![1], vec![2], vec![0, 2], vec![1, 2], vec![0, 1], vec![0, 1, 2]];
    for (k, axes) in axes_list.into_iter().enumerate() {
        let mut c = Case::new(&format!("reduce_sum_{k}"), 110 + k as u64);
        let x = c.param("x", ls(&[2, 3, 4]), Init::Normal(1.0));
        let y = c.op(Op::Reduce { op: ReduceOp::Sum, axes }, &[x]);
        // A nonlinearity after the reduction so that the adjoint is not a constant.
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
    let mut c = Case::new("reduce_sum_symbolic", 118);
    let x = c.param("x", shp(&[sym("B"), sym("T"), lit(2)]), Init::Normal(1.0));
    let y = c.op(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 2] }, &[x]);
    let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
    gradcheck(&c.finish(z));
}

#[test]
fn reduce_max() {
    let axes_list: Vec<Vec<usize>> = vec![vec![0], vec![1], vec![2], vec![0, 2], vec![0, 1, 2]];
    for (k, axes) in axes_list.into_iter().enumerate() {
        let mut c = Case::new(&format!("reduce_max_{k}"), 130 + k as u64);
        let x = c.param("x", ls(&[2, 3, 4]), Init::Distinct);
        let y = c.op(Op::Reduce { op: ReduceOp::Max, axes: axes.clone() }, &[x]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        let groups: usize = [2usize, 3, 4].iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, d)| *d).product();
        let grads = gradcheck(&c.finish(z));
        // Exactly one element per reduced group gets a gradient.
        assert_eq!(grads["x"].data.iter().filter(|v| **v != 0.0).count(), groups);
    }
}

#[test]
fn matmul_all_transposes() {
    let (m, k, n) = (3u64, 4u64, 5u64);
    for batch in [vec![], vec![2u64], vec![2, 2]] {
        for ta in [false, true] {
            for tb in [false, true] {
                let mut c = Case::new(&format!("matmul_{batch:?}_{ta}_{tb}"), 150);
                let mut sa = batch.clone();
                sa.extend(if ta { [k, m] } else { [m, k] });
                let mut sb = batch.clone();
                sb.extend(if tb { [n, k] } else { [k, n] });
                let a = c.param("a", ls(&sa), Init::Normal(1.0));
                let b = c.param("b", ls(&sb), Init::Normal(1.0));
                let y = c.op(Op::MatMul { trans_a: ta, trans_b: tb }, &[a, b]);
                gradcheck(&c.finish(y));
            }
        }
    }
}

#[test]
fn matmul_shared_rank2_b() {
    // a: [..batch, M, K] with b rank 2 shared across the batch, trans_b false and true.
    let (m, k, n) = (3u64, 4u64, 5u64);
    let batches: Vec<Vec<Dim>> = vec![vec![lit(2)], vec![lit(2), lit(3)], vec![sym("B")], vec![sym("B"), sym("T")]];
    for (bi, batch) in batches.into_iter().enumerate() {
        for tb in [false, true] {
            let mut c = Case::new(&format!("matmul_shared_{bi}_{tb}"), 160 + bi as u64);
            let mut sa = batch.clone();
            sa.extend([lit(m), lit(k)]);
            let a = c.param("a", shp(&sa), Init::Normal(1.0));
            let b = c.param("b", if tb { ls(&[n, k]) } else { ls(&[k, n]) }, Init::Normal(1.0));
            let y = c.op(Op::MatMul { trans_a: false, trans_b: tb }, &[a, b]);
            gradcheck(&c.finish(y));
        }
    }
}

#[test]
fn matmul_shared_rank2_b_with_transposed_a() {
    // op(a) = a^T per batch with b shared: the forward is well-typed; autodiff must either
    // differentiate it correctly or return an error, never panic.
    let (m, k, n) = (3u64, 4u64, 5u64);
    for tb in [false, true] {
        let mut c = Case::new(&format!("matmul_shared_ta_{tb}"), 170);
        let a = c.param("a", ls(&[2, k, m]), Init::Normal(1.0));
        let b = c.param("b", if tb { ls(&[n, k]) } else { ls(&[k, n]) }, Init::Normal(1.0));
        let y = c.op(Op::MatMul { trans_a: true, trans_b: tb }, &[a, b]);
        let c = c.finish(y);
        let r = catch_unwind(AssertUnwindSafe(|| autodiff(&c.g)));
        match r {
            Ok(Err(_)) => {}
            Ok(Ok(_)) => {
                gradcheck(&c);
            }
            Err(p) => {
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                panic!("autodiff panicked on matmul(trans_a, trans_b={tb}) with a shared rank-2 b instead of returning Err: {msg}");
            }
        }
    }
}

#[test]
fn matmul_operands_from_one_param() {
    // x @ x^T: both operand contributions reach the same accumulator.
    let mut c = Case::new("matmul_xxt", 171);
    let x = c.param("x", ls(&[3, 4]), Init::Normal(1.0));
    let y = c.op(Op::MatMul { trans_a: false, trans_b: true }, &[x, x]);
    gradcheck(&c.finish(y));
}

// ---- indexing ------------------------------------------------------------------------------

#[test]
fn gather() {
    {
        let mut c = Case::new("gather", 180);
        let t = c.param("table", ls(&[5, 3]), Init::Normal(1.0));
        // Repeated rows (accumulation) and a row never used (row 4: zero gradient).
        let idx = c.ints("idx", ls(&[2, 4]), &[0, 2, 2, 1, 3, 0, 2, 1]);
        let y = c.op(Op::Gather, &[t, idx]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        let g = gradcheck(&c.finish(z));
        assert!(g["table"].data[12..15].iter().all(|v| *v == 0.0), "unused rows get zero gradient");
    }
    {
        let mut c = Case::new("gather_symbolic", 181);
        let t = c.param("table", ls(&[7, 2]), Init::Normal(1.0));
        let idx = c.rand_ints("idx", shp(&[sym("B"), sym("T")]), 7);
        let y = c.op(Op::Gather, &[t, idx]);
        gradcheck(&c.finish(y));
    }
}

#[test]
fn scatter_add() {
    {
        let mut c = Case::new("scatter_add", 190);
        let src = c.param("src", ls(&[6, 3]), Init::Normal(1.0));
        let idx = c.ints("idx", ls(&[6]), &[1, 3, 1, 0, 3, 1]);
        let y = c.op(Op::ScatterAdd { rows: lit(4) }, &[src, idx]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
    {
        let mut c = Case::new("scatter_add_rank3", 191);
        let src = c.param("src", ls(&[2, 3, 2]), Init::Normal(1.0));
        let idx = c.rand_ints("idx", ls(&[2, 3]), 5);
        let y = c.op(Op::ScatterAdd { rows: lit(5) }, &[src, idx]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
    {
        let mut c = Case::new("scatter_add_symbolic_rows", 192);
        let src = c.param("src", ls(&[4, 2]), Init::Normal(1.0));
        let idx = c.ints("idx", ls(&[4]), &[1, 0, 1, 1]);
        let y = c.op(Op::ScatterAdd { rows: sym("B") }, &[src, idx]);
        let z = c.op(Op::Unary(UnaryOp::Tanh), &[y]);
        gradcheck(&c.finish(z));
    }
}

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
