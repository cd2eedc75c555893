//! Placement: persistent regions in parameter order, and the transient arena by decreasing-size
//! best fit (XLA's `GlobalDecreasingSizeBestFitHeap`, lowest fitting offset).

use std::collections::{BTreeMap, HashMap};

use fusec_ir::{Graph, Op};

use super::{Region, RegionPlan, ALIGN};

/// Rounds up to [`ALIGN`].
pub(super) fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// The persistent region of every parameter and input (by value), in layout order.
pub(super) fn persistent_order(g: &Graph) -> Vec<(Region, u32)> {
    let mut params = vec![];
    let mut inputs: Vec<(&str, u32)> = vec![];
    for n in &g.nodes {
        match &n.op {
            Op::Param { name, .. } => params.push((name.as_str(), n.results[0].0)),
            Op::Input { name, .. } => inputs.push((name.as_str(), n.results[0].0)),
            _ => {}
        }
    }
    let by_name: HashMap<&str, u32> = inputs.iter().copied().collect();
    let mut claimed: HashMap<u32, ()> = HashMap::new();
    let mut out: Vec<(Region, u32)> = params.iter().map(|&(_, v)| (Region::Params, v)).collect();
    for (region, prefix) in [(Region::Grads, "grad."), (Region::AdamM, "m."), (Region::AdamV, "v.")] {
        for (p, _) in &params {
            if let Some(&v) = by_name.get(format!("{prefix}{p}").as_str()) {
                if claimed.insert(v, ()).is_none() {
                    out.push((region, v));
                }
            }
        }
    }
    out.extend(inputs.iter().filter(|(_, v)| !claimed.contains_key(v)).map(|&(_, v)| (Region::Inputs, v)));
    out
}

/// Lays the persistent tensors out back to back from offset 0, each [`ALIGN`]ed; returns the
/// regions (all five, possibly empty) and each tensor's offset.
pub(super) fn lay_out_persistent(order: &[(Region, u32)], bytes: &[u64]) -> (Vec<RegionPlan>, Vec<(u32, u64)>) {
    let mut regions = vec![];
    let mut offsets = vec![];
    let mut cur = 0u64;
    for region in Region::PERSISTENT {
        let start = cur;
        let mut tensors = 0;
        for &(_, v) in order.iter().filter(|(r, _)| *r == region) {
            offsets.push((v, cur));
            cur += align(bytes[v as usize]);
            tensors += 1;
        }
        regions.push(RegionPlan { region, offset: start, bytes: cur - start, tensors });
    }
    (regions, offsets)
}

/// One transient buffer to place: its size and live interval (inclusive positions).
#[derive(Clone, Copy, Debug)]
pub(super) struct Item {
    pub bytes: u64,
    pub start: usize,
    pub end: usize,
}

/// Offsets in the arena and its size. With `reuse`, decreasing-size best fit: largest first
/// (ties: earlier start, then input order), each at the lowest [`ALIGN`]ed offset that overlaps
/// no placed buffer whose interval intersects its own. Without, each buffer gets its own range
/// in order of definition.
pub(super) fn place_arena(items: &[Item], reuse: bool) -> (Vec<u64>, u64) {
    let mut off = vec![0u64; items.len()];
    let mut idx: Vec<usize> = (0..items.len()).collect();
    if !reuse {
        idx.sort_by_key(|&i| (items[i].start, i));
        let mut cur = 0;
        for i in idx {
            off[i] = cur;
            cur += align(items[i].bytes);
        }
        return (off, cur);
    }
    idx.sort_by_key(|&i| (std::cmp::Reverse(align(items[i].bytes)), items[i].start, i));
    let mut placed = Placed::default();
    let mut busy: Vec<(u64, u64)> = vec![];
    let mut size = 0;
    for i in idx {
        let it = items[i];
        let need = align(it.bytes);
        busy.clear();
        placed.overlapping(it.start, it.end, &mut busy);
        busy.sort_unstable();
        let mut at = 0u64;
        for &(o, s) in &busy {
            if at + need <= o {
                break;
            }
            at = at.max(o + s);
        }
        off[i] = at;
        size = size.max(at + need);
        placed.insert(i, it.start, it.end, at, need);
    }
    (off, size)
}

/// The placed buffers, indexed so that finding those whose lives intersect an interval does not
/// scan them all when lives are short (a long chain has as many buffers as nodes): short lives
/// by the length class of their life (class `c` holds lengths `end - start` in `2^c..2^(c+1)`,
/// lengths 0 and 1 in class 0), then by start, since a life of class `c` that intersects
/// `[s, e]` starts in `s - (2^(c+1) - 1) ..= e`; long lives in a list scanned linearly (they
/// overlap most queries anyway).
#[derive(Default)]
struct Placed {
    /// Per short class: `(start, item) -> (end, offset, size)`.
    short: Vec<BTreeMap<(usize, usize), Placement>>,
    /// `(start, end, offset, size)` of the buffers with longer lives.
    long: Vec<(usize, usize, u64, u64)>,
}

/// Where a placed buffer's life ends, its offset and its size.
type Placement = (usize, u64, u64);

/// Lives up to `2^SHORT_CLASSES - 1` positions long are indexed.
const SHORT_CLASSES: usize = 8;

impl Placed {
    fn insert(&mut self, item: usize, start: usize, end: usize, offset: u64, size: u64) {
        let c = end.saturating_sub(start).checked_ilog2().unwrap_or(0) as usize;
        if c >= SHORT_CLASSES {
            self.long.push((start, end, offset, size));
            return;
        }
        if self.short.len() <= c {
            self.short.resize_with(c + 1, BTreeMap::new);
        }
        self.short[c].insert((start, item), (end, offset, size));
    }

    /// Appends `(offset, size)` of every placed buffer whose life intersects `[start, end]`.
    fn overlapping(&self, start: usize, end: usize, out: &mut Vec<(u64, u64)>) {
        for (c, m) in self.short.iter().enumerate() {
            let from = start.saturating_sub((1 << (c + 1)) - 1);
            out.extend(m.range((from, 0)..=(end, usize::MAX)).filter(|(_, v)| v.0 >= start).map(|(_, v)| (v.1, v.2)));
        }
        out.extend(self.long.iter().filter(|p| p.0 <= end && start <= p.1).map(|p| (p.2, p.3)));
    }
}

/// The largest sum of bytes of items live at one position (a lower bound on any arena).
pub(super) fn peak_live(items: &[Item], n: usize) -> u64 {
    let mut delta = vec![0i128; n + 2];
    for it in items {
        delta[it.start] += it.bytes as i128;
        delta[it.end + 1] -= it.bytes as i128;
    }
    let (mut live, mut peak) = (0i128, 0i128);
    for d in delta {
        live += d;
        peak = peak.max(live);
    }
    peak as u64
}
