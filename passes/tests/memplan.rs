//! `memplan`: structural checks of the plan (no two live buffers share bytes unless declared
//! aliases that hand over in place, alignment, contiguous persistent regions in parameter order,
//! state written back in place, exact alias counts), snapshots of the annotated dump and the
//! report, and the GPT-2 124M target: arena within 5% of the peak-live lower bound.

use fusec_ir::{BinaryOp, Bindings, DType, Graph, Op, ReduceOp, Shape, Type, UnaryOp, ValueId};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::autodiff::{autodiff, grad_name};
use fusec_passes::explain::FusionLog;
use fusec_passes::memplan::{memplan, AliasKind, MemPlan, MemplanOptions, Region, ALIGN};
use fusec_passes::optimizer::{optimizer, state_names, AdamWConfig};
use fusec_passes::schedule::schedule;

fn bind(b: u64, t: u64) -> Bindings {
    let mut x = Bindings::default();
    x.set("B", b).set("T", t);
    x
}

const REUSE: MemplanOptions = MemplanOptions { reuse: true };
const NO_REUSE: MemplanOptions = MemplanOptions { reuse: false };

/// Forward, backward and AdamW of a GPT-2 preset, scheduled.
fn training(preset: &str) -> Graph {
    let cfg = Gpt2Config::preset(preset).unwrap();
    let g = optimizer(&autodiff(&build_gpt2(&cfg, &format!("gpt2_{preset}"))).unwrap(), &AdamWConfig::default()).unwrap();
    schedule(&g).unwrap()
}

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// Number of gradient accumulations: adds into a `grad.P` input or into such an add.
fn grad_accumulations(g: &Graph) -> usize {
    let mut acc = vec![false; g.values.len()];
    let mut count = 0;
    for n in &g.nodes {
        match &n.op {
            Op::Input { name, .. } if name.starts_with("grad.") => acc[n.results[0].0 as usize] = true,
            Op::Binary(BinaryOp::Add) | Op::Gemm(_) if n.inputs.iter().any(|v| acc[v.0 as usize]) => {
                acc[n.results[0].0 as usize] = true;
                count += 1;
            }
            _ => {}
        }
    }
    count
}

