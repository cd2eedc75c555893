//! The operations of the IR, each with its semantics.
//!
//! Primitives are small and orthogonal; composites are the ops a transformer is made of, with
//! hand-written reference semantics (in the interpreter) and hand-written backward rules (in the
//! `autodiff` pass). Result types are computed by [`crate::infer::result_types`].
//!
//! Conventions: binary elementwise ops need operands of identical type (broadcasting is the
//! explicit [`Op::Broadcast`]); axes are 0-based; "last axis" means the innermost (contiguous)
//! dimension; all tensors are row-major.

use crate::{DType, Dim, Shape, Type};

/// Elementwise unary functions on floats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`.
    Neg,
    /// `e^x`.
    Exp,
    /// Natural logarithm.
    Log,
    /// Square root.
    Sqrt,
    /// `1 / sqrt(x)` (exact, not an approximation).
    Rsqrt,
    /// Hyperbolic tangent.
    Tanh,
    /// `1 / x`.
    Recip,
}

/// Elementwise binary functions; operands and result share one type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b`.
    Div,
    /// `max(a, b)` (a NaN operand gives NaN).
    Max,
    /// `min(a, b)` (a NaN operand gives NaN).
    Min,
}

/// Elementwise comparisons; the result is i32 0 or 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CmpOp {
    /// `a < b`.
    Lt,
    /// `a <= b`.
    Le,
    /// `a > b`.
    Gt,
    /// `a >= b`.
    Ge,
    /// `a == b`.
    Eq,
    /// `a != b`.
    Ne,
}

/// Reduction kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
}

