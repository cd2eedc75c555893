//! Row programs: the kernel-level IR. A [`Prog`] says what one segment of a fused kernel
//! computes, in the shape every code generator wants; `fusec_passes::lower_rows` builds them
//! from a `kernel` node's body and both backends (Cranelift, CUDA C) consume them, so they
//! agree on what a kernel computes and differ only in how it is scheduled. [`region`] and
//! [`liveness`] are the analyses every backend runs first.
//!
//! A kernel's domain is viewed as a matrix `[R, C]`: the domain's axes are split at `split`
//! into row axes (their product is `R`) and column axes (their product is `C`; usually just the
//! last axis). Every value of the program lives in one [`Space`]:
//!
//! - `Elem`: one value per element `(r, c)` — computed in a loop over the columns of a row
//!   (on the CPU four columns at a time, `f32x4`, plus a scalar tail);
//! - `Row`: one value per row (`mean`, `rstd`, targets, row sums) — computed once per row;
//! - `Col`: one value per column (LayerNorm weights, column sums) — loaded per column inside the
//!   loops, or computed once per column in the *finalize* function (column-reduction results);
//! - `Uni`: one value for the whole kernel (constants, `lr`).
//!
//! Every node also has a *level*: the number of row reductions it depends on. Per row, the
//! generated code makes one pass over the columns for each level that has element work: pass
//! `L` computes the element values of level `L` that feed a row reduction or a column reduction
//! of that level, or (in the last pass only) a stored result; the row reductions it finishes give
//! row values of level `L + 1`, computed between the passes. Element values of lower levels
//! needed by a later pass are recomputed from the inputs, never stored. Storing results only in
//! the last pass also makes in-place results safe: every pass reads an operand before any pass
//! writes over it, and within a pass each column's loads come before its stores.
//!
//! The one exception to recomputation: an `exp`, `log` or `tanh` element value needed by a later
//! pass (softmax and cross-entropy gradients: `exp(x - max)` feeds the row sum, then the output)
//! is *stashed* ([`Prog::stashes`]) in a per-chunk row buffer (`C` floats, so it stays in L2) and
//! read back, because recomputing it costs far more than a store and a load (the CUDA backend
//! ignores stashes and recomputes).
//!
//! Column reductions (`dw`, `db`, bias gradients: sums over all rows) have level
//! [`FINAL`]: each chunk of rows accumulates its own partial sums (rows in order) into scratch
//! memory allocated once at compile time; the finalize function adds the partials in chunk order
//! and runs the column-space epilogue. The chunking depends only on `R` and `C`, never on the
//! thread count, so results are bit-identical for any number of threads.
//!
//! The CPU code generator may further run element `exp` / `tanh` values and row maxima of
//! operand rows in native routines over whole rows ([`Prog::offloads`],
//! [`Prog::native_maxes`]); the lowering leaves those lists empty.
//!
//! The printed program (see [`Prog::text`]) refers to memory only through *slots* (operands,
//! results, scratch) in first-use order, so identical segments of different kernels print the
//! same and share one compiled function.

mod analysis;
mod text;

pub use analysis::{liveness, region, Liveness, Region};

use crate::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

/// A node of a [`Prog`], by index.
pub type NodeId = u32;

/// The level of values that exist only after every row is done (column-reduction results).
pub const FINAL: u32 = u32::MAX;

/// A register type: floats of every storage dtype are computed as f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    /// 32-bit float (f32 and bf16 values).
    F32,
    /// 32-bit signed integer (indices, masks).
    I32,
}

/// Where a value varies; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// One value for the whole kernel.
    Uni,
    /// One value per row.
    Row,
    /// One value per column.
    Col,
    /// One value per element.
    Elem,
}

impl Space {
    /// From whether a value varies along rows and along columns.
    pub fn from_parts(row: bool, col: bool) -> Space {
        match (row, col) {
            (false, false) => Space::Uni,
            (true, false) => Space::Row,
            (false, true) => Space::Col,
            (true, true) => Space::Elem,
        }
    }
    /// Whether the value varies along rows.
    pub fn has_row(self) -> bool {
        matches!(self, Space::Row | Space::Elem)
    }
    /// Whether the value varies along columns.
    pub fn has_col(self) -> bool {
        matches!(self, Space::Col | Space::Elem)
    }
    /// The space of a value computed from values in `self` and `other`.
    pub fn join(self, other: Space) -> Space {
        Space::from_parts(self.has_row() || other.has_row(), self.has_col() || other.has_col())
    }
}

