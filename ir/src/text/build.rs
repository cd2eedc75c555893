//! Turning a parsed node (mnemonic, attributes, declared types, kernel body) into an [`Op`].

use super::kind::{attr_names, Kind};
use super::lex::{clip, Pos};
use super::parse::{Parser, R};
use crate::{Graph, Op, Type};

/// An attribute value as written.
pub(super) enum AttrVal {
    /// A numeric literal (or `inf` / `nan`), kept as written.
    Num(String),
    /// `true` or `false`.
    Bool(bool),
    /// `[n, ...]`.
    List(Vec<u64>),
}

/// The attributes of one node: name, name position, value position, value.
pub(super) struct Attrs {
    /// In the order written.
    pub items: Vec<(String, Pos, Pos, AttrVal)>,
}

/// Everything read of one node before its op is built.
pub(super) struct NodeParts {
    /// The op kind.
    pub kind: Kind,
    /// The mnemonic as written.
    pub m: String,
    /// Where the mnemonic is.
    pub op_pos: Pos,
    /// The quoted name of a param, input or kernel.
    pub name: String,
    /// The value of a const.
    pub value: f64,
    /// The attributes.
    pub attrs: Attrs,
    /// The declared result types (at least one) and their positions.
    pub types: Vec<(Type, Pos)>,
    /// The body of a kernel.
    pub body: Option<Graph>,
}

impl Parser<'_> {
    /// Builds the op from what was read of its node: kind, attributes, the declared result
    /// types (for implied attributes) and, for a kernel, its body.
    pub(super) fn build_op(&self, parts: NodeParts) -> R<Op> {
        let NodeParts { kind, m, op_pos, name, value, attrs: a, types, body } = parts;
        let m = m.as_str();
        let allowed = attr_names(kind);
        for (k, pos, _, _) in &a.items {
            if !allowed.contains(&k.as_str()) {
                let takes = if allowed.is_empty() { "it takes none".to_string() } else { format!("expected: {}", allowed.join(", ")) };
                return self.err(*pos, format!("unknown attribute `{}` for `{m}` ({takes})", clip(k)));
            }
        }
        let (ty, ty_pos) = (types[0].0.clone(), types[0].1);
        let mut out = OpBuilder { p: self, m, items: a.items, missing_at: op_pos };
        use Kind::*;
        Ok(match kind {
            Param => Op::Param { name, ty },
            Input => Op::Input { name, ty },
            Const => Op::Const { value, ty },
            Iota => Op::Iota { axis: out.usize("axis")?, ty },
            Unary(u) => Op::Unary(u),
            Binary(b) => Op::Binary(b),
            Compare(c) => Op::Compare(c),
            Select => Op::Select,
            Cast => Op::Cast { to: ty.dtype },
            Reshape => Op::Reshape { shape: ty.shape },
            Broadcast => Op::Broadcast { dims: out.list("dims")?, shape: ty.shape },
            Permute => Op::Permute { perm: out.list("perm")? },
            Slice => Op::Slice { axis: out.usize("axis")?, start: out.int("start")?, end: out.int("end")? },
            Concat => Op::Concat { axis: out.usize("axis")? },
            Reduce(op) => Op::Reduce { op, axes: out.list("axes")? },
            MatMul => Op::MatMul { trans_a: out.bool("trans_a")?, trans_b: out.bool("trans_b")? },
            Gather => Op::Gather,
            ScatterAdd => match ty.shape.0.first() {
                Some(rows) => Op::ScatterAdd { rows: rows.clone() },
                None => return self.err(ty_pos, format!("`scatter_add` produces a rank-2 type, found declared {ty}")),
            },
            Gelu => Op::Gelu,
            GeluGrad => Op::GeluGrad,
            LayerNorm => Op::LayerNorm { eps: out.float("eps")? },
            LayerNormGrad => Op::LayerNormGrad,
            Softmax => Op::Softmax,
            AllReduce => Op::AllReduce,
            FromOwners => Op::FromOwners { owners: out.list("owners")? },
            SoftmaxGrad => Op::SoftmaxGrad,
            CrossEntropy => Op::CrossEntropy { vocab: out.int("vocab")? },
            CrossEntropyGrad => Op::CrossEntropyGrad { vocab: out.int("vocab")? },
            CrossEntropyWithGrad => Op::CrossEntropyWithGrad { vocab: out.int("vocab")? },
            Attention => Op::Attention { heads: out.int("heads")?, scale: out.float("scale")? },
            AttentionGrad => Op::AttentionGrad { heads: out.int("heads")?, scale: out.float("scale")? },
            Gemm => Op::Gemm(crate::Gemm {
                trans_a: out.bool("trans_a")?,
                trans_b: out.bool("trans_b")?,
                bias: out.bool("bias")?,
                gelu: out.bool("gelu")?,
                out: ty.dtype,
                accumulate: out.bool("accumulate")?,
            }),
            Kernel => match body {
                Some(body) => Op::Kernel(Box::new(crate::Kernel { name, body })),
                None => return self.err(op_pos, "internal error: kernel without a body".to_string()),
            },
            AdamW => Op::AdamW {
                beta1: out.float("beta1")?,
                beta2: out.float("beta2")?,
                eps: out.float("eps")?,
                weight_decay: out.float("weight_decay")?,
            },
        })
    }
}

