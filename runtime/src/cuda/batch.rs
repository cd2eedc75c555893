//! Consecutive independent products of one shape run as one batched cuBLAS call.
//!
//! The schedule leaves a GPT-2 step's weight-gradient products for the end of the backward,
//! one shape after another: twelve `[768, 2304]` products (`k` = B·T), then twelve
//! `[768, 768]`, and so on. Each alone fills the GPU poorly (a `[768, 768]` result is 18
//! output tiles of 128 × 256 for 132 SMs: 540 TFLOP/s on an H200), twelve in one
//! `cublasGemmBatchedEx` call 700–790 TFLOP/s. So a run of product launches that are each one
//! plain bf16 cuBLAS call (no epilogue; one product, not a batch) with the same call, types and
//! beta, none reading or writing what an earlier one of the run writes, becomes one launch whose
//! pointer tables (every `A`, then every `B`, then every `C`) live in the static region. Results
//! are those of the separate calls up to the order of each sum's f32 additions.

use fusec_codegen_cuda::gemm::ColMajor;
use fusec_ir::DType;

use super::launch::{Addr, Builder, Launch, Step};

/// The longest run merged into one call.
const MAX_BATCH: usize = 64;

/// What a run's members share: the call, the result's type and beta.
type Shape = (ColMajor, DType, f32);

/// A launch that is one plain bf16 product.
struct Member {
    /// What it shares with the other members of a run.
    shape: Shape,
    /// Its operands in the row-major order: `a`, `b`, `c`.
    ops: [Addr; 3],
    /// The byte ranges it reads.
    reads: Vec<(u64, u64)>,
    /// The byte range it writes.
    write: (u64, u64),
}

/// The launch as a [`Member`], when it is one plain bf16 product.
fn plain_bf16(l: &Launch) -> Option<Member> {
    let [Step::Gemm { g, a, b, c, beta, ab: DType::BF16, out }] = l.steps.as_slice() else { return None };
    if g.batch != 1 || !l.waits.is_empty() || l.side {
        return None;
    }
    let at = |x: Addr| match x {
        Addr::Plan(o) => Some(o),
        _ => None,
    };
    let call = g.call;
    let span = |o: u64, ld: i32, cols: i32, bytes: usize| (o, o + ld as u64 * cols as u64 * bytes as u64);
    // cuBLAS's A is the row-major `b`, its B the row-major `a`.
    let ra = span(at(*b)?, call.lda, if call.trans_a { call.m } else { call.k }, 2);
    let rb = span(at(*a)?, call.ldb, if call.trans_b { call.k } else { call.n }, 2);
    let rc = span(at(*c)?, call.ldc, call.n, out.size_bytes());
    let mut reads = vec![ra, rb];
    if *beta != 0.0 {
        reads.push(rc);
    }
    Some(Member { shape: (call, *out, *beta), ops: [*a, *b, *c], reads, write: rc })
}

fn overlap(x: (u64, u64), y: (u64, u64)) -> bool {
    x.0 < y.1 && y.0 < x.1
}

/// The run being collected: what its members share, their operands, and the byte ranges they
/// read and write.
#[derive(Default)]
struct Run {
    shape: Option<Shape>,
    launches: Vec<Launch>,
    ops: Vec<[Addr; 3]>,
    reads: Vec<(u64, u64)>,
    writes: Vec<(u64, u64)>,
}

impl Builder<'_> {
    /// `out` with each run of mergeable products as one batched launch; `index_of` (a plan
    /// launch's first index in `out`) and the launches' `waits` are renumbered.
    pub(crate) fn batch_products(&mut self, out: Vec<Launch>, index_of: &mut [usize]) -> Vec<Launch> {
        let mut merged: Vec<Launch> = Vec::with_capacity(out.len());
        let mut new_index = Vec::with_capacity(out.len());
        let mut run = Run::default();
        for l in out {
            let plain = plain_bf16(&l);
            let joins = plain.as_ref().is_some_and(|m| {
                run.shape == Some(m.shape)
                    && run.launches.len() < MAX_BATCH
                    && !m.reads.iter().any(|&x| run.writes.iter().any(|&y| overlap(x, y)))
                    && !run.reads.iter().chain(&run.writes).any(|&y| overlap(m.write, y))
            });
            if !joins {
                self.flush(&mut run, &mut merged);
            }
            match plain {
                Some(m) => {
                    // A run becomes one launch, at the index its first member gets.
                    new_index.push(merged.len());
                    run.shape = Some(m.shape);
                    run.ops.push(m.ops);
                    run.reads.extend(m.reads);
                    run.writes.push(m.write);
                    run.launches.push(l);
                }
                None => {
                    new_index.push(merged.len());
                    merged.push(l);
                }
            }
        }
        self.flush(&mut run, &mut merged);
        for i in index_of.iter_mut() {
            *i = new_index.get(*i).copied().unwrap_or(merged.len());
        }
        for l in &mut merged {
            for w in &mut l.waits {
                *w = new_index[*w];
            }
        }
        merged
    }

    /// Appends the run to `merged` (as it is when it has one launch, else as one batched
    /// launch) and empties it.
    fn flush(&mut self, run: &mut Run, merged: &mut Vec<Launch>) {
        let run = std::mem::take(run);
        let (Some((call, out, beta)), true) = (run.shape, run.launches.len() > 1) else {
            merged.extend(run.launches);
            return;
        };
        // cuBLAS's A is the row-major `b`, its B the row-major `a`.
        let ptrs = run.ops.iter().map(|o| o[1]).chain(run.ops.iter().map(|o| o[0])).chain(run.ops.iter().map(|o| o[2]));
        let arrays = self.table(ptrs);
        let n = run.launches.len();
        let first = &run.launches[0];
        merged.push(Launch {
            steps: vec![Step::GemmBatched { call, arrays, batch: n as i32, out, beta }],
            name: format!("{}_batch{n}", first.name),
            bytes: run.launches.iter().map(|l| l.bytes).sum(),
            flops: run.launches.iter().map(|l| l.flops).sum(),
            ops: first.ops.clone(),
            waits: vec![],
            side: false,
        });
    }
}

