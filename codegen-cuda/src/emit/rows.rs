//! The row mapping: a team of threads per row, passes over the row's columns between row
//! reductions, column reductions as per-team partials (in registers when they fit), and
//! 16-byte loads and stores where a pass's views are contiguous and aligned.

use std::fmt::Write;

use fusec_ir::rows::{region, Expr, Mem, NodeId, Region, Store, View, FINAL};
use fusec_ir::ReduceOp;

use super::{op_of, red_fn, red_init, Seg, R};
use crate::plan::{arg, MAX_REG_PARTIALS};

/// Indentation and the scope that places a 4-wide row loop's first column.
const COLS: (&str, &str) = ("      ", "const int c = c0;");

impl Seg<'_> {
    pub(super) fn rows(&self, out: &mut String, team: u32, tpb: u32, teams: u64) -> R<()> {
        let (p, plan) = (self.p, &self.plan);
        let live = &plan.main_live;
        let cols = p.cols;
        let k_count = cols.div_ceil(team as u64);
        let reg = k_count <= MAX_REG_PARTIALS;
        // Register partials of column reductions, four adjacent columns a thread at a time:
        // partial `k` is column `(lane + (k / 4) team) 4 + k % 4`.
        let wide_reg = reg && cols % (4 * team as u64) == 0;
        if team > 32 {
            let _ = writeln!(out, "  __shared__ float sh[{}];", team / 32);
        } else {
            let _ = writeln!(out, "  float* sh = 0;");
        }
        self.lines(out, "  ", &self.entry_nodes(live))?;
        let _ = writeln!(out, "  const int lane = threadIdx.x % {team};");
        let _ = writeln!(out, "  const long long team = (long long)blockIdx.x * {tpb} + threadIdx.x / {team};");
        let _ = writeln!(out, "  if (team >= {teams}) return;");
        for &(c, _) in &self.scratch {
            let op = op_of(&p.node(c).expr);
            if !plan.row_colreds.contains(&c) && reg {
                let _ = writeln!(out, "  float p{c}[{k_count}];");
                let _ = writeln!(out, "#pragma unroll\n  for (int k = 0; k < {k_count}; ++k) p{c}[k] = {};", red_init(op));
            } else if !plan.row_colreds.contains(&c) {
                let _ = writeln!(out, "  float* p{c} = scratch + {} + team * {cols};", self.scratch_of(c));
                let _ = writeln!(out, "  for (int c = lane; c < {cols}; c += {team}) p{c}[c] = {};", red_init(op));
            } else {
                let _ = writeln!(out, "  float p{c} = {};", red_init(op));
            }
        }
        let _ = writeln!(out, "  for (long long r = team; r < {}; r += {teams}) {{", p.rows);
        let row_nodes = |level: u32| -> Vec<NodeId> {
            (0..p.nodes.len() as NodeId)
                .filter(|&id| {
                    live[id as usize]
                        && region(p, id) == Region::Row
                        && p.node(id).level == level
                        && !matches!(p.node(id).expr, Expr::RowReduce(..))
                })
                .collect()
        };
        self.lines(out, "    ", &row_nodes(0))?;
        let max_level = (0..p.nodes.len()).filter(|&i| live[i] && p.nodes[i].level != FINAL).map(|i| p.nodes[i].level).max().unwrap_or(0);
        let mut next = 0;
        for level in 0..=max_level {
            if next < plan.passes.len() && plan.passes[next].level == level {
                let pass = &plan.passes[next];
                next += 1;
                for &rr in &pass.rowreds {
                    let _ = writeln!(out, "    float a{rr} = {};", red_init(op_of(&p.node(rr).expr)));
                }
                let unrolled = reg && !pass.colreds.is_empty();
                let roots: Vec<NodeId> = pass
                    .rowreds
                    .iter()
                    .chain(&pass.colreds)
                    .map(|&r| arg(p, r))
                    .chain(pass.stores.iter().map(|&s| p.stores[s].value))
                    .collect();
                let body = self.needed(roots, |id| live[id as usize] && region(p, id) == Region::Col);
                let wide = if unrolled { wide_reg } else { cols % 4 == 0 };
                if wide && unrolled {
                    let _ = writeln!(out, "#pragma unroll\n    for (int k4 = 0; k4 < {}; ++k4) {{", k_count / 4);
                    let _ = writeln!(out, "      const int c0 = (lane + k4 * {team}) * 4;");
                    self.vector_io(out, COLS, &body, pass.stores.iter().map(|&s| &p.stores[s]), true)?;
                    let _ =
                        writeln!(out, "#pragma unroll\n      for (int j = 0; j < 4; ++j) {{\n      const int c = c0 + j, k = k4 * 4 + j;");
                } else if wide {
                    // 16-byte loads and stores: four columns a thread, in order.
                    let _ = writeln!(out, "    for (int c0 = lane * 4; c0 < {cols}; c0 += {}) {{", team * 4);
                    self.vector_io(out, COLS, &body, pass.stores.iter().map(|&s| &p.stores[s]), true)?;
                    let _ = writeln!(out, "#pragma unroll\n      for (int j = 0; j < 4; ++j) {{\n      const int c = c0 + j;");
                } else if unrolled {
                    let _ = writeln!(out, "#pragma unroll\n    for (int k = 0; k < {k_count}; ++k) {{");
                    let _ = writeln!(out, "      const int c = lane + k * {team};");
                    if cols % team as u64 != 0 {
                        let _ = writeln!(out, "      if (c >= {cols}) break;");
                    }
                } else {
                    let _ = writeln!(out, "    for (int c = lane; c < {cols}; c += {team}) {{");
                }
                self.lines(out, "      ", &body)?;
                for &rr in &pass.rowreds {
                    let _ = writeln!(out, "      a{rr} = {}(a{rr}, v{});", red_fn(op_of(&p.node(rr).expr)), arg(p, rr));
                }
                for &c in &pass.colreds {
                    let f = red_fn(op_of(&p.node(c).expr));
                    let at = if unrolled { format!("p{c}[k]") } else { format!("p{c}[c]") };
                    let _ = writeln!(out, "      {at} = {f}({at}, v{});", arg(p, c));
                }
                for &s in &pass.stores {
                    let _ = writeln!(out, "      {}", self.store(&p.stores[s])?);
                }
                if wide {
                    let _ = writeln!(out, "      }}");
                    self.vector_io(out, COLS, &body, pass.stores.iter().map(|&s| &p.stores[s]), false)?;
                }
                let _ = writeln!(out, "    }}");
                for &rr in &pass.rowreds {
                    let f = match op_of(&p.node(rr).expr) {
                        ReduceOp::Sum => "team_sum",
                        ReduceOp::Max => "team_max",
                    };
                    let _ = writeln!(out, "    const float v{rr} = {f}<{team}>(a{rr}, sh);");
                }
            }
            self.lines(out, "    ", &row_nodes(level + 1))?;
        }
        if !plan.row_stores.is_empty() {
            let _ = writeln!(out, "    if (lane == 0) {{");
            for &s in &plan.row_stores {
                let _ = writeln!(out, "      {}", self.store(&p.stores[s])?);
            }
            let _ = writeln!(out, "    }}");
        }
        for &c in &plan.row_colreds {
            let _ = writeln!(out, "    p{c} = {}(p{c}, v{});", red_fn(op_of(&p.node(c).expr)), arg(p, c));
        }
        let _ = writeln!(out, "  }}");
        for &(c, off) in &self.scratch {
            if plan.row_colreds.contains(&c) {
                let _ = writeln!(out, "  if (lane == 0) scratch[{off} + team] = p{c};");
            } else if reg {
                let _ = writeln!(out, "#pragma unroll\n  for (int k = 0; k < {k_count}; ++k) {{");
                if wide_reg {
                    let _ = writeln!(out, "    const int c = (lane + (k / 4) * {team}) * 4 + k % 4;");
                } else {
                    let _ = writeln!(out, "    const int c = lane + k * {team};");
                }
                let _ = writeln!(out, "    if (c < {cols}) scratch[{off} + team * {cols} + c] = p{c}[k];\n  }}");
            }
        }
        Ok(())
    }

    /// Around a 4-wide column loop (`c0`: its first column): before it (`open`), one `float4`
    /// load per distinct contiguous fp32 view the body reads and a register per such store;
    /// after it, the stores. Other views stay scalar accesses inside the loop.
    pub(super) fn vector_io<'s>(
        &self,
        out: &mut String,
        (ind, at): (&str, &str),
        body: &[NodeId],
        stores: impl Iterator<Item = &'s Store>,
        open: bool,
    ) -> R<()> {
        let wide = |v: &View| v.col && v.mem == Mem::F32 && v.row.iter().all(|t| t.stride % 4 == 0);
        if open {
            let mut vec = vec![];
            for &id in body {
                if let Expr::Load(v) = &self.p.node(id).expr {
                    if wide(v) && !vec.iter().any(|(w, _)| w == v) {
                        let n = format!("q{}", vec.len());
                        let _ = writeln!(
                            out,
                            "{ind}float4 {n};\n{ind}{{ {at} {n} = *(const float4*)&{}[{}]; }}",
                            self.slot_name(v.slot)?,
                            self.offset(v)
                        );
                        vec.push((v.clone(), n));
                    }
                }
            }
            for s in stores {
                if wide(&s.view) && !vec.iter().any(|(w, _)| *w == s.view) {
                    let n = format!("w{}", vec.len());
                    let _ = writeln!(out, "{ind}float4 {n};");
                    vec.push((s.view.clone(), n));
                }
            }
            *self.vec.borrow_mut() = vec;
        } else {
            let vec = self.vec.take();
            for s in stores {
                if let Some((_, n)) = vec.iter().find(|(w, _)| *w == s.view) {
                    let _ = writeln!(out, "{ind}{{ {at} *(float4*)&{}[{}] = {n}; }}", self.slot_name(s.view.slot)?, self.offset(&s.view));
                }
            }
        }
        Ok(())
    }
}
