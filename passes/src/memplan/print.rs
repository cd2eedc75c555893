//! Human-readable forms of a [`MemPlan`]: the summary table and the annotated graph dump.

use std::fmt::Write;

use fusec_ir::Graph;

use super::{AliasKind, MemPlan, Region};

const MIB: f64 = 1024.0 * 1024.0;

impl MemPlan {
    /// A short summary: persistent regions, then arena vs peak-live lower bound vs naive sum (in
    /// bytes and MiB), the ratio arena / lower bound, and the alias counts.
    pub fn report(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "memory plan ({}; reuse {})", self.binding_text(), if self.reuse { "on" } else { "off" });
        let _ = writeln!(s, "  {:<24} {:>7} {:>14} {:>11}", "region", "tensors", "bytes", "MiB");
        let row = |s: &mut String, name: &str, tensors: Option<usize>, bytes: u64| {
            let t = tensors.map(|t| t.to_string()).unwrap_or_default();
            let _ = writeln!(s, "  {name:<24} {t:>7} {bytes:>14} {:>11.2}", bytes as f64 / MIB);
        };
        for r in &self.regions {
            row(&mut s, r.region.name(), Some(r.tensors), r.bytes);
        }
        let tensors = self.regions.iter().map(|r| r.tensors).sum();
        row(&mut s, "persistent total", Some(tensors), self.persistent_bytes);
        row(&mut s, "arena (transient)", None, self.arena_bytes);
        row(&mut s, "peak live (lower bound)", None, self.peak_live_bytes);
        row(&mut s, "naive (no reuse)", None, self.naive_bytes);
        row(&mut s, "total allocation", None, self.total_bytes());
        let _ = writeln!(s, "  arena / lower bound: {}", ratio(self.arena_bytes, self.peak_live_bytes));
        let _ = writeln!(s, "  aliases: {} state, {} in-place, {} views", self.state_aliases, self.in_place, self.view_aliases);
        s
    }

    /// The graph text followed by a `# memory plan` section (comment lines, so the dump still
    /// parses): the regions, then one line per value in value order: `%N`, offset from the start
    /// of the allocation, its bytes, its life `[definition, last read]` in launch positions (`end`:
    /// live when the step ends), and its buffer: a region, or the value it shares one with.
    pub fn annotate(&self, g: &Graph) -> String {
        let mut s = fusec_ir::text::print(g);
        let _ = writeln!(
            s,
            "# memory plan ({}; reuse {}): one allocation, {}-byte aligned offsets; live = [definition, last read] in launch positions",
            self.binding_text(),
            if self.reuse { "on" } else { "off" },
            super::ALIGN
        );
        for r in &self.regions {
            let plural = if r.tensors == 1 { "" } else { "s" };
            let _ =
                writeln!(s, "#   {:<7} offset {:>10}  bytes {:>10}  ({} tensor{plural})", r.region.name(), r.offset, r.bytes, r.tensors);
        }
        let _ = writeln!(
            s,
            "#   {:<7} offset {:>10}  bytes {:>10}  (lower bound {}, naive {}; {} in-place, {} views, {} state)",
            Region::Arena.name(),
            self.persistent_bytes,
            self.arena_bytes,
            self.peak_live_bytes,
            self.naive_bytes,
            self.in_place,
            self.view_aliases,
            self.state_aliases
        );
        let _ = writeln!(
            s,
            "#   total   bytes {} ({:.1} MiB): the one allocation a target makes (CUDA adds scratch and the cuBLAS workspace)",
            self.total_bytes(),
            self.total_bytes() as f64 / MIB
        );
        // Value numbers in print order, and the rows.
        let mut num = vec![0usize; g.values.len()];
        let mut order = vec![];
        for n in &g.nodes {
            for r in &n.results {
                num[r.0 as usize] = order.len();
                order.push(r.0 as usize);
            }
        }
        let pos = |p: usize| {
            if p >= self.nodes {
                "end".to_string()
            } else {
                p.to_string()
            }
        };
        let rows: Vec<[String; 5]> = order
            .iter()
            .map(|&v| {
                let p = &self.values[v];
                let buf = match p.alias {
                    None => p.region.name().to_string(),
                    Some((of, kind)) => {
                        let k = match kind {
                            AliasKind::View => "view of",
                            AliasKind::InPlace => "in-place over",
                            AliasKind::State => "state over",
                        };
                        format!("{} ({k} %{})", p.region.name(), num[of.0 as usize])
                    }
                };
                [format!("%{}", num[v]), p.offset.to_string(), p.bytes.to_string(), format!("[{}, {}]", pos(p.live.0), pos(p.live.1)), buf]
            })
            .collect();
        let head = ["value", "offset", "bytes", "live", "buffer"];
        let mut w = head.map(str::len);
        for r in &rows {
            for (k, c) in r.iter().enumerate() {
                w[k] = w[k].max(c.len());
            }
        }
        let line = |s: &mut String, r: [&str; 5]| {
            let _ = writeln!(
                s,
                "#   {:<w0$}  {:>w1$}  {:>w2$}  {:<w3$}  {}",
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                w0 = w[0],
                w1 = w[1],
                w2 = w[2],
                w3 = w[3]
            );
        };
        line(&mut s, head);
        for r in &rows {
            line(&mut s, [&r[0], &r[1], &r[2], &r[3], &r[4]]);
        }
        s
    }

    /// `B = 2, T = 8`, or `no symbolic dims`.
    fn binding_text(&self) -> String {
        if self.bindings.0.is_empty() {
            return "no symbolic dims".into();
        }
        self.bindings.0.iter().map(|(k, v)| format!("{k} = {v}")).collect::<Vec<_>>().join(", ")
    }
}

/// `a / b` with three decimals (`-` when `b` is zero).
fn ratio(a: u64, b: u64) -> String {
    if b == 0 {
        "-".into()
    } else {
        format!("{:.3}", a as f64 / b as f64)
    }
}
