//! The GPT-2 graph: embeddings, pre-LayerNorm blocks, tied LM head and mean cross-entropy.
//!
//! LayerNorm and the cross-entropy are emitted as primitive ops on purpose: `fuse-layernorm`
//! recognizes them. GELU (tanh form) and causal attention are composites, so that attention can
//! be swapped for a flash kernel without re-matching primitives. Parameters are declared first,
//! in llm.c's checkpoint order, named as in llm.c with a `.layer` suffix (`qkvw.3`).

use fusec_ir::{BinaryOp, CmpOp, DType, Dim, Graph, Op, ReduceOp, Shape, Type, UnaryOp, ValueId};

use crate::Gpt2Config;

/// LayerNorm epsilon (as llm.c and PyTorch).
const LN_EPS: f64 = 1e-5;

/// Builds forward + mean loss over `(tokens, targets): i32[B, T]`; output `loss: f32[]`.
/// The config must pass [`Gpt2Config::validate`].
pub fn build_gpt2(cfg: &Gpt2Config, name: &str) -> Graph {
    let mut b = Builder { g: Graph::new(name, &["B", "T"]) };
    let (c, l) = (cfg.channels as u64, cfg.layers);
    let p = b.params(cfg);
    let tokens = b.input("tokens", DType::I32, &[sym("B"), sym("T")]);
    let targets = b.input("targets", DType::I32, &[sym("B"), sym("T")]);

    let tok_emb = b.g.add1(Op::Gather, &[p.wte, tokens]);
    let pos = b.g.add1(Op::Iota { axis: 1, ty: Type::new(DType::I32, shape(&[sym("B"), sym("T")])) }, &[]);
    let pos_emb = b.g.add1(Op::Gather, &[p.wpe, pos]);
    let mut x = b.bin(BinaryOp::Add, tok_emb, pos_emb);
    for i in 0..l {
        let ln1 = b.layernorm(x, p.ln1w[i], p.ln1b[i], c);
        let qkv = b.linear(ln1, p.qkvw[i], p.qkvb[i]);
        let att = b.attention(qkv, cfg);
        let proj = b.linear(att, p.attprojw[i], p.attprojb[i]);
        x = b.bin(BinaryOp::Add, x, proj);
        let ln2 = b.layernorm(x, p.ln2w[i], p.ln2b[i], c);
        let fc = b.linear(ln2, p.fcw[i], p.fcb[i]);
        let act = b.g.add1(Op::Gelu, &[fc]);
        let fcproj = b.linear(act, p.fcprojw[i], p.fcprojb[i]);
        x = b.bin(BinaryOp::Add, x, fcproj);
    }
    let lnf = b.layernorm(x, p.lnfw, p.lnfb, c);
    let logits = b.g.add1(Op::MatMul { trans_a: false, trans_b: true }, &[lnf, p.wte]);
    let loss = b.mean_cross_entropy(logits, targets, cfg.vocab as u64);
    b.g.output("loss", loss);
    b.g
}

pub(crate) fn sym(s: &str) -> Dim {
    Dim::sym(s)
}

pub(crate) fn shape(d: &[Dim]) -> Shape {
    Shape(d.iter().cloned().collect())
}

/// Parameter values of the whole model.
pub(crate) struct Params {
    pub(crate) wte: ValueId,
    pub(crate) wpe: ValueId,
    pub(crate) ln1w: Vec<ValueId>,
    pub(crate) ln1b: Vec<ValueId>,
    pub(crate) qkvw: Vec<ValueId>,
    pub(crate) qkvb: Vec<ValueId>,
    pub(crate) attprojw: Vec<ValueId>,
    pub(crate) attprojb: Vec<ValueId>,
    pub(crate) ln2w: Vec<ValueId>,
    pub(crate) ln2b: Vec<ValueId>,
    pub(crate) fcw: Vec<ValueId>,
    pub(crate) fcb: Vec<ValueId>,
    pub(crate) fcprojw: Vec<ValueId>,
    pub(crate) fcprojb: Vec<ValueId>,
    pub(crate) lnfw: ValueId,
    pub(crate) lnfb: ValueId,
}

