//! Constructors of row-program nodes: each computes the node's space and level from its
//! arguments, shares identical nodes (hash-consing, so a value needed twice is one node), and
//! refuses what the code generators cannot do (i32 division and reductions, f16, a column
//! reduction result used per row).

use fusec_ir::rows::{Expr, Node, NodeId, Slot, Space, Ty, FINAL, UNI_PARTIAL_STRIDE};
use fusec_ir::{BinaryOp, CmpOp, DType, ReduceOp, UnaryOp};

use super::Lowerer;

impl Lowerer<'_, '_> {
    /// Adds (or finds) a node.
    pub fn node(&mut self, expr: Expr, ty: Ty) -> Result<NodeId, String> {
        if let Some(&id) = self.cse.get(&(expr.clone(), ty)) {
            return Ok(id);
        }
        let arg = |id: NodeId| -> &Node { &self.prog.nodes[id as usize] };
        let (space, level) = match &expr {
            Expr::ConstF(_) | Expr::ConstI(_) => (Space::Uni, 0),
            Expr::Load(v) => (v.space(), 0),
            Expr::ColIota => (Space::Col, 0),
            Expr::RowIota { .. } => (Space::Row, 0),
            Expr::RowReduce(_, a) => {
                let a = arg(*a);
                if a.level == FINAL {
                    return Err("a row reduction of a column-reduction result".into());
                }
                (Space::from_parts(a.space.has_row(), false), a.level + 1)
            }
            Expr::Pick(a, t) => {
                let (a, t) = (arg(*a), arg(*t));
                if a.level == FINAL || t.level == FINAL {
                    return Err("internal: a pick of a column-reduction result".into());
                }
                (Space::from_parts(a.space.has_row() || t.space.has_row(), false), a.level.max(t.level))
            }
            Expr::ColReduce(_, a, _) => {
                let a = arg(*a);
                if a.level == FINAL {
                    return Err("a column reduction of a column-reduction result".into());
                }
                (Space::from_parts(false, a.space.has_col()), FINAL)
            }
            e => e.args().iter().fold((Space::Uni, 0), |(s, l), &a| (s.join(arg(a).space), l.max(arg(a).level))),
        };
        if level == FINAL && space.has_row() {
            return Err("a column-reduction result is used per row (it exists only after every row)".into());
        }
        let id = self.prog.nodes.len() as NodeId;
        self.prog.nodes.push(Node { expr: expr.clone(), ty, space, level });
        self.cse.insert((expr, ty), id);
        Ok(id)
    }

    /// The type of node `id`.
    pub fn ty(&self, id: NodeId) -> Ty {
        self.prog.nodes[id as usize].ty
    }

