//! ZeRO stage 1: each rank keeps the AdamW moments (and, with bf16 parameters, the fp32 master
//! weights) of one shard of the parameters, updates that shard, and the parameters are then
//! all-gathered.
//!
//! The shards are **equal contiguous ranges of the flat parameter space**, the last one padded:
//! the parameters in the order passed (the parameter buffer's order), element after element
//! without gaps, cut into `world` ranges of [`ShardPlan::shard_elements`] elements, that count
//! rounded up to a multiple of [`ALIGN`] elements so that every shard starts aligned in any
//! element size. Why equal ranges rather than shards cut at parameter boundaries: NCCL's
//! `ncclAllGather` (and `ncclReduceScatter`) take one count for every rank, so equal shards are
//! one collective over the padded buffer with no per-rank bookkeeping; the load is balanced to
//! within the padding whatever the parameter sizes (GPT-2's `wte` alone is 31% of 124M, which
//! boundary-cut shards cannot balance on 4 ranks); and AdamW is elementwise, so a parameter
//! split between two ranks costs nothing but knowing which piece is whose
//! ([`Shard::pieces`], e.g. for weight decay that applies to some parameters only).
//! llm.c instead cuts every tensor into `world` equal slices (and requires divisibility).

use std::fmt::Write as _;
use std::ops::Range;

use super::{check_params, grouped, ParamSpec, ALIGN};

/// Bytes per element of each AdamW moment (`m` and `v` are fp32).
pub const MOMENT_BYTES: u64 = 4;
/// Bytes per element of the fp32 master weights.
pub const MASTER_BYTES: u64 = 4;

/// The part of one parameter that falls in a shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPiece {
    /// Index of the parameter in the list passed to [`plan_shards`].
    pub param: usize,
    /// The element range within that parameter.
    pub elements: Range<u64>,
}

/// One rank's shard of the flat parameter space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// The rank that owns it.
    pub rank: usize,
    /// Its range of the padded flat space (`shard_elements` long).
    pub range: Range<u64>,
    /// How many of those elements are real parameters (the rest is padding).
    pub real_elements: u64,
    /// The parameter pieces it holds, in flat order.
    pub pieces: Vec<ShardPiece>,
}

/// Bytes of optimizer state one rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankBytes {
    /// AdamW `m` and `v` together.
    pub moments: u64,
    /// fp32 master weights (0 without them).
    pub master: u64,
}

impl RankBytes {
    /// Moments plus master weights.
    pub fn total(&self) -> u64 {
        self.moments + self.master
    }
}

/// The ZeRO-1 shards of one model over `world` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    /// Number of ranks.
    pub world: usize,
    /// Real parameter elements (N).
    pub total_elements: u64,
    /// Elements in every shard (a multiple of [`ALIGN`]); `world * shard_elements >= N`.
    pub shard_elements: u64,
    /// Whether each rank keeps fp32 master weights (bf16 parameters).
    pub master_weights: bool,
    /// One shard per rank, rank order.
    pub shards: Vec<Shard>,
}

/// Splits the flat space of `params` (in parameter buffer order) into `world` equal shards.
/// `master_weights`: the ranks also keep fp32 master weights of their shard.
///
/// Errors: `world` is 0, or the checks of the parameter list (none, duplicate name, empty
/// parameter, element size other than 1, 2, 4, 8).
pub fn plan_shards(params: &[ParamSpec], world: usize, master_weights: bool) -> Result<ShardPlan, String> {
    if world == 0 {
        return Err("optimizer shards: world size 0 (at least 1 rank is needed)".to_string());
    }
    check_params(params, "optimizer shards")?;
    let total: u64 = params.iter().map(|p| p.elements).sum();
    let shard_elements = total.div_ceil(world as u64).div_ceil(ALIGN) * ALIGN;
    let mut shards = Vec::with_capacity(world);
    // Walk the parameters once; `p` is the current parameter, `p_start` its flat offset.
    let (mut p, mut p_start) = (0usize, 0u64);
    for rank in 0..world {
        let range = rank as u64 * shard_elements..(rank as u64 + 1) * shard_elements;
        let real_end = range.end.min(total);
        let mut pieces = Vec::new();
        let mut at = range.start.min(total);
        while at < real_end {
            let p_end = p_start + params[p].elements;
            let end = p_end.min(real_end);
            pieces.push(ShardPiece { param: p, elements: at - p_start..end - p_start });
            at = end;
            if end == p_end {
                p += 1;
                p_start = p_end;
            }
        }
        let real_elements = real_end.saturating_sub(range.start);
        shards.push(Shard { rank, range, real_elements, pieces });
    }
    Ok(ShardPlan { world, total_elements: total, shard_elements, master_weights, shards })
}

