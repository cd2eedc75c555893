//! `fuse-elementwise`: groups elementwise ops, reductions, row composites and the AdamW updates
//! into `kernel` nodes, each holding its fused group as a small IR graph (its body).
//!
//! # Kernel forms
//!
//! Every kernel has one of these forms; backends lower exactly these.
//!
//! - **A. Pointwise.** Elementwise ops ([`Op::is_elementwise`]) that all produce one shape, the
//!   kernel's *domain*.
//! - **B. Reduction.** One or more `reduce` ops (sum or max) of operands of one shape `D` over
//!   the same axes; a pointwise *prologue* on `D` (the ops feeding them, and other ops on `D`);
//!   a pointwise *epilogue* on the reduced shape `R` (the ops on the reduction results, and other
//!   ops on `R`, all evaluated once the reductions are done). Nothing in the epilogue flows back
//!   into the prologue or into a reduction: a reduction result that is broadcast back to `D`,
//!   or reduced again, is exported and read by a new kernel.
//! - **C. Composite.** One composite row op (`layernorm`, `layernorm_grad`, `softmax`,
//!   `softmax_grad`, `cross_entropy`, `cross_entropy_grad`); a pointwise prologue made only of
//!   ops that feed it (each on the shape of the operand it feeds, so it can be evaluated where
//!   the composite loads that operand); a pointwise epilogue of ops on the shapes of its results
//!   (evaluated where the composite stores a result; they may read the composite's results,
//!   prologue values and operands of that shape).
//! - **D. Multi-tensor AdamW.** Every `adamw` update of the graph in one kernel named `adamw`
//!   (or a few: at most [`MAX_RESULTS`] results each), operands such as `lr`, `bc1`, `bc2`
//!   shared, each update with a pointwise prologue on its parameter's shape made of ops that
//!   feed nothing but that update (gradient accumulation adds, clipping multiplies). The updates
//!   are independent: each tensor is its own domain.
//!
//! In every form, `const` and `iota` nodes, and `broadcast` and `reshape` nodes of values
//! computed *outside* the kernel, are copied into the body of each kernel that uses them (a
//! broadcast of an outside value becomes a broadcast of a kernel operand). They stay in the
//! outer graph only where something unfused (a matmul, an output) uses them. Never fused (their
//! own launches): `matmul`, `gemm`, `attention(_grad)`, `gather`, `scatter_add`, `concat`,
//! `slice`, `permute`, `param`, `input` and existing kernels (kernels do not nest). Dead nodes
//! are dropped.
//!
//! A body's `input` nodes, in order, are the kernel's operands, in first-use order; its outputs,
//! in order, are every member value used outside the kernel (a multi-output kernel; no value is
//! ever recomputed), in program order. Bodies are built canonically (inputs `in0, in1, ..`,
//! outputs `out0, ..`, named after the kernel), so identical groups, such as the same LayerNorm
//! in every layer, get identical bodies and compile once. A kernel is named after the mnemonics
//! of its ops in program order without repeats, whole words up to [`MAX_NAME`] characters
//! (`add_layernorm`, `gelu_grad_reduce_sum_add`). A group whose ops read no operand at all (only
//! constants) stays unfused.
//!
//! # The greedy algorithm and its rules
//!
//! Nodes are visited once, in program order. A fusible node joins the groups of the values it
//! reads (through absorbed broadcasts and reshapes), candidate by candidate in operand order,
//! when the merge is legal; each refused candidate is recorded in the [`FusionLog`] as
//! `%N (op)`, `%N` naming the value in the input graph. A node that joins no producer's group
//! may join an open group that reads one of the same operands (horizontal fusion: the operand is
//! read once; not logged); otherwise it starts a group. An `adamw` node joins the open AdamW
//! group with the pointwise groups that compute only its operands. The rules:
//!
//! - `not-fusible`: the value comes from an op that is never fused (once per op), or from the
//!   AdamW kernel (no epilogue), or would be an AdamW prologue but is read elsewhere too.
//! - `domain-mismatch`: the shapes do not fit the form (pointwise domains differ, reductions of
//!   other shapes or over other axes, a member value read through a broadcast or reshape, an op
//!   that would not feed the composite or is not on its result shapes).
//! - `recompute-in-reduction`: the op needs a value computed after the group's reduction inside
//!   the reduction's own domain (broadcast back, or reduced again): the kernel would have to
//!   recompute the reduction, so the value is exported and read by a new kernel instead.
//! - `one-composite-per-kernel`: a second composite, or a composite and a reduction.
//! - `cycle` (checked after the structural rules): the group already has a result read outside
//!   it. Groups *close* once a result escapes, and only open groups grow. This rules out the
//!   classic fusion bug, a path from the group through an outside node back into it (`a`,
//!   `y = matmul(a)`, `add(a, y)`), and makes every group's last op a valid launch position.
//!   The detail says whether such a path exists (most refusals) or the group is only closed.
//! - `read-count-limit`: the kernel would read more than [`MAX_READS`] distinct operands (the
//!   AdamW kernel is exempt).
//! - `result-count-limit`: the kernel's ops would have more than [`MAX_RESULTS`] results; for
//!   the AdamW updates this starts the next `adamw` kernel (GPT-2 124M: two).
//!
//! The pass is linear in the graph size (GPT-2 124M's training graph: a few ms) except for the
//! `cycle` details, whose search visits only the units between the group and the refused op.
//! It must run after `fuse-epilogue` and `fuse-grad-accum`: the bias adds, GELUs and gradient
//! accumulations they fold into matmuls would otherwise end up in kernels.

