//! Random well-typed graphs for property tests, fuzzing and interpreter/backend comparisons.
//!
//! Every node is added through [`Graph::add`], so types always come from
//! [`crate::infer::result_types`]; a generator bug shows up as a panic naming the ill-typed op.
//! Over many seeds every op variant appears, with symbolic dims from a random header, small
//! constant dims, names that need escapes, and extreme constants; the fused ops appear too
//! (`gemm` with every epilogue, `kernel` wrapping a small random body). Deterministic per seed.

mod fused;

use crate::rng::Rng;
use crate::{DType, Dim, Graph, Op, ReduceOp, Shape, Type, ValueId};

/// Knobs for [`random_graph_with`].
#[derive(Clone, Debug)]
pub struct GenOpts {
    /// Most ops per graph besides the sources created to feed them (at least one is made).
    pub max_ops: usize,
    /// Constant dims are drawn from `1..=max_dim`.
    pub max_dim: u64,
    /// Whether the header declares symbols (a random subset of `B`, `T`, `N`) used in shapes.
    pub symbolic: bool,
    /// Whether float constants include extremes (1e300, 5e-324, -0.0, inf, -inf). Never NaN.
    pub extreme_consts: bool,
    /// Whether param, input and output names contain quotes, backslashes, newlines, tabs,
    /// `#` and non-ASCII characters.
    pub odd_names: bool,
}

impl Default for GenOpts {
    fn default() -> GenOpts {
        GenOpts { max_ops: 16, max_dim: 6, symbolic: true, extreme_consts: true, odd_names: true }
    }
}

/// A random well-typed graph with the default [`GenOpts`].
pub fn random_graph(rng: &mut Rng) -> Graph {
    random_graph_with(rng, &GenOpts::default())
}

/// A random well-typed graph: a random header, `1..=opts.max_ops` random ops (plus the sources
/// they need) and 1 to 4 outputs.
pub fn random_graph_with(rng: &mut Rng, opts: &GenOpts) -> Graph {
    let names = ["g", "gen", "gpt2_tiny", "m.v1-a", "_x9", "Graph-2.b"];
    let name = names[rng.below(names.len() as u64) as usize].to_string();
    let mut syms: Vec<&str> = Vec::new();
    if opts.symbolic {
        for s in ["B", "T", "N"] {
            if rng.chance(0.6) {
                syms.push(s);
            }
        }
        shuffle(rng, &mut syms);
    }
    let mut gen = Gen { rng, o: opts.clone(), g: Graph::new(&name, &syms), serial: 0, body: false };
    let n_ops = 1 + gen.rng.below(opts.max_ops.max(1) as u64);
    for _ in 0..n_ops {
        gen.step();
    }
    let n_out = 1 + gen.rng.below(4);
    gen.outputs(n_out, "out");
    gen.g
}

fn shuffle<T>(rng: &mut Rng, xs: &mut [T]) {
    for i in (1..xs.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        xs.swap(i, j);
    }
}

struct Gen<'r> {
    rng: &'r mut Rng,
    o: GenOpts,
    g: Graph,
    serial: u32,
    /// Whether `g` is a kernel body (its sources are inputs, consts and iotas; no params).
    body: bool,
}

