//! The launch plan: every program of a run as a flat list of backend-neutral launches, built
//! once from the memory plans. Each launch names what it runs, where its operands and results
//! live (byte offsets in the [`SharedLayout`]), its concrete dims and its static byte and FLOP
//! counts. The CPU and CUDA executors translate it into their own launch records; neither
//! reads graphs or memory plans itself.

use std::collections::HashMap;

use fusec_ir::{Bindings, DType, GemmSpec, Graph, Kernel, Node, Op, ValueId};
use fusec_passes::memplan::{memplan, MemPlan, MemplanOptions};
pub use fusec_passes::schedule_colsum::sums_columns;

use crate::layout::SharedLayout;
use crate::programs::{Program, RunPrograms};

/// A matrix product and its epilogue (`matmul`, or a fused `gemm`).
#[derive(Clone, Copy, Debug)]
pub struct Product {
    /// Shape, transposes and epilogue flags.
    pub spec: GemmSpec,
    /// Operands.
    pub a: u64,
    /// Second operand.
    pub b: u64,
    /// Bias vector, when `spec.bias`.
    pub bias: Option<u64>,
    /// The accumulator read when `spec.accumulate` (often the same buffer as `y`).
    pub acc: Option<u64>,
    /// Result.
    pub y: u64,
    /// GELU's pre-activation, when `spec.gelu`.
    pub pre: Option<u64>,
    /// Storage type of the operands.
    pub operands: DType,
    /// Storage type of the result.
    pub out: DType,
}

/// Embedding lookup: `out[i] = table[idx[i]]`, rows of `cols` values.
#[derive(Clone, Copy, Debug)]
pub struct Gather {
    /// The `[rows, cols]` table.
    pub table: u64,
    /// Rows of the table.
    pub rows: usize,
    /// Values per row.
    pub cols: usize,
    /// The `n` i32 indices.
    pub idx: u64,
    /// Number of indices.
    pub n: usize,
    /// The `[n, cols]` result.
    pub out: u64,
}

/// Embedding gradient: `out[idx[i]] += src[i]`, deterministic.
#[derive(Clone, Copy, Debug)]
pub struct ScatterAdd {
    /// The `[n, cols]` rows to add.
    pub src: u64,
    /// Values per row.
    pub cols: usize,
    /// The `n` i32 indices.
    pub idx: u64,
    /// Number of indices.
    pub n: usize,
    /// The `[rows, cols]` result.
    pub out: u64,
    /// Rows of the result.
    pub rows: usize,
}

/// The sizes of one causal attention over packed `[S, T, 3C]` projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    /// Sequences (the product of the leading axes).
    pub s: usize,
    /// Sequence length.
    pub t: usize,
    /// Heads.
    pub h: usize,
    /// Head size (`C / h`).
    pub d: usize,
}

/// Byte offsets of the tensors an attention launch touches.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnOffsets {
    /// Packed projections.
    pub qkv: u64,
    /// Forward output.
    pub out: u64,
    /// Log-sum-exp.
    pub lse: u64,
    /// Output gradient (backward).
    pub dout: Option<u64>,
    /// Projection gradient (backward).
    pub dqkv: Option<u64>,
}

/// Causal attention, forward (`out`, `lse`) or backward (`dqkv`).
#[derive(Clone, Copy, Debug)]
pub struct Attention {
    /// Forward (`attention`) or backward (`attention_grad`).
    pub forward: bool,
    /// Sizes.
    pub dims: AttnDims,
    /// Score scale.
    pub scale: f32,
    /// Storage of `qkv`, `out`, `dout` and `dqkv` (f32 or bf16); `lse` is f32 whatever this is.
    pub dtype: DType,
    /// Where the tensors are.
    pub at: AttnOffsets,
}

/// Index fill: each element is its index along `axis` of the concrete `shape`.
#[derive(Clone, Debug)]
pub struct Iota {
    /// Concrete shape.
    pub shape: Vec<usize>,
    /// The axis whose index is stored.
    pub axis: usize,
    /// f32 or i32.
    pub dtype: DType,
    /// Result.
    pub out: u64,
}

