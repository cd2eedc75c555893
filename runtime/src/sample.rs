//! Sampling tokens from a model's logits: one draw ([`sample_next`]) and the autoregressive
//! loop ([`generate`]) around a caller-supplied forward pass.

use fusec_ir::rng::Rng;

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
    assert!(vocab > 0, "sample_next: the vocabulary is empty");
    assert!(vocab <= logits.len(), "sample_next: vocabulary {vocab} but only {} logits", logits.len());
    assert!(vocab <= 1 << 16, "sample_next: vocabulary {vocab} does not fit u16 ids");
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
    let t = temperature as f64;
    let weight = |l: f32| -> f64 {
        if l.is_nan() {
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