/// Adds GPT-2's pieces to a graph (shared with the decoder builder).
pub(crate) struct Builder {
    pub(crate) g: Graph,
}

impl Builder {
    pub(crate) fn params(&mut self, cfg: &Gpt2Config) -> Params {
        let (c, l) = (cfg.channels as u64, cfg.layers);
        let per_layer =
            |b: &mut Builder, name: &str, dims: &[u64]| -> Vec<ValueId> { (0..l).map(|i| b.param(&format!("{name}.{i}"), dims)).collect() };
        let wte = self.param("wte", &[cfg.padded_vocab as u64, c]);
        let wpe = self.param("wpe", &[cfg.max_seq as u64, c]);
        Params {
            wte,
            wpe,
            ln1w: per_layer(self, "ln1w", &[c]),
            ln1b: per_layer(self, "ln1b", &[c]),
            qkvw: per_layer(self, "qkvw", &[3 * c, c]),
            qkvb: per_layer(self, "qkvb", &[3 * c]),
            attprojw: per_layer(self, "attprojw", &[c, c]),
            attprojb: per_layer(self, "attprojb", &[c]),
            ln2w: per_layer(self, "ln2w", &[c]),
            ln2b: per_layer(self, "ln2b", &[c]),
            fcw: per_layer(self, "fcw", &[4 * c, c]),
            fcb: per_layer(self, "fcb", &[4 * c]),
            fcprojw: per_layer(self, "fcprojw", &[c, 4 * c]),
            fcprojb: per_layer(self, "fcprojb", &[c]),
            lnfw: self.param("lnfw", &[c]),
            lnfb: self.param("lnfb", &[c]),
        }
    }

    pub(crate) fn param(&mut self, name: &str, dims: &[u64]) -> ValueId {
        let ty = Type::new(DType::F32, Shape::lits(dims));
        self.g.add1(Op::Param { name: name.to_string(), ty }, &[])
    }

    pub(crate) fn input(&mut self, name: &str, dtype: DType, dims: &[Dim]) -> ValueId {
        self.g.add1(Op::Input { name: name.to_string(), ty: Type::new(dtype, shape(dims)) }, &[])
    }

    pub(crate) fn bin(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        self.g.add1(Op::Binary(op), &[a, b])
    }

    pub(crate) fn un(&mut self, op: UnaryOp, a: ValueId) -> ValueId {
        self.g.add1(Op::Unary(op), &[a])
    }

    /// A constant splat with the shape and dtype of `like`.
    pub(crate) fn splat(&mut self, value: f64, like: ValueId) -> ValueId {
        let ty = self.g.ty(like).clone();
        self.g.add1(Op::Const { value, ty }, &[])
    }

    /// Broadcasts `x` (whose dims are the leading or trailing dims of `like`) to `like`'s shape.
    pub(crate) fn broadcast_to(&mut self, x: ValueId, like: ValueId, leading: bool) -> ValueId {
        let to = self.g.ty(like).shape.clone();
        let n = self.g.ty(x).shape.rank();
        let dims = if leading { (0..n).collect() } else { (to.rank() - n..to.rank()).collect() };
        self.g.add1(Op::Broadcast { dims, shape: to }, &[x])
    }

    pub(crate) fn reduce(&mut self, op: ReduceOp, x: ValueId, axes: Vec<usize>) -> ValueId {
        self.g.add1(Op::Reduce { op, axes }, &[x])
    }

    /// Mean over the last axis of width `n`, kept as a tensor without that axis.
    pub(crate) fn mean_last(&mut self, x: ValueId, n: u64) -> ValueId {
        let last = self.g.ty(x).shape.rank() - 1;
        let sum = self.reduce(ReduceOp::Sum, x, vec![last]);
        let inv = self.splat(1.0 / n as f64, sum);
        self.bin(BinaryOp::Mul, sum, inv)
    }