/// Typed access to one node's attributes.
struct OpBuilder<'p, 'a> {
    p: &'p Parser<'a>,
    m: &'p str,
    items: Vec<(String, Pos, Pos, AttrVal)>,
    /// Where a missing attribute is reported (the op name).
    missing_at: Pos,
}

impl OpBuilder<'_, '_> {
    fn get(&mut self, key: &str) -> R<(Pos, AttrVal)> {
        match self.items.iter().position(|(k, _, _, _)| k == key) {
            Some(i) => {
                let (_, _, p, v) = self.items.swap_remove(i);
                Ok((p, v))
            }
            None => self.p.err(self.missing_at, format!("`{}` is missing attribute `{key}`", self.m)),
        }
    }

    fn wrong<T>(&self, p: Pos, key: &str, want: &str, v: &AttrVal) -> R<T> {
        let found = match v {
            AttrVal::Num(s) => format!("`{}`", clip(s)),
            AttrVal::Bool(b) => format!("`{b}`"),
            AttrVal::List(_) => "a list".to_string(),
        };
        self.p.err(p, format!("attribute `{key}` of `{}` must be {want}, found {found}", self.m))
    }

    fn int(&mut self, key: &str) -> R<u64> {
        match self.get(key)? {
            (p, AttrVal::Num(s)) => self.p.int_of(&s, p),
            (p, v) => self.wrong(p, key, "an integer", &v),
        }
    }

    fn usize(&mut self, key: &str) -> R<usize> {
        let at = self.items.iter().find(|(k, _, _, _)| k == key).map_or(self.missing_at, |(_, _, p, _)| *p);
        let n = self.int(key)?;
        usize::try_from(n).or_else(|_| self.p.err(at, format!("attribute `{key}` of `{}` is too large", self.m)))
    }

    fn float(&mut self, key: &str) -> R<f64> {
        match self.get(key)? {
            (p, AttrVal::Num(s)) => self.p.float_of(&s, p),
            (p, v) => self.wrong(p, key, "a float", &v),
        }
    }

    fn bool(&mut self, key: &str) -> R<bool> {
        match self.get(key)? {
            (_, AttrVal::Bool(b)) => Ok(b),
            (p, v) => self.wrong(p, key, "`true` or `false`", &v),
        }
    }

    fn list(&mut self, key: &str) -> R<Vec<usize>> {
        match self.get(key)? {
            (p, AttrVal::List(xs)) => xs
                .into_iter()
                .map(|x| usize::try_from(x).or_else(|_| self.p.err(p, format!("attribute `{key}` entry {x} is too large"))))
                .collect(),
            (p, v) => self.wrong(p, key, "a list `[...]`", &v),
        }
    }
}
