//! `memplan`: static memory planning of one training step on the launch order (run `schedule`
//! first: the plan is made for the graph's node order as given).
//!
//! Everything lives in one allocation: a persistent prefix, then the transient arena.
//!
//! - **Persistent regions**, in this order, each contiguous and in parameter order, every tensor
//!   [`ALIGN`]ed: `params` (every `param`), `grads` (inputs `grad.P`), `adam_m` (`m.P`), `adam_v`
//!   (`v.P`), `inputs` (every other input: tokens, targets, runtime scalars). Zeroing all
//!   gradients is one memset; AdamW can run over one flat range.
//! - **State write-back**: a graph output named like a parameter or input is computed straight
//!   into that tensor's buffer. Legal only if the old value is not read after the producer runs
//!   and the producer itself reads it only element by element (`adamw`, elementwise ops);
//!   otherwise [`memplan`] fails and says which read is in the way.
//! - **Views**: a `reshape` result aliases its operand; the operand stays live until the view's
//!   last read.
//! - **In place**: an accumulating `gemm` always writes over its last operand. With reuse, an
//!   elementwise op, or a `kernel` that reads the operand only pointwise into that result (see
//!   `buffers::in_place_options` for the exact rule and the contract it puts on backends), writes
//!   its result into the buffer of an operand of equal size that it reads last; operands already
//!   in a persistent buffer are preferred. Gradient accumulators (`grad.P` inputs) are scratch
//!   owned by the step: accumulations write into them even when the graph does not output `grad.P`
//!   (after the step they hold the gradient, as llm.c's gradient buffer does); other parameters
//!   and inputs are only overwritten by their own write-back.
//! - **Transients** (everything else, `loss` included): one buffer per group of values sharing
//!   it in place, live from the first definition to the last read (graph outputs: to the end).
//!   Placed by decreasing-size best fit into one arena. Without reuse (`--no-reuse`), every
//!   transient buffer gets its own range and nothing is done in place but what semantics require
//!   (write-back, accumulating `gemm`), so the arena is exactly the naive sum.
//!
//! Positions in intervals are node indices in launch order; an end of `n` (the node count) means
//! the value is still live when the step ends.

pub(crate) mod buffers;
mod layout;
mod print;

use fusec_ir::{Bindings, Graph, Op, ValueId};

use buffers::{in_place_options, Conflict, Groups, Live};
use layout::{align, Item};

/// Alignment of every tensor's offset, in bytes.
pub const ALIGN: u64 = 256;

/// What `memplan` may do.
#[derive(Clone, Debug)]
pub struct MemplanOptions {
    /// Share arena bytes between buffers with disjoint lives and write in place (`false`:
    /// `--no-reuse`, each transient buffer gets its own range).
    pub reuse: bool,
}

impl Default for MemplanOptions {
    /// Reuse on.
    fn default() -> Self {
        MemplanOptions { reuse: true }
    }
}

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Region {
    /// Parameters.
    Params,
    /// Gradient accumulators `grad.P`.
    Grads,
    /// AdamW first moments `m.P`.
    AdamM,
    /// AdamW second moments `v.P`.
    AdamV,
    /// Every other input.
    Inputs,
    /// Transient values.
    Arena,
}

impl Region {
    /// The persistent regions in layout order.
    pub const PERSISTENT: [Region; 5] = [Region::Params, Region::Grads, Region::AdamM, Region::AdamV, Region::Inputs];

    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Region::Params => "params",
            Region::Grads => "grads",
            Region::AdamM => "adam_m",
            Region::AdamV => "adam_v",
            Region::Inputs => "inputs",
            Region::Arena => "arena",
        }
    }
}

/// How a value shares another value's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AliasKind {
    /// A `reshape` of it.
    View,
    /// Written over it in place, in the arena.
    InPlace,
    /// Written over it (or over a value in its buffer) in a persistent buffer: state write-back
    /// or gradient accumulation.
    State,
}

