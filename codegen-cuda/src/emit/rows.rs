//! The row mapping: a team of threads per row, passes over the row's columns between row
//! reductions, column reductions as per-team partials (in registers when they fit, in the
//! team's slice of shared memory when there are many), and vector loads and stores where a
//! pass's views are contiguous and aligned.
//!
//! A pass's column loop is *wide* when the row allows it: each thread takes `W` adjacent
//! columns at a time (`c0 .. c0 + W`), loads every vectorizable view the pass reads into
//! registers before the per-column code and stores the pass's results from registers after it.
//! `W` is 4 (f32 views: one 16-byte `float4`; bf16 views: one 8-byte `uint2`), or 8 when the
//! pass touches a bf16 view and every vectorizable view allows it (bf16: one 16-byte `uint4`;
//! f32: two `float4`). A pass that touches no bf16 view keeps `W = 4`, so f32 kernels print as
//! before. With register partials, `W` also needs the row to be a multiple of `W` x team, and
//! partial `k` is then column `(lane + (k / W) team) W + k % W`.
//!
//! A view is vectorizable when it is contiguous f32 or bf16 and all of its row strides are
//! multiples of `W`: its first column's element offset is then a multiple of `W`, and the
//! buffers themselves are 256-byte aligned. Other views stay scalar accesses inside the loop,
//! as do whole loops over rows of other widths. bf16 lanes are widened and narrowed per column
//! by the prelude's `bf16_to_f32`/`f32_to_bf16`, so every element is the bits of the scalar
//! path; what `W` changes is which columns each lane adds into a row reduction before the team
//! reduction (fixed by the shape: still deterministic). Column reductions keep their order.
//! Stores other than 4-wide f32 go through the prelude's `st_*` helpers (one `st.global.v4` or
//! `.v2` each).
//!
//! `width` and `vector_io` serve the other mappings too: the flat body (`w` elements a thread)
//! and the column kernels (`cols.rs`: `W` adjacent columns a thread, one register partial per
//! column, the row walked in the same fixed order whatever `W`).

use std::fmt::Write;

use fusec_ir::rows::{region, Expr, Mem, NodeId, Region, Store, View, FINAL};
use fusec_ir::ReduceOp;

use super::stash::Stash;
use super::{online, op_of, red_fn, red_init, Seg, R};
use crate::plan::{arg, Pass, MAX_REG_PARTIALS};

/// The most vector steps a thread of a wide pass takes unrolled.
pub(super) const MAX_UNROLL: u64 = 8;

/// Indentation and the scope that places a wide row loop's first column.
const COLS: (&str, &str) = ("      ", "const int c = c0;");