/// Constant fill of `n` elements.
#[derive(Clone, Copy, Debug)]
pub struct Fill {
    /// The value (rounded to `dtype` by the target).
    pub value: f64,
    /// f32 or i32.
    pub dtype: DType,
    /// Elements.
    pub n: usize,
    /// Result.
    pub out: u64,
}

/// One operand of a collective: `n` elements at `x` into `y` on every rank, their mean over the
/// ranks (`all_reduce`, `owner` `None`) or rank `owner`'s values (`from_owners`).
#[derive(Clone, Copy, Debug)]
pub struct CollectivePart {
    /// The operand.
    pub x: u64,
    /// The result (the operand's bytes when the memory plan put it in place).
    pub y: u64,
    /// Elements.
    pub n: usize,
    /// f32 or bf16.
    pub dtype: DType,
    /// The rank whose values every rank takes; `None`: the mean.
    pub owner: Option<usize>,
}

impl CollectivePart {
    /// Whether `next` starts where this part ends, in its operand and its result, with the
    /// same type and owner: then the two are one collective (NCCL's cost is per operation:
    /// ZeRO-1's parameter broadcasts in a group of 148 took 13.7 ms for what one takes in 1).
    pub fn continues(&self, next: &CollectivePart) -> bool {
        let end = |at: u64| (self.n as u64).checked_mul(self.dtype.size_bytes() as u64).and_then(|b| at.checked_add(b));
        self.dtype == next.dtype && self.owner == next.owner && end(self.x) == Some(next.x) && end(self.y) == Some(next.y)
    }
}

/// What one launch runs.
#[derive(Clone, Debug)]
pub enum LaunchOp<'g> {
    /// A matrix product with its epilogue.
    Product(Product),
    /// A fused kernel over its operands and results (in the node's order).
    Kernel { kernel: &'g Kernel, ins: Vec<u64>, outs: Vec<u64> },
    /// Embedding lookup.
    Gather(Gather),
    /// Embedding gradient.
    ScatterAdd(ScatterAdd),
    /// Causal attention.
    Attention(Attention),
    /// Index fill.
    Iota(Iota),
    /// Constant fill.
    Fill(Fill),
    /// One collective over every operand (`all_reduce` or `from_owners`).
    Collective(Vec<CollectivePart>),
}

/// One launch of a program.
#[derive(Clone, Debug)]
pub struct Launch<'g> {
    /// The graph node it runs.
    pub node: usize,
    /// The name profiles show: the kernel's name, `gemm_bias_gelu`, `gather`, ...
    pub name: String,
    /// What it runs.
    pub op: LaunchOp<'g>,
    /// Storage types of the node's operands, then of its results.
    pub dtypes: Vec<DType>,
    /// Bytes of the operands and results (static).
    pub bytes: u64,
    /// Useful floating-point operations (static; 0 for kernels, which targets count).
    pub flops: u64,
    /// The IR ops it runs, in order: a fused kernel's body, a product's epilogues
    /// ([`fused_ops`]); what timelines show.
    pub ops: Vec<&'static str>,
    /// The `all_reduce` launches (indices in this list) whose results it reads, directly or
    /// through views: a target that runs collectives beside the other launches waits for them
    /// here.
    pub waits: Vec<usize>,
}

impl Launch<'_> {
    /// An error about this launch: `node 12 (`gemm`): ...`.
    pub fn err(&self, msg: impl std::fmt::Display) -> String {
        format!("node {} (`{}`): {msg}", self.node, self.name)
    }
}

/// Where a program's outputs land.
#[derive(Clone, Debug, Default)]
pub struct ProgramIo {
    /// Scalar outputs (`loss`, `grad_norm`): name, byte offset, type.
    pub scalars: Vec<(String, u64, DType)>,
    /// Every output: name → (byte offset, type, concrete shape).
    pub outputs: HashMap<String, (u64, DType, Vec<usize>)>,
}

/// The launch plan of a run: the shared layout and every program's launches.
pub struct LaunchPlan<'g> {
    /// Where persistent tensors live.
    pub layout: SharedLayout,
    /// The persistent prefix plus the largest program's arena: the planned bytes.
    pub planned_bytes: u64,
    /// Each program's launches and outputs, in [`Program`] order.
    pub programs: Vec<(Program, Vec<Launch<'g>>, ProgramIo)>,
    /// Type and concrete shape of every parameter and input, by name.
    pub tensors: HashMap<String, (DType, Vec<usize>)>,
    /// The Step program's memory plan (for summaries; the first program's in a run without Step).
    pub step_plan: MemPlan,
}

