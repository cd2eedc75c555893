//! Mutations of valid graphs for the fuzz tests past the parser (`passes/tests/fuzz_passes.rs`
//! through every pass, `tests/tests/fuzz_lower.rs` through both backends' kernel lowering): as
//! IR (then usually re-typed, so that the mutant is a well-typed graph the passes must handle)
//! and as `.graph` text.

use crate::rng::Rng;
use crate::{BinaryOp, CmpOp, DType, Dim, Graph, Op, ReduceOp, UnaryOp, ValueId};

/// A random element of `xs`.
pub fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.below(xs.len() as u64) as usize]
}

/// A random index below `n` (which must be positive).
fn idx(rng: &mut Rng, n: usize) -> usize {
    rng.below(n as u64) as usize
}

/// Names the passes add or give meaning to, plus the empty name.
const SPECIAL: [&str; 10] = ["loss", "dloss", "lr", "bc1", "bc2", "grad_clip", "grad_norm", "tokens", "", "grad."];

/// One random mutation of `g`. Four times out of five the result is re-typed (every node added
/// again through `try_add`, so result types follow the mutation); when that fails, or otherwise,
/// the declared types are kept and only the verifier stands between the mutant and the passes.
pub fn mutate_ir(rng: &mut Rng, g: &Graph) -> Graph {
    let mut m = g.clone();
    let n = m.nodes.len();
    if n == 0 {
        return m;
    }
    let i = idx(rng, n);
    match rng.below(10) {
        0 | 1 => mutate_attr(rng, &mut m, i),
        2 => {
            // Swap two operands.
            let ins = &mut m.nodes[i].inputs;
            if ins.len() >= 2 {
                let (a, b) = (idx(rng, ins.len()), idx(rng, ins.len()));
                ins.swap(a, b);
            }
        }
        3 => {
            // Rewire an operand to an earlier value.
            let first = m.nodes[..i].iter().flat_map(|nd| nd.results.iter().copied()).collect::<Vec<_>>();
            let k = m.nodes[i].inputs.len();
            if k > 0 && !first.is_empty() {
                m.nodes[i].inputs[idx(rng, k)] = pick(rng, &first);
            }
        }
        4 => swap_op(rng, &mut m.nodes[i].op),
        5 => rename(rng, &mut m, i),
        6 => mutate_outputs(rng, &mut m),
        7 => {
            // Symbols: drop one, or add one.
            if !m.syms.is_empty() && rng.chance(0.5) {
                let k = idx(rng, m.syms.len());
                m.syms.remove(k);
            } else {
                m.syms.push(pick(rng, &["N", "B", "T", "Z"]).to_string());
            }
        }
        _ => {
            // A source's type: another dtype or another dim.
            let syms = m.syms.clone();
            if let Op::Param { ty, .. } | Op::Input { ty, .. } | Op::Const { ty, .. } | Op::Iota { ty, .. } = &mut m.nodes[i].op {
                if rng.chance(0.4) || ty.shape.rank() == 0 {
                    ty.dtype = pick(rng, &DType::ALL);
                } else {
                    let k = idx(rng, ty.shape.rank());
                    ty.shape.0[k] = dim(rng, &syms);
                }
            }
        }
    }
    if rng.chance(0.8) {
        if let Some(t) = retype(&m) {
            return t;
        }
    }
    // Keep the declared types, but let sources declare the type their op now says.
    for k in 0..m.nodes.len() {
        if let Op::Param { ty, .. } | Op::Input { ty, .. } | Op::Const { ty, .. } | Op::Iota { ty, .. } = &m.nodes[k].op {
            if let Some(&r) = m.nodes[k].results.first() {
                if let Some(info) = m.values.get_mut(r.0 as usize) {
                    info.ty = ty.clone();
                }
            }
        }
    }
    m
}

