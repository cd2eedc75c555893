//! The launch order of a data-parallel step, so that gradient all-reduces overlap the backward:
//! the nodes that only produce gradients run as soon as they can, and each bucket's
//! `all_reduce` right after its gradients.

use fusec_ir::{Graph, Op, ValueId};

/// Which collectives a node's result reaches through its users.
#[derive(Clone, Copy, PartialEq)]
enum Reach {
    None,
    One(usize),
    Many,
}

fn join(a: Reach, b: Reach) -> Reach {
    match (a, b) {
        (Reach::None, x) | (x, Reach::None) => x,
        (Reach::One(x), Reach::One(y)) if x == y => a,
        _ => Reach::Many,
    }
}

/// `order` with each gradient's own work (its weight-gradient product, bias reduction, and the
/// views and recomputed activations they read: the nodes whose results reach one collective
/// only) moved up, as autograd orders a backward: work that reads a backward value (one the
/// loss does not depend on) runs as soon as the rest of the step has made what it needs, with
/// the recomputed activations it reads right before it; the collectives' operands likewise. The
/// memory-greedy order leaves every weight gradient for after the whole backward, and then no
/// bucket is complete before the backward ends: nothing overlaps (GPT-2 124M on two H200s: the
/// collectives, 2.6 ms a step, all after the backward).
pub(super) fn gradients_early(g: &Graph, order: &[usize]) -> Vec<usize> {
    let n = g.nodes.len();
    let producer = |v: &ValueId| g.values[v.0 as usize].node.0 as usize;
    let mut users: Vec<Vec<usize>> = vec![vec![]; n];
    for (i, node) in g.nodes.iter().enumerate() {
        for v in &node.inputs {
            users[producer(v)].push(i);
        }
    }
    let mut pinned = vec![false; n];
    for (_, v) in &g.outputs {
        pinned[producer(v)] = true;
    }
    let is_all_reduce = |i: usize| g.nodes[i].op == Op::AllReduce;
    // Users come after their producers in `order`: decide in reverse. A node is a gradient's own
    // work when everything that reads it is too, or is the one collective it reaches. A value is
    // forward when the loss depends on it.
    let mut forward = vec![false; g.values.len()];
    if let Some((_, loss)) = g.outputs.iter().find(|(name, _)| name == "loss") {
        forward[loss.0 as usize] = true;
    }
    let mut reach = vec![Reach::None; n];
    let mut own = vec![false; n];
    for &i in order.iter().rev() {
        let node = &g.nodes[i];
        let of = |u: usize| if is_all_reduce(u) { Reach::One(u) } else { reach[u] };
        reach[i] = users[i].iter().fold(Reach::None, |r, &u| join(r, of(u)));
        own[i] = matches!(reach[i], Reach::One(_))
            && !pinned[i]
            && !node.op.is_collective()
            && !node.op.is_source()
            && users[i].iter().all(|&u| own[u] || is_all_reduce(u));
        if node.results.iter().any(|r| forward[r.0 as usize]) {
            node.inputs.iter().for_each(|v| forward[v.0 as usize] = true);
        }
    }
    let backward_input = |i: usize| g.nodes[i].inputs.iter().any(|v| !forward[v.0 as usize] && !g.nodes[producer(v)].op.is_source());
    // Items: own work that reads a backward value, and the collectives. Each runs with the own
    // work it reads (in order) once the rest of the step has made every other operand.
    let items: Vec<usize> = order.iter().copied().filter(|&i| (own[i] && backward_input(i)) || is_all_reduce(i)).collect();
    let mut work: Vec<Vec<usize>> = vec![];
    let mut missing: Vec<usize> = vec![];
    let mut waiters: Vec<Vec<usize>> = vec![vec![]; n];
    let mut rank = vec![0; n];
    for (p, &i) in order.iter().enumerate() {
        rank[i] = p;
    }
    for (k, &item) in items.iter().enumerate() {
        let (mut nodes, mut stack, mut needs) = (vec![item], vec![item], vec![]);
        while let Some(x) = stack.pop() {
            for v in &g.nodes[x].inputs {
                let p = producer(v);
                if !own[p] {
                    if !needs.contains(&p) {
                        needs.push(p);
                    }
                } else if !nodes.contains(&p) {
                    nodes.push(p);
                    stack.push(p);
                }
            }
        }
        nodes.sort_by_key(|&x| rank[x]);
        work.push(nodes);
        missing.push(needs.len());
        for p in needs {
            waiters[p].push(k);
        }
    }
    let mut done = vec![false; n];
    let mut out = Vec::with_capacity(order.len());
    let run = |k: usize, out: &mut Vec<usize>, done: &mut Vec<bool>| {
        for &x in &work[k] {
            if !std::mem::replace(&mut done[x], true) {
                out.push(x);
            }
        }
    };
    for k in (0..items.len()).filter(|&k| missing[k] == 0) {
        run(k, &mut out, &mut done);
    }
    for &i in order.iter().filter(|&&i| !own[i] && !is_all_reduce(i)) {
        out.push(i);
        done[i] = true;
        for &k in &waiters[i] {
            missing[k] -= 1;
            if missing[k] == 0 {
                run(k, &mut out, &mut done);
            }
        }
    }
    out.extend(order.iter().copied().filter(|&i| !done[i]));
    // Topological, or the order as it was (a safeguard: the construction above keeps it).
    let mut placed = vec![false; n];
    let topological = out.iter().all(|&i| {
        placed[i] = true;
        g.nodes[i].inputs.iter().all(|v| placed[producer(v)])
    });
    if topological && out.len() == order.len() {
        out
    } else {
        order.to_vec()
    }
}

/// `order` with every `all_reduce` moved up to right after the last producer of its operands:
/// a bucket's collective starts as soon as its gradients are complete and overlaps the rest of
/// the backward. The memory model sees no difference when the result overwrites its operand
/// (`memplan` decides that: the operand is read by nothing else).
///
/// The collectives keep their order in `g` (the order `data-parallel` made them in), whatever
/// the rest of the order: every rank must issue them in the same order, and with ZeRO-1 the
/// ranks' programs differ after the optimizer, so their schedules may too.
pub(super) fn collectives_early(g: &Graph, order: &[usize]) -> Vec<usize> {
    let is_all_reduce = |i: &usize| g.nodes[*i].op == Op::AllReduce;
    let mut out: Vec<usize> = order.iter().copied().filter(|i| !is_all_reduce(i)).collect();
    let mut collectives: Vec<usize> = order.iter().copied().filter(is_all_reduce).collect();
    collectives.sort_unstable();
    let mut after_previous = 0;
    for i in collectives {
        let producers: Vec<usize> = g.nodes[i].inputs.iter().map(|v| g.values[v.0 as usize].node.0 as usize).collect();
        let at = out.iter().rposition(|j| producers.contains(j)).map_or(0, |p| p + 1).max(after_previous);
        out.insert(at, i);
        after_previous = at + 1;
    }
    out
}