impl Gen<'_> {
    /// Declares `n` outputs named from `prefix`, preferring late values.
    fn outputs(&mut self, n: u64, prefix: &str) {
        for _ in 0..n {
            let n = self.g.values.len() as u64;
            // Prefer late values: the last one half of the time.
            let v = if self.rng.chance(0.5) { n - 1 } else { self.rng.below(n) };
            let oname = self.name(prefix);
            self.g.output(&oname, ValueId(v as u32));
        }
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.rng.below(xs.len() as u64) as usize]
    }

    fn lit(&mut self) -> u64 {
        1 + self.rng.below(self.o.max_dim.max(1))
    }

    /// A constant dim, or (30%) a symbol, possibly times 2 or 3 or another symbol.
    fn dim(&mut self) -> Dim {
        if self.g.syms.is_empty() || !self.rng.chance(0.3) {
            return Dim::lit(self.lit());
        }
        let syms = self.g.syms.clone();
        let s = Dim::sym(&syms[self.rng.below(syms.len() as u64) as usize]);
        match self.rng.below(5) {
            0 => s.mul(&Dim::lit(2 + self.rng.below(2))),
            1 => s.mul(&Dim::sym(&syms[self.rng.below(syms.len() as u64) as usize])),
            _ => s,
        }
    }

    fn shape(&mut self, rank: usize) -> Shape {
        Shape((0..rank).map(|_| self.dim()).collect())
    }

    fn rank(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.rng.below((hi - lo + 1) as u64) as usize
    }

    fn fdtype(&mut self) -> DType {
        self.pick(&[DType::F32, DType::F32, DType::BF16, DType::F16])
    }

    fn dtype(&mut self) -> DType {
        self.pick(&[DType::F32, DType::F32, DType::BF16, DType::F16, DType::I32])
    }

    /// A fresh name, unique within the graph, starting with `prefix` or (with odd names) with
    /// characters that need escapes.
    fn name(&mut self, prefix: &str) -> String {
        self.serial += 1;
        let odd = ["h0.ln1w", "tok\"en", "back\\slash", "tab\there", "new\nline", "ünï ☃", "#hash", "{%[*]}", "", "a b"];
        if self.o.odd_names && self.rng.chance(0.5) {
            format!("{}_{}", self.pick(&odd), self.serial)
        } else {
            format!("{prefix}{}", self.serial)
        }
    }

    fn const_value(&mut self, dtype: DType) -> f64 {
        if dtype == DType::I32 {
            return self.rng.below(11) as f64 - 5.0;
        }
        let plain = [0.0, 1.0, -1.0, 0.5, 0.1, -2.5, 1e-5, 3.0, 0.044715, -0.125];
        let extreme = [
            -0.0,
            1e-30,
            5e-324,
            2.2250738585072014e-308,
            1e300,
            -1e300,
            f64::MAX,
            f64::MIN_POSITIVE,
            65504.0,
            3.0e38,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ];
        match self.rng.below(4) {
            0 if self.o.extreme_consts => self.pick(&extreme),
            1 => self.rng.normal() * 10f64.powi(self.rng.below(7) as i32 - 3),
            _ => self.pick(&plain),
        }
    }

    /// A new source node of type `ty`: a param, input, const or (rank >= 1) iota.
    fn source(&mut self, ty: Type) -> ValueId {
        let kinds = if ty.shape.rank() >= 1 { 4 } else { 3 };
        let op = match self.rng.below(kinds) {
            0 if !self.body => Op::Param { name: self.name("p"), ty },
            0 => Op::Input { name: self.name("x"), ty },
            1 => Op::Input { name: self.name("x"), ty },
            2 => Op::Const { value: self.const_value(ty.dtype), ty },
            _ => Op::Iota { axis: self.rng.below(ty.shape.rank() as u64) as usize, ty },
        };
        self.g.add1(op, &[])
    }

    /// A random existing value whose type satisfies `pred`.
    fn find(&mut self, pred: impl Fn(&Type) -> bool) -> Option<ValueId> {
        let c: Vec<usize> = (0..self.g.values.len()).filter(|&i| pred(&self.g.values[i].ty)).collect();
        (!c.is_empty()).then(|| ValueId(c[self.rng.below(c.len() as u64) as usize] as u32))
    }

    /// A value of exactly `ty`: an existing one half of the time when there is one, else a source.
    fn value_of(&mut self, ty: &Type) -> ValueId {
        if self.rng.chance(0.5) {
            if let Some(v) = self.find(|t| t == ty) {
                return v;
            }
        }
        self.source(ty.clone())
    }

    /// An existing value satisfying `pred` (75%), else a source of the type `make` builds.
    fn operand(&mut self, pred: impl Fn(&Type) -> bool, make: impl FnOnce(&mut Self) -> Type) -> ValueId {
        if self.rng.chance(0.75) {
            if let Some(v) = self.find(&pred) {
                return v;
            }
        }
        let ty = make(self);
        self.source(ty)
    }

    fn ty(&self, v: ValueId) -> Type {
        self.g.ty(v).clone()
    }

    fn any_value(&mut self, min_rank: usize) -> ValueId {
        self.operand(
            |t| t.shape.rank() >= min_rank,
            |s| {
                let (d, r) = (s.dtype(), s.rank(min_rank, 3.max(min_rank)));
                Type::new(d, s.shape(r))
            },
        )
    }

    fn float_value(&mut self, min_rank: usize) -> ValueId {
        self.operand(
            |t| t.dtype.is_float() && t.shape.rank() >= min_rank,
            |s| {
                let (d, r) = (s.fdtype(), s.rank(min_rank, 3.max(min_rank)));
                Type::new(d, s.shape(r))
            },
        )
    }

    /// A float value with rank >= 1 whose last dim is constant.
    fn float_lit_last(&mut self) -> ValueId {
        self.operand(
            |t| t.dtype.is_float() && t.shape.0.last().is_some_and(|d| d.as_lit().is_some()),
            |s| {
                let (d, r) = (s.fdtype(), s.rank(0, 2));
                let mut sh = s.shape(r);
                let last = s.lit();
                sh.0.push(Dim::lit(last));
                Type::new(d, sh)
            },
        )
    }

    /// Indices of shape `shape` valid for `n` rows: an in-range constant, or an input (filled
    /// by whoever runs the graph).
    fn indices(&mut self, shape: Shape, n: &Dim) -> ValueId {
        let ty = Type::new(DType::I32, shape);
        let op = match n.as_lit() {
            Some(n) if self.rng.chance(0.7) => Op::Const { value: self.rng.below(n.max(1)) as f64, ty },
            _ if self.rng.chance(0.5) => Op::Const { value: 0.0, ty },
            _ => Op::Input { name: self.name("idx"), ty },
        };
        self.g.add1(op, &[])
    }

    /// A shape with the same element count: merges, splits, unit dims added or removed.
    fn reshape_of(&mut self, s: &Shape) -> Shape {
        let mut d: Vec<Dim> = s.0.to_vec();
        for _ in 0..1 + self.rng.below(3) {
            let n = d.len();
            match self.rng.below(5) {
                0 if n >= 2 => {
                    let i = self.rng.below(n as u64 - 1) as usize;
                    let m = d[i].mul(&d[i + 1]);
                    d[i] = m;
                    d.remove(i + 1);
                }
                1 if n < 5 => d.insert(self.rng.below(n as u64 + 1) as usize, Dim::lit(1)),
                2 => {
                    if let Some(i) = d.iter().position(|x| *x == Dim::lit(1)) {
                        d.remove(i);
                    }
                }
                3 if n >= 1 => {
                    let i = self.rng.below(n as u64) as usize;
                    let c = d[i].coef;
                    if let Some(f) = (2..c).find(|&f| c.is_multiple_of(f)) {
                        let rest = Dim { coef: c / f, syms: d[i].syms.clone() };
                        d[i] = Dim::lit(f);
                        d.insert(i + 1, rest);
                    }
                }
                _ if n >= 1 => {
                    // Split a symbolic dim into its constant factor and symbols, or its first symbol.
                    let i = self.rng.below(n as u64) as usize;
                    let x = d[i].clone();
                    if x.coef != 1 && !x.syms.is_empty() {
                        d[i] = Dim::lit(x.coef);
                        d.insert(i + 1, Dim { coef: 1, syms: x.syms });
                    } else if x.syms.len() >= 2 {
                        d[i] = Dim::sym(&x.syms[0]);
                        d.insert(i + 1, Dim { coef: 1, syms: x.syms[1..].iter().cloned().collect() });
                    }
                }
                _ => {}
            }
        }
        Shape::from(d)
    }

    fn step(&mut self) {
        let k = self.rng.below(34);
        self.step_kind(k);
    }

    /// Adds the kind of node numbered `k` (see [`Gen::step`]), with the operands it needs.
    fn step_kind(&mut self, k: u64) {
        match k {
            0 | 30 => {
                let x = self.float_value(0);
                let u = self.pick(&Op::UNARY);
                self.g.add1(Op::Unary(u), &[x]);
            }
            1 | 31 => {
                let x = self.any_value(0);
                let y = self.value_of(&self.ty(x));
                let b = self.pick(&Op::BINARY);
                self.g.add1(Op::Binary(b), &[x, y]);
            }
            2 => {
                let x = self.any_value(0);
                let y = self.value_of(&self.ty(x));
                let c = self.pick(&Op::COMPARE);
                self.g.add1(Op::Compare(c), &[x, y]);
            }
            3 => {
                let a = self.any_value(0);
                let t = self.ty(a);
                let cond = self.value_of(&t.with_dtype(DType::I32));
                let b = self.value_of(&t);
                self.g.add1(Op::Select, &[cond, a, b]);
            }
            4 => {
                let x = self.any_value(0);
                let to = self.dtype();
                self.g.add1(Op::Cast { to }, &[x]);
            }
            5 => {
                let x = self.any_value(0);
                let shape = self.reshape_of(&self.ty(x).shape);
                self.g.add1(Op::Reshape { shape }, &[x]);
            }
            6 => self.broadcast(),
            7 => {
                let x = self.any_value(1);
                let mut perm: Vec<usize> = (0..self.ty(x).shape.rank()).collect();
                shuffle(self.rng, &mut perm);
                self.g.add1(Op::Permute { perm }, &[x]);
            }
            8 | 9 => self.slice_or_concat(),
            10 | 11 => {
                let x = self.any_value(1);
                let r = self.ty(x).shape.rank();
                let mut axes: Vec<usize> = (0..r).filter(|_| self.rng.chance(0.5)).collect();
                if axes.is_empty() {
                    axes.push(self.rng.below(r as u64) as usize);
                }
                let op = if self.rng.chance(0.5) { ReduceOp::Sum } else { ReduceOp::Max };
                self.g.add1(Op::Reduce { op, axes }, &[x]);
            }
            12 => self.matmul(),
            13 => {
                let table = self.operand(
                    |t| t.shape.rank() == 2,
                    |s| {
                        let d = s.dtype();
                        Type::new(d, s.shape(2))
                    },
                );
                let n = self.ty(table).shape.0[0].clone();
                let r = self.rank(0, 2);
                let sh = self.shape(r);
                let idx = self.indices(sh, &n);
                self.g.add1(Op::Gather, &[table, idx]);
            }
            14 => {
                let src = self.any_value(1);
                let s = self.ty(src).shape;
                let rows = self.dim();
                let idx = self.indices(Shape(s.0[..s.rank() - 1].iter().cloned().collect()), &rows);
                self.g.add1(Op::ScatterAdd { rows }, &[src, idx]);
            }
            15 | 19 => {
                let x = self.float_value(1);
                self.g.add1(if self.rng.chance(0.5) { Op::Gelu } else { Op::Softmax }, &[x]);
            }
            16 | 20 => {
                let softmax = self.rng.chance(0.5);
                let x = self.float_value(softmax as usize);
                let dy = self.value_of(&self.ty(x));
                self.g.add1(if softmax { Op::SoftmaxGrad } else { Op::GeluGrad }, &[x, dy]);
            }
            17 | 18 => self.layernorm(),
            21 | 22 => self.cross_entropy(),
            23 | 24 => self.attention(),
            25 => self.adamw(),
            32 => self.gemm(),
            33 if !self.body => self.kernel(),
            _ => {
                let (d, r) = (self.dtype(), self.rank(0, 3));
                let ty = Type::new(d, self.shape(r));
                self.source(ty);
            }
        }
    }

    fn broadcast(&mut self) {
        let x = self.any_value(0);
        let t = self.ty(x);
        let r = t.shape.rank();
        let big = if r < 4 { r + self.rng.below(3) as usize } else { r };
        let mut pos: Vec<usize> = (0..big).collect();
        shuffle(self.rng, &mut pos);
        let mut dims: Vec<usize> = pos[..r].to_vec();
        dims.sort_unstable();
        let mut shape: Vec<Dim> = (0..big).map(|_| self.dim()).collect();
        for (i, &d) in dims.iter().enumerate() {
            let a = t.shape.0[i].clone();
            if a != Dim::lit(1) || self.rng.chance(0.5) {
                shape[d] = a;
            }
        }
        self.g.add1(Op::Broadcast { dims, shape: Shape::from(shape) }, &[x]);
    }

    fn slice_or_concat(&mut self) {
        let x = self.operand(
            |t| t.shape.0.iter().any(|d| d.as_lit().is_some()),
            |s| {
                let (d, r) = (s.dtype(), s.rank(1, 3));
                let mut sh = s.shape(r);
                let i = s.rng.below(r as u64) as usize;
                sh.0[i] = Dim::lit(s.lit());
                Type::new(d, sh)
            },
        );
        let t = self.ty(x);
        let lits: Vec<usize> = (0..t.shape.rank()).filter(|&i| t.shape.0[i].as_lit().is_some()).collect();
        let axis = self.pick(&lits);
        let n = t.shape.0[axis].coef;
        if self.rng.chance(0.5) {
            let start = self.rng.below(n);
            let end = start + 1 + self.rng.below(n - start);
            self.g.add1(Op::Slice { axis, start, end }, &[x]);
        } else {
            let mut ops = vec![x];
            for _ in 0..self.rng.below(3) {
                let mut s = t.shape.clone();
                s.0[axis] = Dim::lit(self.lit());
                ops.push(self.value_of(&Type::new(t.dtype, s)));
            }
            shuffle(self.rng, &mut ops);
            self.g.add1(Op::Concat { axis }, &ops);
        }
    }

    fn matmul(&mut self) {
        let (ta, tb, a, b) = self.matmul_operands();
        self.g.add1(Op::MatMul { trans_a: ta, trans_b: tb }, &[a, b]);
    }

    /// Random transpose flags and operands that a matmul with them accepts (batched or with a
    /// shared rank-2 `b`).
    fn matmul_operands(&mut self) -> (bool, bool, ValueId, ValueId) {
        let (ta, tb) = (self.rng.chance(0.5), self.rng.chance(0.5));
        let existing = if self.rng.chance(0.5) { self.find(|t| t.dtype.is_float() && (2..=4).contains(&t.shape.rank())) } else { None };
        let (a, dtype, batch, m, k) = match existing {
            Some(a) => {
                let s = self.ty(a).shape;
                let r = s.rank();
                let (x, y) = (s.0[r - 2].clone(), s.0[r - 1].clone());
                let (m, k) = if ta { (y, x) } else { (x, y) };
                (Some(a), self.ty(a).dtype, s.0[..r - 2].to_vec(), m, k)
            }
            None => {
                let r = self.rank(0, 2);
                (None, self.fdtype(), self.shape(r).0.to_vec(), self.dim(), self.dim())
            }
        };
        let n = self.dim();
        let mk = |b: &[Dim], x: &Dim, y: &Dim, t: bool| {
            let mut v = b.to_vec();
            if t {
                v.extend([y.clone(), x.clone()]);
            } else {
                v.extend([x.clone(), y.clone()]);
            }
            Type::new(dtype, Shape::from(v))
        };
        let a = match a {
            Some(a) => a,
            None => self.value_of(&mk(&batch, &m, &k, ta)),
        };
        let shared = batch.is_empty() || self.rng.chance(0.4);
        let bty = mk(if shared { &[] } else { &batch }, &k, &n, tb);
        let b = self.value_of(&bty);
        (ta, tb, a, b)
    }

    fn layernorm(&mut self) {
        let prior = self.g.nodes.iter().rev().find(|n| matches!(n.op, Op::LayerNorm { .. })).cloned();
        if self.rng.chance(0.5) {
            if let Some(ln) = prior {
                let x = ln.inputs[0];
                let dy = self.value_of(&self.ty(x));
                self.g.add(Op::LayerNormGrad, &[dy, x, ln.inputs[1], ln.results[1], ln.results[2]]);
                return;
            }
        }
        let x = self.float_value(1);
        let t = self.ty(x);
        let r = t.shape.rank();
        let w_ty = Type::new(t.dtype, Shape::from(vec![t.shape.0[r - 1].clone()]));
        let stat = Type::new(t.dtype, Shape(t.shape.0[..r - 1].iter().cloned().collect()));
        let w = self.value_of(&w_ty);
        if self.rng.chance(0.6) {
            let b = self.value_of(&w_ty);
            let eps = self.pick(&[1e-5, 1e-6, 1e-12, 0.1, 1.0, 5e-324, 1e300]);
            self.g.add(Op::LayerNorm { eps }, &[x, w, b]);
        } else {
            let dy = self.value_of(&t);
            let (mean, rstd) = (self.value_of(&stat), self.value_of(&stat));
            self.g.add(Op::LayerNormGrad, &[dy, x, w, mean, rstd]);
        }
    }

    fn cross_entropy(&mut self) {
        let l = self.float_lit_last();
        let t = self.ty(l);
        let r = t.shape.rank();
        let vp = t.shape.0[r - 1].coef;
        let vocab = 1 + self.rng.below(vp);
        let rows = Shape(t.shape.0[..r - 1].iter().cloned().collect());
        let targets = self.indices(rows.clone(), &Dim::lit(vocab));
        if self.rng.chance(0.5) {
            self.g.add1(Op::CrossEntropy { vocab }, &[l, targets]);
        } else {
            let dloss = self.value_of(&Type::new(t.dtype, rows));
            self.g.add1(Op::CrossEntropyGrad { vocab }, &[l, targets, dloss]);
        }
    }

    fn attention(&mut self) {
        let scale = self.pick(&[0.125, 0.5, 1.0, -0.25, 0.0, 1e-3, 0.35355339059327373]);
        let prior = self.g.nodes.iter().rev().find(|n| matches!(n.op, Op::Attention { .. })).cloned();
        if self.rng.chance(0.5) {
            if let Some(at) = prior {
                let Op::Attention { heads, .. } = at.op else { unreachable!() };
                let dout = self.value_of(&self.ty(at.results[0]));
                let ins = [at.inputs[0], at.results[0], at.results[1], dout];
                self.g.add(Op::AttentionGrad { heads, scale }, &ins);
                return;
            }
        }
        let heads = self.pick(&[1u64, 2, 3]);
        let d = self.pick(&[1u64, 2, 4]);
        let rank = self.rng.below(2) as usize + 1;
        let mut shape = self.shape(rank);
        shape.0.push(Dim::lit(3 * heads * d));
        let dtype = self.pick(&[DType::F32, DType::F32, DType::BF16]);
        let qkv = self.value_of(&Type::new(dtype, shape));
        let r = self.g.add(Op::Attention { heads, scale }, &[qkv]);
        if self.rng.chance(0.4) {
            let (out, lse) = (self.ty(r[0]), self.ty(r[1]));
            let (out, lse, dout) = (self.value_of(&out), self.value_of(&lse), self.value_of(&out));
            self.g.add(Op::AttentionGrad { heads, scale }, &[qkv, out, lse, dout]);
        }
    }

    fn adamw(&mut self) {
        let p = self.operand(
            |t| t.dtype == DType::F32,
            |s| {
                let r = s.rank(0, 3);
                Type::new(DType::F32, s.shape(r))
            },
        );
        let t = self.ty(p);
        let mut ins = vec![p];
        for _ in 0..3 {
            ins.push(self.value_of(&t));
        }
        for _ in 0..3 {
            ins.push(self.value_of(&Type::scalar(DType::F32)));
        }
        let op = Op::AdamW {
            beta1: self.pick(&[0.9, 0.0, 0.5, 0.99]),
            beta2: self.pick(&[0.999, 0.95, 0.0, 0.9999999]),
            eps: self.pick(&[1e-8, 0.0, 1e-6]),
            weight_decay: self.pick(&[0.0, 0.1, 0.01]),
        };
        self.g.add(op, &ins);
    }
}
