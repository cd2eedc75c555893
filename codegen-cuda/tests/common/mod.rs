//! Helpers shared by this crate's tests.

use fusec_codegen_cuda::{kernel_source, KernelSource};
use fusec_ir::{Bindings, Graph, Op};

/// Every distinct kernel source of a scheduled graph under `bind`, in program order, and how
/// many kernel nodes it has.
pub fn distinct_sources(g: &Graph, bind: &Bindings) -> (Vec<KernelSource>, usize) {
    let mut out: Vec<KernelSource> = vec![];
    let mut kernels = 0;
    for n in &g.nodes {
        if let Op::Kernel(k) = &n.op {
            kernels += 1;
            let ks = kernel_source(k, bind).unwrap_or_else(|e| panic!("{}: {e}", k.name));
            if !out.iter().any(|o| o.source == ks.source) {
                out.push(ks);
            }
        }
    }
    (out, kernels)
}
