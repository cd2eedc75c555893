//! The training data loader: fixed-size batches read in order (no shuffling) from a token
//! vector, exactly as the llm.c reference trainer reads them.
//!
//! Step k takes the B·T+1 tokens starting at offset (k·B·T) mod N; inputs are the first
//! B·T, targets the same positions shifted by one token. Unlike llm.c's `dataloader.h`, which
//! starts over when the next batch would run past the end, this loader takes tokens
//! cyclically: a batch that runs past the end continues at token 0. Both agree on every
//! batch that fits, which is all the reference runs use.
//!
//! In a data-parallel run of W ranks ([`DataLoader::for_rank`]) step k's global batch is the one
//! a single process with batch W·B would read, and rank r takes its rows r·B..(r+1)·B.

/// Batches of `batch` × `seq` tokens over an in-memory token vector.
#[derive(Debug, Clone)]
pub struct DataLoader {
    tokens: Vec<u16>,
    batch: usize,
    seq: usize,
    rank: usize,
    world: usize,
}

impl DataLoader {
    /// A loader for batches of `batch` sequences of `seq` tokens. Fails if either is 0 or
    /// if there are fewer than `batch * seq + 1` tokens (the message says how many).
    pub fn new(tokens: Vec<u16>, batch: usize, seq: usize) -> Result<DataLoader, String> {
        DataLoader::for_rank(tokens, batch, seq, 0, 1)
    }

    /// Rank `rank`'s loader in a data-parallel run of `world` ranks: its `batch` rows of each
    /// global batch of `world * batch` rows. The checks of [`DataLoader::new`] apply to the
    /// global batch.
    pub fn for_rank(tokens: Vec<u16>, batch: usize, seq: usize, rank: usize, world: usize) -> Result<DataLoader, String> {
        if batch == 0 || seq == 0 {
            return Err(format!("batch size ({batch}) and sequence length ({seq}) must both be positive"));
        }
        if rank >= world {
            return Err(format!("rank {rank} is outside a world of {world} ranks"));
        }
        let global = batch.checked_mul(world).ok_or_else(|| format!("batch {batch} x {world} ranks is too large"))?;
        let need = global
            .checked_mul(seq)
            .and_then(|bt| bt.checked_add(1))
            .ok_or_else(|| format!("batch {global} x sequence {seq} is too large"))?;
        if tokens.len() < need {
            return Err(format!(
                "not enough tokens: a batch of B={global} x T={seq} needs at least {need} \
                 tokens (B*T+1), found {}",
                tokens.len()
            ));
        }
        Ok(DataLoader { tokens, batch, seq, rank, world })
    }

    /// Number of tokens in the data.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Batch size B.
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// Sequence length T.
    pub fn seq_len(&self) -> usize {
        self.seq
    }

    /// Whole global batches the data holds (evaluating more would repeat tokens):
    /// (N - 1) / (W·B·T).
    pub fn batches(&self) -> usize {
        (self.tokens.len() - 1) / (self.world * self.batch * self.seq)
    }

    /// The token offset at which step `step`'s global batch starts: (step·W·B·T) mod N.
    pub fn offset(&self, step: usize) -> usize {
        let bt = (self.world * self.batch * self.seq) as u128;
        ((step as u128 * bt) % self.tokens.len() as u128) as usize
    }

    /// Inputs and targets of this rank's rows of step `step`, each B·T token ids (row-major
    /// B × T); tokens are taken cyclically from [`DataLoader::offset`].
    pub fn batch(&self, step: usize) -> (Vec<i32>, Vec<i32>) {
        let bt = self.batch * self.seq;
        let start = (self.offset(step) as u128 + (self.rank * bt) as u128) as usize % self.tokens.len();
        let window: Vec<i32> = self.tokens.iter().cycle().skip(start).take(bt + 1).map(|&t| i32::from(t)).collect();
        (window[..bt].to_vec(), window[1..].to_vec())
    }

    /// Checks every token id is below `vocab`; the error names the first offending position
    /// and id.
    pub fn check_vocab(&self, vocab: usize) -> Result<(), String> {
        match self.tokens.iter().position(|&t| usize::from(t) >= vocab) {
            None => Ok(()),
            Some(i) => Err(format!("token at position {i} is {}, not below the vocabulary size {vocab}", self.tokens[i])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_split_the_global_batch_a_single_process_reads() {
        let tokens: Vec<u16> = (0..997).map(|i| (i * 7 % 1000) as u16).collect();
        let whole = DataLoader::new(tokens.clone(), 6, 8).unwrap();
        let ranks: Vec<DataLoader> = (0..3).map(|r| DataLoader::for_rank(tokens.clone(), 2, 8, r, 3).unwrap()).collect();
        assert_eq!(ranks[0].batches(), whole.batches());
        // Steps past the end wrap around the same way.
        for step in [0, 1, 5, 20, 21] {
            let (x, y) = whole.batch(step);
            let (xs, ys): (Vec<i32>, Vec<i32>) = ranks.iter().map(|l| l.batch(step)).fold((vec![], vec![]), |(mut a, mut b), (x, y)| {
                a.extend(x);
                b.extend(y);
                (a, b)
            });
            assert_eq!((xs, ys), (x, y), "step {step}");
        }
        assert!(DataLoader::for_rank(tokens.clone(), 2, 8, 3, 3).unwrap_err().contains("outside a world of 3"));
        assert!(DataLoader::for_rank(vec![0; 40], 2, 8, 0, 3).unwrap_err().contains("B=6 x T=8 needs at least 49"));
    }
}
