//! `schedule`: the launch order is a verified, deterministic, topological permutation of the
//! nodes that never raises the peak of live transient memory, keeps the interface first and the
//! interpreter's results bit for bit, and orders state writes after every read of the old value.

use std::collections::HashMap;

use fusec_ir::interp::{self, random_feeds, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::text::print;
use fusec_ir::verify::verify;
use fusec_ir::{BinaryOp, Bindings, DType, Graph, Op, Shape, Type, UnaryOp};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::autodiff::autodiff;
use fusec_passes::memplan::{memplan, MemplanOptions};
use fusec_passes::optimizer::{optimizer, AdamWConfig};
use fusec_passes::schedule::{default_bindings, peak_bytes, schedule, schedule_with};

fn bind() -> Bindings {
    let mut b = Bindings::default();
    b.set("B", 2).set("T", 8);
    b
}

/// The tiny GPT-2 training step: forward, backward, AdamW.
fn tiny_training() -> Graph {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    optimizer(&autodiff(&build_gpt2(&cfg, "gpt2_tiny")).unwrap(), &AdamWConfig::default()).unwrap()
}

/// Node identities independent of value numbering and order: the op text and the operands'
/// identities, interned in `ids` (shared between the graphs compared).
fn node_keys(g: &Graph, ids: &mut HashMap<String, usize>) -> Vec<usize> {
    let mut id_of_value = vec![0; g.values.len()];
    let mut keys = vec![];
    for n in &g.nodes {
        let ins: Vec<String> = n.inputs.iter().map(|v| id_of_value[v.0 as usize].to_string()).collect();
        let text = format!("{:?}({})", n.op, ins.join(","));
        let next = ids.len();
        let k = *ids.entry(text).or_insert(next);
        for (i, r) in n.results.iter().enumerate() {
            let next = ids.len();
            id_of_value[r.0 as usize] = *ids.entry(format!("{k}#{i}")).or_insert(next);
        }
        keys.push(k);
    }
    keys
}

/// Checks the structural promises of `schedule` on `g`; returns the scheduled graph.
fn check_schedule(g: &Graph) -> Graph {
    let s = schedule(g).unwrap();
    verify(&s).unwrap_or_else(|e| panic!("scheduled graph does not verify: {e}"));
    // A permutation of the nodes (keys are multiset-equal), same outputs by identity.
    let mut ids = HashMap::new();
    let (mut a, mut b) = (node_keys(g, &mut ids), node_keys(&s, &mut ids));
    a.sort();
    b.sort();
    assert_eq!(a, b, "schedule must permute the nodes");
    // Topological: every operand is defined before its reader.
    let mut defined = vec![false; s.values.len()];
    for n in &s.nodes {
        assert!(n.inputs.iter().all(|v| defined[v.0 as usize]), "not topological at {}", n.op.mnemonic());
        n.results.iter().for_each(|r| defined[r.0 as usize] = true);
    }
    // Deterministic.
    assert_eq!(print(&schedule(g).unwrap()), print(&s));
    // Never worse than the input order.
    let db = default_bindings(g);
    assert!(peak_bytes(&s, &db).unwrap() <= peak_bytes(g, &db).unwrap());
    // The interface first, in its original order.
    let iface = |g: &Graph| -> Vec<String> {
        g.nodes.iter().take_while(|n| matches!(n.op, Op::Param { .. } | Op::Input { .. })).map(|n| format!("{:?}", n.op)).collect()
    };
    let all_iface: Vec<String> =
        g.nodes.iter().filter(|n| matches!(n.op, Op::Param { .. } | Op::Input { .. })).map(|n| format!("{:?}", n.op)).collect();
    assert_eq!(iface(&s), all_iface);
    s
}

/// Feeds with valid optimizer state: `v.*` non-negative, bias corrections in (0, 1].
fn feeds(g: &Graph, seed: u64, int_hi: u64) -> HashMap<String, Tensor> {
    let mut f = random_feeds(g, &bind(), &mut Rng::new(seed), int_hi).unwrap();
    for (name, t) in f.iter_mut() {
        match name.as_str() {
            "lr" => t.data[0] = 1e-3,
            "bc1" => t.data[0] = 0.1,
            "bc2" => t.data[0] = 0.001,
            n if n.starts_with("v.") => t.data.iter_mut().for_each(|x| *x = x.abs()),
            _ => {}
        }
    }
    f
}

#[test]
fn tiny_training_step_is_reordered_without_changing_results() {
    let g = tiny_training();
    let s = check_schedule(&g);
    let vocab = Gpt2Config::preset("tiny").unwrap().vocab as u64;
    let f = feeds(&g, 7, vocab);
    let before = interp::run(&g, &bind(), &f, Rounding::F32).unwrap();
    let after = interp::run(&s, &bind(), &f, Rounding::F32).unwrap();
    assert_eq!(g.outputs.iter().map(|o| &o.0).collect::<Vec<_>>(), s.outputs.iter().map(|o| &o.0).collect::<Vec<_>>());
    for ((name, _), (x, y)) in g.outputs.iter().zip(before.iter().zip(&after)) {
        let bits = |t: &Tensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(x), bits(y), "output `{name}` changed");
    }
    // The order is one `memplan` accepts: state is written after its last read.
    memplan(&s, &bind(), &MemplanOptions::default()).unwrap();
}