/// How elements are stored in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mem {
    /// f32.
    F32,
    /// bfloat16: loaded by a 16-bit shift, stored with round-to-nearest-even.
    Bf16,
    /// i32.
    I32,
}

impl Mem {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Mem::Bf16 => 2,
            Mem::F32 | Mem::I32 => 4,
        }
    }
    /// The register type of a loaded element.
    pub fn ty(self) -> Ty {
        match self {
            Mem::I32 => Ty::I32,
            Mem::F32 | Mem::Bf16 => Ty::F32,
        }
    }
}

/// One term of a row offset: `((r / div) % modulo) * stride` (`modulo == 0`: no modulo).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowTerm {
    /// Divisor of the row index.
    pub div: u64,
    /// Modulus after dividing (0 for none).
    pub modulo: u64,
    /// Elements per step.
    pub stride: u64,
}

/// Where element `(r, c)` of a value lives in a slot: at element offset
/// `Σ row terms + (col ? c : 0)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct View {
    /// The slot holding the buffer.
    pub slot: u32,
    /// The storage type.
    pub mem: Mem,
    /// The row part of the offset.
    pub row: Vec<RowTerm>,
    /// Whether the offset advances with the column (contiguously); otherwise the value is the
    /// same for every column of a row.
    pub col: bool,
}

impl View {
    /// The space of the values this view reads.
    pub fn space(&self) -> Space {
        Space::from_parts(!self.row.is_empty(), self.col)
    }
}

/// What a node computes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expr {
    /// An f32 constant (by bits).
    ConstF(u32),
    /// An i32 constant.
    ConstI(i32),
    /// A load through a view.
    Load(View),
    /// The column index `c` (i32).
    ColIota,
    /// `(r / div) % modulo` (i32; `modulo == 0`: none).
    RowIota {
        /// Divisor of the row index.
        div: u64,
        /// Modulus (0 for none).
        modulo: u64,
    },
    /// A unary float function.
    Unary(UnaryOp, NodeId),
    /// A binary function (float or i32 by the node's type).
    Binary(BinaryOp, NodeId, NodeId),
    /// A comparison of two values of one type; i32 0 or 1.
    Cmp(CmpOp, NodeId, NodeId),
    /// `cond != 0 ? a : b`.
    Select(NodeId, NodeId, NodeId),
    /// An f32 rounded to the nearest bf16 (ties to even), kept as f32.
    RoundBf16(NodeId),
    /// f32 to i32, truncating (saturating).
    FToI(NodeId),
    /// i32 to f32, rounding to nearest.
    IToF(NodeId),
    /// A reduction over the columns of a row (level + 1).
    RowReduce(ReduceOp, NodeId),
    /// `x(r, t) + 0.0` for the per-row (or kernel-wide) i32 column `t`, or `0.0` when `t` is
    /// outside `[0, C)`: the row sum of `c == t ? x : 0` (a one-hot pick, such as the target's
    /// logit in cross-entropy), bit for bit, computed at one column instead of summed over all.
    Pick(NodeId, NodeId),
    /// A reduction over all rows, by chunk partials in the given scratch slot ([`FINAL`]).
    ColReduce(ReduceOp, NodeId, u32),
}

impl Expr {
    /// The nodes this one reads.
    pub fn args(&self) -> Vec<NodeId> {
        use Expr::*;
        match *self {
            ConstF(_) | ConstI(_) | Load(_) | ColIota | RowIota { .. } => vec![],
            Unary(_, a) | RoundBf16(a) | FToI(a) | IToF(a) | RowReduce(_, a) | ColReduce(_, a, _) => vec![a],
            Binary(_, a, b) | Cmp(_, a, b) | Pick(a, b) => vec![a, b],
            Select(c, a, b) => vec![c, a, b],
        }
    }
}

