//! Fuzzing past the passes: mutants of the fused GPT-2 tiny step that compile to `memplan` are
//! lowered kernel by kernel to row programs (`lower-rows`), Cranelift machine code (`lower-cpu`)
//! and CUDA C (`lower-cuda`, source only), under `catch_unwind`; every mutant that verifies also
//! goes through `Gpt2Config::from_graph` (what `fusec run` reads first). An unsupported kernel is an
//! error; a panic fails the test. Bounded: a fixed seed, at most 2,000 mutants, 25 s of wall clock.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use fusec_codegen_cpu::KernelCompiler;
use fusec_ir::rng::Rng;
use fusec_ir::testkit::mutate::{mutate_ir, mutate_text};
use fusec_ir::text::{parse, print};
use fusec_ir::verify::verify;
use fusec_ir::{Bindings, Graph, Op};
use fusec_models::Gpt2Config;
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};

const TINY: &str = include_str!("../../models/gpt2-tiny.graph");

/// Lowers every kernel of `g` through the three lowerings; returns the panics.
fn lower_all(g: &Graph, bind: &Bindings, kc: &mut KernelCompiler) -> Vec<String> {
    let mut panics = vec![];
    for n in &g.nodes {
        let Op::Kernel(k) = &n.op else { continue };
        let steps: [(&str, &mut dyn FnMut()); 3] = [
            ("lower-rows", &mut || drop(fusec_passes::lower_rows::lower_kernel(k, bind))),
            ("lower-cpu", &mut || drop(kc.compile(k, bind))),
            ("lower-cuda", &mut || drop(fusec_codegen_cuda::kernel_source(k, bind))),
        ];
        for (what, f) in steps {
            if let Err(p) = catch_unwind(AssertUnwindSafe(f)) {
                let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                panics.push(format!("{what} of kernel `{}`: {}", k.name, msg.unwrap_or_default()));
            }
        }
    }
    panics
}

#[test]
fn mutants_never_panic_in_kernel_lowering() {
    let tiny = parse(TINY, "gpt2-tiny.graph").unwrap();
    let mut bind = Bindings::default();
    bind.set("B", 2).set("T", 8);
    let fused = compile(&tiny, "fuse", Mode::Step, &PipelineOptions::default(), &bind).unwrap().graph;
    let mut kc = KernelCompiler::new().unwrap();
    let mut rng = Rng::new(0x5eed_1011);
    let (t0, mut mutants, mut lowered) = (Instant::now(), 0, 0);
    let mut failures = vec![];
    while mutants < 2000 && t0.elapsed() < Duration::from_secs(25) {
        mutants += 1;
        // Mutate the source graph (as text or IR) or the already fused one (kernel bodies).
        let g = match mutants % 3 {
            0 => parse(&mutate_text(&mut rng, TINY), "mutant.graph").ok(),
            1 => Some(mutate_ir(&mut rng, &tiny)),
            _ => Some(mutate_ir(&mut rng, &fused)),
        };
        let Some(g) = g.filter(|g| verify(g).is_ok()) else { continue };
        // What `fusec run` reads from a graph first: its GPT-2 sizes.
        if catch_unwind(AssertUnwindSafe(|| drop(Gpt2Config::from_graph(&g)))).is_err() {
            failures.push(format!("Gpt2Config::from_graph panicked\n{}", print(&g)));
        }
        let Ok(Ok(c)) = catch_unwind(AssertUnwindSafe(|| compile(&g, "memplan", Mode::Step, &PipelineOptions::default(), &bind))) else {
            continue; // the passes' own fuzz test (passes/tests/fuzz_passes.rs) covers them
        };
        lowered += 1;
        for p in lower_all(&c.graph, &bind, &mut kc) {
            failures.push(format!("{p}\n{}", print(&g)));
        }
    }
    eprintln!("{mutants} mutants, {lowered} lowered kernel by kernel, {} panics", failures.len());
    assert!(failures.is_empty(), "{} panics; the first:\n{}", failures.len(), failures[0]);
    assert!(lowered >= 20, "only {lowered} mutants reached the lowering");
}
