//! Column sums of the attention backward's result right after it: the qkv bias gradient is a
//! fused kernel that only sums `dqkv` over its rows ([`sums_columns`]); placed right after the
//! `attention_grad` that writes `dqkv`, a target can compute the sums inside the backward
//! kernels (CUDA on Hopper: partial sums per tile, then one small launch) instead of reading
//! `dqkv` again. The memory-greedy order may put other nodes between the two.

use fusec_ir::{BinaryOp, DType, Graph, Kernel, Node, Op, ReduceOp};

/// Whether a fused kernel only sums its first operand, bf16, over every axis but the last, in
/// f32 (`cast` then `reduce_sum`): `Some(false)`, or `Some(true)` when it adds that sum to its
/// second operand (an f32 accumulator of the sum's shape, under gradient accumulation).
pub fn sums_columns(k: &Kernel) -> Option<bool> {
    let body = &k.body;
    let (inputs, ops): (Vec<&Node>, Vec<&Node>) = body.nodes.iter().partition(|n| matches!(n.op, Op::Input { .. }));
    let x = inputs.first()?.results[0];
    let rank = body.ty(x).shape.rank();
    let (cast, sum) = (ops.first()?, ops.get(1)?);
    let summed = body.ty(x).dtype == DType::BF16
        && cast.op == Op::Cast { to: DType::F32 }
        && cast.inputs[..] == [x]
        && matches!(&sum.op, Op::Reduce { op: ReduceOp::Sum, axes } if rank >= 2 && *axes == (0..rank - 1).collect::<Vec<_>>())
        && sum.inputs[..] == [cast.results[0]];
    let (last, accumulates) = match (&inputs[1..], &ops[2..]) {
        ([], []) => (sum.results[0], false),
        ([acc], [add]) => {
            let (a, s) = (acc.results[0], sum.results[0]);
            let adds = add.op == Op::Binary(BinaryOp::Add) && (add.inputs[..] == [a, s] || add.inputs[..] == [s, a]);
            (add.results[0], adds && body.ty(a) == body.ty(s))
        }
        _ => return None,
    };
    let one_output = body.outputs.len() == 1 && body.outputs[0].1 == last;
    (summed && one_output && (accumulates || inputs.len() == 1)).then_some(accumulates)
}

/// `order` with each [`sums_columns`] kernel of an `attention_grad` result moved to right after
/// that node, where its other operand (an accumulator) is already there.
pub(super) fn after_attention(g: &Graph, order: &[usize]) -> Vec<usize> {
    let producer = |n: &Node, k: usize| g.values[n.inputs[k].0 as usize].node.0 as usize;
    let mut pos = vec![usize::MAX; g.nodes.len()];
    for (p, &n) in order.iter().enumerate() {
        pos[n] = p;
    }
    let mut moves: Vec<(usize, usize)> = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        let Op::Kernel(k) = &n.op else { continue };
        if sums_columns(k).is_none() {
            continue;
        }
        let a = producer(n, 0);
        let ready = (1..n.inputs.len()).all(|j| pos[producer(n, j)] < pos[a]);
        if matches!(g.nodes[a].op, Op::AttentionGrad { .. }) && ready && pos[i] > pos[a] + 1 {
            moves.push((i, a));
        }
    }
    let mut out: Vec<usize> = order.iter().copied().filter(|n| !moves.iter().any(|(k, _)| k == n)).collect();
    for (k, a) in moves {
        let at = out.iter().position(|&n| n == a).expect("in the order");
        out.insert(at + 1, k);
    }
    out
}