/// A dim for a shape: a small or huge literal, a symbol, or a product.
fn dim(rng: &mut Rng, syms: &[String]) -> Dim {
    match rng.below(6) {
        0 | 1 => Dim::lit(pick(rng, &[1, 2, 3, 4, 8, 64])),
        2 => Dim::lit(pick(rng, &[0, 1 << 31, 1 << 40, 1 << 62, u64::MAX])),
        _ if syms.is_empty() => Dim::lit(2),
        3 => Dim::sym(&syms[idx(rng, syms.len())]),
        4 => Dim::sym(&syms[idx(rng, syms.len())]).mul(&Dim::sym(&syms[idx(rng, syms.len())])),
        _ => Dim::sym(&syms[idx(rng, syms.len())]).mul(&Dim::lit(pick(rng, &[2, 3, 1 << 40]))),
    }
}

/// `g` with every node added again through `try_add` (result types recomputed), or `None`
/// when some node no longer types.
pub fn retype(g: &Graph) -> Option<Graph> {
    let mut out = Graph::new(&g.name, &[]);
    out.syms = g.syms.clone();
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    for n in &g.nodes {
        let ins = n.inputs.iter().map(|v| map.get(v.0 as usize).copied().flatten()).collect::<Option<Vec<_>>>()?;
        let res = out.try_add(n.op.clone(), &ins).ok()?;
        if res.len() != n.results.len() {
            return None;
        }
        for (old, new) in n.results.iter().zip(res) {
            *map.get_mut(old.0 as usize)? = Some(new);
        }
    }
    for (name, v) in &g.outputs {
        out.output(name, map.get(v.0 as usize).copied().flatten()?);
    }
    Some(out)
}

/// Changes one attribute of node `i` to a value from the edges of its range.
fn mutate_attr(rng: &mut Rng, g: &mut Graph, i: usize) {
    let syms = g.syms.clone();
    let rank = g.nodes[i].inputs.first().map_or(2, |v| g.values.get(v.0 as usize).map_or(2, |x| x.ty.shape.rank()));
    let axis = |rng: &mut Rng| pick(rng, &[0, 1, 2, rank.saturating_sub(1), rank, 7, usize::MAX]);
    let float = |rng: &mut Rng| pick(rng, &[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, -1.0, 1e-30, 1e30, 0.5, 2147483648.0]);
    let big = |rng: &mut Rng| pick(rng, &[0, 1, 2, 3, 4, 250, 256, 257, 1 << 40, u64::MAX]);
    match &mut g.nodes[i].op {
        Op::Const { value, ty } => {
            if rng.chance(0.8) {
                *value = float(rng);
            } else {
                ty.dtype = pick(rng, &DType::ALL);
            }
        }
        Op::Iota { axis: a, .. } | Op::Concat { axis: a } => *a = axis(rng),
        Op::Cast { to } => *to = pick(rng, &DType::ALL),
        Op::Reshape { shape } => {
            if shape.rank() >= 2 && rng.chance(0.5) {
                let (a, b) = (idx(rng, shape.rank()), idx(rng, shape.rank()));
                shape.0.swap(a, b);
            } else if shape.rank() >= 1 {
                let k = idx(rng, shape.rank());
                shape.0[k] = dim(rng, &syms);
            }
        }
        Op::Broadcast { dims, shape } => {
            if rng.chance(0.5) {
                *dims = (0..idx(rng, 4)).map(|_| axis(rng)).collect();
            } else if shape.rank() >= 1 {
                let k = idx(rng, shape.rank());
                shape.0[k] = dim(rng, &syms);
            }
        }
        Op::Permute { perm } => {
            if perm.len() >= 2 && rng.chance(0.7) {
                let (a, b) = (idx(rng, perm.len()), idx(rng, perm.len()));
                perm.swap(a, b);
            } else {
                *perm = (0..idx(rng, 4)).map(|_| axis(rng)).collect();
            }
        }
        Op::Slice { axis: a, start, end } => match rng.below(3) {
            0 => *a = axis(rng),
            1 => *start = big(rng),
            _ => *end = big(rng),
        },
        Op::Reduce { axes, .. } => *axes = (0..idx(rng, 4)).map(|_| axis(rng)).collect(),
        Op::MatMul { trans_a, trans_b } => {
            if rng.chance(0.5) {
                *trans_a = !*trans_a;
            } else {
                *trans_b = !*trans_b;
            }
        }
        Op::ScatterAdd { rows } => *rows = dim(rng, &syms),
        Op::LayerNorm { eps } => *eps = float(rng),
        Op::CrossEntropy { vocab } | Op::CrossEntropyGrad { vocab } | Op::CrossEntropyWithGrad { vocab } => *vocab = big(rng),
        Op::Attention { heads, scale } | Op::AttentionGrad { heads, scale } => {
            if rng.chance(0.6) {
                *heads = big(rng);
            } else {
                *scale = float(rng);
            }
        }
        Op::AdamW { beta1, beta2, eps, weight_decay } => {
            let v = pick(rng, &[f64::NAN, 1.0, -0.5, 0.0, f64::INFINITY, -1e-8, 0.999]);
            match rng.below(4) {
                0 => *beta1 = v,
                1 => *beta2 = v,
                2 => *eps = v,
                _ => *weight_decay = v,
            }
        }
        Op::Gemm(gm) => match rng.below(6) {
            0 => gm.trans_a = !gm.trans_a,
            1 => gm.trans_b = !gm.trans_b,
            2 => gm.bias = !gm.bias,
            3 => gm.gelu = !gm.gelu,
            4 => gm.accumulate = !gm.accumulate,
            _ => gm.out = pick(rng, &DType::ALL),
        },
        Op::Kernel(k) => {
            // Mutate the body (re-typed when possible), or its name.
            if rng.chance(0.2) {
                k.name = pick(rng, &["", "adamw", "k"]).to_string();
            } else {
                k.body = mutate_ir(rng, &k.body);
            }
        }
        op => swap_op(rng, op),
    }
}