impl ShardPlan {
    /// Optimizer state bytes on every rank (the same on all: the padding is allocated too).
    pub fn rank_bytes(&self) -> RankBytes {
        RankBytes {
            moments: 2 * MOMENT_BYTES * self.shard_elements,
            master: if self.master_weights { MASTER_BYTES * self.shard_elements } else { 0 },
        }
    }

    /// Optimizer state bytes of one unsharded GPU, for comparison.
    pub fn unsharded_bytes(&self) -> u64 {
        let per_element = 2 * MOMENT_BYTES + if self.master_weights { MASTER_BYTES } else { 0 };
        per_element * self.total_elements
    }

    /// A small table: each rank's range of the flat space, its parameter pieces and its bytes
    /// (what `dump --pass memplan` can print per rank).
    pub fn table(&self) -> String {
        let b = self.rank_bytes();
        let mut s = format!(
            "ZeRO-1 optimizer state: {} parameters over {} ranks, {} elements a shard ({} padding)\n",
            grouped(self.total_elements),
            self.world,
            grouped(self.shard_elements),
            grouped(self.world as u64 * self.shard_elements - self.total_elements),
        );
        let _ = writeln!(
            s,
            "{:>5}  {:>14}  {:>14}  {:>6}  {:>14}  {:>14}  {:>14}",
            "rank", "first", "end", "pieces", "AdamW m+v", "master fp32", "bytes"
        );
        for sh in &self.shards {
            let _ = writeln!(
                s,
                "{:>5}  {:>14}  {:>14}  {:>6}  {:>14}  {:>14}  {:>14}",
                sh.rank,
                grouped(sh.range.start),
                grouped(sh.range.end),
                sh.pieces.len(),
                grouped(b.moments),
                grouped(b.master),
                grouped(b.total()),
            );
        }
        let _ = writeln!(s, "one GPU without sharding: {} bytes", grouped(self.unsharded_bytes()));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fusec_ir::rng::Rng;

    /// Everything the plan promises: equal aligned shards tiling the padded space, and every
    /// parameter element in exactly one piece of exactly one shard, in flat order.
    fn check_plan(params: &[ParamSpec], world: usize, plan: &ShardPlan) {
        let n: u64 = params.iter().map(|p| p.elements).sum();
        assert_eq!(plan.total_elements, n);
        assert_eq!(plan.shards.len(), world);
        assert_eq!(plan.shard_elements % ALIGN, 0);
        assert!(plan.shard_elements * world as u64 >= n);
        // Not more padding than rounding needs: one shard fewer would not hold N.
        assert!((plan.shard_elements - ALIGN) * (world as u64) < n);
        let mut expect = (0usize, 0u64); // (parameter, next element within it)
        for (r, sh) in plan.shards.iter().enumerate() {
            assert_eq!(sh.rank, r);
            assert_eq!(sh.range, r as u64 * plan.shard_elements..(r as u64 + 1) * plan.shard_elements);
            let mut real = 0;
            for piece in &sh.pieces {
                assert_eq!((piece.param, piece.elements.start), expect, "pieces must continue where the last ended");
                assert!(piece.elements.start < piece.elements.end && piece.elements.end <= params[piece.param].elements);
                real += piece.elements.end - piece.elements.start;
                expect = if piece.elements.end == params[piece.param].elements {
                    (piece.param + 1, 0)
                } else {
                    (piece.param, piece.elements.end)
                };
            }
            assert_eq!(sh.real_elements, real);
            assert_eq!(real, sh.range.end.min(n).saturating_sub(sh.range.start));
        }
        assert_eq!(expect, (params.len(), 0), "every parameter element is in a shard");
    }

    #[test]
    fn random_plans_keep_every_promise() {
        let mut rng = Rng::new(1515);
        for _ in 0..500 {
            let count = 1 + rng.below(40) as usize;
            let params: Vec<ParamSpec> = (0..count)
                .map(|i| {
                    let most = if rng.chance(0.5) { 100 } else { 2_000_000 };
                    ParamSpec::new(format!("p{i}"), 1 + rng.below(most), 4)
                })
                .collect();
            let world = 1 + rng.below(16) as usize;
            let plan = plan_shards(&params, world, rng.chance(0.5)).unwrap();
            check_plan(&params, world, &plan);
        }
    }

    #[test]
    fn gpt2_124m_on_4_ranks() {
        // 124,475,904 parameters (Vp = 50,304): the 16 tensors of llm.c's layout, sizes only.
        let (c, l, v, t) = (768u64, 12u64, 50304u64, 1024u64);
        let sizes = [
            v * c,
            t * c,
            l * c,
            l * c,
            l * 3 * c * c,
            l * 3 * c,
            l * c * c,
            l * c,
            l * c,
            l * c,
            l * 4 * c * c,
            l * 4 * c,
            l * 4 * c * c,
            l * c,
            c,
            c,
        ];
        let params: Vec<ParamSpec> = sizes.iter().enumerate().map(|(i, &e)| ParamSpec::new(format!("t{i}"), e, 2)).collect();
        let plan = plan_shards(&params, 4, true).unwrap();
        check_plan(&params, 4, &plan);
        assert_eq!(plan.total_elements, 124_475_904);
        assert_eq!(plan.shard_elements, 31_119_104); // N / 4 = 31,118,976 rounded up to 256
        assert_eq!(plan.rank_bytes(), RankBytes { moments: 8 * 31_119_104, master: 4 * 31_119_104 });
        assert_eq!(plan.unsharded_bytes(), 12 * 124_475_904);
        // wte (38.6M elements) spans ranks 0 and 1.
        assert_eq!(plan.shards[0].pieces, vec![ShardPiece { param: 0, elements: 0..31_119_104 }]);
        assert_eq!(plan.shards[1].pieces[0], ShardPiece { param: 0, elements: 31_119_104..v * c });
        let table = plan.table();
        assert!(table.contains("124,475,904 parameters over 4 ranks, 31,119,104 elements a shard (512 padding)"), "{table}");
        assert!(table.contains("373,429,248"), "{table}"); // 12 bytes x 31,119,104 per rank
    }

    #[test]
    fn edge_cases() {
        let one = [ParamSpec::new("w", 1000, 4)];
        // world = 1: one shard with everything, padded to 1,024 elements.
        let plan = plan_shards(&one, 1, false).unwrap();
        check_plan(&one, 1, &plan);
        assert_eq!(plan.shard_elements, 1024);
        assert_eq!(plan.shards[0].pieces, vec![ShardPiece { param: 0, elements: 0..1000 }]);
        assert_eq!(plan.rank_bytes(), RankBytes { moments: 8192, master: 0 });
        // More ranks than shards of real data: the later ranks hold padding only.
        let plan = plan_shards(&one, 8, true).unwrap();
        check_plan(&one, 8, &plan);
        assert_eq!(plan.shard_elements, 256);
        assert_eq!(plan.shards.iter().map(|s| s.real_elements).collect::<Vec<_>>(), vec![256, 256, 256, 232, 0, 0, 0, 0]);
        assert!(plan.shards[7].pieces.is_empty());
        // Errors.
        assert!(plan_shards(&one, 0, false).unwrap_err().contains("world size 0"));
        assert!(plan_shards(&[], 2, false).unwrap_err().contains("no parameters"));
    }
}
