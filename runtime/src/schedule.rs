//! The learning-rate schedule: linear warmup, then cosine decay to a floor — llm.c's `cosine`
//! scheduler (`llmc/schedulers.h`) and nanoGPT's, computed in f32 in llm.c's order.
//!
//! With `warmup = 0` and `decay_to = 1` (the defaults) every step gets exactly `lr`: the floor
//! is `lr`, so the cosine term adds `coeff · 0`.

/// A learning rate per optimizer step (0-based), a pure function of the step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The peak learning rate (reached at the end of the warmup).
    pub lr: f32,
    /// Warmup steps: step `s < warmup` gets `lr · (s + 1) / warmup`.
    pub warmup: usize,
    /// The steps the schedule spans (the run's total `--steps`): the cosine reaches the floor
    /// at step `total` (the last step, `total - 1`, is just above it, as in llm.c).
    pub total: usize,
    /// The floor as a fraction of `lr`, in [0, 1]; 1 keeps `lr` constant after the warmup.
    pub decay_to: f32,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f32) -> LrSchedule {
        LrSchedule { lr, warmup: 0, total: 0, decay_to: 1.0 }
    }

    /// Whether every step gets exactly `lr`.
    pub fn is_constant(&self) -> bool {
        self.warmup == 0 && self.decay_to == 1.0
    }

    /// The learning rate of step `step` (0-based).
    pub fn at(&self, step: usize) -> f32 {
        if step < self.warmup {
            return self.lr * (step + 1) as f32 / self.warmup as f32;
        }
        // Past the end (not reached by a run of `total` steps) the floor holds.
        let span = self.total.saturating_sub(self.warmup).max(1);
        let ratio = ((step - self.warmup) as f32 / span as f32).min(1.0);
        // llm.c: cosf(M_PI * decay_ratio), the product in double.
        let coeff = 0.5f32 * (1.0 + ((std::f64::consts::PI * ratio as f64) as f32).cos());
        let floor = self.lr * self.decay_to;
        floor + coeff * (self.lr - floor)
    }
}

#[cfg(test)]
mod tests {
    use super::LrSchedule;

    #[test]
    fn defaults_give_exactly_lr_at_every_step() {
        for lr in [1e-3f32, 3e-4, 6e-4, 0.1, 0.0, 1e6] {
            let s = LrSchedule { lr, warmup: 0, total: 50, decay_to: 1.0 };
            assert!(s.is_constant());
            for step in 0..60 {
                assert_eq!(s.at(step).to_bits(), lr.to_bits(), "lr {lr} step {step}");
                assert_eq!(LrSchedule::constant(lr).at(step).to_bits(), lr.to_bits());
            }
        }
    }

    #[test]
    fn warmup_is_linear_from_lr_over_warmup_to_lr() {
        let s = LrSchedule { lr: 6e-4, warmup: 4, total: 20, decay_to: 1.0 };
        assert!(!s.is_constant());
        assert_eq!(s.at(0), 6e-4f32 * 1.0 / 4.0);
        assert_eq!(s.at(1), 6e-4f32 * 2.0 / 4.0);
        assert_eq!(s.at(3), 6e-4);
        assert_eq!(s.at(4), 6e-4);
        assert_eq!(s.at(19), 6e-4);
    }

    #[test]
    fn cosine_decays_from_lr_to_the_floor_like_llmc() {
        let (lr, warmup, total, frac) = (1e-3f32, 10, 110, 0.1f32);
        let s = LrSchedule { lr, warmup, total, decay_to: frac };
        // Against the formula in f64.
        for step in warmup..total {
            let ratio = (step - warmup) as f64 / (total - warmup) as f64;
            let floor = lr as f64 * frac as f64;
            let want = floor + 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()) * (lr as f64 - floor);
            let got = s.at(step) as f64;
            assert!((got - want).abs() <= 1e-6 * lr as f64, "step {step}: {got} vs {want}");
        }
        assert_eq!(s.at(warmup), lr);
        // Non-increasing after the warmup, above the floor until the end, the floor after it.
        for step in warmup + 1..total {
            assert!(s.at(step) <= s.at(step - 1), "step {step}");
            assert!(s.at(step) > lr * frac, "step {step}");
        }
        assert!((s.at(total) - lr * frac).abs() < 1e-9);
        assert!((s.at(total + 100) - lr * frac).abs() < 1e-9);
        // Halfway through the decay: the mean of lr and the floor.
        assert!((s.at(warmup + 50) - (lr + lr * frac) / 2.0).abs() < 1e-8);
    }

    #[test]
    fn decay_to_zero_and_warmup_longer_than_the_run() {
        let s = LrSchedule { lr: 1.0, warmup: 0, total: 4, decay_to: 0.0 };
        let got: Vec<f32> = (0..4).map(|i| s.at(i)).collect();
        assert_eq!(got[0], 1.0);
        assert!((got[2] - 0.5).abs() < 1e-7);
        assert!(got[3] > 0.0 && got[3] < 0.2);
        let s = LrSchedule { lr: 1.0, warmup: 100, total: 10, decay_to: 0.0 };
        assert!((0..10).all(|i| s.at(i) == (i + 1) as f32 / 100.0));
    }
}
