//! `gemm_f32` against a naive f64 triple loop, over every transpose, batch,
//! shared-`b` and epilogue combination, at odd sizes and sizes crossing tile boundaries.

use fusec_codegen_cpu::gemm::{gelu, gemm_f32};
use fusec_ir::testkit::assert_close_slice;
use fusec_ir::GemmSpec;

/// A small deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `len` values with magnitude in `[0.1, 1] * scale` and random sign: never zero.
    fn vec(&mut self, len: usize, scale: f64) -> Vec<f32> {
        (0..len)
            .map(|_| {
                let mag = 0.1 + 0.9 * self.next();
                let sign = if self.next() < 0.5 { -1.0 } else { 1.0 };
                (sign * mag * scale) as f32
            })
            .collect()
    }
}

/// The tanh-form GELU in f64.
fn gelu64(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// The expected `(y, pre_gelu)` in f64 from the f32 inputs, with `y0` the accumulator.
fn reference(s: &GemmSpec, a: &[f32], b: &[f32], bias: Option<&[f32]>, y0: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let (m, n, k) = (s.m, s.n, s.k);
    let mut y = vec![0.0; s.y_len()];
    let mut pre = vec![0.0; s.y_len()];
    for z in 0..s.batch {
        let bz = if s.b_shared { 0 } else { z * k * n };
        for i in 0..m {
            for j in 0..n {
                let mut t = 0.0f64;
                for p in 0..k {
                    let av = if s.trans_a { a[z * m * k + p * m + i] } else { a[z * m * k + i * k + p] };
                    let bv = if s.trans_b { b[bz + j * k + p] } else { b[bz + p * n + j] };
                    t += av as f64 * bv as f64;
                }
                if let Some(bias) = bias {
                    t += bias[j] as f64;
                }
                let o = z * m * n + i * n + j;
                pre[o] = t;
                let v = if s.gelu { gelu64(t) } else { t };
                y[o] = if s.accumulate { y0[o] as f64 + v } else { v };
            }
        }
    }
    (y, pre)
}

/// Inputs for `s`: `a`, `b` (scaled so sums stay O(1)), bias, and the initial `y`.
fn inputs(s: &GemmSpec, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut r = Rng(seed | 1);
    let a = r.vec(s.a_len(), 1.0);
    let b = r.vec(s.b_len(), 1.0 / (s.k.max(1) as f64).sqrt());
    let bias = r.vec(s.n, 0.5);
    let y0 = r.vec(s.y_len(), 1.0);
    (a, b, bias, y0)
}

/// Runs `s` with `threads`, returns `(y, pre_gelu)`.
fn run(s: &GemmSpec, a: &[f32], b: &[f32], bias: &[f32], y0: &[f32], threads: usize) -> (Vec<f32>, Vec<f32>) {
    let mut y = y0.to_vec();
    let mut pre = vec![f32::NAN; if s.gelu { s.y_len() } else { 0 }];
    let bias = s.bias.then_some(bias);
    gemm_f32(s, a, b, bias, &mut y, s.gelu.then_some(&mut pre[..]), threads);
    (y, pre)
}

/// Checks `s` against the reference with 1 and 2 threads, and that both agree bit for bit.
fn check(s: GemmSpec, seed: u64) {
    let (a, b, bias, y0) = inputs(&s, seed);
    let (want_y, want_pre) = reference(&s, &a, &b, s.bias.then_some(&bias[..]), &y0);
    let (y1, pre1) = run(&s, &a, &b, &bias, &y0, 1);
    let what = format!("{s:?}");
    assert_close_slice(&format!("y, 1 thread, {what}"), &y1, &want_y, 1e-5, 1e-5);
    if s.gelu {
        assert_close_slice(&format!("pre_gelu, {what}"), &pre1, &want_pre, 1e-5, 1e-5);
        // `y` is exactly the f32 GELU of the stored pre-activation (plus the accumulator).
        for (i, (yv, p)) in y1.iter().zip(&pre1).enumerate() {
            let want = if s.accumulate { y0[i] + gelu(*p) } else { gelu(*p) };
            assert_eq!(yv.to_bits(), want.to_bits(), "y != gelu(pre) at {i}, {what}");
        }
    }
    let (y2, pre2) = run(&s, &a, &b, &bias, &y0, 2);
    assert!(y1.iter().zip(&y2).all(|(p, q)| p.to_bits() == q.to_bits()), "y differs between 1 and 2 threads, {what}");
    assert!(pre1.iter().zip(&pre2).all(|(p, q)| p.to_bits() == q.to_bits()), "pre_gelu differs between 1 and 2 threads, {what}");
}

/// Every flag combination at one size.
fn all_combos(m: usize, n: usize, k: usize) {
    let mut seed = 0x9e37_79b9_7f4a_7c15 ^ (m * 1_000_003 + n * 1009 + k) as u64;
    for trans_a in [false, true] {
        for trans_b in [false, true] {
            for (batch, b_shared) in [(1, true), (3, true), (3, false)] {
                for flags in 0..8 {
                    let (bias, gelu, accumulate) = (flags & 1 != 0, flags & 2 != 0, flags & 4 != 0);
                    seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    check(GemmSpec { batch, m, n, k, trans_a, trans_b, b_shared, bias, gelu, accumulate }, seed);
                }
            }
        }
    }
}

#[test]
fn odd_sizes_all_combos() {
    all_combos(37, 29, 53);
}

#[test]
fn tile_boundary_sizes_all_combos() {
    // Rows and columns just past a tile (96 x 512) and a long contraction.
    all_combos(97, 530, 129);
}

#[test]
fn many_tiles() {
    for (m, n, k) in [(300, 1100, 70), (193, 1025, 3), (1, 700, 40), (250, 1, 33), (64, 48, 1)] {
        for trans in [(false, false), (true, false), (false, true), (true, true)] {
            let s = GemmSpec {
                batch: 2,
                m,
                n,
                k,
                trans_a: trans.0,
                trans_b: trans.1,
                b_shared: m % 2 == 0,
                bias: true,
                gelu: true,
                accumulate: true,
            };
            check(s, (m * n * k) as u64);
            check(GemmSpec { bias: false, gelu: false, ..s }, (m + n + k) as u64);
        }
    }
}

#[test]
fn tall_tiles_over_a_long_contraction() {
    // At most 16 columns and k >= 1024: on a host with AVX-512 every tile (at least 64 rows) is
    // computed column-major into scratch and copied into place (`column_major_pays`), plain and
    // accumulating; elsewhere these are row-major tiles like the rest.
    for (m, n, k) in [(300, 16, 1030), (129, 13, 1024)] {
        for trans in [(false, false), (true, false), (false, true), (true, true)] {
            for (batch, b_shared, accumulate) in [(1, true, false), (1, true, true), (2, false, true)] {
                let s = GemmSpec { batch, m, n, k, trans_a: trans.0, trans_b: trans.1, b_shared, bias: false, gelu: false, accumulate };
                check(s, (m * 31 + n * 7 + k) as u64 ^ batch as u64);
            }
        }
    }
}

#[test]
fn accumulate_really_adds() {
    let s = GemmSpec { accumulate: true, ..GemmSpec::new(130, 520, 31) };
    let (a, b, _, _) = inputs(&s, 7);
    let mut once = vec![0.0f32; s.y_len()];
    gemm_f32(&GemmSpec { accumulate: false, ..s }, &a, &b, None, &mut once, None, 2);
    let mut y = vec![0.0f32; s.y_len()];
    gemm_f32(&s, &a, &b, None, &mut y, None, 2);
    assert_eq!(y, once, "accumulating into zeros is the plain product");
    gemm_f32(&s, &a, &b, None, &mut y, None, 2);
    for (t, o) in y.iter().zip(&once) {
        assert_eq!(*t, 2.0 * o, "a second accumulation doubles");
    }
}

#[test]
fn empty_contraction_gives_bias_epilogue_or_keeps_accumulator() {
    let s = GemmSpec { bias: true, gelu: true, ..GemmSpec::new(5, 7, 0) };
    let bias: Vec<f32> = (0..7).map(|j| j as f32 - 3.0).collect();
    let (mut y, mut pre) = (vec![f32::NAN; 35], vec![f32::NAN; 35]);
    gemm_f32(&s, &[], &[], Some(&bias), &mut y, Some(&mut pre), 2);
    for (o, (yv, p)) in y.iter().zip(&pre).enumerate() {
        assert_eq!(*p, bias[o % 7]);
        assert_eq!(*yv, gelu(bias[o % 7]));
    }
    let s = GemmSpec { accumulate: true, ..GemmSpec::new(3, 4, 0) };
    let mut y = vec![1.5f32; 12];
    gemm_f32(&s, &[], &[], None, &mut y, None, 2);
    assert!(y.iter().all(|v| *v == 1.5));
    gemm_f32(&GemmSpec::new(0, 4, 3), &[], &[0.0; 12], None, &mut [], None, 2);
}

#[test]
fn threads_beyond_and_below_the_pool_agree() {
    let s = GemmSpec {
        batch: 3,
        m: 200,
        n: 700,
        k: 45,
        trans_a: true,
        trans_b: false,
        b_shared: false,
        bias: true,
        gelu: true,
        accumulate: false,
    };
    let (a, b, bias, y0) = inputs(&s, 11);
    let (y1, p1) = run(&s, &a, &b, &bias, &y0, 1);
    let (y8, p8) = run(&s, &a, &b, &bias, &y0, 8);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
    let (y3, p3) = pool.install(|| run(&s, &a, &b, &bias, &y0, 3));
    assert_eq!((&y1, &p1), (&y8, &p8));
    assert_eq!((&y1, &p1), (&y3, &p3));
}

#[test]
fn gelu_is_llmc_gelu_forward_with_a_2_ulp_tanh() {
    // llm.c: GELU_SCALING_FACTOR = sqrtf(2.0f / M_PI), same order of operations; tanh is the
    // kernels' Cephes tanhf (within 2 ulp of the exact value) instead of glibc's.
    let scale = ((2.0f64 / std::f64::consts::PI) as f32).sqrt();
    for x in [-6.0f32, -2.5, -1.0, -0.3, 0.0, 1e-3, 0.7, 1.0, 3.25, 9.0] {
        let cube = 0.044715f32 * x * x * x;
        let want = 0.5f32 * x * (1.0f32 + (scale * (x + cube)).tanh());
        assert!((gelu(x) - want).abs() <= 2.0 * f32::EPSILON * want.abs().max(1e-30), "gelu({x}): {} vs {want}", gelu(x));
        assert!((gelu(x) as f64 - gelu64(x as f64)).abs() <= 1e-6 * (1.0 + x.abs() as f64));
    }
    let mut worst = 0f64;
    for i in 0..2_000_000 {
        let x = -12.0 + 24.0 * i as f32 / 2e6;
        let exact = (x as f64).tanh();
        let got = fusec_codegen_cpu::gemm::tanh(x) as f64;
        let ulp = (exact as f32).abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64;
        worst = worst.max((got - exact).abs() / ulp);
    }
    assert!(worst <= 2.0, "tanh error {worst} ulp");
}

#[test]
#[should_panic(expected = "`b` has")]
fn wrong_length_panics() {
    let s = GemmSpec::new(2, 3, 4);
    gemm_f32(&s, &[0.0; 8], &[0.0; 11], None, &mut [0.0; 6], None, 1);
}

#[test]
#[should_panic(expected = "pre_gelu")]
fn missing_pre_gelu_panics() {
    let s = GemmSpec { gelu: true, ..GemmSpec::new(2, 3, 4) };
    gemm_f32(&s, &[0.0; 8], &[0.0; 12], None, &mut [0.0; 6], None, 1);
}

#[test]
fn many_core_hosts_cut_products_into_four_tiles_a_core() {
    use fusec_codegen_cpu::gemm::host_tiles_per_core;
    assert_eq!((1..8).map(host_tiles_per_core).collect::<Vec<_>>(), [1; 7]);
    assert_eq!([8, 16, 64].map(host_tiles_per_core), [4; 3]);
}
