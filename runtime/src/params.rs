//! Binding checkpoint tensors to graph parameters, by name.

use std::collections::HashMap;

use fusec_ir::interp::Tensor;
use fusec_ir::{Bindings, Graph};

use crate::checkpoint::Checkpoint;

/// One host tensor per graph parameter, taken from the checkpoint by name; errors name the
/// parameter whose tensor is missing or has another shape, and any checkpoint tensor the graph
/// does not use.
pub fn params_from_checkpoint(g: &Graph, ckpt: &Checkpoint) -> Result<HashMap<String, Tensor>, String> {
    let named = ckpt.named_tensors();
    let by_name: HashMap<&str, (&Vec<usize>, &[f32])> = named.iter().map(|(n, s, d)| (n.as_str(), (s, *d))).collect();
    let mut feeds = HashMap::new();
    for (name, v) in g.params() {
        let want = g.ty(v).shape.eval(&Bindings::default()).map_err(|e| format!("parameter `{name}`: {e}"))?;
        let (shape, data) = by_name
            .get(name)
            .ok_or_else(|| format!("the graph's parameter `{name}` is not in the checkpoint (config {:?})", ckpt.config))?;
        if **shape != want {
            return Err(format!(
                "checkpoint tensor `{name}` has shape {shape:?} but the graph wants {want:?}: the checkpoint's config {:?} does not fit the graph",
                ckpt.config
            ));
        }
        feeds.insert(name.to_string(), Tensor::from_f32((*shape).clone(), data));
    }
    if let Some((n, _, _)) = named.iter().find(|(n, _, _)| !feeds.contains_key(n)) {
        return Err(format!("checkpoint tensor `{n}` has no parameter of that name in graph `{}`", g.name));
    }
    Ok(feeds)
}

/// Writes parameter tensors back into a checkpoint of the given config, by name.
pub fn checkpoint_from_params(cfg: &fusec_models::Gpt2Config, params: &HashMap<String, Tensor>) -> Result<Checkpoint, String> {
    Checkpoint::from_named(*cfg, |name| params.get(name).map(|t| t.to_f32()))
}
