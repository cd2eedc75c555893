//! Gradient buckets: which gradients are all-reduced together, and when each collective can
//! start.
//!
//! The gradients live in one flat buffer laid out in the order in which the backward
//! *produces* them (for GPT-2 roughly the reverse of the forward; the caller passes the order,
//! and for a tied weight such as `wte` the place of its *last* contribution). Every gradient
//! starts at a multiple of [`ALIGN`] (256 bytes); the bytes between the end of one gradient and
//! the next aligned offset are padding (zeros, reduced along harmlessly). A bucket is a
//! contiguous range of that buffer: consecutive gradients of one element size, filled until the
//! next gradient would take it past the bucket size (PyTorch DDP's `bucket_cap_mb`, 25 MiB by
//! default). A gradient larger than the bucket size gets a bucket of its own. Because the
//! layout follows production order, a bucket is complete as soon as its last gradient is
//! produced: [`Bucket::ready_after`] names that producer, and the runtime can launch the
//! bucket's all-reduce right after it, overlapped with the rest of the backward.

use std::fmt::Write as _;
use std::ops::Range;

use super::{align_up, check_params, grouped, ParamSpec, ALIGN};

/// The default bucket size: 25 MiB, as PyTorch DDP.
pub const DEFAULT_BUCKET_BYTES: u64 = 25 << 20;
/// The smallest bucket size accepted: 64 KiB. Below it a GPT-2 step would issue thousands of
/// collectives, each paying NCCL's fixed launch latency.
pub const MIN_BUCKET_BYTES: u64 = 64 << 10;
/// The largest bucket size accepted: 4 GiB. Larger buckets leave nothing to overlap.
pub const MAX_BUCKET_BYTES: u64 = 4 << 30;

/// Where one parameter's gradient lives in the flat gradient buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GradSlot {
    /// The parameter's name.
    pub name: String,
    /// Byte offset in the flat buffer (a multiple of [`ALIGN`]).
    pub offset: u64,
    /// The gradient's size in bytes (without padding).
    pub bytes: u64,
    /// The bucket that holds it (index into [`BucketPlan::buckets`]).
    pub bucket: usize,
}

/// One bucket: a contiguous, aligned byte range of the flat gradient buffer, reduced by one
/// collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Byte offset in the flat buffer (a multiple of [`ALIGN`]).
    pub offset: u64,
    /// Length in bytes, padding included (a multiple of [`ALIGN`]).
    pub bytes: u64,
    /// Bytes per element of every gradient in it; `bytes / dtype_bytes` is the collective's count.
    pub dtype_bytes: u64,
    /// The parameters in it, as indices into the production order passed in.
    pub params: Range<usize>,
    /// The index (production order) of the parameter whose gradient completes the bucket: its
    /// all-reduce can be launched right after that gradient is produced.
    pub ready_after: usize,
}

/// Gradient buckets for one model: the flat buffer's layout and its buckets, both in backward
/// production order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    /// The bucket size the plan was made with, in bytes.
    pub bucket_bytes: u64,
    /// One slot per parameter, in production order.
    pub slots: Vec<GradSlot>,
    /// The buckets, in production order (the order their all-reduces are launched).
    pub buckets: Vec<Bucket>,
    /// Size of the flat gradient buffer in bytes (a multiple of [`ALIGN`]).
    pub total_bytes: u64,
}

/// Plans gradient buckets of at most `bucket_bytes` bytes (a single gradient larger than that
/// gets its own bucket) for `params` given in the order the backward produces their gradients.
///
/// Errors: no parameters, a duplicate name, an empty parameter, an element size other than
/// 1, 2, 4 or 8, or a bucket size outside [`MIN_BUCKET_BYTES`]`..=`[`MAX_BUCKET_BYTES`].
pub fn plan_buckets(params: &[ParamSpec], bucket_bytes: u64) -> Result<BucketPlan, String> {
    if !(MIN_BUCKET_BYTES..=MAX_BUCKET_BYTES).contains(&bucket_bytes) {
        return Err(format!(
            "gradient buckets: bucket size {bucket_bytes} bytes is outside {}..={} bytes (64 KiB to 4 GiB; default 25 MiB)",
            MIN_BUCKET_BYTES, MAX_BUCKET_BYTES
        ));
    }
    check_params(params, "gradient buckets")?;
    let mut slots = Vec::with_capacity(params.len());
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut offset = 0u64;
    for (i, p) in params.iter().enumerate() {
        // check_params has made sure that all padded sizes add up without overflow.
        let padded = align_up(p.bytes()).expect("checked");
        let joins = match buckets.last() {
            Some(b) => b.params.end == i && b.dtype_bytes == p.dtype_bytes && b.bytes + padded <= bucket_bytes,
            None => false,
        };
        if joins {
            let b = buckets.last_mut().expect("joins implies a bucket");
            b.bytes += padded;
            b.params.end = i + 1;
            b.ready_after = i;
        } else {
            buckets.push(Bucket { offset, bytes: padded, dtype_bytes: p.dtype_bytes, params: i..i + 1, ready_after: i });
        }
        slots.push(GradSlot { name: p.name.clone(), offset, bytes: p.bytes(), bucket: buckets.len() - 1 });
        offset += padded;
    }
    debug_assert!(buckets.iter().all(|b| b.offset % ALIGN == 0 && b.bytes % ALIGN == 0));
    Ok(BucketPlan { bucket_bytes, slots, buckets, total_bytes: offset })
}