/// The placement of one value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValuePlan {
    /// The region of its buffer.
    pub region: Region,
    /// Byte offset from the start of the allocation.
    pub offset: u64,
    /// Its own size in bytes.
    pub bytes: u64,
    /// Its own life `[definition, last read]` in launch positions (`n`: to the end of the step).
    pub live: (usize, usize),
    /// The value whose buffer it shares (viewed or overwritten), if it does not own one.
    pub alias: Option<(ValueId, AliasKind)>,
}

/// One persistent region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionPlan {
    /// Which region.
    pub region: Region,
    /// Byte offset from the start of the allocation.
    pub offset: u64,
    /// Size including alignment padding.
    pub bytes: u64,
    /// Number of tensors.
    pub tensors: usize,
}

/// A memory plan: where every value lives, and the sizes to report.
#[derive(Clone, Debug)]
pub struct MemPlan {
    /// Per value (indexed by [`ValueId`]).
    pub values: Vec<ValuePlan>,
    /// The persistent regions in layout order (empty ones included).
    pub regions: Vec<RegionPlan>,
    /// Bytes of the persistent prefix (where the arena starts).
    pub persistent_bytes: u64,
    /// Size of the transient arena.
    pub arena_bytes: u64,
    /// Lower bound on the arena: the largest sum of live transient buffer bytes at one position.
    pub peak_live_bytes: u64,
    /// The arena without any reuse: the sum of every transient buffer's aligned size.
    pub naive_bytes: u64,
    /// Values written in place over an arena buffer.
    pub in_place: usize,
    /// `reshape` results.
    pub view_aliases: usize,
    /// Values written into a persistent buffer they do not own.
    pub state_aliases: usize,
    /// The number of nodes (the end position).
    pub nodes: usize,
    /// The binding the plan was made for.
    pub bindings: Bindings,
    /// Whether reuse was on.
    pub reuse: bool,
}

impl MemPlan {
    /// Persistent prefix plus arena: the size of the one allocation.
    pub fn total_bytes(&self) -> u64 {
        self.persistent_bytes + self.arena_bytes
    }

    /// The persistent region `r`.
    pub fn region(&self, r: Region) -> Option<&RegionPlan> {
        self.regions.iter().find(|p| p.region == r)
    }
}

