//! Sampling tokens from a model's logits: one draw ([`sample_next`], [`sample_next_with`] with
//! top-k) and the autoregressive loop ([`generate`]) around a caller-supplied forward pass.

use fusec_ir::rng::Rng;

/// How the next token is drawn from a row of logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    /// Softmax temperature; 0 (or below, or NaN) is the argmax.
    pub temperature: f32,
    /// Draw only among the `k` largest logits (those equal to the k-th largest included);
    /// `None` draws among all.
    pub top_k: Option<usize>,
}

/// Draws the next token from one row of logits.
///
/// Only the first `vocab` logits count: the rest (padding up to the padded vocabulary, e.g.
/// 50304 for GPT-2's 50257) are never drawn. With `temperature <= 0` this is the argmax (the
/// first one on ties); otherwise a multinomial draw from `softmax(logits / temperature)`,
/// computed in f64. NaN logits are treated as impossible; if no logit is usable (all NaN or
/// −∞) the result is token 0.
///
/// Panics if `vocab` is 0, exceeds `logits.len()`, or exceeds 65536 (ids are u16).
pub fn sample_next(logits: &[f32], vocab: usize, temperature: f32, rng: &mut Rng) -> u16 {
    sample_next_with(logits, vocab, &Draw { temperature, top_k: None }, rng)
}

/// [`sample_next`] with top-k: with `draw.top_k = Some(k)` the logits below the k-th largest
/// (non-NaN) one have no weight (`k` of 0 counts as 1; a `k` at least the vocabulary changes
/// nothing). Without top-k the draw is [`sample_next`]'s, bit for bit.
///
/// Panics as [`sample_next`] does.
pub fn sample_next_with(logits: &[f32], vocab: usize, draw: &Draw, rng: &mut Rng) -> u16 {
    assert!(vocab > 0, "sample_next: the vocabulary is empty");
    assert!(vocab <= logits.len(), "sample_next: vocabulary {vocab} but only {} logits", logits.len());
    assert!(vocab <= 1 << 16, "sample_next: vocabulary {vocab} does not fit u16 ids");
    let temperature = draw.temperature;
    let row = &logits[..vocab];
    let best = argmax(row);
    if temperature <= 0.0 || temperature.is_nan() {
        return best as u16;
    }
    let max = row[best] as f64;
    if !max.is_finite() {
        // Everything is −∞ or NaN (max would be finite otherwise), or some logit is +∞:
        // the argmax is the only sensible answer in both cases.
        return best as u16;
    }
    let threshold = draw.top_k.map_or(f32::NEG_INFINITY, |k| kth_largest(row, k));
    let t = temperature as f64;
    let weight = |l: f32| -> f64 {
        if l.is_nan() || l < threshold {
            0.0
        } else {
            ((l as f64 - max) / t).exp()
        }
    };
    let total: f64 = row.iter().map(|&l| weight(l)).sum();
    let mut target = rng.uniform() * total;
    let mut last_possible = best;
    for (i, &l) in row.iter().enumerate() {
        let w = weight(l);
        if w <= 0.0 {
            continue;
        }
        last_possible = i;
        if target < w {
            return i as u16;
        }
        target -= w;
    }
    // Rounding left a sliver of `target`: the last token with non-zero weight.
    last_possible as u16
}

/// The `k`-th largest non-NaN value of `row` (1-based; `k` 0 counts as 1); −∞ when `row` has
/// `k` or fewer such values (nothing is cut).
fn kth_largest(row: &[f32], k: usize) -> f32 {
    let mut vals: Vec<f32> = row.iter().copied().filter(|v| !v.is_nan()).collect();
    let k = k.max(1);
    if vals.len() <= k {
        return f32::NEG_INFINITY;
    }
    let (_, kth, _) = vals.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    *kth
}

/// Index of the largest non-NaN value (the first on ties); 0 when all are NaN.
fn argmax(row: &[f32]) -> usize {
    let mut best: Option<usize> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|b| v > row[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0)
}

/// Generates `n` tokens after `prompt` and returns them (without the prompt).
///
/// Each step calls `next_logits(context)`, where `context` is the prompt followed by the
/// tokens generated so far; it must return the logits row for the last position (at least
/// `vocab` values, padding allowed). Cropping the context to the model's maximum sequence
/// length is the closure's business. Draws use [`sample_next`] with one [`Rng`] seeded by
/// `seed`, so the same seed and logits give the same tokens. Errors from the closure are
/// passed on; a row shorter than `vocab` is an error.
pub fn generate(
    mut next_logits: impl FnMut(&[u16]) -> Result<Vec<f32>, String>,
    prompt: &[u16],
    n: usize,
    vocab: usize,
    temperature: f32,
    seed: u64,
) -> Result<Vec<u16>, String> {
    if vocab == 0 || vocab > 1 << 16 {
        return Err(format!("cannot sample from a vocabulary of {vocab} tokens (u16 ids need 1..=65536)"));
    }
    let mut rng = Rng::new(seed);
    let mut context = Vec::with_capacity(prompt.len() + n);
    context.extend_from_slice(prompt);
    for step in 0..n {
        let logits = next_logits(&context)?;
        if logits.len() < vocab {
            return Err(format!(
                "generation step {step}: the model returned {} logits for a vocabulary of \
                 {vocab}",
                logits.len()
            ));
        }
        let next = sample_next(&logits, vocab, temperature, &mut rng);
        context.push(next);
    }
    Ok(context.split_off(prompt.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_draws_only_among_the_k_largest() {
        let logits = [0.5f32, 3.0, -1.0, 2.5, 2.9, f32::NAN, 0.0];
        let mut rng = Rng::new(7);
        let draw = Draw { temperature: 5.0, top_k: Some(2) };
        let mut seen = [0usize; 7];
        for _ in 0..2000 {
            seen[sample_next_with(&logits, 7, &draw, &mut rng) as usize] += 1;
        }
        assert!(seen[1] > 0 && seen[4] > 0, "{seen:?}");
        assert_eq!(seen[1] + seen[4], 2000, "{seen:?}");
    }

    #[test]
    fn top_k_keeps_ties_and_large_k_changes_nothing() {
        let logits = [1.0f32, 2.0, 2.0, 0.0];
        assert_eq!(kth_largest(&logits, 2), 2.0);
        assert_eq!(kth_largest(&logits, 0), 2.0);
        assert_eq!(kth_largest(&logits, 4), f32::NEG_INFINITY);
        for seed in 0..50 {
            let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
            let all = Draw { temperature: 0.7, top_k: Some(4) };
            assert_eq!(sample_next_with(&logits, 4, &all, &mut a), sample_next(&logits, 4, 0.7, &mut b));
        }
    }

    #[test]
    fn top_k_at_temperature_zero_is_the_argmax() {
        let logits = [1.0f32, 4.0, 2.0];
        let draw = Draw { temperature: 0.0, top_k: Some(2) };
        assert_eq!(sample_next_with(&logits, 3, &draw, &mut Rng::new(1)), 1);
    }
}