    /// An f32 constant.
    pub fn constf(&mut self, x: f32) -> Result<NodeId, String> {
        self.node(Expr::ConstF(x.to_bits()), Ty::F32)
    }
    /// An i32 constant.
    pub fn consti(&mut self, x: i32) -> Result<NodeId, String> {
        self.node(Expr::ConstI(x), Ty::I32)
    }
    /// A unary float function.
    pub fn un(&mut self, u: UnaryOp, a: NodeId) -> Result<NodeId, String> {
        if self.ty(a) != Ty::F32 {
            return Err(format!("`{u:?}` of an i32"));
        }
        self.node(Expr::Unary(u, a), Ty::F32)
    }
    /// A binary op of two values of one type.
    pub fn bin(&mut self, op: BinaryOp, a: NodeId, b: NodeId) -> Result<NodeId, String> {
        let ty = self.ty(a);
        if ty == Ty::I32 && op == BinaryOp::Div {
            return Err("i32 division".into());
        }
        self.node(Expr::Binary(op, a, b), ty)
    }
    /// `a + b`.
    pub fn add(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, String> {
        self.bin(BinaryOp::Add, a, b)
    }
    /// `a - b`.
    pub fn sub(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, String> {
        self.bin(BinaryOp::Sub, a, b)
    }
    /// `a * b`.
    pub fn mul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, String> {
        self.bin(BinaryOp::Mul, a, b)
    }
    /// `a / b`.
    pub fn div(&mut self, a: NodeId, b: NodeId) -> Result<NodeId, String> {
        self.bin(BinaryOp::Div, a, b)
    }
    /// A comparison (i32 0/1).
    pub fn cmp(&mut self, c: CmpOp, a: NodeId, b: NodeId) -> Result<NodeId, String> {
        self.node(Expr::Cmp(c, a, b), Ty::I32)
    }
    /// `c != 0 ? a : b`.
    pub fn select(&mut self, c: NodeId, a: NodeId, b: NodeId) -> Result<NodeId, String> {
        let ty = self.ty(a);
        self.node(Expr::Select(c, a, b), ty)
    }
    /// The column index (i32).
    pub fn col_iota(&mut self) -> Result<NodeId, String> {
        if self.dom.len() - self.split > 1 && self.dom[self.split..self.dom.len() - 1].iter().any(|&d| d > 1) {
            return Err("a column index over several column axes".into());
        }
        self.node(Expr::ColIota, Ty::I32)
    }
    /// A reduction over the columns of each row. The row sum of a one-hot selection
    /// `c == t ? x : 0` (`t` per row, everything computable before the first pass) becomes a
    /// [`Expr::Pick`] of `x` at column `t`.
    pub fn row_reduce(&mut self, op: ReduceOp, a: NodeId) -> Result<NodeId, String> {
        if self.ty(a) != Ty::F32 {
            return Err("an i32 reduction".into());
        }
        if op == ReduceOp::Sum {
            if let Some((x, t)) = self.one_hot(a) {
                return self.node(Expr::Pick(x, t), Ty::F32);
            }
        }
        self.node(Expr::RowReduce(op, a), Ty::F32)
    }

    /// `(x, t)` when node `a` is `select(c == t, x, +0.0)` (or `t == c`) for the column index
    /// `c` and a value `t` constant along the row, all of level 0 (so a pick reads its operands
    /// before any pass writes a result, which may be in place over them).
    fn one_hot(&self, a: NodeId) -> Option<(NodeId, NodeId)> {
        let n = |id: NodeId| &self.prog.nodes[id as usize];
        let Expr::Select(c, x, z) = n(a).expr else { return None };
        if n(z).expr != Expr::ConstF(0.0f32.to_bits()) {
            return None;
        }
        let Expr::Cmp(fusec_ir::CmpOp::Eq, p, q) = n(c).expr else { return None };
        let t = match (&n(p).expr, &n(q).expr) {
            (Expr::ColIota, _) => q,
            (_, Expr::ColIota) => p,
            _ => return None,
        };
        let ok = n(t).ty == Ty::I32 && !n(t).space.has_col() && n(t).level == 0 && n(x).level == 0;
        ok.then_some((x, t))
    }
    /// A reduction over all rows (partials per chunk in fresh scratch).
    pub fn col_reduce(&mut self, op: ReduceOp, a: NodeId) -> Result<NodeId, String> {
        if self.ty(a) != Ty::F32 {
            return Err("an i32 reduction".into());
        }
        if let Some(&id) = self.colred.get(&(op, a)) {
            return Ok(id);
        }
        let per_chunk = if self.prog.node(a).space.has_col() { self.cols } else { UNI_PARTIAL_STRIDE };
        let slot = self.slot(Slot::Scratch((self.prog.chunks * per_chunk) as usize));
        let id = self.node(Expr::ColReduce(op, a, slot), Ty::F32)?;
        self.colred.insert((op, a), id);
        Ok(id)
    }
    /// `x` rounded as a result of dtype `d` is (bf16 results are rounded to bf16).
    pub fn round(&mut self, x: NodeId, d: DType) -> Result<NodeId, String> {
        match d {
            DType::BF16 => self.node(Expr::RoundBf16(x), Ty::F32),
            DType::F16 => Err("f16 values are not supported in row programs".into()),
            _ => Ok(x),
        }
    }
}
