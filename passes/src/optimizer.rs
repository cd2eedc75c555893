//! `optimizer`: appends one AdamW update per parameter to a graph from `autodiff`.
//!
//! New inputs are runtime scalars, so that a new step or schedule never changes the graph:
//! `lr`, `bc1 = 1 - beta1^t`, `bc2 = 1 - beta2^t` (t = step, 1-based), and with clipping
//! `grad_clip` (the maximum global norm). Per parameter `P` the optimizer state `m.P` and `v.P`
//! are inputs. Outputs: `loss`, then the updated `P`, `m.P`, `v.P` (an output named like an
//! input or parameter is written back to it after the step), and with clipping `grad_norm`.

use fusec_ir::{BinaryOp, DType, Graph, Op, Type, UnaryOp, ValueId};

use crate::autodiff::grad_name;
use crate::rewrite::Emit;

/// AdamW hyperparameters that are constants of the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Whether to clip the global gradient norm to the runtime scalar `grad_clip`.
    pub clip: bool,
}

impl Default for AdamWConfig {
    /// llm.c's and PyTorch's defaults, with llm.c's zero weight decay and no clipping.
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, clip: false }
    }
}

/// The optimizer state input names of a parameter.
pub fn state_names(param: &str) -> [String; 2] {
    [format!("m.{param}"), format!("v.{param}")]
}

/// Appends the updates; see the module docs.
pub fn optimizer(g: &Graph, cfg: &AdamWConfig) -> Result<Graph, String> {
    let mut out = g.clone();
    let params: Vec<(String, ValueId)> = g.params().into_iter().map(|(n, v)| (n.to_string(), v)).collect();
    let mut grads = vec![];
    for (name, _) in &params {
        let gn = grad_name(name);
        grads.push(g.output_named(&gn).ok_or_else(|| format!("optimizer needs output `{gn}` (run autodiff first)"))?);
    }
    out.outputs.retain(|(n, _)| n == "loss");
    let mut e = Emit { g: &mut out };
    let scalar = Type::scalar(DType::F32);
    let lr = e.input("lr", &scalar);
    let bc1 = e.input("bc1", &scalar);
    let bc2 = e.input("bc2", &scalar);
    let mut norm = None;
    if cfg.clip {
        let max_norm = e.input("grad_clip", &scalar);
        let (scale, n) = clip_scale(&mut e, &grads, max_norm);
        grads = grads
            .iter()
            .map(|&gr| {
                let s = e.broadcast_scalar(scale, gr);
                e.bin(BinaryOp::Mul, gr, s)
            })
            .collect();
        norm = Some(n);
    }
    let op = Op::AdamW { beta1: cfg.beta1, beta2: cfg.beta2, eps: cfg.eps, weight_decay: cfg.weight_decay };
    let mut news = vec![];
    for ((name, p), gr) in params.iter().zip(&grads) {
        let ty = e.g.ty(*p).clone();
        let [mn, vn] = state_names(name);
        let m = e.input(&mn, &ty);
        let v = e.input(&vn, &ty);
        let r = e.g.add(op.clone(), &[*p, *gr, m, v, lr, bc1, bc2]);
        news.push((name.clone(), r));
    }
    for (name, r) in news {
        let [mn, vn] = state_names(&name);
        out.output(&name, r[0]);
        out.output(&mn, r[1]);
        out.output(&vn, r[2]);
    }
    if let Some(n) = norm {
        out.output("grad_norm", n);
    }
    Ok(out)
}

/// `min(1, max_norm / (norm + 1e-6))` and the global norm itself.
fn clip_scale(e: &mut Emit, grads: &[ValueId], max_norm: ValueId) -> (ValueId, ValueId) {
    let mut total: Option<ValueId> = None;
    for &gr in grads {
        let sq = e.bin(BinaryOp::Mul, gr, gr);
        let s = e.sum_all(sq);
        total = Some(match total {
            Some(t) => e.bin(BinaryOp::Add, t, s),
            None => s,
        });
    }
    let norm = e.un(UnaryOp::Sqrt, total.expect("a model has parameters"));
    let tiny = e.splat_like(1e-6, norm);
    let denom = e.bin(BinaryOp::Add, norm, tiny);
    let ratio = e.bin(BinaryOp::Div, max_norm, denom);
    let one = e.splat_like(1.0, norm);
    (e.bin(BinaryOp::Min, ratio, one), norm)
}
