//! ZeRO stage 1 by whole parameters (llm.c's contiguous shards, cut between tensors): each
//! parameter has one owner rank, which alone keeps its AdamW moments and updates
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

/// The owner of each parameter, given their names and sizes in bytes, in the order the
/// parameters are laid out: the list cut into `world` contiguous runs of about equal bytes (a
/// parameter goes to the rank whose equal share holds its middle byte), as llm.c cuts its flat
/// parameter buffer, but never inside a tensor. Each rank's parameters are then one contiguous
/// range of the parameter buffer, so `from_owners` is one broadcast a rank on the GPU (GPT-2 124M
/// on 2 H200s: 148 broadcasts in a group took 13.7 ms a step; PyTorch's greedy assignment by
/// size, which interleaves the owners, was the assignment before). Every parameter has exactly
/// one owner.
pub fn owners(params: &[(&str, u64)], world: usize) -> Vec<usize> {
    let world = world.max(1) as u128;
    let total: u128 = params.iter().map(|p| p.1 as u128).sum::<u128>().max(1);
    let mut before = 0u128;
    params
        .iter()
        .map(|&(_, bytes)| {
            let middle = 2 * before + bytes as u128;
            before += bytes as u128;
            ((middle * world) / (2 * total)).min(world - 1) as usize
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_has_one_owner_in_contiguous_balanced_runs() {
        let bytes = [100, 3, 50, 50, 1, 99, 7];
        let names = ["a", "b", "c", "d", "e", "f", "g"];
        let params: Vec<(&str, u64)> = names.iter().copied().zip(bytes).collect();
        let o = owners(&params, 2);
        assert_eq!(o, [0, 0, 0, 1, 1, 1, 1]);
        let held = |r: usize| -> u64 { bytes.iter().zip(&o).filter(|(_, &x)| x == r).map(|(b, _)| b).sum() };
        assert_eq!((held(0), held(1)), (153, 157));
        assert_eq!(owners(&params, 1), vec![0; 7]);
        // Runs: the owners never decrease along the list.
        for world in 1..=9 {
            let o = owners(&params, world);
            assert!(o.windows(2).all(|w| w[0] <= w[1]) && o.iter().all(|&r| r < world), "{world}: {o:?}");
        }
        // More ranks than parameters: some own nothing; no parameters, no owners.
        assert_eq!(owners(&[("x", 5), ("y", 9)], 4), [0, 2]);
        assert!(owners(&[], 3).is_empty());
        assert_eq!(owners(&[("z", 0)], 2), [0]);
    }
}
