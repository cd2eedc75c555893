//! The embedded default corpus: token streams generated (not copied text) from a seeded random
//! first-order Markov chain in which every token has four likely successors. It has structure to
//! learn: the best loss is far below the uniform guess `ln V`, so a falling loss is visible
//! within a few dozen steps, and it needs no files.

use fusec_ir::rng::Rng;

/// Successors per token in the chain.
const FANOUT: usize = 4;

/// `n` tokens below `vocab` from the chain seeded by `chain_seed`, walked with `walk_seed`.
pub fn markov_tokens(vocab: usize, n: usize, chain_seed: u64, walk_seed: u64) -> Vec<u16> {
    let vocab = vocab.clamp(1, u16::MAX as usize + 1);
    let mut chain = Rng::new(chain_seed);
    let next: Vec<[u16; FANOUT]> = (0..vocab).map(|_| std::array::from_fn(|_| chain.below(vocab as u64) as u16)).collect();
    let mut walk = Rng::new(walk_seed);
    let mut tok = walk.below(vocab as u64) as usize;
    (0..n)
        .map(|_| {
            let t = tok as u16;
            // Mostly follow the chain; now and then jump anywhere, so every token appears.
            tok =
                if walk.chance(0.05) { walk.below(vocab as u64) as usize } else { next[tok][walk.below(FANOUT as u64) as usize] as usize };
            t
        })
        .collect()
}