/// One operation. Inputs are listed per variant as `(name: type)`; results likewise.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    // ---- sources -------------------------------------------------------------------------
    /// A trainable parameter, bound by name (checkpoint tensors map to parameters by name).
    /// No inputs; result `ty`.
    Param { name: String, ty: Type },
    /// A per-step input (tokens, targets, runtime scalars such as the learning rate).
    /// No inputs; result `ty`.
    Input { name: String, ty: Type },
    /// Every element equal to `value` (rounded to the dtype). No inputs; result `ty`.
    Const { value: f64, ty: Type },
    /// Index along `axis`: element `[i0, .., in]` is `i_axis`. No inputs; result `ty` (i32 or float).
    Iota { axis: usize, ty: Type },

    // ---- elementwise ---------------------------------------------------------------------
    /// `f(x)` per element. `(x: float T) -> T`.
    Unary(UnaryOp),
    /// `f(a, b)` per element. `(a: T, b: T) -> T`.
    Binary(BinaryOp),
    /// Comparison per element. `(a: T, b: T) -> i32 with T's shape` (1 where true).
    Compare(CmpOp),
    /// `cond != 0 ? a : b`. `(cond: i32[S], a: T[S], b: T[S]) -> T[S]`.
    Select,
    /// Conversion to `to` (round-to-nearest-even; float to i32 truncates). `(x: T[S]) -> to[S]`.
    Cast { to: DType },

    // ---- layout --------------------------------------------------------------------------
    /// Same elements in row-major order, new shape of equal element count. `(x) -> dtype(x)[shape]`.
    Reshape { shape: Shape },
    /// Operand axis `i` becomes result axis `dims[i]` (strictly increasing); an operand dim must
    /// equal the result dim or be 1; other result axes repeat the operand. `(x) -> dtype(x)[shape]`.
    Broadcast { dims: Vec<usize>, shape: Shape },
    /// Result axis `i` is operand axis `perm[i]`. `(x) -> permuted`.
    Permute { perm: Vec<usize> },
    /// Elements `start..end` along `axis` (constant bounds). `(x) -> x with that axis = end-start`.
    Slice { axis: usize, start: u64, end: u64 },
    /// Operands joined along `axis`; other dims equal. `(x0, x1, ..) -> joined`.
    Concat { axis: usize },

    // ---- reductions and contractions -----------------------------------------------------
    /// Reduces over `axes` (sorted, distinct), removing them. `(x: T[S]) -> T[S without axes]`.
    Reduce { op: ReduceOp, axes: Vec<usize> },
    /// Batched matrix product of the last two axes, `op(a) @ op(b)`, where `op` transposes when
    /// the flag is set. `a: [..., M, K]`, `b: [..., K, N]` with equal batch dims, or `b` rank 2
    /// (shared across a's batch). Result `[..., M, N]`. Accumulation is in f32 (f64 in f64 mode).
    MatMul { trans_a: bool, trans_b: bool },

    // ---- indexing ------------------------------------------------------------------------
    /// Row lookup: `(table: T[N, C], idx: i32[S]) -> T[S, C]`, `out[s, c] = table[idx[s], c]`.
    Gather,
    /// Adjoint of `Gather`: `(src: T[S, C], idx: i32[S]) -> T[rows, C]`, zeros plus
    /// `out[idx[s], c] += src[s, c]` in increasing order of `s`.
    ScatterAdd { rows: Dim },

    // ---- composites ----------------------------------------------------------------------
    /// GELU, tanh form: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`. `(x: T) -> T`.
    Gelu,
    /// Gradient of GELU: `(x: T, dy: T) -> dx: T`.
    GeluGrad,
    /// LayerNorm over the last axis with biased variance:
    /// `(x: f32[S, C], w: f32[C], b: f32[C]) -> (y: f32[S, C], mean: f32[S], rstd: f32[S])`,
    /// `rstd = 1 / sqrt(var + eps)`, `y = (x - mean) * rstd * w + b`.
    LayerNorm { eps: f64 },
    /// Gradient of LayerNorm from its saved statistics:
    /// `(dy: [S, C], x: [S, C], w: [C], mean: [S], rstd: [S]) -> (dx: [S, C], dw: [C], db: [C])`.
    LayerNormGrad,
    /// Softmax over the last axis (max-subtracted). `(x: T[S, N]) -> T[S, N]`.
    Softmax,
    /// Gradient of softmax from its output: `(y: [S, N], dy: [S, N]) -> dx = y * (dy - sum(dy*y))`.
    SoftmaxGrad,
    /// Per-position cross-entropy over the first `vocab` of the last axis:
    /// `(logits: f32[S, Vp], targets: i32[S]) -> loss: f32[S]`,
    /// `loss = logsumexp(logits[.., :vocab]) - logits[target]`.
    CrossEntropy { vocab: u64 },
    /// Gradient of `CrossEntropy`: `(logits, targets, dloss: f32[S]) -> dlogits: f32[S, Vp]`,
    /// `(softmax(logits[:vocab]) - onehot(target)) * dloss`, zero in the padding columns.
    CrossEntropyGrad { vocab: u64 },
    /// `CrossEntropy` and its gradient in one pass over the logits (llm.c's fused classifier):
    /// `(logits, targets, dloss: f32[S]) -> (loss: f32[S], dlogits)`. Made by `fuse-classifier`
    /// from a `cross_entropy` and a `cross_entropy_grad` of the same logits.
    CrossEntropyWithGrad { vocab: u64 },
    /// Causal multi-head attention on packed projections, as llm.c lays them out:
    /// `(qkv: f32[S, T, 3C]) -> (out: f32[S, T, C], lse: f32[S, heads, T])`. Channels `0..C` are
    /// the queries, `C..2C` the keys, `2C..3C` the values; head `h` uses channels
    /// `h*D..(h+1)*D` of each (`D = C / heads`). Per head, `s = scale * q k^T` masked to `j <= i`,
    /// `p = softmax(s)`, `out = p v`; `lse` is the log-sum-exp of each masked row of `s`, saved for
    /// the backward. Taking the packed layout keeps the split/transpose copies out of the graph.
    Attention { heads: u64, scale: f64 },
    /// Gradient of `Attention`: `(qkv, out, lse, dout) -> dqkv` (`p` recomputed from `lse`).
    AttentionGrad { heads: u64, scale: f64 },
    /// One AdamW update (PyTorch / llm.c formula) of a parameter tensor:
    /// `(p, g, m, v: f32[S], lr, bc1, bc2: f32[]) -> (p', m', v')` with `m' = b1 m + (1-b1) g`,
    /// `v' = b2 v + (1-b2) g^2`, `p' = p - lr ((m'/bc1) / (sqrt(v'/bc2) + eps) + wd p)`,
    /// where `bc1 = 1 - b1^t` and `bc2 = 1 - b2^t` are runtime scalars. An optional eighth
    /// operand is a low-precision copy of `p` (the bf16 weights the products read): then a fourth
    /// result is `p'` in the copy's dtype, written in the same pass (mixed precision's `amp`).
    AdamW { beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
    /// The mean of each operand over the ranks of a data-parallel run:
    /// `(x0: T0[S0], x1: T1[S1], ..) -> (T0[S0], T1[S1], ..)`, the identity on one rank (and in
    /// the interpreter, which is one rank). Made by `data-parallel` for the loss and for buckets
    /// of gradients; backends run one node as one collective (a group of NCCL all-reduces on
    /// CUDA), result `i` in place over operand `i` or elsewhere.
    AllReduce,
    /// Each operand as its owner rank holds it: `(x0, x1, ..) -> (x0, x1, ..)` where result `i`
    /// is operand `i` of rank `owners[i]` (ZeRO-1's parameter all-gather, per tensor: each
    /// rank updates the parameters it owns, then every rank takes every parameter from its
    /// owner); the identity on one rank and in the interpreter. Made by `optimizer` with
    /// sharded state; backends run one NCCL broadcast per operand, in one group.
    FromOwners { owners: Vec<usize> },

    // ---- fused ---------------------------------------------------------------------------
    /// A matmul with its epilogue folded in (`fuse-epilogue`, `fuse-grad-accum`):
    /// `y = op(a) op(b)` accumulated in f32, then in this order: `+ bias` (broadcast over the
    /// last axis), GELU (the value before GELU is a second result, saved for the backward), a
    /// cast to `out`, and `acc + y` (beta = 1: the result is written in place over `acc`).
    /// Inputs: `a`, `b`, then `bias: [N]` if `bias`, then `acc` (typed like the result) if
    /// `accumulate`. Results: `y: out[..., M, N]`, then `pre_gelu: dtype(a)[..., M, N]` if `gelu`.
    Gemm(Gemm),
    /// A fused group: runs `body` (a small graph whose `input` nodes, in order, receive the
    /// operands and whose outputs, in order, are the results). Produced by `fuse-elementwise`;
    /// the interpreter runs the body, backends compile it to one kernel named `name`.
    Kernel(Box<Kernel>),
}

