//! The column mapping (column reductions only: bias gradients): blocks of 32 x 8 threads; a
//! block owns `32 W` adjacent columns and one chunk of rows. Thread `(x, y)` takes the `W`
//! adjacent columns `c0 = (32 blockIdx.x + x) W .. c0 + W` and the rows `r0 + y, r0 + y + 8,
//! ...` of the block's chunk `[r0, r1)`, keeping one register partial per column.
//!
//! `W` is the row loops' width (`Seg::width`, see `rows.rs`): 8 when a bf16 view is among the
//! vectorizable ones and all allow it, else 4 when the row is a multiple of 4, else 1 (scalar
//! accesses). With `W > 1` the views that allow it are one vector load (store) a row (`uint4`
//! or `uint2` for bf16, `float4` for f32) through `vector_io`, and bf16 lanes are widened and
//! narrowed per column by the prelude's `bf16_to_f32`/`f32_to_bf16`: every element is the
//! bits of the scalar path. With `W = 1`, values without a row axis are computed once, before
//! the row loop.
//!
//! After the rows the block's 8 row slices are added in shared memory in slice order (slice
//! `y` holds rows `r0 + y + 8 k` in order), one partial per column and chunk lands in scratch,
//! and the finalize kernel adds the chunks in order: the order of every column sum is fixed by
//! the shape alone.

use std::fmt::Write;

use fusec_ir::rows::{region, NodeId, Region};

use super::{op_of, red_fn, red_init, Seg, R};
use crate::plan::{arg, COL_BX, COL_BY};

impl Seg<'_> {
    /// The nodes of a column kernel's row loop (everything the column reductions and element
    /// stores need that depends on the row or column) and the loop's width `W`.
    fn col_loop(&self) -> (Vec<NodeId>, u32) {
        let (p, plan) = (self.p, &self.plan);
        let live = &plan.main_live;
        let roots: Vec<NodeId> =
            plan.colreds.iter().map(|&c| arg(p, c)).chain(plan.elem_stores.iter().map(|&s| p.stores[s].value)).collect();
        let in_loop = |id: NodeId| live[id as usize] && matches!(region(p, id), Region::Col | Region::Row);
        let all = self.needed(roots, in_loop);
        let w = self.width(&all, plan.elem_stores.iter().map(|&s| &p.stores[s]));
        (all, w)
    }

    /// Columns a thread of the column kernel takes (1, 4 or 8).
    pub fn col_width(&self) -> u32 {
        self.col_loop().1
    }

    pub(super) fn cols(&self, out: &mut String, chunks: u64) -> R<()> {
        let (p, plan) = (self.p, &self.plan);
        let (rows, cols) = (p.rows, p.cols);
        let (all, w) = self.col_loop();
        let groups = cols / w as u64;
        let span = COL_BX * w;
        self.lines(out, "  ", &self.entry_nodes(&plan.main_live))?;
        let _ = writeln!(out, "  const int g = blockIdx.x * {COL_BX} + threadIdx.x, y = threadIdx.y;");
        for &c in &plan.colreds {
            let init = red_init(op_of(&p.node(c).expr));
            if w > 1 {
                let _ = writeln!(out, "  float p{c}[{w}];\n#pragma unroll\n  for (int j = 0; j < {w}; ++j) p{c}[j] = {init};");
            } else {
                let _ = writeln!(out, "  float p{c}[1] = {{{init}}};");
            }
        }
        let _ = writeln!(out, "  if (g < {groups}) {{");
        let _ = writeln!(out, "    const int c0 = g * {w};");
        let _ = writeln!(
            out,
            "    const long long r0 = (long long)blockIdx.y * {rows} / {chunks}, r1 = ((long long)blockIdx.y + 1) * {rows} / {chunks};"
        );
        // Scalar: values without a row axis once, before the rows; wide: per row and column
        // (their vector loads come from cache).
        let (hoisted, body): (Vec<NodeId>, Vec<NodeId>) = all.into_iter().partition(|&i| w == 1 && !p.node(i).space.has_row());
        if w == 1 {
            let _ = writeln!(out, "    const int c = c0;");
            self.lines(out, "    ", &hoisted)?;
        }
        let _ = writeln!(out, "    for (long long r = r0 + y; r < r1; r += {COL_BY}) {{");
        let stores = || plan.elem_stores.iter().map(|&s| &p.stores[s]);
        let (ind, j) = if w > 1 {
            self.vector_io(out, ("      ", "const int c = c0;"), &body, stores(), w, true)?;
            let _ = writeln!(out, "#pragma unroll\n      for (int j = 0; j < {w}; ++j) {{\n        const int c = c0 + j;");
            ("        ", "j")
        } else {
            ("      ", "0")
        };
        self.lines(out, ind, &body)?;
        for &c in &plan.colreds {
            let _ = writeln!(out, "{ind}p{c}[{j}] = {}(p{c}[{j}], v{});", red_fn(op_of(&p.node(c).expr)), arg(p, c));
        }
        for s in stores() {
            let _ = writeln!(out, "{ind}{}", self.store(s)?);
        }
        if w > 1 {
            let _ = writeln!(out, "      }}");
            self.vector_io(out, ("      ", "const int c = c0;"), &body, stores(), w, false)?;
        }
        let _ = writeln!(out, "    }}\n  }}");
        // The 8 row slices of each column, added in slice order.
        let _ = writeln!(out, "  __shared__ float sh[{COL_BY}][{span}];");
        for (i, &c) in plan.colreds.iter().enumerate() {
            if i > 0 {
                let _ = writeln!(out, "  __syncthreads();");
            }
            let f = red_fn(op_of(&p.node(c).expr));
            let _ = writeln!(out, "#pragma unroll\n  for (int j = 0; j < {w}; ++j) sh[y][threadIdx.x * {w} + j] = p{c}[j];");
            let _ = writeln!(out, "  __syncthreads();");
            let _ = writeln!(out, "  for (int i = y * {COL_BX} + threadIdx.x; i < {span}; i += {}) {{", COL_BX * COL_BY);
            let _ = writeln!(out, "    const int c = blockIdx.x * {span} + i;\n    if (c < {cols}) {{");
            let _ = writeln!(out, "      float a = sh[0][i];\n      for (int k = 1; k < {COL_BY}; ++k) a = {f}(a, sh[k][i]);");
            let _ = writeln!(out, "      scratch[{} + (long long)blockIdx.y * {cols} + c] = a;\n    }}\n  }}", self.scratch_of(c));
        }
        Ok(())
    }
}
