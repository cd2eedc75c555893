use fusec_ir::{Bindings, Op};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
#[test]
fn probe() {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let g = build_gpt2(&cfg, "tiny");
    let mut bind = Bindings::default();
    bind.set("B", 2).set("T", 8);
    let s = compile(&g, "schedule", Mode::Step, &PipelineOptions::default(), &bind).unwrap().graph;
    let mut seen = std::collections::HashSet::new();
    for n in &s.nodes {
        if let Op::Kernel(k) = &n.op {
            if !seen.insert(k.name.clone()) { continue; }
            let progs = fusec_codegen_cpu::lower::lower_kernel(k, &bind).unwrap();
            for p in progs.iter().take(2) { println!("{}", p.text()); }
        }
    }
}