/// Every structural promise of a plan for `g`.
fn check_plan(g: &Graph, p: &MemPlan) {
    let nv = g.values.len();
    assert_eq!(p.values.len(), nv);
    let end = p.persistent_bytes + p.arena_bytes;
    for (v, vp) in p.values.iter().enumerate() {
        assert_eq!(vp.offset % ALIGN, 0, "value {v} is not aligned");
        if vp.region == Region::Arena {
            assert!(vp.offset >= p.persistent_bytes && vp.offset + vp.bytes <= end, "value {v} is outside the arena");
        } else {
            assert!(vp.offset + vp.bytes <= p.persistent_bytes, "value {v} is outside the persistent prefix");
        }
    }

    // Persistent regions: in order, back to back, each tensor in parameter order.
    assert_eq!(p.regions.iter().map(|r| r.region).collect::<Vec<_>>(), Region::PERSISTENT.to_vec());
    let mut cur = 0;
    for r in &p.regions {
        assert_eq!(r.offset, cur, "region {} is not contiguous with the one before", r.region.name());
        cur += r.bytes;
    }
    assert_eq!(cur, p.persistent_bytes);
    let params: Vec<(String, ValueId)> = g.params().into_iter().map(|(n, v)| (n.to_string(), v)).collect();
    let inputs: Vec<(String, ValueId)> = g.inputs().into_iter().map(|(n, v)| (n.to_string(), v)).collect();
    let input = |name: &str| inputs.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
    let expect_region = |region: Region, tensors: &[ValueId]| {
        let rp = p.region(region).unwrap();
        let mut at = rp.offset;
        for v in tensors {
            let vp = &p.values[v.0 as usize];
            assert_eq!((vp.region, vp.offset), (region, at), "tensor {v:?} out of order in {}", region.name());
            assert_eq!(vp.alias, None);
            at += align(vp.bytes);
        }
        assert_eq!((rp.tensors, at), (tensors.len(), rp.offset + rp.bytes), "region {}", region.name());
    };
    let mut claimed = vec![];
    let lists: [(Region, Vec<ValueId>); 4] = [
        (Region::Params, params.iter().map(|(_, v)| *v).collect()),
        (Region::Grads, params.iter().filter_map(|(n, _)| input(&grad_name(n))).collect()),
        (Region::AdamM, params.iter().filter_map(|(n, _)| input(&state_names(n)[0])).collect()),
        (Region::AdamV, params.iter().filter_map(|(n, _)| input(&state_names(n)[1])).collect()),
    ];
    for (region, tensors) in &lists {
        expect_region(*region, tensors);
        claimed.extend(tensors.iter().copied());
    }
    let rest: Vec<ValueId> = inputs.iter().map(|(_, v)| *v).filter(|v| !claimed.contains(v)).collect();
    expect_region(Region::Inputs, &rest);

    // State outputs live in their parameter's or input's buffer.
    for (name, v) in &g.outputs {
        if let Some((_, x)) = params.iter().chain(&inputs).find(|(n, _)| n == name) {
            let (a, b) = (&p.values[v.0 as usize], &p.values[x.0 as usize]);
            assert_eq!((a.region, a.offset), (b.region, b.offset), "output `{name}` is not written back in place");
        }
    }

    // Declared aliases share their target's bytes; overwrites come after the target's last read.
    let mut class: Vec<usize> = (0..nv).collect();
    let mut overwritten = vec![false; nv];
    for n in &g.nodes {
        for r in &n.results {
            let vp = &p.values[r.0 as usize];
            let Some((of, kind)) = vp.alias else { continue };
            let op = &p.values[of.0 as usize];
            assert_eq!(vp.offset, op.offset, "alias {r:?} of {of:?} at another offset");
            match kind {
                AliasKind::View => class[r.0 as usize] = class[of.0 as usize],
                AliasKind::InPlace | AliasKind::State => {
                    assert_eq!(kind == AliasKind::State, vp.region != Region::Arena);
                    assert_eq!(vp.bytes, op.bytes);
                    assert!(op.live.1 <= vp.live.0, "{r:?} overwrites {of:?} while it is live");
                    overwritten[of.0 as usize] = true;
                }
            }
        }
    }
    // Persistent tensors hold their bytes for the whole step unless something overwrites them.
    let span = |v: usize| {
        let vp = &p.values[v];
        let owner = vp.region != Region::Arena && vp.alias.is_none();
        (vp.live.0, if owner && !overwritten[v] { p.nodes } else { vp.live.1 })
    };
    // No two values live at one position share a byte, except views of one buffer and a value
    // handed over in place (its last read is the node that writes the next one, declared).
    let mut by_offset: Vec<usize> = (0..nv).collect();
    by_offset.sort_by_key(|&v| p.values[v].offset);
    for (i, &a) in by_offset.iter().enumerate() {
        let (pa, sa) = (&p.values[a], span(a));
        for &b in &by_offset[i + 1..] {
            let pb = &p.values[b];
            if pb.offset >= pa.offset + pa.bytes {
                break;
            }
            let sb = span(b);
            if class[a] == class[b] || sa.1 < sb.0 || sb.1 < sa.0 {
                continue;
            }
            let (first, second) = if sa.0 <= sb.0 { (a, b) } else { (b, a) };
            let handover = span(first).1 == span(second).0
                && p.values[second].alias.is_some_and(|(of, k)| k != AliasKind::View && class[of.0 as usize] == class[first]);
            assert!(handover, "values {first} and {second} share bytes while both live ({:?} / {:?})", span(first), span(second));
        }
    }

    // Counts match the declared aliases; the arena is at least the lower bound.
    let count = |k: AliasKind| p.values.iter().filter(|v| v.alias.is_some_and(|(_, x)| x == k)).count();
    assert_eq!((count(AliasKind::View), count(AliasKind::InPlace), count(AliasKind::State)), (p.view_aliases, p.in_place, p.state_aliases));
    assert_eq!(p.view_aliases, g.nodes.iter().filter(|n| matches!(n.op, Op::Reshape { .. })).count());
    assert!(p.arena_bytes >= p.peak_live_bytes);
    assert!(p.arena_bytes <= p.naive_bytes);
}