mod emit;
mod group;

use fusec_ir::{Graph, Op, ValueId};
use smallvec::SmallVec;

use crate::explain::FusionLog;

/// The pass name as used in the [`FusionLog`] and on the command line.
pub const PASS: &str = "fuse-elementwise";

/// The most distinct operands a kernel other than the AdamW kernel may read.
pub const MAX_READS: usize = 8;

/// The most results a kernel may have: the IR numbers a node's results with a `u16`
/// (`ValueInfo::index`).
pub const MAX_RESULTS: usize = u16::MAX as usize;

/// Kernel names are cut to this many characters (at a `_` boundary).
pub const MAX_NAME: usize = 40;

/// Groups the graph's elementwise ops, reductions, composites and AdamW updates into kernels;
/// see the module docs for the forms and rules. Refused candidates go to `log`. The result
/// computes the same outputs as `g`, rounding at the same points.
pub fn fuse_elementwise(g: &Graph, log: &mut FusionLog) -> Result<Graph, String> {
    fusec_ir::verify::verify(g).map_err(|e| format!("fuse-elementwise input: {e}"))?;
    let cx = Ctx::new(g);
    let grouping = group::group(&cx, log);
    emit::emit(&cx, &grouping)
}

/// How many launches running `g` takes: every node except `param`, `input` and `reshape`
/// (a view). Each kernel, matmul or other op is one launch.
pub fn launches(g: &Graph) -> usize {
    g.nodes.iter().filter(|n| !matches!(n.op, Op::Param { .. } | Op::Input { .. } | Op::Reshape { .. })).count()
}

/// Positional names of `g`'s values: value `v` is the `k`-th result in definition order, printed
/// `%k`, as in the `.graph` text.
pub fn positional_names(g: &Graph) -> Vec<u32> {
    let mut names = vec![u32::MAX; g.values.len()];
    let mut k = 0u32;
    for n in &g.nodes {
        for r in &n.results {
            names[r.0 as usize] = k;
            k += 1;
        }
    }
    names
}

/// What the pass does with a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// Its own launch (or an interface node: param, input).
    Fixed,
    /// `const`, `iota`, `broadcast`, `reshape`: copied into the kernels that use it.
    Absorb,
    /// Elementwise.
    Pointwise,
    /// `reduce`.
    Reduce,
    /// A composite row op.
    Composite,
    /// `adamw`.
    AdamW,
}

fn classify(op: &Op) -> Class {
    use Op::*;
    match op {
        _ if op.is_elementwise() => Class::Pointwise,
        Const { .. } | Iota { .. } | Broadcast { .. } | Reshape { .. } => Class::Absorb,
        Reduce { .. } => Class::Reduce,
        _ if op.is_row_composite() => Class::Composite,
        AdamW { .. } => Class::AdamW,
        _ => Class::Fixed,
    }
}