/// One node: an expression with its type, space and level.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What it computes.
    pub expr: Expr,
    /// Its register type.
    pub ty: Ty,
    /// Where it varies.
    pub space: Space,
    /// How many row reductions it depends on ([`FINAL`] after a column reduction).
    pub level: u32,
}

/// A result written through a view.
#[derive(Clone, Debug, PartialEq)]
pub struct Store {
    /// Where (the view's space is the value's space).
    pub view: View,
    /// What.
    pub value: NodeId,
}

/// What a slot of the argument array points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    /// Kernel operand `k`.
    Operand(usize),
    /// Kernel result `j`.
    Result(usize),
    /// Scratch of this many f32 (column-reduction partials), owned by the compiled kernel.
    Scratch(usize),
}

/// One independent part of a kernel (a kernel body is usually one segment; the multi-tensor
/// AdamW kernel has one per parameter), compiled to one function (plus a finalize function
/// when it has column-space results).
#[derive(Clone, Debug, PartialEq)]
pub struct Prog {
    /// The kernel's name.
    pub name: String,
    /// Rows `R`.
    pub rows: u64,
    /// Columns `C`.
    pub cols: u64,
    /// Chunks of rows (the unit of parallelism and of column-reduction partials).
    pub chunks: u64,
    /// Nodes in topological order.
    pub nodes: Vec<Node>,
    /// Results to write.
    pub stores: Vec<Store>,
    /// The argument array's slots, in first-use order.
    pub slots: Vec<Slot>,
    /// Transcendental element values (`exp`, `log`, `tanh`) that later passes read back from a
    /// per-chunk row buffer (in the given scratch slot) instead of recomputing them.
    pub stashes: Vec<(NodeId, u32)>,
    /// Element `exp` / `tanh` values the CPU code generator computes with a native routine into
    /// a per-chunk row buffer (in the given scratch slot), from an operand row or from the
    /// arguments a column loop wrote there; every later read loads them back. Empty as the
    /// lowering (`fusec_passes::lower_rows`) returns a program; the CPU compiler fills it in
    /// when its host has such routines (they give the same bits as the generated code).
    pub offloads: Vec<(NodeId, u32)>,
    /// Row maxima of an f32 operand row (or of its first `k` columns, the others masked to
    /// `-inf`) that the CPU code generator computes with a native routine (the column loop's
    /// value). Empty from the lowering; filled in with [`Prog::offloads`].
    pub native_maxes: Vec<NodeId>,
}

/// Rows `[begin, end)` of chunk `k` of `chunks` over `rows` rows.
pub fn chunk_bounds(rows: u64, chunks: u64, k: u64) -> (u64, u64) {
    (k * rows / chunks, (k + 1) * rows / chunks)
}

/// Scratch floats per chunk for a row-space column reduction (a 64-byte line per chunk).
pub const UNI_PARTIAL_STRIDE: u64 = 16;

impl Prog {
    /// The node `id`.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// Rows `[begin, end)` of chunk `k` (how the CPU backend cuts the rows; see [`chunk_bounds`]).
    pub fn chunk_rows(&self, k: u64) -> (u64, u64) {
        chunk_bounds(self.rows, self.chunks, k)
    }

    /// Approximate float operations: one per arithmetic node per element of its space (a
    /// reduction: one per element reduced).
    pub fn flops(&self) -> u64 {
        let (r, c) = (self.rows, self.cols);
        let size = |s: Space| match s {
            Space::Uni => 1,
            Space::Row => r,
            Space::Col => c,
            Space::Elem => r * c,
        };
        self.nodes
            .iter()
            .map(|n| match n.expr {
                Expr::ConstF(_) | Expr::ConstI(_) | Expr::Load(_) | Expr::ColIota | Expr::RowIota { .. } => 0,
                Expr::RowReduce(_, a) => size(self.node(a).space) * if self.node(a).space.has_col() { 1 } else { c },
                Expr::ColReduce(_, a, _) => size(self.node(a).space) * if self.node(a).space.has_row() { 1 } else { r },
                _ => size(n.space),
            })
            .sum()
    }
}