/// Plans `g`'s memory for its node order under `bind` (every symbolic dim must be bound).
pub fn memplan(g: &Graph, bind: &Bindings, opts: &MemplanOptions) -> Result<MemPlan, String> {
    let nv = g.values.len();
    let names = value_numbers(g);
    let name = |v: u32| format!("%{}", names[v as usize]);
    let live = Live::new(g, bind)?;
    let mut gr = Groups::new(g, &live);
    let mut alias: Vec<Option<(ValueId, AliasKind)>> = vec![None; nv];
    let persistent = layout::persistent_order(g);
    let mut is_grad_acc = vec![false; nv];
    for &(r, v) in &persistent {
        is_grad_acc[v as usize] = r == Region::Grads;
    }
    let conflict_msg = |c: Conflict, live: &Live| match c {
        Conflict::TwoOwners(x, y) => format!("{} and {} are different persistent tensors", name(x), name(y)),
        Conflict::Overlap { earlier, later } => format!(
            "{} (live at positions {}..={}) is still read after {} is written at position {}",
            name(earlier),
            live.def[earlier as usize],
            live.vend[earlier as usize],
            name(later),
            live.def[later as usize]
        ),
    };

    for n in &g.nodes {
        if let Op::Reshape { .. } = n.op {
            alias[n.results[0].0 as usize] = Some((n.inputs[0], AliasKind::View));
        }
    }
    // Semantics first: accumulating gemms, then state write-back.
    for (i, n) in g.nodes.iter().enumerate() {
        let Op::Gemm(gm) = &n.op else { continue };
        let (true, Some(&acc)) = (gm.accumulate, n.inputs.last()) else {
            continue;
        };
        let (r, b) = (n.results[0].0, live.base[acc.0 as usize]);
        let at = || format!("memplan: gemm {} (position {i}) accumulates in place into {}", name(r), name(acc.0));
        if n.inputs[..n.inputs.len() - 1].iter().any(|v| live.base[v.0 as usize] == b) {
            return Err(format!("{}, which it also reads as a factor", at()));
        }
        if live.bytes[r as usize] != live.bytes[b as usize] {
            return Err(format!("{}, whose size differs", at()));
        }
        gr.merge(&live, b, r).map_err(|c| format!("{}: {}", at(), conflict_msg(c, &live)))?;
    }
    let ipo: Vec<_> = g.nodes.iter().map(|n| in_place_options(n, g)).collect();
    let by_name: std::collections::HashMap<&str, u32> = persistent.iter().map(|&(_, v)| (source_name(g, v), v)).collect();
    for (oname, v) in &g.outputs {
        let Some(&x) = by_name.get(oname.as_str()) else {
            continue;
        };
        let b = live.base[v.0 as usize];
        if gr.find(b) != gr.find(x) {
            let at = || {
                format!(
                    "memplan: output `{oname}` ({}, position {}) cannot be written back in place over {}",
                    name(v.0),
                    live.def[b as usize],
                    name(x)
                )
            };
            if live.bytes[b as usize] != live.bytes[x as usize] {
                return Err(format!("{}: sizes differ ({} vs {} bytes)", at(), live.bytes[b as usize], live.bytes[x as usize]));
            }
            // The producer may read the old value only element by element.
            let pi = g.values[b as usize].node.0 as usize;
            let pn = &g.nodes[pi];
            let ri = pn.results.iter().position(|r| r.0 == b).unwrap_or(0);
            let opt = &ipo[pi];
            if let Some(k) = (0..pn.inputs.len()).find(|&k| live.base[pn.inputs[k].0 as usize] == x && !opt.safe_while_writing(k, ri)) {
                return Err(format!("{}: `{}` reads it (operand {k}) other than element by element", at(), pn.op.mnemonic()));
            }
            gr.merge(&live, x, b).map_err(|c| format!("{}: {}", at(), conflict_msg(c, &live)))?;
        }
        gr.set_written_back(x);
    }
    // Accumulating gemms may only overwrite persistent tensors that are scratch or written back.
    for n in &g.nodes {
        if let (Op::Gemm(gm), Some(acc)) = (&n.op, n.inputs.last()) {
            let b = live.base[acc.0 as usize];
            if let (true, Some(o)) = (gm.accumulate, gr.owner(b)) {
                if !is_grad_acc[o as usize] && !gr.written_back(b) {
                    return Err(format!(
                        "memplan: gemm {} accumulates in place into `{}`, which is not a gradient accumulator and is not written back",
                        name(n.results[0].0),
                        source_name(g, o)
                    ));
                }
            }
        }
    }
    // The buffers without reuse: the naive sum.
    let naive_bytes: u64 = transient_items(&mut gr, &live).iter().map(|(_, it)| align(it.bytes)).sum();

    if opts.reuse {
        for (i, n) in g.nodes.iter().enumerate() {
            let opt = &ipo[i];
            for (ri, cands) in opt.candidates.iter().enumerate() {
                let r = n.results[ri].0;
                if cands.is_empty() || live.base[r as usize] != r {
                    continue;
                }
                // Persistent buffers first: writing there frees an arena buffer.
                let mut order: Vec<usize> = cands.clone();
                order.sort_by_key(|&k| (gr.owner(live.base[n.inputs[k].0 as usize]).is_none(), k));
                for k in order {
                    let o = n.inputs[k];
                    let b = live.base[o.0 as usize];
                    // Every read of the buffer being overwritten is element by element.
                    let all_safe =
                        n.inputs.iter().enumerate().all(|(k2, v)| live.base[v.0 as usize] != b || opt.safe_while_writing(k2, ri));
                    let writable = match gr.owner(b) {
                        None => true,
                        Some(x) => is_grad_acc[x as usize] || gr.written_back(b),
                    };
                    if live.vend[b as usize] != i || live.bytes[b as usize] != live.bytes[r as usize] || !all_safe || !writable {
                        continue;
                    }
                    if gr.find(b) != gr.find(r) && gr.merge(&live, b, r).is_ok() {
                        break;
                    }
                }
            }
        }
    }

    // Place: persistent tensors, then the arena.
    let (regions, poffsets) = layout::lay_out_persistent(&persistent, &live.bytes);
    let persistent_bytes: u64 = regions.iter().map(|r| r.bytes).sum();
    let mut offset = vec![u64::MAX; nv];
    let mut region = vec![Region::Arena; nv];
    for (&(reg, v), &(_, off)) in persistent.iter().zip(&poffsets) {
        offset[v as usize] = off;
        region[v as usize] = reg;
    }
    let items = transient_items(&mut gr, &live);
    let plain: Vec<Item> = items.iter().map(|(_, it)| *it).collect();
    let (aoff, arena_bytes) = layout::place_arena(&plain, opts.reuse);
    for ((root, _), off) in items.iter().zip(aoff) {
        offset[*root as usize] = persistent_bytes + off;
    }
    // Every version after the first in a buffer overwrites the one before it.
    for v in 0..nv as u32 {
        if live.base[v as usize] == v && gr.find(v) == v {
            let kind = if gr.owner(v).is_some() { AliasKind::State } else { AliasKind::InPlace };
            let vs = gr.versions(v).to_vec();
            for w in vs.windows(2) {
                alias[w[1] as usize] = Some((ValueId(w[0]), kind));
            }
        }
    }
    let mut values = Vec::with_capacity(nv);
    let (mut in_place, mut view_aliases, mut state_aliases) = (0, 0, 0);
    for v in 0..nv as u32 {
        let b = live.base[v as usize];
        let (reg, off) = match gr.owner(b) {
            Some(x) => (region[x as usize], offset[x as usize]),
            None => (Region::Arena, offset[gr.find(b) as usize]),
        };
        let a = alias[v as usize];
        match a.map(|(_, k)| k) {
            Some(AliasKind::View) => view_aliases += 1,
            Some(AliasKind::InPlace) => in_place += 1,
            Some(AliasKind::State) => state_aliases += 1,
            None => {}
        }
        values.push(ValuePlan {
            region: reg,
            offset: off,
            bytes: live.bytes[v as usize],
            live: (live.def[v as usize], live.end[v as usize]),
            alias: a,
        });
    }
    Ok(MemPlan {
        values,
        regions,
        persistent_bytes,
        arena_bytes,
        peak_live_bytes: layout::peak_live(&plain, live.n),
        naive_bytes,
        in_place,
        view_aliases,
        state_aliases,
        nodes: live.n,
        bindings: bind.clone(),
        reuse: opts.reuse,
    })
}

