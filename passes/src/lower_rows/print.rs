//! The text of `fusec dump --pass lower-rows`: every distinct kernel's row programs.

use std::collections::HashSet;
use std::fmt::Write;

use fusec_ir::{Bindings, Graph, Op};

use super::lower_kernel;

/// The row programs of every distinct kernel of `g` under `bind` (run after `memplan`, as the
/// backends do), as text: per kernel a `# kernel NAME: N segment(s)` header, then
/// [`Prog::text`](fusec_ir::rows::Prog::text) of each segment; identical kernels (same text)
/// print once. Ends with the count of distinct kernels. An `Err` names the first kernel that
/// does not lower and why.
pub fn print(g: &Graph, bind: &Bindings) -> Result<String, String> {
    let mut seen = HashSet::new();
    let mut text = String::new();
    for n in &g.nodes {
        if let Op::Kernel(k) = &n.op {
            let progs = lower_kernel(k, bind)?;
            let mut one = String::new();
            let _ = writeln!(one, "# kernel {}: {} segment(s)", k.name, progs.len());
            for p in &progs {
                one.push_str(&p.text());
            }
            if seen.insert(one.clone()) {
                text.push_str(&one);
                text.push('\n');
            }
        }
    }
    let _ = writeln!(text, "# {} distinct kernels", seen.len());
    Ok(text)
}
