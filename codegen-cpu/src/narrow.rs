//! bf16 copies of f32 results rounded in native code after each block of rows. AdamW stores `p'` twice,
//! as the f32 parameter and as its bf16 copy for the products; the generated code rounds four
//! lanes to bf16 in about ten integer operations, which made the bf16 AdamW half again as slow
//! as the f32 one. Such a copy's store leaves the row program ([`assign`]); the runner calls the
//! chunk's function on blocks of about [`BLOCK`] elements of rows and rounds each block of the
//! f32 result into the copy ([`round_rows`]) while it is in cache, in the level's widest
//! vectors: the same bits (nearest, ties to even, NaN kept quiet).

use fusec_ir::rows::{Expr, Mem, Prog, RowTerm, View};

use crate::convert::round_rows;

/// Elements of the rows the runner computes before rounding them (64 KiB of f32: in the L2 of
/// every common core).
pub(crate) const BLOCK: u64 = 16 * 1024;

/// A copy the runner makes after each block of rows: the argument slots of an f32 result and of its
/// bf16 copy, both `cols` contiguous elements a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Narrow {
    /// The f32 result's slot.
    pub src: usize,
    /// The bf16 copy's slot.
    pub dst: usize,
}

/// Whether copies are rounded natively: unless `FUSEC_CPU_NARROW=0` keeps them in the generated
/// loop (for comparisons).
pub(crate) fn enabled() -> bool {
    std::env::var("FUSEC_CPU_NARROW").map_or(true, |v| v.trim() != "0")
}

/// Whether `v` lays element `(r, c)` at `r * cols + c`.
fn row_major(v: &View, p: &Prog) -> bool {
    let one_row = [RowTerm { div: 1, modulo: 0, stride: p.cols }];
    v.col && (v.row == one_row || (p.rows == 1 && v.row.is_empty()))
}

/// Takes out of `p` every bf16 store of a value that `p` also stores as f32 (or of that value
/// rounded to bf16 first, which the store's rounding leaves as it is), both through row-major
/// views of whole rows, and returns them as narrows for the runner. Not in programs with column
/// reductions, whose chunk partials cannot be computed a block of rows at a time.
pub(crate) fn assign(p: &mut Prog) -> Vec<Narrow> {
    let mut out = vec![];
    if p.nodes.iter().any(|n| matches!(n.expr, Expr::ColReduce(..))) {
        return out;
    }
    let mut i = 0;
    while i < p.stores.len() {
        let st = &p.stores[i];
        let value = match p.node(st.value).expr {
            Expr::RoundBf16(x) => x,
            _ => st.value,
        };
        let twin = p.stores.iter().find(|f| f.value == value && f.view.mem == Mem::F32 && row_major(&f.view, p));
        match twin {
            Some(f) if st.view.mem == Mem::Bf16 && row_major(&st.view, p) => {
                out.push(Narrow { src: f.view.slot as usize, dst: st.view.slot as usize });
                p.stores.remove(i);
            }
            _ => i += 1,
        }
    }
    out
}

/// Rounds rows `[begin, end)` of each narrow's f32 result into its copy.
///
/// # Safety
/// `args` must hold the segment's slot pointers, the results valid for those rows.
pub(crate) unsafe fn run(narrows: &[Narrow], args: *const *mut u8, cols: u64, begin: u64, end: u64) {
    let (at, n) = ((begin * cols) as usize, ((end - begin) * cols) as usize);
    for nw in narrows {
        let src = std::slice::from_raw_parts((*args.add(nw.src) as *const f32).add(at), n);
        round_rows((*args.add(nw.dst) as *mut u16).add(at), src, 1, n, n);
    }
}
