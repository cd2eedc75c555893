//! A small deterministic random generator (SplitMix64) for tests, fuzzing and initialization.
//! Deliberately dependency-free so that seeds mean the same thing in every crate and release.

/// SplitMix64 generator.
#[derive(Clone, Debug)]
pub struct Rng(u64);

/// The SplitMix64 increment: output `i` (from 1) mixes `state + i * GAMMA`.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function of a state.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64 random bits as a uniform in `[0, 1)`: the top 53 bits times 2^-53 (exact).
#[inline]
pub fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// Box-Muller from two uniforms in `[0, 1)`: `sqrt(-2 ln max(u1, 1e-300)) * cos(2π u2)`, with
/// the platform's `ln` and `cos` ([`Rng::normal`] is this of its next two uniforms).
#[inline]
pub fn box_muller(u1: f64, u2: f64) -> f64 {
    let u1 = u1.max(1e-300);
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ GAMMA)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix(self.0)
    }
    /// The output `i` places ahead (`peek(0)` is what [`Rng::next_u64`] returns next), without
    /// advancing: lets a batch of outputs be computed side by side (vectorized).
    #[inline]
    pub fn peek(&self, i: u64) -> u64 {
        mix(self.0.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)))
    }
    /// Skips the next `n` outputs (SplitMix64 is a counter: this is O(1)), so that slices of
    /// one stream can be drawn in parallel with the same values as in order.
    pub fn skip(&mut self, n: u64) {
        self.0 = self.0.wrapping_add(n.wrapping_mul(GAMMA));
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }
    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform();
        box_muller(u1, self.uniform())
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.uniform() < p
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn skip_equals_drawing() {
        let (mut a, mut b) = (Rng::new(9), Rng::new(9));
        for _ in 0..1000 {
            a.next_u64();
        }
        b.skip(1000);
        let ahead: Vec<u64> = (0..5).map(|i| b.peek(i)).collect();
        let drawn: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
        assert_eq!(ahead, drawn);
        assert_eq!(b.next_u64(), drawn[0]);
    }
}