    /// LayerNorm over the last axis from primitives: mean, biased variance, rsqrt, scale, shift.
    pub(crate) fn layernorm(&mut self, x: ValueId, w: ValueId, b: ValueId, c: u64) -> ValueId {
        let mean = self.mean_last(x, c);
        let mean_b = self.broadcast_to(mean, x, true);
        let xc = self.bin(BinaryOp::Sub, x, mean_b);
        let sq = self.bin(BinaryOp::Mul, xc, xc);
        let var = self.mean_last(sq, c);
        let eps = self.splat(LN_EPS, var);
        let var_eps = self.bin(BinaryOp::Add, var, eps);
        let rstd = self.un(UnaryOp::Rsqrt, var_eps);
        let rstd_b = self.broadcast_to(rstd, x, true);
        let norm = self.bin(BinaryOp::Mul, xc, rstd_b);
        let w_b = self.broadcast_to(w, x, false);
        let scaled = self.bin(BinaryOp::Mul, norm, w_b);
        let b_b = self.broadcast_to(b, x, false);
        self.bin(BinaryOp::Add, scaled, b_b)
    }

    /// `x @ w^T + b` with `w: [out, in]` (PyTorch `nn.Linear`).
    pub(crate) fn linear(&mut self, x: ValueId, w: ValueId, b: ValueId) -> ValueId {
        let y = self.g.add1(Op::MatMul { trans_a: false, trans_b: true }, &[x, w]);
        let b_b = self.broadcast_to(b, y, false);
        self.bin(BinaryOp::Add, y, b_b)
    }

    /// Causal multi-head attention on `qkv: [B, T, 3C]`, returning `[B, T, C]`.
    fn attention(&mut self, qkv: ValueId, cfg: &Gpt2Config) -> ValueId {
        let hs = (cfg.channels / cfg.heads) as f64;
        self.g.add(Op::Attention { heads: cfg.heads as u64, scale: 1.0 / hs.sqrt() }, &[qkv])[0]
    }

    /// Mean over all positions of `logsumexp(logits[.., :V]) - logits[target]`, from primitives.
    fn mean_cross_entropy(&mut self, logits: ValueId, targets: ValueId, vocab: u64) -> ValueId {
        let lv = self.g.add1(Op::Slice { axis: 2, start: 0, end: vocab }, &[logits]);
        let mx = self.reduce(ReduceOp::Max, lv, vec![2]);
        let mx_b = self.broadcast_to(mx, lv, true);
        let shifted = self.bin(BinaryOp::Sub, lv, mx_b);
        let e = self.un(UnaryOp::Exp, shifted);
        let sum = self.reduce(ReduceOp::Sum, e, vec![2]);
        let lse = self.un(UnaryOp::Log, sum);
        // The target's shifted logit, picked with a one-hot mask built from iota == target.
        let ids = self.g.add1(Op::Iota { axis: 2, ty: self.g.ty(lv).with_dtype(DType::I32) }, &[]);
        let tgt_b = self.broadcast_to(targets, ids, true);
        let hit = self.g.add1(Op::Compare(CmpOp::Eq), &[ids, tgt_b]);
        let zero = self.splat(0.0, shifted);
        let picked_all = self.g.add1(Op::Select, &[hit, shifted, zero]);
        let picked = self.reduce(ReduceOp::Sum, picked_all, vec![2]);
        let per_pos = self.bin(BinaryOp::Sub, lse, picked);
        let total = self.reduce(ReduceOp::Sum, per_pos, vec![0, 1]);
        // B*T is symbolic: the count is a reduction of ones that canonicalize folds once bound.
        let ones = self.splat(1.0, per_pos);
        let count = self.reduce(ReduceOp::Sum, ones, vec![0, 1]);
        self.bin(BinaryOp::Div, total, count)
    }
}

/// The same model with the logits `f32[B, T, Vp]` as its only output (for sampling): the
/// LM-head matmul (the one reading `wte` transposed). The loss nodes become dead code.
pub fn logits_graph(g: &Graph) -> Result<Graph, String> {
    let wte = g.params().into_iter().find(|(n, _)| *n == "wte").map(|(_, v)| v).ok_or("the graph has no `wte` parameter")?;
    let head = g
        .nodes
        .iter()
        .rev()
        .find(|n| matches!(n.op, Op::MatMul { trans_a: false, trans_b: true }) && n.inputs[1] == wte)
        .ok_or("the graph has no LM head (a matmul with wte transposed)")?;
    let mut out = g.clone();
    out.outputs = vec![("logits".to_string(), head.results[0])];
    Ok(out)
}