impl BucketPlan {
    /// The bucket that becomes complete when the gradient of parameter `index` (production
    /// order) has been produced, if any: where the runtime launches that bucket's all-reduce.
    pub fn completed_by(&self, index: usize) -> Option<usize> {
        let b = self.slots.get(index)?.bucket;
        (self.buckets[b].ready_after == index).then_some(b)
    }

    /// A small table of the buckets: offset, bytes, parameters and the producer that completes
    /// each.
    pub fn table(&self) -> String {
        let mut s = format!(
            "gradient buckets: {} parameters in {} buckets of at most {} bytes; flat buffer {} bytes (offsets aligned to {ALIGN})\n",
            self.slots.len(),
            self.buckets.len(),
            grouped(self.bucket_bytes),
            grouped(self.total_bytes),
        );
        let _ = writeln!(s, "{:>6}  {:>14}  {:>14}  {:>6}  ready after", "bucket", "offset", "bytes", "params");
        for (i, b) in self.buckets.iter().enumerate() {
            let _ = writeln!(
                s,
                "{i:>6}  {:>14}  {:>14}  {:>6}  {}",
                grouped(b.offset),
                grouped(b.bytes),
                b.params.len(),
                self.slots[b.ready_after].name
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusec_ir::rng::Rng;

    fn random_params(rng: &mut Rng) -> Vec<ParamSpec> {
        let n = 1 + rng.below(60) as usize;
        (0..n)
            .map(|i| {
                // Mostly small parameters, some larger than any bucket size drawn below.
                let elements = match rng.below(4) {
                    0 => 1 + rng.below(300),
                    1 | 2 => 1 + rng.below(200_000),
                    _ => 1 + rng.below(3_000_000),
                };
                let dtype = if rng.chance(0.1) { 2 } else { 4 };
                ParamSpec::new(format!("p{i}"), elements, dtype)
            })
            .collect()
    }

    /// Everything the plan promises, checked against the input.
    fn check_plan(params: &[ParamSpec], plan: &BucketPlan) {
        assert_eq!(plan.slots.len(), params.len());
        // Slots: production order, aligned, tiling the buffer in order without overlap.
        let mut end = 0;
        for (p, s) in params.iter().zip(&plan.slots) {
            assert_eq!(s.name, p.name, "slot order must be production order");
            assert_eq!(s.bytes, p.bytes());
            assert_eq!(s.offset % ALIGN, 0);
            assert!(s.offset >= end, "slots overlap");
            assert!(s.offset - end < ALIGN, "gap larger than padding");
            end = s.offset + s.bytes;
        }
        assert_eq!(plan.total_bytes, align_up(end).unwrap());
        // Buckets: contiguous, aligned, covering the buffer exactly; each parameter in exactly
        // the one bucket whose range holds all its bytes.
        let mut covered = 0;
        let mut next_param = 0;
        for (bi, b) in plan.buckets.iter().enumerate() {
            assert_eq!(b.offset, covered, "buckets must tile the buffer");
            assert_eq!(b.offset % ALIGN, 0);
            assert_eq!(b.bytes % ALIGN, 0);
            assert_eq!(b.params.start, next_param, "bucket order must be production order");
            assert!(!b.params.is_empty());
            assert!(b.bytes <= plan.bucket_bytes || b.params.len() == 1, "oversize bucket with several params");
            assert_eq!(b.ready_after, b.params.end - 1);
            for i in b.params.clone() {
                let s = &plan.slots[i];
                assert_eq!(s.bucket, bi);
                assert_eq!(params[i].dtype_bytes, b.dtype_bytes, "one element size per bucket");
                assert!(s.offset >= b.offset && s.offset + s.bytes <= b.offset + b.bytes);
            }
            // No parameter of another bucket touches this one's bytes.
            for (j, s) in plan.slots.iter().enumerate() {
                if !b.params.contains(&j) {
                    assert!(s.offset + s.bytes <= b.offset || s.offset >= b.offset + b.bytes);
                }
            }
            // Greedy: the next parameter did not fit (or has another element size).
            if let Some(p) = params.get(b.params.end) {
                assert!(b.bytes + align_up(p.bytes()).unwrap() > plan.bucket_bytes || p.dtype_bytes != b.dtype_bytes);
            }
            covered += b.bytes;
            next_param = b.params.end;
        }
        assert_eq!(covered, plan.total_bytes);
        assert_eq!(next_param, params.len());
        // completed_by names each bucket exactly once, at its last producer.
        let completions: Vec<(usize, usize)> = (0..params.len()).filter_map(|i| plan.completed_by(i).map(|b| (i, b))).collect();
        assert_eq!(completions.len(), plan.buckets.len());
        for (i, b) in completions {
            assert_eq!(plan.buckets[b].ready_after, i);
        }
    }

    #[test]
    fn random_plans_keep_every_promise() {
        let mut rng = Rng::new(15);
        for _ in 0..300 {
            let params = random_params(&mut rng);
            let bucket = MIN_BUCKET_BYTES + rng.below(8 << 20);
            let plan = plan_buckets(&params, bucket).unwrap();
            check_plan(&params, &plan);
        }
    }

    #[test]
    fn gpt2_124m_in_default_buckets() {
        // GPT-2 124M's parameters in backward production order: the last block first, the
        // tied `wte` last (its embedding contribution comes at the very end of the backward).
        let (c, v, t) = (768u64, 50304u64, 1024u64);
        let mut params = vec![ParamSpec::new("lnf.w", c, 4), ParamSpec::new("lnf.b", c, 4)];
        for l in (0..12).rev() {
            for (n, e) in [
                ("mlp.proj.b", c),
                ("mlp.proj.w", 4 * c * c),
                ("mlp.fc.b", 4 * c),
                ("mlp.fc.w", 4 * c * c),
                ("ln2.b", c),
                ("ln2.w", c),
                ("attn.proj.b", c),
                ("attn.proj.w", c * c),
                ("attn.qkv.b", 3 * c),
                ("attn.qkv.w", 3 * c * c),
                ("ln1.b", c),
                ("ln1.w", c),
            ] {
                params.push(ParamSpec::new(format!("h.{l}.{n}"), e, 4));
            }
        }
        params.push(ParamSpec::new("wpe", t * c, 4));
        params.push(ParamSpec::new("wte", v * c, 4));
        let plan = plan_buckets(&params, DEFAULT_BUCKET_BYTES).unwrap();
        check_plan(&params, &plan);
        // wte (147 MiB) is larger than a bucket: alone, and last.
        let last = plan.buckets.last().unwrap();
        assert_eq!(last.params, params.len() - 1..params.len());
        assert_eq!(plan.completed_by(params.len() - 1), Some(plan.buckets.len() - 1));
        // Each block is 7,087,872 fp32 values (27 MiB): every bucket is under 25 MiB but wte.
        assert!(plan.buckets[..plan.buckets.len() - 1].iter().all(|b| b.bytes <= DEFAULT_BUCKET_BYTES));
        assert!(plan.table().contains("ready after"));
    }

    #[test]
    fn edge_cases() {
        // One parameter: one bucket, ready after it.
        let one = [ParamSpec::new("w", 10, 4)];
        let plan = plan_buckets(&one, DEFAULT_BUCKET_BYTES).unwrap();
        assert_eq!(plan.buckets.len(), 1);
        assert_eq!(plan.buckets[0], Bucket { offset: 0, bytes: 256, dtype_bytes: 4, params: 0..1, ready_after: 0 });
        assert_eq!(plan.completed_by(0), Some(0));
        assert_eq!(plan.completed_by(1), None);
        // Zero parameters: an error, not an empty plan (a training run always has some).
        assert!(plan_buckets(&[], DEFAULT_BUCKET_BYTES).unwrap_err().contains("no parameters"));
        // Bucket size limits, with the allowed range in the message.
        let e = plan_buckets(&one, MIN_BUCKET_BYTES - 1).unwrap_err();
        assert!(e.contains("65535 bytes is outside 65536..=4294967296"), "{e}");
        assert!(plan_buckets(&one, MAX_BUCKET_BYTES + 1).is_err());
        assert!(plan_buckets(&one, MIN_BUCKET_BYTES).is_ok());
        assert!(plan_buckets(&one, MAX_BUCKET_BYTES).is_ok());
    }

    #[test]
    fn exact_fit_and_element_size_change() {
        let k = MIN_BUCKET_BYTES;
        // Two halves fill a bucket exactly; the third starts a new one.
        let ps = [ParamSpec::new("a", k / 8, 4), ParamSpec::new("b", k / 8, 4), ParamSpec::new("c", 1, 4)];
        let plan = plan_buckets(&ps, k).unwrap();
        assert_eq!(plan.buckets.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), vec![0..2, 2..3]);
        // A bf16 gradient between fp32 ones gets its own bucket even though all would fit.
        let ps = [ParamSpec::new("a", 4, 4), ParamSpec::new("b", 4, 2), ParamSpec::new("c", 4, 4)];
        let plan = plan_buckets(&ps, k).unwrap();
        assert_eq!(plan.buckets.len(), 3);
        assert_eq!(plan.slots.iter().map(|s| s.offset).collect::<Vec<_>>(), vec![0, 256, 512]);
    }
}