#[cfg(test)]
mod tests {
    //! Which launches merge, without a GPU.
    use super::*;
    use crate::cuda::launch::Native;
    use fusec_codegen_cuda::gemm::batched;
    use fusec_ir::GemmSpec;
    use std::collections::HashMap;

    const MB: u64 = 1 << 20;

    /// A weight-gradient-like product `y[64, 32] = a[128, 64]^T b[128, 32]` (bf16 operands,
    /// f32 result) reading `a` and `b` and writing `y` at these offsets.
    fn product(a: u64, b: u64, y: u64) -> Launch {
        let mut spec = GemmSpec::new(64, 32, 128);
        spec.trans_a = true;
        let g = batched(&spec).unwrap();
        let (a, b, c) = (Addr::Plan(a), Addr::Plan(b), Addr::Plan(y));
        let steps = vec![Step::Gemm { g, a, b, c, beta: 0.0, ab: DType::BF16, out: DType::F32 }];
        Launch { steps, name: "gemm".into(), bytes: 10, flops: 7, ops: vec![], waits: vec![], side: false }
    }

    fn other() -> Launch {
        Launch { steps: vec![], name: "kernel".into(), bytes: 1, flops: 0, ops: vec![], waits: vec![0], side: false }
    }

    fn merge(launches: Vec<Launch>) -> (Vec<Launch>, Vec<usize>, usize) {
        let f = 1 as cudarc::driver::sys::CUfunction;
        let native = Native {
            gather: f,
            scatter: [f; 5],
            attn_softmax: f,
            attn_probs: f,
            attn_dscores: f,
            iota_f32: f,
            iota_i32: f,
            gemm_epilogue: f,
            gemm_epilogue_mixed: f,
            sum_rows: f,
            flash: HashMap::new(),
            flash_arch: "sm_80".into(),
        };
        let mut b = Builder { native: &native, words: vec![], scratch: 0, lt: None };
        let mut index_of: Vec<usize> = (0..launches.len()).collect();
        let out = b.batch_products(launches, &mut index_of);
        (out, index_of, b.words.len())
    }

    #[test]
    fn independent_products_of_one_shape_become_one_batched_call() {
        let (out, index_of, words) =
            merge(vec![product(0, MB, 2 * MB), product(3 * MB, 4 * MB, 5 * MB), product(6 * MB, 7 * MB, 8 * MB), other()]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].name, "gemm_batch3");
        assert_eq!((out[0].bytes, out[0].flops), (30, 21));
        assert!(matches!(out[0].steps[..], [Step::GemmBatched { batch: 3, out: DType::F32, .. }]));
        // Three pointer tables of three entries: cuBLAS's A (the row-major `b`) first.
        assert_eq!(words, 9);
        assert_eq!(index_of, [0, 0, 0, 1]);
        assert_eq!(out[1].waits, [0], "waits are renumbered");
    }

    #[test]
    fn a_product_that_reads_or_overwrites_a_member_starts_a_new_run() {
        // Reads the first one's result.
        let (out, index_of, _) = merge(vec![product(0, MB, 2 * MB), product(2 * MB, 4 * MB, 5 * MB)]);
        assert_eq!(out.len(), 2);
        assert_eq!(index_of, [0, 1]);
        // Writes over the first one's operand.
        let (out, _, _) = merge(vec![product(0, MB, 2 * MB), product(3 * MB, 4 * MB, 0)]);
        assert_eq!(out.len(), 2);
        // A launch in between.
        let (out, _, _) = merge(vec![product(0, MB, 2 * MB), other(), product(3 * MB, 4 * MB, 5 * MB)]);
        assert_eq!(out.len(), 3);
        // Then the next independent ones merge again.
        let (out, index_of, _) =
            merge(vec![product(0, MB, 2 * MB), product(2 * MB, 4 * MB, 5 * MB), product(6 * MB, 7 * MB, 8 * MB)]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].name, "gemm_batch2");
        assert_eq!(index_of, [0, 1, 1]);
    }
}