/// Replaces an op by another of the same family (same operand count).
fn swap_op(rng: &mut Rng, op: &mut Op) {
    *op = match op {
        Op::Unary(_) => Op::Unary(pick(rng, &Op::UNARY)),
        Op::Binary(_) => Op::Binary(pick(rng, &Op::BINARY)),
        Op::Compare(_) => Op::Compare(pick(rng, &Op::COMPARE)),
        Op::Reduce { axes, .. } => Op::Reduce { op: pick(rng, &[ReduceOp::Sum, ReduceOp::Max]), axes: axes.clone() },
        Op::Gelu | Op::Softmax => match rng.below(3) {
            0 => Op::Gelu,
            1 => Op::Softmax,
            _ => Op::Unary(UnaryOp::Exp),
        },
        Op::GeluGrad | Op::SoftmaxGrad => match rng.below(3) {
            0 => Op::GeluGrad,
            1 => Op::SoftmaxGrad,
            _ => Op::Binary(BinaryOp::Mul),
        },
        Op::Select => Op::Compare(CmpOp::Lt),
        Op::MatMul { .. } => Op::MatMul { trans_a: rng.chance(0.5), trans_b: rng.chance(0.5) },
        _ => return,
    };
}

/// Renames the source `i` (or, if it is none, a random source) to another source's name, to a
/// name the passes add, or to one derived from another name (`grad.P`, `m.P`, `v.P`).
fn rename(rng: &mut Rng, g: &mut Graph, i: usize) {
    let names: Vec<String> = g.nodes.iter().filter_map(|n| source_name(&n.op)).collect();
    if names.is_empty() {
        return;
    }
    let new = match rng.below(3) {
        0 => names[idx(rng, names.len())].clone(),
        1 => pick(rng, &SPECIAL).to_string(),
        _ => format!("{}{}", pick(rng, &["grad.", "m.", "v."]), names[idx(rng, names.len())]),
    };
    let sources: Vec<usize> = (0..g.nodes.len()).filter(|&k| source_name(&g.nodes[k].op).is_some()).collect();
    let k = if source_name(&g.nodes[i].op).is_some() { i } else { sources[idx(rng, sources.len())] };
    if let Op::Param { name, .. } | Op::Input { name, .. } = &mut g.nodes[k].op {
        *name = new;
    }
}