#[test]
fn schedule_lowers_the_peak_of_the_training_step() {
    let g = tiny_training();
    // At B = 2, T = 8 parameter-sized gradients dominate: updating each parameter as soon as its
    // gradient is complete frees them early. (At larger B * T the activations saved for the
    // backward set the peak whatever the order.)
    let s = schedule_with(&g, &bind()).unwrap();
    let (before, after) = (peak_bytes(&g, &bind()).unwrap(), peak_bytes(&s, &bind()).unwrap());
    eprintln!("peak at B = 2, T = 8: input order {before}, scheduled {after}");
    assert!(after < before, "peak {after} is not below the input order's {before}");
}

#[test]
fn forward_graphs_and_scheduled_graphs_are_handled() {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let fwd = build_gpt2(&cfg, "gpt2_tiny");
    let s = check_schedule(&fwd);
    // Scheduling a scheduled graph keeps it valid and no worse.
    check_schedule(&s);
    check_schedule(&autodiff(&fwd).unwrap());
}

#[test]
fn constants_and_iotas_come_right_before_their_first_user() {
    let s = schedule(&tiny_training()).unwrap();
    let producer = |v: &fusec_ir::ValueId| s.values[v.0 as usize].node.0 as usize;
    let mut checked = 0;
    for (i, n) in s.nodes.iter().enumerate() {
        if !matches!(n.op, Op::Const { .. } | Op::Iota { .. }) {
            continue;
        }
        let r = n.results[0];
        let user = s.nodes.iter().position(|m| m.inputs.contains(&r)).expect("every constant is used");
        // Everything between is pulled in by the same user: its own (transitive) operands.
        let mut ancestors = vec![false; s.nodes.len()];
        let mut stack = vec![user];
        while let Some(k) = stack.pop() {
            for v in &s.nodes[k].inputs {
                let p = producer(v);
                if !ancestors[p] {
                    ancestors[p] = true;
                    stack.push(p);
                }
            }
        }
        assert!((i + 1..user).all(|k| ancestors[k]), "`{}` at {i} is not emitted right before its first user at {user}", n.op.mnemonic());
        checked += 1;
    }
    assert!(checked > 10);
}

/// `p' = neg p` is written back over `p`, but `exp p` (read later in the input order) still
/// needs the old value: the schedule must run `exp p` first.
fn late_reader() -> Graph {
    let mut g = Graph::new("late_reader", &[]);
    let ty = Type::new(DType::F32, Shape::lits(&[4]));
    let p = g.add1(Op::Param { name: "p".into(), ty: ty.clone() }, &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty }, &[]);
    let q = g.add1(Op::Unary(UnaryOp::Neg), &[p]);
    let e = g.add1(Op::Unary(UnaryOp::Exp), &[p]);
    let y = g.add1(Op::Binary(BinaryOp::Mul), &[e, x]);
    g.output("p", q);
    g.output("y", y);
    g
}

#[test]
fn state_writes_wait_for_every_read_of_the_old_value() {
    let g = late_reader();
    let err = memplan(&g, &Bindings::default(), &MemplanOptions::default()).unwrap_err();
    assert!(err.contains("output `p`") && err.contains("still read"), "{err}");
    let s = check_schedule(&g);
    let pos = |m: &str| s.nodes.iter().position(|n| n.op.mnemonic() == m).unwrap();
    assert!(pos("exp") < pos("neg"), "{}", print(&s));
    memplan(&s, &Bindings::default(), &MemplanOptions::default()).unwrap();
}

#[test]
fn unbound_dims_are_an_error() {
    let g = tiny_training();
    let err = schedule_with(&g, &Bindings::default()).unwrap_err();
    assert!(err.contains("not bound"), "{err}");
}

#[test]
fn gpt2_124m_schedules_quickly_enough_to_not_matter() {
    // Not a timing test: it checks that the 124M step schedules at all and stays valid.
    let cfg = Gpt2Config::preset("d12").unwrap();
    let g = optimizer(&autodiff(&build_gpt2(&cfg, "gpt2_124m")).unwrap(), &AdamWConfig::default()).unwrap();
    let t0 = std::time::Instant::now();
    let s = schedule(&g).unwrap();
    eprintln!("schedule: {} nodes in {:?}", g.nodes.len(), t0.elapsed());
    verify(&s).unwrap();
    assert_eq!(s.nodes.len(), g.nodes.len());
}
