//! ZeRO stage 1 by whole parameters (PyTorch's `ZeroRedundancyOptimizer` partitions the same
//! way): each parameter has one owner rank, which alone keeps its AdamW moments and updates
//! it; then every rank takes every parameter from its owner (`from_owners`). The gradients are
//! still averaged on every rank (`data-parallel`), so clipping sees the global norm.

use fusec_ir::{Bindings, Graph};

/// This process's place in a run whose optimizer state is sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This rank, `0..world`.
    pub rank: usize,
    /// Number of ranks, at least 1.
    pub world: usize,
}

/// The owner of each of `g`'s parameters, in [`Graph::params`] order ([`owners`] of their names
/// and sizes): what `optimizer` shards by, and what a checkpoint gathers from.
pub fn param_owners(g: &Graph, world: usize) -> Result<Vec<usize>, String> {
    // Parameters have concrete shapes: no binding is needed.
    let sized = g.params().into_iter().map(|(n, v)| g.ty(v).bytes(&Bindings::default()).map(|b| (n, b as u64))).collect::<Result<Vec<_>, _>>()?;
    Ok(owners(&sized, world))
}

/// The owner of each parameter, given their names and sizes in bytes: largest first (ties: by
/// name), each to the rank that holds the fewest bytes so far (ties: the lower rank). The same
/// on every rank and for any order of the list; every parameter has exactly one owner.
pub fn owners(params: &[(&str, u64)], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let bytes: Vec<u64> = params.iter().map(|p| p.1).collect();
    let mut order: Vec<usize> = (0..bytes.len()).collect();
    order.sort_by(|&i, &j| bytes[j].cmp(&bytes[i]).then_with(|| params[i].0.cmp(params[j].0)));
    let mut held = vec![0u64; world];
    let mut owner = vec![0; bytes.len()];
    for i in order {
        let r = (0..world).min_by_key(|&r| (held[r], r)).expect("world >= 1");
        owner[i] = r;
        held[r] = held[r].saturating_add(bytes[i]);
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_has_one_owner_and_the_load_is_balanced() {
        let bytes = [100, 3, 50, 50, 1, 99, 7];
        let names = ["a", "b", "c", "d", "e", "f", "g"];
        let params: Vec<(&str, u64)> = names.iter().copied().zip(bytes).collect();
        let o = owners(&params, 2);
        assert_eq!(o, [0, 0, 1, 0, 0, 1, 1]);
        let held = |r: usize| -> u64 { bytes.iter().zip(&o).filter(|(_, &x)| x == r).map(|(b, _)| b).sum() };
        assert_eq!((held(0), held(1)), (154, 156));
        assert_eq!(owners(&params, 1), vec![0; 7]);
        // The order of the list does not matter.
        let reversed: Vec<(&str, u64)> = params.iter().rev().copied().collect();
        assert_eq!(owners(&reversed, 2).into_iter().rev().collect::<Vec<_>>(), o);
        // More ranks than parameters: some own nothing.
        assert_eq!(owners(&[("x", 5), ("y", 9)], 4), [1, 0]);
        assert!(owners(&[], 3).is_empty());
    }
}