impl<'g> LaunchPlan<'g> {
    /// Plans memory for every program (the Step program's persistent regions are shared, or the
    /// first program's in a run without Step) and lists their launches.
    pub fn new(run: &'g RunPrograms) -> Result<LaunchPlan<'g>, String> {
        let bind = &run.bind;
        let mut plans = vec![];
        for (p, g) in run.in_order() {
            plans.push((p, g, memplan(g, bind, &MemplanOptions::default()).map_err(|e| format!("memory plan of {p:?}: {e}"))?));
        }
        // The Step program's persistent tensors are laid out first (a run without one, such
        // as the decoder's, starts from its first program), then any another program adds.
        let first = plans.iter().position(|(p, _, _)| *p == Program::Step).unwrap_or(0);
        let (_, main, main_plan) = plans.get(first).ok_or("a run needs at least one program")?;
        let mut layout = SharedLayout::new(main, main_plan);
        for (p, g, plan) in &plans {
            layout.add_missing(g, plan).map_err(|e| format!("{p:?} program: {e}"))?;
        }
        let arena = plans.iter().map(|(_, _, plan)| plan.arena_bytes).max().unwrap_or(0);
        let planned_bytes = layout.persistent_bytes.checked_add(arena).ok_or("the memory plan overflows 64 bits")?;
        let mut programs = vec![];
        let mut tensors = HashMap::new();
        for (p, g, plan) in &plans {
            let launches = launches(g, plan, &layout, bind).map_err(|e| format!("{p:?} program: {e}"))?;
            let mut io = ProgramIo::default();
            for (name, v) in &g.outputs {
                let (off, ty) = (layout.offset(g, plan, *v)?, g.ty(*v));
                if ty.shape.rank() == 0 {
                    io.scalars.push((name.clone(), off, ty.dtype));
                }
                io.outputs.insert(name.clone(), (off, ty.dtype, concrete(g, *v, bind)?));
            }
            for (name, v) in g.params().into_iter().chain(g.inputs()) {
                tensors.insert(name.to_string(), (g.ty(v).dtype, concrete(g, v, bind)?));
            }
            programs.push((*p, launches, io));
        }
        let step_plan = plans.into_iter().nth(first).map(|(_, _, plan)| plan).ok_or("no program")?;
        Ok(LaunchPlan { layout, planned_bytes, programs, tensors, step_plan })
    }
}

impl LaunchPlan<'_> {
    /// "The memory plan needs ... (persistent ..., activations ...)": the start of the error
    /// when the plan does not fit the memory at hand.
    pub fn too_large(&self) -> String {
        format!(
            "the memory plan needs {} ({} persistent: parameters, gradients, AdamW state; {} activations): lower --batch or --seq",
            mib(self.planned_bytes),
            mib(self.layout.persistent_bytes),
            mib(self.planned_bytes - self.layout.persistent_bytes)
        )
    }
}

/// Bytes as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1048576.0)
}

fn concrete(g: &Graph, v: ValueId, bind: &Bindings) -> Result<Vec<usize>, String> {
    Ok(g.ty(v).shape.eval(bind)?.into_iter().collect())
}

