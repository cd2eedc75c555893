//! The canonical text of a row program ([`Prog::text`]): what `fusec dump --pass lower-rows`
//! prints, and what the CPU backend keys its compiled-function cache by.

use std::fmt::Write;

use super::{Expr, Prog, Slot, View, FINAL};

impl Prog {
    /// The canonical text of the program (no operand indices: identical segments print the
    /// same). The CPU backend keys its compiled-function cache by it.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "prog {} rows={} cols={} chunks={}", self.name, self.rows, self.cols, self.chunks);
        for (i, sl) in self.slots.iter().enumerate() {
            let what = match sl {
                Slot::Operand(_) => "in".to_string(),
                Slot::Result(_) => "out".to_string(),
                Slot::Scratch(n) => format!("scratch[{n}]"),
            };
            let _ = writeln!(s, "  s{i}: {what}");
        }
        for (i, n) in self.nodes.iter().enumerate() {
            let lvl = if n.level == FINAL { "final".to_string() } else { n.level.to_string() };
            let _ = writeln!(s, "  %{i} = {} : {:?} {:?} L{lvl}", expr_text(&n.expr), n.ty, n.space);
        }
        for st in &self.stores {
            let _ = writeln!(s, "  store {}, %{}", view_text(&st.view), st.value);
        }
        for (id, slot) in &self.stashes {
            let _ = writeln!(s, "  stash %{id} s{slot}");
        }
        for (id, slot) in &self.offloads {
            let _ = writeln!(s, "  offload %{id} s{slot}");
        }
        for id in &self.native_maxes {
            let _ = writeln!(s, "  native_max %{id}");
        }
        s
    }
}

fn view_text(v: &View) -> String {
    let mut s = format!("s{} {:?} [", v.slot, v.mem);
    for (i, t) in v.row.iter().enumerate() {
        if i > 0 {
            s.push_str(" + ");
        }
        let _ = write!(s, "(r/{}", t.div);
        if t.modulo != 0 {
            let _ = write!(s, "%{}", t.modulo);
        }
        let _ = write!(s, ")*{}", t.stride);
    }
    if v.col {
        s.push_str(if v.row.is_empty() { "c" } else { " + c" });
    }
    s.push(']');
    s
}

fn expr_text(e: &Expr) -> String {
    use Expr::*;
    match e {
        ConstF(b) => format!("constf {:?}", f32::from_bits(*b)),
        ConstI(i) => format!("consti {i}"),
        Load(v) => format!("load {}", view_text(v)),
        ColIota => "col_iota".to_string(),
        RowIota { div, modulo } => format!("row_iota /{div} %{modulo}"),
        Unary(u, a) => format!("{u:?} %{a}").to_lowercase(),
        Binary(b, x, y) => format!("{} %{x}, %{y}", format!("{b:?}").to_lowercase()),
        Cmp(c, x, y) => format!("{} %{x}, %{y}", format!("{c:?}").to_lowercase()),
        Select(c, a, b) => format!("select %{c}, %{a}, %{b}"),
        RoundBf16(a) => format!("round_bf16 %{a}"),
        FToI(a) => format!("f2i %{a}"),
        IToF(a) => format!("i2f %{a}"),
        RowReduce(op, a) => format!("row_{} %{a}", format!("{op:?}").to_lowercase()),
        Pick(a, t) => format!("pick %{a}, col %{t}"),
        ColReduce(op, a, s) => format!("col_{} %{a} s{s}", format!("{op:?}").to_lowercase()),
    }
}
