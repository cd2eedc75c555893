//! The training data loader: fixed-size batches read in order (no shuffling) from a token
//! vector, exactly as the llm.c reference trainer reads them.
//!
//! Step k takes the B·T+1 tokens starting at offset (k·B·T) mod N; inputs are the first
//! B·T, targets the same positions shifted by one token. Unlike llm.c's `dataloader.h`, which
//! starts over when the next batch would run past the end, this loader takes tokens
//! cyclically: a batch that runs past the end continues at token 0. Both agree on every
//! batch that fits, which is all the reference runs use.

/// Batches of `batch` × `seq` tokens over an in-memory token vector.
#[derive(Debug, Clone)]
pub struct DataLoader {
    tokens: Vec<u16>,
    batch: usize,
    seq: usize,
}

impl DataLoader {
    /// A loader for batches of `batch` sequences of `seq` tokens. Fails if either is 0 or
    /// if there are fewer than `batch * seq + 1` tokens (the message says how many).
    pub fn new(tokens: Vec<u16>, batch: usize, seq: usize) -> Result<DataLoader, String> {
        if batch == 0 || seq == 0 {
            return Err(format!("batch size ({batch}) and sequence length ({seq}) must both be positive"));
        }
        let need = batch
            .checked_mul(seq)
            .and_then(|bt| bt.checked_add(1))
            .ok_or_else(|| format!("batch {batch} x sequence {seq} is too large"))?;
        if tokens.len() < need {
            return Err(format!(
                "not enough tokens: a batch of B={batch} x T={seq} needs at least {need} \
                 tokens (B*T+1), found {}",
                tokens.len()
            ));
        }
        Ok(DataLoader { tokens, batch, seq })
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

    /// Whole batches the data holds (evaluating more would repeat tokens): (N - 1) / (B·T).
    pub fn batches(&self) -> usize {
        (self.tokens.len() - 1) / (self.batch * self.seq)
    }

    /// The token offset at which step `step` starts: (step·B·T) mod N.
    pub fn offset(&self, step: usize) -> usize {
        let bt = (self.batch * self.seq) as u128;
        ((step as u128 * bt) % self.tokens.len() as u128) as usize
    }

    /// Inputs and targets of step `step`, each B·T token ids (row-major B × T); tokens are
    /// taken cyclically from [`DataLoader::offset`].
    pub fn batch(&self, step: usize) -> (Vec<i32>, Vec<i32>) {
        let bt = self.batch * self.seq;
        let start = self.offset(step);
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