/// The launches of `g` under `plan`: every node but parameters, inputs and views.
fn launches<'g>(g: &'g Graph, plan: &MemPlan, layout: &SharedLayout, bind: &Bindings) -> Result<Vec<Launch<'g>>, String> {
    let mut out = vec![];
    // The `all_reduce` launch each value is a result (or a view of a result) of.
    let mut reduced_by: HashMap<ValueId, usize> = HashMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if let Op::Reshape { .. } = n.op {
            if let Some(&by) = n.inputs.first().and_then(|v| reduced_by.get(v)) {
                reduced_by.insert(n.results[0], by);
            }
        }
        if matches!(n.op, Op::Param { .. } | Op::Input { .. } | Op::Reshape { .. }) {
            continue;
        }
        let err = |m: String| format!("node {i} (`{}`): {m}", n.op.mnemonic());
        let off = |v: ValueId| layout.offset(g, plan, v).map_err(err);
        let dims = |v: ValueId| concrete(g, v, bind).map_err(err);
        let values = || n.inputs.iter().chain(&n.results);
        let bytes = values().map(|v| g.ty(*v).bytes(bind).map(|b| b as u64)).sum::<Result<u64, String>>().map_err(err)?;
        let dtypes = values().map(|v| g.ty(*v).dtype).collect();
        let (op, name, flops) = match &n.op {
            Op::MatMul { .. } | Op::Gemm(_) => {
                let p = product(g, n, bind, &off).map_err(err)?;
                let name = if let Op::Gemm(gm) = &n.op { gm.launch_name() } else { "matmul".to_string() };
                (LaunchOp::Product(p), name, p.spec.flops())
            }
            Op::Kernel(k) => {
                let ins = n.inputs.iter().map(|v| off(*v)).collect::<Result<_, _>>()?;
                let outs = n.results.iter().map(|v| off(*v)).collect::<Result<_, _>>()?;
                (LaunchOp::Kernel { kernel: k, ins, outs }, k.name.clone(), 0)
            }
            Op::Gather => {
                let t = dims(n.inputs[0])?;
                let cnt = dims(n.inputs[1])?.iter().product();
                let (table, idx, out) = (off(n.inputs[0])?, off(n.inputs[1])?, off(n.results[0])?);
                (LaunchOp::Gather(Gather { table, rows: t[0], cols: t[1], idx, n: cnt, out }), "gather".into(), 0)
            }
            Op::ScatterAdd { .. } => {
                let o = dims(n.results[0])?;
                let cnt: usize = dims(n.inputs[1])?.iter().product();
                let (src, idx, out) = (off(n.inputs[0])?, off(n.inputs[1])?, off(n.results[0])?);
                let s = ScatterAdd { src, cols: o[1], idx, n: cnt, out, rows: o[0] };
                (LaunchOp::ScatterAdd(s), "scatter_add".into(), (cnt * o[1]) as u64)
            }
            Op::Attention { heads, scale } | Op::AttentionGrad { heads, scale } => {
                let q = dims(n.inputs[0])?;
                let r = q.len();
                let h = *heads as usize;
                let dims = AttnDims { s: q[..r - 2].iter().product(), t: q[r - 2], h, d: q[r - 1] / 3 / h };
                let forward = matches!(n.op, Op::Attention { .. });
                let at = if forward {
                    AttnOffsets { qkv: off(n.inputs[0])?, out: off(n.results[0])?, lse: off(n.results[1])?, dout: None, dqkv: None }
                } else {
                    let (dout, dqkv) = (Some(off(n.inputs[3])?), Some(off(n.results[0])?));
                    AttnOffsets { qkv: off(n.inputs[0])?, out: off(n.inputs[1])?, lse: off(n.inputs[2])?, dout, dqkv }
                };
                let name = if forward { "attention" } else { "attention_grad" };
                let dtype = g.ty(n.inputs[0]).dtype;
                (LaunchOp::Attention(Attention { forward, dims, scale: *scale as f32, dtype, at }), name.into(), 0)
            }
            Op::Iota { axis, ty } => {
                let iota = Iota { shape: dims(n.results[0])?, axis: *axis, dtype: ty.dtype, out: off(n.results[0])? };
                (LaunchOp::Iota(iota), "iota".into(), 0)
            }
            Op::Const { value, ty } => {
                let cnt = dims(n.results[0])?.iter().product();
                (LaunchOp::Fill(Fill { value: *value, dtype: ty.dtype, n: cnt, out: off(n.results[0])? }), "fill".into(), 0)
            }
            Op::AllReduce | Op::FromOwners { .. } => {
                let owners = match &n.op {
                    Op::FromOwners { owners } => owners.iter().map(|&o| Some(o)).collect(),
                    _ => vec![None; n.inputs.len()],
                };
                let mut parts: Vec<CollectivePart> = vec![];
                for ((&x, &y), owner) in n.inputs.iter().zip(&n.results).zip(owners) {
                    let part = CollectivePart { x: off(x)?, y: off(y)?, n: dims(y)?.iter().product(), dtype: g.ty(y).dtype, owner };
                    match parts.last_mut() {
                        Some(last) if last.continues(&part) => last.n += part.n,
                        _ => parts.push(part),
                    }
                }
                (LaunchOp::Collective(parts), n.op.mnemonic().into(), 0)
            }
            other => return Err(err(format!("`{}` outside a fused kernel has no launch on a compiled target", other.mnemonic()))),
        };
        let mut waits: Vec<usize> = n.inputs.iter().filter_map(|v| reduced_by.get(v).copied()).collect();
        waits.sort_unstable();
        waits.dedup();
        if n.op == Op::AllReduce {
            n.results.iter().for_each(|r| _ = reduced_by.insert(*r, out.len()));
        }
        out.push(Launch { node: i, name, op, dtypes, bytes, flops, ops: fused_ops(g, n), waits });
    }
    Ok(out)
}