#[test]
fn tiny_training_plan_is_sound() {
    let g = training("tiny");
    let nparams = g.params().len();
    let reuse = memplan(&g, &bind(2, 8), &REUSE).unwrap();
    check_plan(&g, &reuse);
    // P, m.P, v.P written back; every gradient accumulation into its accumulator.
    assert_eq!(reuse.state_aliases, 3 * nparams + grad_accumulations(&g));
    assert!(reuse.in_place > 0);
    assert!(reuse.arena_bytes < reuse.naive_bytes / 4);

    let naive = memplan(&g, &bind(2, 8), &NO_REUSE).unwrap();
    check_plan(&g, &naive);
    assert_eq!(naive.arena_bytes, naive.naive_bytes);
    assert_eq!(naive.naive_bytes, reuse.naive_bytes);
    assert_eq!((naive.in_place, naive.state_aliases), (0, 3 * nparams));
    assert_eq!(naive.view_aliases, reuse.view_aliases);
}

#[test]
fn the_checker_catches_shared_bytes() {
    // Guard against a vacuous `check_plan`: move one live arena value onto another.
    let g = training("tiny");
    let p = memplan(&g, &bind(2, 8), &REUSE).unwrap();
    let arena: Vec<usize> = (0..p.values.len()).filter(|&v| p.values[v].region == Region::Arena && p.values[v].alias.is_none()).collect();
    let (a, b) = arena
        .iter()
        .flat_map(|&a| arena.iter().map(move |&b| (a, b)))
        .find(|&(a, b)| {
            let (x, y) = (&p.values[a], &p.values[b]);
            a != b && x.offset != y.offset && x.live.0 < y.live.0 && y.live.0 < x.live.1
        })
        .expect("two overlapping lives");
    let mut bad = p.clone();
    bad.values[b].offset = p.values[a].offset;
    let caught = std::panic::catch_unwind(|| check_plan(&g, &bad));
    assert!(caught.is_err(), "values {a} and {b} share bytes unnoticed");
}

#[test]
fn backward_only_graph_writes_gradients_back() {
    // `autodiff` alone outputs `grad.P`: the accumulators are state.
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let g = schedule(&autodiff(&build_gpt2(&cfg, "gpt2_tiny")).unwrap()).unwrap();
    let nparams = g.params().len();
    let reuse = memplan(&g, &bind(2, 8), &REUSE).unwrap();
    check_plan(&g, &reuse);
    assert_eq!(reuse.state_aliases, grad_accumulations(&g));
    let naive = memplan(&g, &bind(2, 8), &NO_REUSE).unwrap();
    check_plan(&g, &naive);
    assert_eq!(naive.state_aliases, nparams, "only the final accumulation of each gradient");
}

#[test]
fn fused_gemms_accumulate_in_place() {
    use fusec_passes::fuse_epilogue::fuse_epilogue;
    use fusec_passes::fuse_grad_accum::fuse_grad_accum;
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let train = optimizer(&autodiff(&build_gpt2(&cfg, "gpt2_tiny")).unwrap(), &AdamWConfig::default()).unwrap();
    let mut log = FusionLog::default();
    let fused = fuse_grad_accum(&fuse_epilogue(&train, &mut log).unwrap(), &mut log).unwrap();
    let g = schedule(&fused).unwrap();
    let gemms: Vec<_> = g.nodes.iter().filter(|n| matches!(&n.op, Op::Gemm(gm) if gm.accumulate)).collect();
    assert!(!gemms.is_empty(), "fuse-grad-accum fired");
    for opts in [REUSE, NO_REUSE] {
        let p = memplan(&g, &bind(2, 8), &opts).unwrap();
        check_plan(&g, &p);
        for n in &gemms {
            let (r, acc) = (&p.values[n.results[0].0 as usize], &p.values[n.inputs.last().unwrap().0 as usize]);
            assert_eq!((r.region, r.offset), (acc.region, acc.offset), "gemm does not accumulate in place");
        }
    }
}