/// The attributes of [`Op::Gemm`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Gemm {
    /// Transpose `a` (its last two axes).
    pub trans_a: bool,
    /// Transpose `b`.
    pub trans_b: bool,
    /// Add a bias vector over the last axis.
    pub bias: bool,
    /// Apply GELU (tanh form) and also return the pre-GELU value.
    pub gelu: bool,
    /// The result dtype (a cast epilogue when it differs from the operands').
    pub out: DType,
    /// Add into the last operand (beta = 1), in place.
    pub accumulate: bool,
}

impl Gemm {
    /// The name backends give its launch, after what it fuses: `gemm`, `gemm_bias_gelu`, ...
    pub fn launch_name(&self) -> String {
        let parts = [(self.bias, "_bias"), (self.gelu, "_gelu"), (self.accumulate, "_acc")];
        parts.iter().filter(|(on, _)| *on).fold("gemm".to_string(), |s, (_, p)| s + p)
    }
}

/// The body of an [`Op::Kernel`].
#[derive(Clone, Debug, PartialEq)]
pub struct Kernel {
    /// What the kernel contains, e.g. `add_layernorm`; backends name the kernel after it.
    pub name: String,
    /// The fused ops as a graph: `input` nodes are the operands, outputs are the results.
    pub body: crate::Graph,
}

