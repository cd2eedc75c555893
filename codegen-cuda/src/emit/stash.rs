//! Row values stashed in registers between passes: a value rounded to bf16 that the first
//! pass over a row computes and a later pass needs is kept as the 16 bits it is exactly
//! (two to a 32-bit register), instead of being recomputed from the row's loads.
//!
//! A LayerNorm forward on a bf16 residual stream (`x = round(round(a + bias) + residual)`)
//! otherwise recomputes `x` in its variance and output passes; at C = 1,600 the kernel was
//! bound by issuing those instructions (`ncu`: 0.72 warps issued a scheduler a cycle) and took
//! 47.6 µs where the same code with `x` stashed took 38.9 µs, bit for bit (H200 harness).
//!
//! Stashing f32 values as well (a LayerNorm gradient's `x̂` and `dy·γ`, so that its second
//! pass loads only the residual gradient) was measured and not kept: the 1.5B step 0.8 ms
//! slower (its C = 1,600 gradient lost the shared-memory copy of its rows), 124M level.
//!
//! Only short unrolled wide passes of one shape take part (each thread visits the same
//! columns in every pass, `W` at a time, at constant vector steps `k4`), and at most
//! [`MAX_STASH_REGS`] registers a thread are spent.

use fusec_ir::rows::{Expr, Mem, NodeId};

use super::rows::vec_reg;
use super::Seg;

/// The most registers a thread spends on stashed values.
const MAX_STASH_REGS: u64 = 32;

/// The values a row kernel stashes and the register shape that holds them.
#[derive(Default)]
pub(super) struct Stash {
    /// Stashed nodes; node `nodes[i]` lives in the register array `sk{i}`.
    pub nodes: Vec<NodeId>,
    /// Vector steps a thread (the arrays' length) and columns a step.
    pub steps: u64,
    pub w: u32,
}

impl Stash {
    /// The lines that declare the arrays at the start of a row: per step, the register that
    /// holds `w` bf16 values (`uint4`, or `uint2` for `w = 4`).
    pub(super) fn declare(&self) -> String {
        let t = vec_reg(Mem::Bf16, self.w).0;
        (0..self.nodes.len()).map(|i| format!("    {t} sk{i}[{}];\n", self.steps)).collect()
    }

    /// In the first pass, after the body: element `j` of step `k4` of each stashed value.
    pub(super) fn fill(&self, ind: &str) -> String {
        let put = |(i, n): (usize, &NodeId)| format!("{ind}((unsigned short*)&sk{i}[k4])[j] = f32_to_bf16(v{n});\n");
        self.nodes.iter().enumerate().map(put).collect()
    }

    /// In a later pass, before the body: the stashed values it reads (`used`).
    pub(super) fn read(&self, ind: &str, used: &[NodeId]) -> String {
        let get = |(i, n): (usize, &NodeId)| format!("{ind}const float v{n} = bf16_to_f32(((unsigned short*)&sk{i}[k4])[j]);\n");
        self.nodes.iter().enumerate().filter(|(_, n)| used.contains(n)).map(get).collect()
    }
}

impl Seg<'_> {
    /// Picks the stashed values: `RoundBf16` nodes of the first pass's body that a later pass
    /// still needs once the values picked before it are
    /// stashed, latest first (a later value usually covers the ones it is computed from),
    /// within the register budget. `shapes` are the passes' `(W, vector steps)`, `None` where a
    /// pass is not a short unrolled wide one; `roots` each pass's roots and `body(roots, cut)`
    /// its per-column nodes with `cut` stashed.
    pub(super) fn stash_plan(
        &self,
        shapes: &[Option<(u32, u64)>],
        roots: &[Vec<NodeId>],
        body: impl Fn(&[NodeId], &[NodeId]) -> Vec<NodeId>,
    ) -> Stash {
        let Some(Some((w, steps))) = shapes.first().copied() else { return Stash::default() };
        if shapes.len() < 2 || shapes.iter().any(|s| *s != Some((w, steps))) {
            return Stash::default();
        }
        let p = self.p;
        let regs = steps * w as u64 / 2;
        let later_reads = |n: NodeId, cut: &[NodeId]| roots[1..].iter().any(|r| self.reads_stashed(r, &body(r, cut)).contains(&n));
        let mut nodes: Vec<NodeId> = vec![];
        let mut used = 0;
        for &n in body(&roots[0], &[]).iter().rev() {
            if !matches!(p.node(n).expr, Expr::RoundBf16(_)) || used + regs > MAX_STASH_REGS {
                continue;
            }
            let trial: Vec<NodeId> = nodes.iter().copied().chain([n]).collect();
            if later_reads(n, &trial) {
                nodes = trial;
                used += regs;
            }
        }
        // Drop the ones no later pass reads once all are stashed (a later pick covered them).
        let all = nodes.clone();
        nodes.retain(|&n| later_reads(n, &all));
        nodes.sort_unstable();
        Stash { nodes, steps, w }
    }

    /// The nodes a pass with `roots` and per-column nodes `body` reads without computing them:
    /// roots outside the body and the arguments of body nodes outside it (the candidates for
    /// stashed values among them).
    pub(super) fn reads_stashed(&self, roots: &[NodeId], body: &[NodeId]) -> Vec<NodeId> {
        let args = body.iter().flat_map(|&b| self.p.node(b).expr.args());
        let mut v: Vec<NodeId> = roots.iter().copied().chain(args).filter(|n| !body.contains(n)).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}