/// The transient groups (root, size and interval), in root order.
fn transient_items(gr: &mut Groups, live: &Live) -> Vec<(u32, Item)> {
    let mut out = vec![];
    for v in 0..live.base.len() as u32 {
        if live.base[v as usize] != v || gr.find(v) != v || gr.owner(v).is_some() {
            continue;
        }
        let vs = gr.versions(v);
        let bytes = vs.iter().map(|&b| live.bytes[b as usize]).max().unwrap_or(0);
        let start = vs.iter().map(|&b| live.def[b as usize]).min().unwrap_or(0);
        let end = vs.iter().map(|&b| live.vend[b as usize]).max().unwrap_or(0);
        out.push((v, Item { bytes, start, end }));
    }
    out
}

/// The name of the parameter or input producing `v`.
fn source_name(g: &Graph, v: u32) -> &str {
    match &g.producer(ValueId(v)).op {
        Op::Param { name, .. } | Op::Input { name, .. } => name,
        _ => "",
    }
}

/// Positional value numbers (`%k`), as the printer assigns them.
fn value_numbers(g: &Graph) -> Vec<u32> {
    let mut num = vec![u32::MAX; g.values.len()];
    let mut k = 0;
    for n in &g.nodes {
        for r in &n.results {
            num[r.0 as usize] = k;
            k += 1;
        }
    }
    num
}