/// Whether the pass may put `op` in a kernel with its operands' producers (an elementwise op,
/// a reduction, or a node it copies into its readers).
pub(crate) fn joins_producers(op: &Op) -> bool {
    matches!(classify(op), Class::Pointwise | Class::Absorb | Class::Reduce)
}

/// A value a node reads, seen through the absorbable nodes in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Read {
    /// The value produced by a non-absorbable node.
    root: ValueId,
    /// Whether it is read through a `broadcast` or `reshape` (rather than directly).
    layout: bool,
}

/// Facts about the input graph that the grouping and the emission share.
struct Ctx<'g> {
    g: &'g Graph,
    class: Vec<Class>,
    /// Per node: whether an output depends on it (params and inputs always are).
    live: Vec<bool>,
    /// Per value: the live nodes that use it, in order, once each.
    users: Vec<Vec<u32>>,
    /// Per value: whether it is a graph output.
    is_output: Vec<bool>,
    /// Per absorbable node: the non-absorbable value at the end of its chain (none for chains
    /// that start at a `const` or `iota`).
    chain_root: Vec<Option<ValueId>>,
    /// Per value: its positional number.
    names: Vec<u32>,
}

impl<'g> Ctx<'g> {
    fn new(g: &'g Graph) -> Ctx<'g> {
        let class: Vec<Class> = g.nodes.iter().map(|n| classify(&n.op)).collect();
        let mut is_output = vec![false; g.values.len()];
        for (_, v) in &g.outputs {
            is_output[v.0 as usize] = true;
        }
        let mut live_val = is_output.clone();
        let mut live = vec![false; g.nodes.len()];
        for (i, n) in g.nodes.iter().enumerate().rev() {
            let interface = matches!(n.op, Op::Param { .. } | Op::Input { .. }) || n.op.is_collective();
            if interface || n.results.iter().any(|r| live_val[r.0 as usize]) {
                live[i] = true;
                for v in &n.inputs {
                    live_val[v.0 as usize] = true;
                }
            }
        }
        let mut users: Vec<Vec<u32>> = vec![Vec::new(); g.values.len()];
        for (i, n) in g.nodes.iter().enumerate().filter(|(i, _)| live[*i]) {
            for v in &n.inputs {
                let u = &mut users[v.0 as usize];
                if u.last() != Some(&(i as u32)) {
                    u.push(i as u32);
                }
            }
        }
        let mut chain_root = vec![None; g.nodes.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            if class[i] == Class::Absorb {
                chain_root[i] = n.inputs.first().and_then(|&v| {
                    let p = g.values[v.0 as usize].node.0 as usize;
                    if class[p] == Class::Absorb {
                        chain_root[p]
                    } else {
                        Some(v)
                    }
                });
            }
        }
        Ctx { g, class, live, users, is_output, chain_root, names: positional_names(g) }
    }

    /// The node producing `v`.
    fn prod(&self, v: ValueId) -> usize {
        self.g.values[v.0 as usize].node.0 as usize
    }

    /// What node `n` reads, through absorbable chains, in operand order, without repeats.
    fn reads(&self, n: usize) -> SmallVec<[Read; 8]> {
        let mut out: SmallVec<[Read; 8]> = SmallVec::new();
        for &v in &self.g.nodes[n].inputs {
            let p = self.prod(v);
            let r = if self.class[p] == Class::Absorb {
                match self.chain_root[p] {
                    Some(root) => Read { root, layout: true },
                    None => continue,
                }
            } else {
                Read { root: v, layout: false }
            };
            if !out.contains(&r) {
                out.push(r);
            }
        }
        out
    }

    /// `%k (mnemonic)` for a value: how refusals name a candidate.
    fn at(&self, v: ValueId) -> String {
        format!("%{} ({})", self.names[v.0 as usize], self.g.nodes[self.prod(v)].op.mnemonic())
    }

    /// `%k` for the first result of node `n`.
    fn node_name(&self, n: usize) -> String {
        match self.g.nodes[n].results.first() {
            Some(r) => format!("%{}", self.names[r.0 as usize]),
            None => format!("node {n}"),
        }
    }
}
