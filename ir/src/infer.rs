//! Result-type rules: the single source of truth for what each op accepts and produces.
//! The verifier, the builders and the parser all go through [`result_types`].

use smallvec::{smallvec, SmallVec};

use crate::{DType, Dim, Op, Shape, Type};

/// Result types of `op` applied to inputs of types `ins`, or a message saying what is wrong.
pub fn result_types(op: &Op, ins: &[&Type]) -> Result<SmallVec<[Type; 3]>, String> {
    use Op::*;
    let arity = expected_arity(op);
    if let Some(n) = arity {
        if ins.len() != n {
            return Err(format!("`{}` takes {n} operand(s), found {}", op.mnemonic(), ins.len()));
        }
    } else if ins.is_empty() {
        return Err(format!("`{}` takes at least one operand", op.mnemonic()));
    }
    let one = |t: Type| -> Result<SmallVec<[Type; 3]>, String> { Ok(smallvec![t]) };
    match op {
        Param { ty, .. } | Input { ty, .. } | Const { ty, .. } => one(ty.clone()),
        Iota { axis, ty } => {
            check(*axis < ty.shape.rank(), || format!("iota axis {axis} out of range for {ty}"))?;
            one(ty.clone())
        }
        Unary(_) => {
            float(ins[0], "operand")?;
            one(ins[0].clone())
        }
        Binary(_) => {
            same(ins[0], ins[1])?;
            one(ins[0].clone())
        }
        Compare(_) => {
            same(ins[0], ins[1])?;
            one(ins[0].with_dtype(DType::I32))
        }
        Select => {
            check(ins[0].dtype == DType::I32, || format!("select condition must be i32, found {}", ins[0]))?;
            check(ins[0].shape == ins[1].shape, || format!("select condition {} and value {} differ in shape", ins[0], ins[1]))?;
            same(ins[1], ins[2])?;
            one(ins[1].clone())
        }
        Cast { to } => one(ins[0].with_dtype(*to)),
        Reshape { shape } => {
            let (from, to) = (ins[0].shape.checked_numel(), shape.checked_numel());
            check(from.is_some() && to.is_some(), || {
                format!("the element count of reshape from {} to {shape} overflows 64 bits", ins[0].shape)
            })?;
            check(from == to, || format!("reshape from {} to {shape} changes the element count", ins[0].shape))?;
            one(Type::new(ins[0].dtype, shape.clone()))
        }
        Broadcast { dims, shape } => {
            let x = &ins[0].shape;
            check(dims.len() == x.rank(), || format!("broadcast dims {dims:?} must list one result axis per operand axis ({})", x.rank()))?;
            check(dims.windows(2).all(|w| w[0] < w[1]), || format!("broadcast dims {dims:?} must be strictly increasing"))?;
            for (i, &d) in dims.iter().enumerate() {
                check(d < shape.rank(), || format!("broadcast dim {d} out of range for {shape}"))?;
                let (a, r) = (&x.0[i], &shape.0[d]);
                check(a == r || *a == Dim::lit(1), || format!("broadcast of operand axis {i} ({a}) to result axis {d} ({r})"))?;
            }
            one(Type::new(ins[0].dtype, shape.clone()))
        }
        Permute { perm } => {
            let x = &ins[0].shape;
            let mut seen = vec![false; x.rank()];
            check(perm.len() == x.rank(), || format!("permutation {perm:?} has the wrong length for {x}"))?;
            for &p in perm {
                check(p < x.rank() && !seen[p], || format!("{perm:?} is not a permutation of 0..{}", x.rank()))?;
                seen[p] = true;
            }
            one(Type::new(ins[0].dtype, Shape(perm.iter().map(|&p| x.0[p].clone()).collect())))
        }
        Slice { axis, start, end } => {
            let x = &ins[0].shape;
            check(*axis < x.rank(), || format!("slice axis {axis} out of range for {x}"))?;
            let n = x.0[*axis].as_lit().ok_or_else(|| format!("slice axis {axis} of {x} must be constant"))?;
            check(start < end && *end <= n, || format!("slice {start}..{end} out of range 0..{n}"))?;
            let mut s = x.clone();
            s.0[*axis] = Dim::lit(end - start);
            one(Type::new(ins[0].dtype, s))
        }
        Concat { axis } => {
            let x = &ins[0].shape;
            check(*axis < x.rank(), || format!("concat axis {axis} out of range for {x}"))?;
            let mut total = 0u64;
            for t in ins {
                check(t.dtype == ins[0].dtype && t.shape.rank() == x.rank(), || format!("concat operands {} and {t} differ", ins[0]))?;
                for (i, (a, b)) in x.0.iter().zip(&t.shape.0).enumerate() {
                    check(i == *axis || a == b, || format!("concat operands {} and {t} differ off axis {axis}", ins[0]))?;
                }
                let n = t.shape.0[*axis].as_lit().ok_or_else(|| format!("concat axis of {t} must be constant"))?;
                total = total.checked_add(n).ok_or("concat result is too large")?;
            }
            let mut s = x.clone();
            s.0[*axis] = Dim::lit(total);
            one(Type::new(ins[0].dtype, s))
        }
        Reduce { axes, .. } => {
            let x = &ins[0].shape;
            check(!axes.is_empty() && axes.windows(2).all(|w| w[0] < w[1]), || {
                format!("reduce axes {axes:?} must be sorted and distinct")
            })?;
            check(axes.iter().all(|&a| a < x.rank()), || format!("reduce axes {axes:?} out of range for {x}"))?;
            let s = x.0.iter().enumerate().filter(|(i, _)| !axes.contains(i)).map(|(_, d)| d.clone()).collect();
            one(Type::new(ins[0].dtype, Shape(s)))
        }
        MatMul { trans_a, trans_b } => {
            let (a, b) = (&ins[0].shape, &ins[1].shape);
            check(ins[0].dtype == ins[1].dtype, || format!("matmul operands {} and {} differ in dtype", ins[0], ins[1]))?;
            float(ins[0], "matmul operand")?;
            check(a.rank() >= 2 && b.rank() >= 2, || format!("matmul operands must have rank >= 2, found {a} and {b}"))?;
            let (ra, rb) = (a.rank(), b.rank());
            let (m, ka) = if *trans_a { (&a.0[ra - 1], &a.0[ra - 2]) } else { (&a.0[ra - 2], &a.0[ra - 1]) };
            let (kb, n) = if *trans_b { (&b.0[rb - 1], &b.0[rb - 2]) } else { (&b.0[rb - 2], &b.0[rb - 1]) };
            check(ka == kb, || format!("matmul contraction dims differ: {ka} vs {kb} ({a} @ {b})"))?;
            check(rb == 2 || a.0[..ra - 2] == b.0[..rb - 2], || format!("matmul batch dims differ: {a} @ {b}"))?;
            let mut s: Vec<Dim> = a.0[..ra - 2].to_vec();
            s.push(m.clone());
            s.push(n.clone());
            one(Type::new(ins[0].dtype, s.into()))
        }
        Gather => {
            let (t, i) = (ins[0], ins[1]);
            check(t.shape.rank() == 2, || format!("gather table must be rank 2, found {t}"))?;
            check(i.dtype == DType::I32, || format!("gather indices must be i32, found {i}"))?;
            let mut s = i.shape.0.to_vec();
            s.push(t.shape.0[1].clone());
            one(Type::new(t.dtype, s.into()))
        }
        ScatterAdd { rows } => {
            let (src, i) = (ins[0], ins[1]);
            check(i.dtype == DType::I32, || format!("scatter_add indices must be i32, found {i}"))?;
            check(src.shape.rank() == i.shape.rank() + 1 && src.shape.0[..i.shape.rank()] == i.shape.0[..], || {
                format!("scatter_add source {src} must be indices {i} plus one trailing axis")
            })?;
            let c = src.shape.0.last().ok_or_else(|| format!("scatter_add source {src} must have rank >= 1"))?;
            one(Type::new(src.dtype, vec![rows.clone(), c.clone()].into()))
        }
        Gelu => {
            float(ins[0], "operand")?;
            one(ins[0].clone())
        }
        GeluGrad | SoftmaxGrad => {
            float(ins[0], "operand")?;
            check(matches!(op, GeluGrad) || ins[0].shape.rank() >= 1, || "softmax_grad needs rank >= 1".to_string())?;
            same(ins[0], ins[1])?;
            one(ins[0].clone())
        }
        FromOwners { owners } => {
            check(owners.len() == ins.len(), || format!("from_owners has {} operands but {} owners", ins.len(), owners.len()))?;
            Ok(ins.iter().map(|x| (*x).clone()).collect())
        }
        AllReduce => {
            check(!ins.is_empty(), || "all_reduce needs at least one operand".to_string())?;
            let mut out = SmallVec::new();
            for x in ins {
                float(x, "operand")?;
                out.push((*x).clone());
            }
            Ok(out)
        }
        Softmax => {
            float(ins[0], "operand")?;
            check(ins[0].shape.rank() >= 1, || "softmax needs rank >= 1".to_string())?;
            one(ins[0].clone())
        }
        LayerNorm { eps } => {
            check(*eps > 0.0 && eps.is_finite(), || format!("layernorm eps must be positive, found {eps}"))?;
            let (x, w, b) = (ins[0], ins[1], ins[2]);
            let (rows, c) = split_last(x, "layernorm input")?;
            float(x, "layernorm input")?;
            same(w, b)?;
            check(w.dtype == x.dtype && w.shape.0[..] == [c.clone()], || format!("layernorm weight {w} must be {}[{c}]", x.dtype))?;
            let stat = Type::new(x.dtype, rows);
            Ok(smallvec![x.clone(), stat.clone(), stat])
        }
        LayerNormGrad => {
            let (dy, x, w, mean, rstd) = (ins[0], ins[1], ins[2], ins[3], ins[4]);
            same(dy, x)?;
            let (rows, c) = split_last(x, "layernorm_grad input")?;
            check(w.dtype == x.dtype && w.shape.0[..] == [c.clone()], || format!("layernorm_grad weight {w} must be {}[{c}]", x.dtype))?;
            let stat = Type::new(x.dtype, rows);
            check(*mean == stat && *rstd == stat, || format!("layernorm_grad statistics must be {stat}, found {mean} and {rstd}"))?;
            Ok(smallvec![x.clone(), w.clone(), w.clone()])
        }
        CrossEntropy { vocab } | CrossEntropyGrad { vocab } | CrossEntropyWithGrad { vocab } => {
            let (l, t) = (ins[0], ins[1]);
            let (rows, vp) = split_last(l, "cross_entropy logits")?;
            float(l, "logits")?;
            check(t.dtype == DType::I32 && t.shape == rows, || format!("targets must be i32{rows}, found {t}"))?;
            let vp = vp.as_lit().ok_or("cross_entropy vocab axis must be constant")?;
            check(*vocab >= 1 && *vocab <= vp, || format!("vocab {vocab} must be in 1..={vp}"))?;
            let loss = Type::new(l.dtype, rows);
            if matches!(op, CrossEntropy { .. }) {
                one(loss)
            } else {
                check(*ins[2] == loss, || format!("dloss must be {loss}, found {}", ins[2]))?;
                if matches!(op, CrossEntropyWithGrad { .. }) {
                    return Ok(smallvec![loss, l.clone()]);
                }
                one(l.clone())
            }
        }
        Attention { heads, scale } | AttentionGrad { heads, scale } => {
            check(scale.is_finite(), || "attention scale must be finite".to_string())?;
            let qkv = ins[0];
            check(qkv.shape.rank() >= 2, || format!("attention qkv must have rank >= 2, found {qkv}"))?;
            float(qkv, "attention qkv")?;
            let (rows, c3) = split_last(qkv, "attention qkv")?;
            let c3 = c3.as_lit().ok_or("attention channels must be constant")?;
            let per = heads.checked_mul(3).filter(|&p| p >= 3 && c3 % p == 0);
            check(per.is_some(), || format!("attention qkv width {c3} must be 3 * heads ({heads}) * head size"))?;
            let mut out = rows.clone();
            out.0.push(Dim::lit(c3 / 3));
            let out = Type::new(qkv.dtype, out);
            let mut lse = Shape(rows.0[..rows.rank() - 1].iter().cloned().collect());
            lse.0.push(Dim::lit(*heads));
            lse.0.push(rows.0[rows.rank() - 1].clone());
            // Softmax statistics stay f32 whatever the storage of q, k and v.
            let lse = Type::new(DType::F32, lse);
            if matches!(op, Attention { .. }) {
                return Ok(smallvec![out, lse]);
            }
            check(*ins[1] == out, || format!("attention out must be {out}, found {}", ins[1]))?;
            check(*ins[2] == lse, || format!("attention lse must be {lse}, found {}", ins[2]))?;
            check(*ins[3] == out, || format!("attention dout must be {out}, found {}", ins[3]))?;
            one(qkv.clone())
        }
        Gemm(gm) => gemm_types(gm, ins),
        Kernel(k) => {
            let n = k.body.values.len();
            let in_range = k
                .body
                .nodes
                .iter()
                .flat_map(|nd| nd.results.iter())
                .chain(k.body.outputs.iter().map(|(_, v)| v))
                .all(|v| (v.0 as usize) < n);
            check(in_range, || format!("kernel `{}` body refers to values it does not define", k.name))?;
            let params = k.body.inputs();
            check(params.len() == ins.len(), || format!("kernel `{}` takes {} operand(s), found {}", k.name, params.len(), ins.len()))?;
            for (i, ((name, v), t)) in params.iter().zip(ins).enumerate() {
                let want = k.body.ty(*v);
                check(want == *t, || format!("kernel `{}` operand {i} (`{name}`) must be {want}, found {t}", k.name))?;
            }
            check(!k.body.outputs.is_empty(), || format!("kernel `{}` has no outputs", k.name))?;
            Ok(k.body.outputs.iter().map(|(_, v)| k.body.ty(*v).clone()).collect())
        }
        AdamW { beta1, beta2, eps, weight_decay } => {
            for (n, v) in [("beta1", beta1), ("beta2", beta2)] {
                check((0.0..1.0).contains(v), || format!("adamw {n} must be in [0, 1), found {v}"))?;
            }
            check(*eps >= 0.0 && *weight_decay >= 0.0, || "adamw eps and weight_decay must be >= 0".to_string())?;
            let p = ins[0];
            check(p.dtype == DType::F32, || format!("adamw parameters must be f32, found {p}"))?;
            for t in &ins[1..4] {
                same(p, t)?;
            }
            check(matches!(ins.len(), 7 | 8), || format!("`adamw` takes 7 or 8 operands, found {}", ins.len()))?;
            for t in &ins[4..7] {
                check(**t == Type::scalar(DType::F32), || format!("adamw lr/bc1/bc2 must be f32[], found {t}"))?;
            }
            let mut out = smallvec![p.clone(), p.clone(), p.clone()];
            if let Some(copy) = ins.get(7) {
                check(copy.shape == p.shape && copy.dtype.is_float(), || format!("adamw copy must be a float {}, found {copy}", p.shape))?;
                out.push((*copy).clone());
            }
            Ok(out)
        }
    }
}