impl Op {
    /// The mnemonic used in `.graph` text.
    pub fn mnemonic(&self) -> &'static str {
        use Op::*;
        match self {
            Param { .. } => "param",
            Input { .. } => "input",
            Const { .. } => "const",
            Iota { .. } => "iota",
            Unary(u) => match u {
                UnaryOp::Neg => "neg",
                UnaryOp::Exp => "exp",
                UnaryOp::Log => "log",
                UnaryOp::Sqrt => "sqrt",
                UnaryOp::Rsqrt => "rsqrt",
                UnaryOp::Tanh => "tanh",
                UnaryOp::Recip => "recip",
            },
            Binary(b) => match b {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
                BinaryOp::Max => "max",
                BinaryOp::Min => "min",
            },
            Compare(c) => match c {
                CmpOp::Lt => "lt",
                CmpOp::Le => "le",
                CmpOp::Gt => "gt",
                CmpOp::Ge => "ge",
                CmpOp::Eq => "eq",
                CmpOp::Ne => "ne",
            },
            Select => "select",
            Cast { .. } => "cast",
            Reshape { .. } => "reshape",
            Broadcast { .. } => "broadcast",
            Permute { .. } => "permute",
            Slice { .. } => "slice",
            Concat { .. } => "concat",
            Reduce { op: ReduceOp::Sum, .. } => "reduce_sum",
            Reduce { op: ReduceOp::Max, .. } => "reduce_max",
            MatMul { .. } => "matmul",
            Gather => "gather",
            ScatterAdd { .. } => "scatter_add",
            Gelu => "gelu",
            GeluGrad => "gelu_grad",
            LayerNorm { .. } => "layernorm",
            LayerNormGrad => "layernorm_grad",
            Softmax => "softmax",
            SoftmaxGrad => "softmax_grad",
            CrossEntropy { .. } => "cross_entropy",
            CrossEntropyGrad { .. } => "cross_entropy_grad",
            CrossEntropyWithGrad { .. } => "cross_entropy_with_grad",
            Attention { .. } => "attention",
            AttentionGrad { .. } => "attention_grad",
            AdamW { .. } => "adamw",
            AllReduce => "all_reduce",
            FromOwners { .. } => "from_owners",
            Gemm(_) => "gemm",
            Kernel(_) => "kernel",
        }
    }

    /// Whether the op is a collective (`all_reduce`, `from_owners`): it talks to the other ranks,
    /// so every rank must run it, also where nothing reads its results — passes never drop one.
    pub fn is_collective(&self) -> bool {
        matches!(self, Op::AllReduce | Op::FromOwners { .. })
    }

    /// Whether the op is elementwise (each output element depends only on the same element of
    /// each input): the ops `fuse-elementwise` chains.
    pub fn is_elementwise(&self) -> bool {
        matches!(self, Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Select | Op::Cast { .. } | Op::Gelu | Op::GeluGrad)
    }

    /// Whether the op is a composite row op: one that reads and writes whole rows of its last
    /// axis (LayerNorm, softmax, cross-entropy and their gradients), which fusion keeps as one
    /// kernel's core and `lower_rows` expands.
    pub fn is_row_composite(&self) -> bool {
        matches!(
            self,
            Op::LayerNorm { .. }
                | Op::LayerNormGrad
                | Op::Softmax
                | Op::SoftmaxGrad
                | Op::CrossEntropy { .. }
                | Op::CrossEntropyGrad { .. }
                | Op::CrossEntropyWithGrad { .. }
        )
    }

    /// Whether the op has no inputs.
    pub fn is_source(&self) -> bool {
        matches!(self, Op::Param { .. } | Op::Input { .. } | Op::Const { .. } | Op::Iota { .. })
    }

    /// Every unary op, for generators and parsers.
    pub const UNARY: [UnaryOp; 7] =
        [UnaryOp::Neg, UnaryOp::Exp, UnaryOp::Log, UnaryOp::Sqrt, UnaryOp::Rsqrt, UnaryOp::Tanh, UnaryOp::Recip];
    /// Every binary op.
    pub const BINARY: [BinaryOp; 6] = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Max, BinaryOp::Min];
    /// Every comparison.
    pub const COMPARE: [CmpOp; 6] = [CmpOp::Lt, CmpOp::Le, CmpOp::Gt, CmpOp::Ge, CmpOp::Eq, CmpOp::Ne];
}

#[cfg(test)]
mod gemm_name_tests {
    use super::{DType, Gemm};

    #[test]
    fn launch_names_list_the_epilogues_in_order() {
        let g = Gemm { trans_a: false, trans_b: true, bias: true, gelu: true, out: DType::F32, accumulate: false };
        assert_eq!(g.launch_name(), "gemm_bias_gelu");
        assert_eq!(Gemm { bias: false, gelu: false, accumulate: true, ..g.clone() }.launch_name(), "gemm_acc");
        assert_eq!(Gemm { bias: false, gelu: false, ..g }.launch_name(), "gemm");
    }
}
