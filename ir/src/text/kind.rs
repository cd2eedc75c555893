//! Op mnemonics to op kinds, and the attributes each kind takes.

use crate::{BinaryOp, CmpOp, Op, ReduceOp, UnaryOp};

/// What kind of op a mnemonic names (attributes are filled in later).
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Kind {
    Param,
    Input,
    Const,
    Iota,
    Unary(UnaryOp),
    Binary(BinaryOp),
    Compare(CmpOp),
    Select,
    Cast,
    Reshape,
    Broadcast,
    Permute,
    Slice,
    Concat,
    Reduce(ReduceOp),
    MatMul,
    Gather,
    ScatterAdd,
    Gelu,
    GeluGrad,
    LayerNorm,
    LayerNormGrad,
    Softmax,
    SoftmaxGrad,
    CrossEntropy,
    CrossEntropyGrad,
    CrossEntropyWithGrad,
    Attention,
    AttentionGrad,
    AdamW,
    AllReduce,
    FromOwners,
    Gemm,
    Kernel,
}

/// The kind of op that mnemonic `m` names, if any.
pub(crate) fn kind_of(m: &str) -> Option<Kind> {
    use Kind::*;
    for u in Op::UNARY {
        if Op::Unary(u).mnemonic() == m {
            return Some(Unary(u));
        }
    }
    for b in Op::BINARY {
        if Op::Binary(b).mnemonic() == m {
            return Some(Binary(b));
        }
    }
    for c in Op::COMPARE {
        if Op::Compare(c).mnemonic() == m {
            return Some(Compare(c));
        }
    }
    Some(match m {
        "param" => Param,
        "input" => Input,
        "const" => Const,
        "iota" => Iota,
        "select" => Select,
        "cast" => Cast,
        "reshape" => Reshape,
        "broadcast" => Broadcast,
        "permute" => Permute,
        "slice" => Slice,
        "concat" => Concat,
        "reduce_sum" => Reduce(ReduceOp::Sum),
        "reduce_max" => Reduce(ReduceOp::Max),
        "matmul" => MatMul,
        "gather" => Gather,
        "scatter_add" => ScatterAdd,
        "gelu" => Gelu,
        "gelu_grad" => GeluGrad,
        "layernorm" => LayerNorm,
        "layernorm_grad" => LayerNormGrad,
        "softmax" => Softmax,
        "softmax_grad" => SoftmaxGrad,
        "cross_entropy" => CrossEntropy,
        "cross_entropy_grad" => CrossEntropyGrad,
        "cross_entropy_with_grad" => CrossEntropyWithGrad,
        "attention" => Attention,
        "attention_grad" => AttentionGrad,
        "adamw" => AdamW,
        "all_reduce" => AllReduce,
        "from_owners" => FromOwners,
        "gemm" => Gemm,
        "kernel" => Kernel,
        _ => return None,
    })
}

/// The attribute names a kind takes, in printing order.
pub(crate) fn attr_names(k: Kind) -> &'static [&'static str] {
    use Kind::*;
    match k {
        Iota | Concat => &["axis"],
        Broadcast => &["dims"],
        Permute => &["perm"],
        Slice => &["axis", "start", "end"],
        Reduce(_) => &["axes"],
        FromOwners => &["owners"],
        MatMul => &["trans_a", "trans_b"],
        LayerNorm => &["eps"],
        CrossEntropy | CrossEntropyGrad | CrossEntropyWithGrad => &["vocab"],
        Attention | AttentionGrad => &["heads", "scale"],
        AdamW => &["beta1", "beta2", "eps", "weight_decay"],
        Gemm => &["trans_a", "trans_b", "bias", "gelu", "accumulate"],
        _ => &[],
    }
}