fn source_name(op: &Op) -> Option<String> {
    match op {
        Op::Param { name, .. } | Op::Input { name, .. } => Some(name.clone()),
        _ => None,
    }
}

/// Retargets, renames, adds or removes an output.
fn mutate_outputs(rng: &mut Rng, g: &mut Graph) {
    let nv = g.values.len();
    if nv == 0 {
        return;
    }
    let v = ValueId(idx(rng, nv) as u32);
    let k = if g.outputs.is_empty() { None } else { Some(idx(rng, g.outputs.len())) };
    match (rng.below(4), k) {
        (0, Some(k)) => g.outputs[k].1 = v,
        (1, Some(k)) => {
            let other = g.outputs[idx(rng, g.outputs.len())].0.clone();
            g.outputs[k].0 = if rng.chance(0.5) { other } else { pick(rng, &SPECIAL).to_string() };
        }
        (2, Some(k)) => {
            g.outputs.remove(k);
        }
        _ => g.output(pick(rng, &["loss", "extra", "wte", "grad.wte"]), v),
    }
}

/// One random mutation of `.graph` text that keeps it mostly well-formed: a number, a dtype, an
/// operand, a name, an op or a flag replaced by another.
pub fn mutate_text(rng: &mut Rng, src: &str) -> String {
    let mut lines: Vec<String> = src.lines().map(str::to_string).collect();
    if lines.len() < 3 {
        return src.to_string();
    }
    // Never the header or the closing brace.
    let li = 1 + idx(rng, lines.len() - 2);
    let line = &lines[li];
    let words: Vec<(usize, usize)> = token_spans(line);
    if words.is_empty() {
        return src.to_string();
    }
    let (a, b) = words[idx(rng, words.len())];
    let w = &line[a..b];
    let new: String = if w.starts_with('%') && rng.chance(0.5) {
        format!("%{}", rng.below(li as u64 + 1))
    } else if w.bytes().all(|c| c.is_ascii_digit()) {
        pick(rng, &["0", "1", "2", "3", "4", "63", "64", "65", "255", "256", "1099511627776", "18446744073709551615"]).to_string()
    } else if w.parse::<f64>().is_ok() || w == "nan" || w == "inf" {
        pick(rng, &["nan", "inf", "-inf", "0.0", "-0.0", "-1.0", "1e-30", "1e30", "0.5"]).to_string()
    } else if DType::from_name(w).is_some() {
        pick(rng, &["f32", "bf16", "f16", "i32"]).to_string()
    } else if w == "true" || w == "false" {
        if w == "true" { "false" } else { "true" }.to_string()
    } else if w.starts_with('"') {
        // Another name from the text, or a special one.
        let names: Vec<&str> = src.split('"').skip(1).step_by(2).collect();
        if rng.chance(0.6) && !names.is_empty() {
            format!("\"{}\"", pick(rng, &names))
        } else {
            format!("\"{}\"", pick(rng, &SPECIAL))
        }
    } else {
        let ops = ["add", "sub", "mul", "div", "max", "exp", "tanh", "neg", "reduce_sum", "reduce_max", "gelu", "softmax"];
        pick(rng, &ops).to_string()
    };
    let mut l = line.clone();
    l.replace_range(a..b, &new);
    lines[li] = l;
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// Byte spans of the words of a line: `%N`, numbers, identifiers and quoted strings.
fn token_spans(line: &str) -> Vec<(usize, usize)> {
    let b = line.as_bytes();
    let mut out = vec![];
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let start = i;
        if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(b.len());
            out.push((start, i));
        } else if c == b'%' || c == b'-' || c.is_ascii_alphanumeric() || c == b'_' {
            i += 1;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || matches!(b[i], b'_' | b'.' | b'-' | b'+')) {
                i += 1;
            }
            out.push((start, i));
        } else {
            i += 1;
        }
    }
    out
}
