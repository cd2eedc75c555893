use fusec_ir::{Bindings, Graph};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::memplan::{memplan, MemplanOptions};
use fusec_passes::optimizer::{optimizer, AdamWConfig};
use fusec_passes::schedule::{peak_bytes, schedule_with};

fn training(preset: &str) -> Graph {
    let cfg = Gpt2Config::preset(preset).unwrap();
    let fwd = build_gpt2(&cfg, preset);
    let ad = fusec_passes::autodiff::autodiff(&fwd).unwrap();
    optimizer(&ad, &AdamWConfig::default()).unwrap()
}

#[test]
fn gpt2_124m_arena_near_lower_bound() {
    let g = training("d12");
    let mut b = Bindings::default();
    b.set("B", 16).set("T", 1024);
    let t0 = std::time::Instant::now();
    let s = schedule_with(&g, &b).unwrap();
    let t1 = std::time::Instant::now();
    let p = memplan(&s, &b, &MemplanOptions::default()).unwrap();
    let t2 = std::time::Instant::now();
    let p0 = memplan(&g, &b, &MemplanOptions::default()).unwrap();
    eprintln!("nodes {} schedule {:?} memplan {:?}", g.nodes.len(), t1 - t0, t2 - t1);
    eprintln!("model peak input {} sched {}", peak_bytes(&g, &b).unwrap(), peak_bytes(&s, &b).unwrap());
    eprintln!("{}", p.report());
    eprintln!("unscheduled:\n{}", p0.report());
}

#[test]
fn scratch_tiny() {
    let g = training("tiny");
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 8);
    let s = schedule_with(&g, &b).unwrap();
    let p = memplan(&s, &b, &MemplanOptions::default()).unwrap();
    std::fs::write("/tmp/tiny_sched.txt", p.annotate(&s)).unwrap();
    eprintln!("model peak input {} sched {}", peak_bytes(&g, &b).unwrap(), peak_bytes(&s, &b).unwrap());
    eprintln!("{}", p.report());
}