/// The IR ops node `n` of `g` runs, in order: a `kernel`'s body ops (its `input` nodes left out), a
/// `gemm`'s product and epilogues (`matmul`, `add bias`, `gelu`, `cast`, `add accumulator`),
/// or the node's own op.
pub fn fused_ops(g: &Graph, n: &Node) -> Vec<&'static str> {
    match &n.op {
        Op::Kernel(k) => k.body.nodes.iter().filter(|b| !matches!(b.op, Op::Input { .. })).map(|b| b.op.mnemonic()).collect(),
        Op::Gemm(gm) => {
            let cast = gm.out != g.ty(n.inputs[0]).dtype;
            let parts = [(true, "matmul"), (gm.bias, "add bias"), (gm.gelu, "gelu"), (cast, "cast"), (gm.accumulate, "add accumulator")];
            parts.iter().filter(|(on, _)| *on).map(|(_, op)| *op).collect()
        }
        op => vec![op.mnemonic()],
    }
}

/// The product of a `matmul` or `gemm` node.
fn product(g: &Graph, n: &Node, bind: &Bindings, off: &dyn Fn(ValueId) -> Result<u64, String>) -> Result<Product, String> {
    let (ta, tb) = match &n.op {
        Op::Gemm(gm) => (gm.trans_a, gm.trans_b),
        Op::MatMul { trans_a, trans_b } => (*trans_a, *trans_b),
        _ => unreachable!("called on products only"),
    };
    let mut spec = gemm_spec(g, bind, n.inputs[0], n.inputs[1], n.results[0], ta, tb)?;
    let mut p = Product {
        spec,
        a: off(n.inputs[0])?,
        b: off(n.inputs[1])?,
        bias: None,
        acc: None,
        y: off(n.results[0])?,
        pre: None,
        operands: g.ty(n.inputs[0]).dtype,
        out: g.ty(n.results[0]).dtype,
    };
    if let Op::Gemm(gm) = &n.op {
        (spec.bias, spec.gelu, spec.accumulate) = (gm.bias, gm.gelu, gm.accumulate);
        p.spec = spec;
        p.bias = if gm.bias { Some(off(n.inputs[2])?) } else { None };
        p.acc = match n.inputs.last() {
            Some(acc) if gm.accumulate => Some(off(*acc)?),
            _ => None,
        };
        p.pre = if gm.gelu { Some(off(n.results[1])?) } else { None };
    }
    Ok(p)
}

/// The GEMM shape of `y = op(a) op(b)`.
fn gemm_spec(g: &Graph, bind: &Bindings, a: ValueId, b: ValueId, y: ValueId, ta: bool, tb: bool) -> Result<GemmSpec, String> {
    let ev = |v: ValueId| g.ty(v).shape.eval(bind);
    let (ad, bd, yd) = (ev(a)?, ev(b)?, ev(y)?);
    let r = yd.len();
    let k = if ta { ad[ad.len() - 2] } else { ad[ad.len() - 1] };
    let mut spec = GemmSpec::new(yd[r - 2], yd[r - 1], k);
    spec.batch = yd[..r - 2].iter().product();
    (spec.trans_a, spec.trans_b) = (ta, tb);
    spec.b_shared = bd.len() == 2 && ad.len() > 2;
    Ok(spec)
}