/// A small step: `h = tanh(x @ w)` (in place over the matmul), a reshape view of it, a loss,
/// and `w` updated in place: `w' = w - h^T x` written back over `w`.
fn small() -> Graph {
    let mut g = Graph::new("small", &["B"]);
    let f32t = |dims: Vec<fusec_ir::Dim>| Type::new(DType::F32, Shape::from(dims));
    let (lit, b) = (fusec_ir::Dim::lit, fusec_ir::Dim::sym("B"));
    let w = g.add1(Op::Param { name: "w".into(), ty: f32t(vec![lit(8), lit(8)]) }, &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32t(vec![b.clone(), lit(8)]) }, &[]);
    let y = g.add1(Op::MatMul { trans_a: false, trans_b: false }, &[x, w]);
    let h = g.add1(Op::Unary(UnaryOp::Tanh), &[y]);
    let v = g.add1(Op::Reshape { shape: Shape::from(vec![b.clone(), lit(2), lit(4)]) }, &[h]);
    let s = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![1, 2] }, &[v]);
    let loss = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0] }, &[s]);
    let dw = g.add1(Op::MatMul { trans_a: true, trans_b: false }, &[h, x]);
    let w2 = g.add1(Op::Binary(BinaryOp::Sub), &[w, dw]);
    g.output("loss", loss);
    g.output("w", w2);
    g
}

#[test]
fn small_graph_annotated() {
    let g = small();
    let mut b = Bindings::default();
    b.set("B", 4);
    let p = memplan(&g, &b, &REUSE).unwrap();
    check_plan(&g, &p);
    assert_eq!((p.in_place, p.view_aliases, p.state_aliases), (1, 1, 1));
    insta::assert_snapshot!(p.annotate(&g));
}

#[test]
fn tiny_training_report() {
    let g = training("tiny");
    let reuse = memplan(&g, &bind(2, 8), &REUSE).unwrap();
    let naive = memplan(&g, &bind(2, 8), &NO_REUSE).unwrap();
    insta::assert_snapshot!(format!("{}\n{}", reuse.report(), naive.report()));
}

#[test]
fn unbound_dims_and_unsound_write_backs_are_errors() {
    let g = small();
    let err = memplan(&g, &Bindings::default(), &REUSE).unwrap_err();
    assert!(err.contains("`B` is not bound"), "{err}");
    // `w` read again after its write-back is produced.
    let mut bad = small();
    let w = bad.params()[0].1;
    let late = bad.add1(Op::Unary(UnaryOp::Exp), &[w]);
    bad.output("late", late);
    let mut b = Bindings::default();
    b.set("B", 4);
    let err = memplan(&bad, &b, &REUSE).unwrap_err();
    assert!(err.contains("output `w`") && err.contains("still read"), "{err}");
    // `w' = w @ w` would read `w` while overwriting it.
    let mut bad = small();
    let w = bad.params()[0].1;
    let ww = bad.add1(Op::MatMul { trans_a: false, trans_b: false }, &[w, w]);
    bad.outputs.retain(|(n, _)| n != "w");
    bad.output("w", ww);
    let err = memplan(&bad, &b, &REUSE).unwrap_err();
    assert!(err.contains("output `w`") && err.contains("`matmul` reads it"), "{err}");
}