/// The fixed operand count of `op`, or `None` for variadic ops.
pub fn expected_arity(op: &Op) -> Option<usize> {
    use Op::*;
    Some(match op {
        Param { .. } | Input { .. } | Const { .. } | Iota { .. } => 0,
        Unary(_) | Cast { .. } | Reshape { .. } | Broadcast { .. } | Permute { .. } | Slice { .. } | Reduce { .. } => 1,
        Gelu | Softmax => 1,
        Binary(_) | Compare(_) | MatMul { .. } | Gather | ScatterAdd { .. } | GeluGrad | SoftmaxGrad => 2,
        CrossEntropy { .. } => 2,
        Attention { .. } => 1,
        Select | LayerNorm { .. } | CrossEntropyGrad { .. } | CrossEntropyWithGrad { .. } => 3,
        AttentionGrad { .. } => 4,
        LayerNormGrad => 5,
        Concat { .. } | Kernel(_) | AdamW { .. } | AllReduce | FromOwners { .. } => return None,
        Gemm(g) => 2 + g.bias as usize + g.accumulate as usize,
    })
}

/// Types of a [`crate::Gemm`]: the matmul's rule, then the epilogue's operands and results.
fn gemm_types(gm: &crate::Gemm, ins: &[&Type]) -> Result<SmallVec<[Type; 3]>, String> {
    let mm = result_types(&Op::MatMul { trans_a: gm.trans_a, trans_b: gm.trans_b }, &ins[..2])?.remove(0);
    let n = mm.shape.0.last().ok_or("gemm: the product has rank 0")?.clone();
    let mut next = 2;
    if gm.bias {
        let want = Type::new(mm.dtype, Shape(smallvec![n]));
        check(*ins[next] == want, || format!("gemm bias must be {want}, found {}", ins[next]))?;
        next += 1;
    }
    check(gm.out.is_float(), || format!("gemm out dtype must be a float type, found {}", gm.out))?;
    let y = mm.with_dtype(gm.out);
    if gm.accumulate {
        check(*ins[next] == y, || format!("gemm accumulator must be {y}, found {}", ins[next]))?;
    }
    let mut out = smallvec![y];
    if gm.gelu {
        out.push(mm);
    }
    Ok(out)
}

fn check(ok: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(msg())
    }
}

fn same(a: &Type, b: &Type) -> Result<(), String> {
    check(a == b, || format!("operand types differ: {a} vs {b}"))
}

fn float(t: &Type, what: &str) -> Result<(), String> {
    check(t.dtype.is_float(), || format!("{what} must be a float type, found {t}"))
}

fn split_last(t: &Type, what: &str) -> Result<(Shape, Dim), String> {
    let s = &t.shape.0;
    check(!s.is_empty(), || format!("{what} must have rank >= 1, found {t}"))?;
    Ok((Shape(s[..s.len() - 1].iter().cloned().collect()), s[s.len() - 1].clone()))
}