impl Seg<'_> {
    /// The row body for teams of `team` threads, `tpb` a block; with `cluster` > 1 a team is a
    /// cluster of that many blocks (sm_90): its lanes span the blocks, its reductions go
    /// through distributed shared memory (the prelude's `cluster_sum`/`cluster_max`), and it
    /// syncs once more at the end of each row so that no block reuses or leaves its shared
    /// memory while another still reads it.
    pub(super) fn rows(&self, out: &mut String, team: u32, tpb: u32, teams: u64, cluster: u32) -> R<()> {
        let (p, plan) = (self.p, &self.plan);
        let live = &plan.main_live;
        let cols = p.cols;
        let k_count = cols.div_ceil(team as u64);
        let reg = k_count <= MAX_REG_PARTIALS;
        // Register partials of column reductions accumulated by a wide pass (`W` adjacent
        // columns a thread at a time): partial `k` is column `(lane + (k / W) team) W + k % W`.
        let mut reg_width: Vec<(NodeId, u32)> = vec![];
        if cluster > 1 {
            // Eight warps' partials, then a block total for each of up to eight reductions a row.
            let _ = writeln!(out, "  __shared__ float sh[16];");
        } else if team > 32 {
            let _ = writeln!(out, "  __shared__ float sh[{}];", team / 32);
        } else {
            let _ = writeln!(out, "  float* sh = 0;");
        }
        self.lines(out, "  ", &self.entry_nodes(live))?;
        if cluster > 1 {
            let _ = writeln!(out, "  const int lane = (int)cluster_rank() * {} + threadIdx.x;", team / cluster);
            let _ = writeln!(out, "  const long long team = (long long)blockIdx.x / {cluster};");
        } else {
            let _ = writeln!(out, "  const int lane = threadIdx.x % {team};");
            let _ = writeln!(out, "  const long long team = (long long)blockIdx.x * {tpb} + threadIdx.x / {team};");
        }
        // A team reduction of `arg` (`sum` or `max`): the k-th of a row in a cluster uses slot k.
        let slot = std::cell::Cell::new(0u32);
        let reduce = |f: &str, arg: String| {
            if cluster > 1 {
                slot.set(slot.get() + 1);
                format!("cluster_{f}<{cluster}>({arg}, sh, {})", slot.get() - 1)
            } else {
                format!("team_{f}<{team}>({arg}, sh)")
            }
        };
        let _ = writeln!(out, "  if (team >= {teams}) return;");
        // Column partials in registers, or in the team's slice of shared memory (`Plan::smem_partials`).
        let in_smem = plan.smem_partials;
        let mut shared = 0u64;
        // Where each column reduction's shared-memory partials start.
        let mut smem_base: Vec<(NodeId, u64)> = vec![];
        // Each pass's per-column code, worked out once for staging and for emission.
        let mut codes: Vec<(Vec<NodeId>, u32, bool)> = plan.passes.iter().map(|pass| self.pass_code(pass, reg)).collect();
        // Partial slots a thread keeps per column reduction: one per column it visits, or more
        // where a wide pass's last vector step runs past the row (those stay unused).
        let k_slots = codes
            .iter()
            .filter(|(_, w, unrolled)| *unrolled && *w > 1)
            .map(|(_, w, _)| cols.div_ceil(team as u64 * *w as u64) * *w as u64)
            .fold(k_count, u64::max);
        let online = if self.fast_math { online::detect(p, &plan.passes) } else { None };
        // Values of the first pass kept for the later ones (`stash.rs`); the later passes'
        // bodies then start from them (at the width they had: they load fewer views).
        let roots: Vec<Vec<NodeId>> = plan.passes.iter().map(|pass| self.pass_roots(pass)).collect();
        let stash = if online.is_none() && cluster == 1 {
            let shapes: Vec<Option<(u32, u64)>> = codes
                .iter()
                .map(|&(_, w, unrolled)| {
                    let steps = if unrolled { k_slots / w as u64 } else { cols.div_ceil(team as u64 * w as u64) };
                    (w > 1 && (unrolled || steps <= MAX_UNROLL)).then_some((w, steps))
                })
                .collect();
            self.stash_plan(&shapes, &roots, |r, cut| self.pass_body(r, cut))
        } else {
            Stash::default()
        };
        for (code, r) in codes.iter_mut().zip(&roots).skip(1) {
            code.0 = self.pass_body(r, &stash.nodes);
        }
        // The online pass computes the second pass's sum: that pass is not emitted.
        let merged = online.as_ref().map(|_| 1);
        let staged = self.stage_plan(tpb, &codes, merged);
        // Later passes' views loaded ahead only by warp teams: a block team's extra registers
        // cost it a block an SM (GPT-2 1.5B LayerNorm gradient 0.066 -> 0.074 ms, while the
        // 124M one, warp teams, went 0.044 -> 0.038 ms on an H200). Not beside an online pass,
        // which is not emitted and so could not load them.
        let kept = self.keep_plan(team, k_slots, &codes, &staged, team <= 32 && merged.is_none());
        if in_smem || !staged.is_empty() {
            let _ = writeln!(out, "  extern __shared__ __align__(16) unsigned char stage[];");
        }
        let part = |c: NodeId| if in_smem { format!("p{c}[k * {team}]") } else { format!("p{c}[k]") };
        for &(c, _) in &self.scratch {
            let op = op_of(&p.node(c).expr);
            if !plan.row_colreds.contains(&c) && reg {
                if in_smem {
                    let per_warp = k_slots * team as u64;
                    smem_base.push((c, shared));
                    let _ = writeln!(out, "  float* p{c} = (float*)(stage + {shared}) + (threadIdx.x / 32) * {per_warp} + lane;");
                    shared += per_warp * tpb as u64 * 4;
                } else {
                    let _ = writeln!(out, "  float p{c}[{k_slots}];");
                }
                let _ = writeln!(out, "#pragma unroll\n  for (int k = 0; k < {k_slots}; ++k) {} = {};", part(c), red_init(op));
            } else if !plan.row_colreds.contains(&c) {
                let _ = writeln!(out, "  float* p{c} = scratch + {} + team * {cols};", self.scratch_of(c));
                let _ = writeln!(out, "  for (int c = lane; c < {cols}; c += {team}) p{c}[c] = {};", red_init(op));
            } else {
                let _ = writeln!(out, "  float p{c} = {};", red_init(op));
            }
        }
        for (i, (v, _)) in staged.iter().enumerate() {
            let t = if v.mem == Mem::Bf16 { "unsigned short" } else { "float" };
            let _ = writeln!(out, "  {t}* s{i} = ({t}*)(stage + {shared});");
            shared += cols * mem_bytes(v.mem);
        }
        self.shared.set(shared as u32);
        let _ = writeln!(out, "  for (long long r = team; r < {}; r += {teams}) {{", p.rows);
        if !staged.is_empty() {
            // The previous row's last pass may still read the staged copies.
            let _ = writeln!(out, "    __syncthreads();");
        }
        for (i, k) in kept.iter().enumerate() {
            let (t, n) = vec_reg(k.view.mem, k.w);
            let parts = if n > 1 { format!("[{n}]") } else { String::new() };
            let _ = writeln!(out, "    {t} rk{i}[{}]{parts};", k.steps);
        }
        out.push_str(&stash.declare());
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
            if merged == Some(next) {
                // Its sum was computed by the online pass before it.
                next += 1;
            } else if next < plan.passes.len() && plan.passes[next].level == level {
                let pass = &plan.passes[next];
                let (body, w, unrolled) = &codes[next];
                let (w, unrolled) = (*w, *unrolled);
                next += 1;
                for &rr in &pass.rowreds {
                    match &online {
                        Some(o) if o.max == rr => out.push_str(&o.open(codes[next - 1].1)),
                        _ => _ = writeln!(out, "    float a{rr} = {};", red_init(op_of(&p.node(rr).expr))),
                    }
                }
                let stores = || pass.stores.iter().map(|&s| &p.stores[s]);
                let wide = w > 1;
                reg_width.extend(pass.colreds.iter().map(|&c| (c, w)));
                let mut stage = vec![];
                for (i, (v, first)) in staged.iter().enumerate() {
                    if self.loads_view(body, v) {
                        stage.push((v.clone(), format!("s{i}"), *first == pass.level));
                        if *first != pass.level && stage.len() == 1 {
                            let _ = writeln!(out, "    __syncthreads();");
                        }
                    }
                }
                *self.stage.borrow_mut() = stage;
                *self.keep.borrow_mut() = kept
                    .iter()
                    .enumerate()
                    .filter(|(_, k)| k.first == pass.level || self.loads_view(body, &k.view))
                    .map(|(i, k)| (k.view.clone(), format!("rk{i}"), k.first == pass.level))
                    .collect();
                // Vector steps of the team over the row; in an unrolled wide pass the last one
                // may start past the row's end.
                let steps = cols.div_ceil(team as u64 * w as u64);
                let past_end = wide && (unrolled || steps <= MAX_UNROLL) && steps * (team * w) as u64 > cols;
                if wide && unrolled {
                    let _ = writeln!(out, "#pragma unroll\n    for (int k4 = 0; k4 < {}; ++k4) {{", k_slots / w as u64);
                    let _ = writeln!(out, "      const int c0 = (lane + k4 * {team}) * {w};");
                    if past_end {
                        let _ = writeln!(out, "      if (c0 < {cols}) {{");
                    }
                    self.vector_io(out, COLS, body, stores(), w, true)?;
                    let _ = writeln!(
                        out,
                        "#pragma unroll\n      for (int j = 0; j < {w}; ++j) {{\n      const int c = c0 + j, k = k4 * {w} + j;"
                    );
                } else if wide && steps <= MAX_UNROLL {
                    // A few vector steps a thread: unrolled, so that all their loads are in
                    // flight at once (LayerNorm forward 0.062 -> 0.056 ms on the H100).
                    let _ = writeln!(out, "#pragma unroll\n    for (int k4 = 0; k4 < {steps}; ++k4) {{");
                    let _ = writeln!(out, "      const int c0 = (lane + k4 * {team}) * {w};");
                    if past_end {
                        let _ = writeln!(out, "      if (c0 < {cols}) {{");
                    }
                    self.vector_io(out, COLS, body, stores(), w, true)?;
                    let _ = writeln!(out, "#pragma unroll\n      for (int j = 0; j < {w}; ++j) {{\n      const int c = c0 + j;");
                } else if wide {
                    // Vector loads and stores: `w` columns a thread, in order.
                    let _ = writeln!(out, "    for (int c0 = lane * {w}; c0 < {cols}; c0 += {}) {{", team * w);
                    self.vector_io(out, COLS, body, stores(), w, true)?;
                    let _ = writeln!(out, "#pragma unroll\n      for (int j = 0; j < {w}; ++j) {{\n      const int c = c0 + j;");
                } else if unrolled {
                    let _ = writeln!(out, "#pragma unroll\n    for (int k = 0; k < {k_count}; ++k) {{");
                    let _ = writeln!(out, "      const int c = lane + k * {team};");
                    if cols % team as u64 != 0 {
                        let _ = writeln!(out, "      if (c >= {cols}) break;");
                    }
                } else {
                    let _ = writeln!(out, "    for (int c = lane; c < {cols}; c += {team}) {{");
                }
                let first = next == 1;
                if !first {
                    let reads = self.reads_stashed(&roots[next - 1], body);
                    out.push_str(&stash.read("      ", &reads));
                    *self.stashed.borrow_mut() = stash.nodes.clone();
                }
                self.lines(out, "      ", body)?;
                if first {
                    out.push_str(&stash.fill("      "));
                }
                for &rr in &pass.rowreds {
                    match &online {
                        Some(o) if o.max == rr => out.push_str(&o.update(arg(p, rr), w)),
                        _ => _ = writeln!(out, "      a{rr} = {}(a{rr}, v{});", red_fn(op_of(&p.node(rr).expr)), arg(p, rr)),
                    }
                }
                for &c in &pass.colreds {
                    let f = red_fn(op_of(&p.node(c).expr));
                    let at = if unrolled { part(c) } else { format!("p{c}[c]") };
                    let _ = writeln!(out, "      {at} = {f}({at}, v{});", arg(p, c));
                }
                for &s in &pass.stores {
                    let _ = writeln!(out, "      {}", self.store(&p.stores[s])?);
                }
                if wide {
                    let _ = writeln!(out, "      }}");
                    if let Some(o) = online.as_ref().filter(|o| pass.rowreds.contains(&o.max)) {
                        out.push_str(&o.step(w));
                    }
                    self.vector_io(out, COLS, body, stores(), w, false)?;
                }
                if past_end {
                    let _ = writeln!(out, "      }}");
                }
                let _ = writeln!(out, "    }}");
                self.stage.borrow_mut().clear();
                self.keep.borrow_mut().clear();
                self.stashed.borrow_mut().clear();
                for &rr in &pass.rowreds {
                    let f = match op_of(&p.node(rr).expr) {
                        ReduceOp::Sum => "sum",
                        ReduceOp::Max => "max",
                    };
                    let _ = writeln!(out, "    const float v{rr} = {};", reduce(f, format!("a{rr}")));
                    if let Some(o) = online.as_ref().filter(|o| o.max == rr) {
                        out.push_str(&o.close(&reduce("sum", format!("a{}", o.sum))));
                    }
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
        if cluster > 1 {
            if slot.get() > 8 {
                return Err(format!("internal: {} row reductions for a cluster team (at most 8)", slot.get()));
            }
            let _ = writeln!(out, "    cluster_sync();");
        }
        let _ = writeln!(out, "  }}");
        let width_of = |c: NodeId| reg_width.iter().find(|&&(n, _)| n == c).map_or(1, |&(_, w)| w);
        if in_smem {
            // The block sums its warps' partials (in warp order) and writes one set.
            let per_warp = k_slots * team as u64;
            let _ = writeln!(out, "  __syncthreads();");
            let _ = writeln!(out, "  for (int i = threadIdx.x; i < {per_warp}; i += {}) {{", tpb * team);
            for &(c, base) in &smem_base {
                let f = red_fn(op_of(&p.node(c).expr));
                let col = match width_of(c) {
                    1 => format!("i % {team} + (i / {team}) * {team}"),
                    w => format!("(i % {team} + (i / {team} / {w}) * {team}) * {w} + (i / {team}) % {w}"),
                };
                let _ = writeln!(out, "    {{\n      const float* s = (const float*)(stage + {base}) + i;\n      float a = s[0];");
                let _ = writeln!(out, "      for (int t = 1; t < {tpb}; ++t) a = {f}(a, s[t * {per_warp}]);");
                let _ = writeln!(out, "      const int c = {col};");
                let _ = writeln!(out, "      if (c < {cols}) scratch[{} + blockIdx.x * {cols}ll + c] = a;\n    }}", self.scratch_of(c));
            }
            let _ = writeln!(out, "  }}");
            return Ok(());
        }
        for &(c, off) in &self.scratch {
            if plan.row_colreds.contains(&c) {
                let _ = writeln!(out, "  if (lane == 0) scratch[{off} + team] = p{c};");
            } else if reg {
                let _ = writeln!(out, "#pragma unroll\n  for (int k = 0; k < {k_slots}; ++k) {{");
                let w = width_of(c);
                if w > 1 {
                    let _ = writeln!(out, "    const int c = (lane + (k / {w}) * {team}) * {w} + k % {w};");
                } else {
                    let _ = writeln!(out, "    const int c = lane + k * {team};");
                }
                let _ = writeln!(out, "    if (c < {cols}) scratch[{off} + team * {cols} + c] = {};\n  }}", part(c));
            }
        }
        Ok(())
    }

    /// A row pass's per-column code: the nodes it computes, its width (see `width`) and
    /// whether its column loop is unrolled over register partials.
    fn pass_code(&self, pass: &Pass, reg: bool) -> (Vec<NodeId>, u32, bool) {
        let unrolled = reg && !pass.colreds.is_empty();
        let body = self.pass_body(&self.pass_roots(pass), &[]);
        let stores = pass.stores.iter().map(|&s| &self.p.stores[s]);
        // An unrolled pass's last vector step may run past the row (guarded where emitted).
        let w = self.width(&body, stores);
        (body, w, unrolled)
    }

    /// What a row pass computes per column for: its row and column reductions' arguments and
    /// its stores' values.
    fn pass_roots(&self, pass: &Pass) -> Vec<NodeId> {
        let p = self.p;
        pass.rowreds.iter().chain(&pass.colreds).map(|&r| arg(p, r)).chain(pass.stores.iter().map(|&s| p.stores[s].value)).collect()
    }

    /// The per-column nodes computed for `roots`, taking the `stashed` ones as given.
    fn pass_body(&self, roots: &[NodeId], stashed: &[NodeId]) -> Vec<NodeId> {
        let (p, live) = (self.p, &self.plan.main_live);
        self.needed(roots.to_vec(), |id| live[id as usize] && region(p, id) == Region::Col && !stashed.contains(&id))
    }

    /// Whether `body` loads view `v`.
    fn loads_view(&self, body: &[NodeId], v: &View) -> bool {
        body.iter().any(|&id| matches!(&self.p.node(id).expr, Expr::Load(x) if x == v))
    }

    /// The columns a thread takes at a time in a column loop over `body` and `stores`: 8 when a
    /// bf16 view is among the vectorizable ones, all of them allow it and the row is a multiple
    /// of 8, else 4 where the row is a multiple of 4, else 1 (a scalar loop).
    pub(super) fn width<'s>(&self, body: &[NodeId], stores: impl Iterator<Item = &'s Store>) -> u32 {
        let cols = self.p.cols;
        let loads = body.iter().filter_map(|&id| match &self.p.node(id).expr {
            Expr::Load(v) => Some(v),
            _ => None,
        });
        let views: Vec<&View> = loads.chain(stores.map(|s| &s.view)).filter(|v| vectorizable(v, 4)).collect();
        let eight = views.iter().any(|v| v.mem == Mem::Bf16) && views.iter().all(|v| vectorizable(v, 8));
        if eight && cols.is_multiple_of(8) {
            8
        } else if cols.is_multiple_of(4) {
            4
        } else {
            1
        }
    }

    /// Around a `w`-wide column loop (`c0`: its first column): before it (`open`), one vector
    /// load per distinct vectorizable view the body reads (f32: `float4`, two for `w = 8`;
    /// bf16: `uint2`, or `uint4` for `w = 8`) and a register per such store; after it, the
    /// stores (f32 with `w = 4` as a C store, as before; the others through the prelude's
    /// `st_*` helpers, which NVRTC cannot split). Other views stay scalar accesses inside the
    /// loop.
    pub(super) fn vector_io<'s>(
        &self,
        out: &mut String,
        (ind, at): (&str, &str),
        body: &[NodeId],
        stores: impl Iterator<Item = &'s Store>,
        w: u32,
        open: bool,
    ) -> R<()> {
        let reg = |m: Mem| vec_reg(m, w);
        let decl = |v: &View, n: &str| match reg(v.mem) {
            (t, 1) => format!("{t} {n};"),
            (t, k) => format!("{t} {n}[{k}];"),
        };
        if open {
            let mut vec = vec![];
            for &id in body {
                if let Expr::Load(v) = &self.p.node(id).expr {
                    if vectorizable(v, w) && !vec.iter().any(|(x, _)| x == v) {
                        let n = format!("q{}", vec.len());
                        // A staged view: from its shared-memory copy, or into it (`rows.rs`).
                        let staged = self.stage.borrow().iter().find(|(x, _, _)| x == v).map(|(_, s, fill)| (s.clone(), *fill));
                        let kept = self.keep.borrow().iter().find(|(x, _, _)| x == v).map(|(_, s, fill)| (s.clone(), *fill));
                        if let Some((rk, false)) = &kept {
                            // Loaded by an earlier pass over the row: from its registers.
                            let init = match reg(v.mem) {
                                (t, 1) => format!("{t} {n} = {rk}[k4];"),
                                (t, _) => format!("{t} {n}[2] = {{{rk}[k4][0], {rk}[k4][1]}};"),
                            };
                            let _ = writeln!(out, "{ind}{init}");
                            vec.push((v.clone(), n));
                            continue;
                        }
                        let (s, off) = match &staged {
                            Some((sm, false)) => (sm.clone(), "c".to_string()),
                            _ => (self.slot_name(v.slot)?, self.offset(v)),
                        };
                        let (load, k) = match reg(v.mem) {
                            (t, 1) => (format!("{n} = *(const {t}*)&{s}[{off}];"), 1),
                            (t, k) => {
                                let parts: Vec<String> = (0..k).map(|i| format!(" {n}[{i}] = vp[{i}];")).collect();
                                (format!("const {t}* vp = (const {t}*)&{s}[{off}];{}", parts.concat()), k)
                            }
                        };
                        let keep = match &staged {
                            Some((sm, true)) => {
                                let t = reg(v.mem).0;
                                let parts: Vec<String> = (0..k)
                                    .map(|i| {
                                        if k == 1 {
                                            format!(" *({t}*)&{sm}[c] = {n};")
                                        } else {
                                            format!(" (({t}*)&{sm}[c])[{i}] = {n}[{i}];")
                                        }
                                    })
                                    .collect();
                                parts.concat()
                            }
                            _ => match &kept {
                                Some((rk, true)) if k == 1 => format!(" {rk}[k4] = {n};"),
                                Some((rk, true)) => format!(" {rk}[k4][0] = {n}[0]; {rk}[k4][1] = {n}[1];"),
                                _ => String::new(),
                            },
                        };
                        let _ = writeln!(out, "{ind}{}\n{ind}{{ {at} {load}{keep} }}", decl(v, &n));
                        vec.push((v.clone(), n));
                    }
                }
            }
            // Views a later pass reads, loaded ahead into their registers (`keep_plan`).
            for (v, rk, _) in self.keep.borrow().iter().filter(|(x, _, fill)| *fill && !vec.iter().any(|(y, _)| y == x)) {
                let (s, off) = (self.slot_name(v.slot)?, self.offset(v));
                let load = match reg(v.mem) {
                    (t, 1) => format!("{rk}[k4] = *(const {t}*)&{s}[{off}];"),
                    (t, _) => format!("const {t}* vp = (const {t}*)&{s}[{off}]; {rk}[k4][0] = vp[0]; {rk}[k4][1] = vp[1];"),
                };
                let _ = writeln!(out, "{ind}{{ {at} {load} }}");
            }
            for s in stores {
                if vectorizable(&s.view, w) && !vec.iter().any(|(x, _)| *x == s.view) {
                    let n = format!("w{}", vec.len());
                    let _ = writeln!(out, "{ind}{}", decl(&s.view, &n));
                    vec.push((s.view.clone(), n));
                }
            }
            *self.vec.borrow_mut() = vec;
        } else {
            let vec = self.vec.take();
            for s in stores {
                if let Some((_, n)) = vec.iter().find(|(x, _)| *x == s.view) {
                    let (sl, off) = (self.slot_name(s.view.slot)?, self.offset(&s.view));
                    let store = match (s.view.mem, w) {
                        (Mem::Bf16, 4) => format!("st_b32x2(&{sl}[{off}], {n});"),
                        (Mem::Bf16, _) => format!("st_b32x4(&{sl}[{off}], {n});"),
                        (_, 4) => format!("*(float4*)&{sl}[{off}] = {n};"),
                        _ => format!("float* vp = &{sl}[{off}]; st_f32x4(vp, {n}[0]); st_f32x4(vp + 4, {n}[1]);"),
                    };
                    let _ = writeln!(out, "{ind}{{ {at} {store} }}");
                }
            }
        }
        Ok(())
    }
}

/// The register type, and how many of it, that hold `w` elements of a view stored as `m`:
/// f32 `float4` (two for `w = 8`), bf16 `uint2` (`w = 4`) or `uint4`.
pub(super) fn vec_reg(m: Mem, w: u32) -> (&'static str, u32) {
    match (m, w) {
        (Mem::Bf16, 4) => ("uint2", 1),
        (Mem::Bf16, _) => ("uint4", 1),
        (_, 4) => ("float4", 1),
        _ => ("float4", 2),
    }
}

/// Whether a view's `w` columns from a multiple of `w` are one aligned vector: contiguous f32
/// or bf16 with every row stride a multiple of `w` (buffers are 256-byte aligned).
pub(super) fn vectorizable(v: &View, w: u32) -> bool {
    v.col && matches!(v.mem, Mem::F32 | Mem::Bf16) && v.row.iter().all(|t| t.stride.is_multiple_of(w as u64))
}

/// Bytes an element of `m` takes in memory.
pub(super) fn mem_bytes(m: Mem) -> u64 {
    if m == Mem::Bf16 {
        2
    } else {
        4
    }
}