/// Kernels: a reduction epilogue accumulates into `grad.w` in place; a kernel that reads its
/// operand through a reduction does not overwrite it; a single-phase kernel does.
const KERNELS: &str = r#"graph kernels(B) {
  %0 = param "w" : f32[8]
  %1 = input "grad.w" : f32[8]
  %2 = input "x" : f32[B, 8]
  %3 = mul %2, %2 : f32[B, 8]
  %4 = kernel "reduce_sum_add" %1, %3 : f32[8] {
    %0 = input "x0" : f32[8]
    %1 = input "x1" : f32[B, 8]
    %2 = reduce_sum %1 {axes = [0]} : f32[8]
    %3 = add %0, %2 : f32[8]
    output "y0" = %3
  }
  %5 = exp %2 : f32[B, 8]
  %6 = kernel "center" %5 : f32[B, 8] {
    %0 = input "x0" : f32[B, 8]
    %1 = reduce_sum %0 {axes = [1]} : f32[B]
    %2 = broadcast %1 {dims = [0]} : f32[B, 8]
    %3 = sub %0, %2 : f32[B, 8]
    output "y0" = %3
  }
  %7 = broadcast %0 {dims = [1]} : f32[B, 8]
  %8, %9 = kernel "add_gelu" %6, %7 : f32[B, 8], f32[B, 8] {
    %0 = input "x0" : f32[B, 8]
    %1 = input "x1" : f32[B, 8]
    %2 = add %0, %1 : f32[B, 8]
    %3 = gelu %2 : f32[B, 8]
    output "y0" = %3
    output "y1" = %2
  }
  output "dw" = %4
  output "y" = %8
  output "pre" = %9
}
"#;

#[test]
fn kernels_overwrite_only_operands_they_read_elementwise() {
    let g = fusec_ir::text::parse(KERNELS, "kernels.graph").unwrap();
    fusec_ir::verify::verify(&g).unwrap();
    let mut b = Bindings::default();
    b.set("B", 4);
    let p = memplan(&g, &b, &REUSE).unwrap();
    check_plan(&g, &p);
    let v = |k: u32| &p.values[k as usize];
    let id = |k: usize| g.nodes.iter().flat_map(|n| n.results.iter()).nth(k).copied().unwrap();
    assert_eq!(v(id(4).0).alias, Some((id(1), AliasKind::State)), "reduce_sum_add accumulates into grad.w");
    assert_eq!(v(id(6).0).alias, None, "center reads its operand through a reduction");
    assert_eq!(v(id(8).0).alias, Some((id(6), AliasKind::InPlace)), "add_gelu is one elementwise pass");
    assert_eq!(v(id(9).0).alias, Some((id(7), AliasKind::InPlace)), "its other result takes the broadcast's buffer");
    assert_eq!((p.in_place, p.state_aliases), (2, 1));
}

/// The Done-when target: GPT-2 124M, B = 16, T = 1024, fp32.
#[test]
fn gpt2_124m_arena_within_5_percent_of_lower_bound() {
    let cfg = Gpt2Config::preset("d12").unwrap();
    let train = optimizer(&autodiff(&build_gpt2(&cfg, "gpt2_124m")).unwrap(), &AdamWConfig::default()).unwrap();
    let t0 = std::time::Instant::now();
    let g = schedule(&train).unwrap();
    let t1 = std::time::Instant::now();
    let p = memplan(&g, &bind(16, 1024), &REUSE).unwrap();
    let t2 = std::time::Instant::now();
    let mib = |x: u64| x as f64 / (1 << 20) as f64;
    eprintln!(
        "gpt2-124m B=16 T=1024: arena {} ({:.1} MiB), lower bound {} ({:.1} MiB), ratio {:.4}, naive {} ({:.1} MiB), persistent {} ({:.1} MiB); {} nodes, schedule {:?}, memplan {:?}",
        p.arena_bytes,
        mib(p.arena_bytes),
        p.peak_live_bytes,
        mib(p.peak_live_bytes),
        p.arena_bytes as f64 / p.peak_live_bytes as f64,
        p.naive_bytes,
        mib(p.naive_bytes),
        p.persistent_bytes,
        mib(p.persistent_bytes),
        g.nodes.len(),
        t1 - t0,
        t2 - t1
    );
    eprintln!("{}", p.report());
    check_plan(&g, &p);
    assert_eq!(p.state_aliases, 3 * g.params().len() + grad_accumulations(&g));
    assert!(p.arena_bytes * 100 <= p.peak_live_bytes * 105, "arena {} > 1.05 x lower bound {}", p.arena_bytes, p.peak_live_bytes);
}
