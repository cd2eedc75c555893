//! Operands packed once for a whole call and shared by its tiles.
//!
//! Each tile packs its rows of `op(a)` and its columns of `op(b)` for itself
//! ([`super::packed::tile`]), so `op(a)` is packed once per column tile and `op(b)` once per row
//! tile. Packing costs one to four cycles a value, against the micro-kernels' 16 to 64 products
//! a cycle: at four tiles a core on 2 cores (the 16-core Xeon cuts 64 tiles), the 124M step's
//! AVX2 products spent 22% of their time packing, the classifier's input gradient 32%. [`run`] packs
//! each operand that more than one tile would pack (within [`MAX_VALUES`]) into a buffer first,
//! in the layout the tiles read, and the tiles take its panels: the same values multiplied in
//! the same order, so the same bits. `op(b)` is shared a chunk of k blocks at a time where it
//! exceeds 32 MiB packed (the classifier's weight in its input-gradient product, 154 MiB): the
//! tiles run once per chunk and keep their sums in the buffer between chunks.

use std::ops::Range;
use std::sync::Mutex;

use super::super::for_each_task;
use super::packed::{pack_a, pack_b, steps, take, tile, Micro};
use super::{Job, Tile};

/// Packed values (`u32`) a shared `op(a)` or the tiles' sums may take: 128 MiB; a chunk of
/// `op(b)` takes a quarter of it.
const MAX_VALUES: usize = 32 << 20;

/// The shared panels' buffer (grown, never shrunk). A call that finds it in use (another
/// thread's product) packs per tile.
static BUFFER: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// One operand's packed blocks, laid out by `layout`, for k blocks `kb0..kb0 + k_blocks`.
pub(super) struct Panels {
    base: *const u32,
    layout: Layout,
    kb0: usize,
    k_blocks: usize,
}

impl Panels {
    /// The packed block of batch `z` (its group: one for all batches where they share one
    /// `b`), tile `t` (row tile for `op(a)`, column tile for `op(b)`), k block `kb` and row
    /// block `rb`.
    pub(super) fn at(&self, z: usize, t: usize, kb: usize, rb: usize) -> *const u32 {
        let l = &self.layout;
        let g = if l.groups == 1 { 0 } else { z };
        let i = ((g * l.tiles + t) * self.k_blocks + kb - self.kb0) * l.row_blocks + rb;
        self.base.wrapping_add(i * l.slot)
    }
}

/// What the tiles of one pass read and cover ([`run`]): the operands packed once (`None` where
/// each tile packs its own), the k blocks (all when `None`), and where the tiles keep their
/// sums between passes (a slot of `.1` values a tile; the thread's scratch when `None`).
#[derive(Default)]
pub(super) struct Shared {
    pub a: Option<Panels>,
    pub b: Option<Panels>,
    pub blocks: Option<Range<usize>>,
    pub sums: Option<(*mut f32, usize)>,
}

// SAFETY: the tiles only read the panels, which are written before any tile starts, and each
// writes only its own sums slot.
unsafe impl Sync for Shared {}

/// Where a shared operand's blocks go: a slot of `slot` values for every `(group, tile, k
/// block, row block)`, in that order; `op(b)` has one row block.
#[derive(Clone, Copy)]
struct Layout {
    groups: usize,
    tiles: usize,
    row_blocks: usize,
    slot: usize,
}

impl Layout {
    /// Blocks for `k_blocks` k blocks (`None` on overflow).
    fn blocks(&self, k_blocks: usize) -> Option<usize> {
        [self.tiles, k_blocks, self.row_blocks].iter().try_fold(self.groups, |v, &f| v.checked_mul(f))
    }

    /// Packed values for `k_blocks` k blocks (`None` on overflow).
    fn values(&self, k_blocks: usize) -> Option<usize> {
        self.blocks(k_blocks)?.checked_mul(self.slot)
    }

    /// (group, tile, k block, row block) of block `i` of `k_blocks` blocks from `kb0`.
    fn block(&self, i: usize, kb0: usize, k_blocks: usize) -> (usize, usize, usize, usize) {
        let rb = i % self.row_blocks;
        let kb = kb0 + i / self.row_blocks % k_blocks;
        let t = i / (self.row_blocks * k_blocks) % self.tiles;
        (i / (self.row_blocks * k_blocks * self.tiles), t, kb, rb)
    }
}

/// Runs every tile of `job` with micro-kernel `M` on `threads` threads, packing first each
/// operand that several tiles would pack.
///
/// # Safety
/// As [`tile`], for every tile.
pub(super) unsafe fn run<M: Micro>(job: &Job, threads: usize) {
    run_within::<M>(job, threads, MAX_VALUES)
}

/// [`run`] with `max` in place of [`MAX_VALUES`] (tests take small ones).
///
/// # Safety
/// As [`tile`], for every tile.
pub(super) unsafe fn run_within<M: Micro>(job: &Job, threads: usize, max: usize) {
    let tl = &job.tiling;
    let k_blocks = job.spec.k.div_ceil(M::KU).div_ceil(M::KC);
    let full = steps::<M>(M::KC * M::KU);
    let a = Layout { groups: tl.batches, tiles: tl.row_tiles, row_blocks: tl.tile_m.div_ceil(M::MC), slot: full * M::MC };
    let b_groups = if tl.b_batch == 0 { 1 } else { tl.batches };
    let b = Layout { groups: b_groups, tiles: tl.col_tiles, row_blocks: 1, slot: full * tl.tile_n.next_multiple_of(M::NR) };
    let fits = |v: Option<usize>| v.is_some_and(|v| v <= max);
    let share_a = tl.col_tiles > 1 && fits(a.values(k_blocks));
    // `op(b)` whole, or as many k blocks at a time as fit in a quarter of `max` (32 MiB), with
    // the tiles' sums kept between chunks.
    let chunk = match b.values(1) {
        Some(one) if tl.row_tiles > 1 && one > 0 && one <= max / 4 => (max / 4 / one).min(k_blocks),
        _ => 0,
    };
    let sums_slot = tl.tile_m.next_multiple_of(M::MR) * tl.tile_n.next_multiple_of(M::NR);
    let chunked = chunk > 0 && chunk < k_blocks;
    let share_b = chunk > 0 && (!chunked || fits(tl.tasks().checked_mul(sums_slot)));
    let buffer = if (share_a || share_b) && k_blocks > 0 { BUFFER.try_lock().ok() } else { None };
    let Some(mut buffer) = buffer else {
        return for_each_task(tl.tasks(), threads, &|t| tile::<M>(job, t, &Shared::default()));
    };
    let (chunk, chunked) = if share_b { (chunk, chunked) } else { (k_blocks, false) };
    let a_len = if share_a { a.values(k_blocks).unwrap_or(0) } else { 0 };
    let b_len = if share_b { b.values(chunk).unwrap_or(0) } else { 0 };
    let sums_len = if chunked { tl.tasks() * sums_slot } else { 0 };
    let base = take(&mut buffer, a_len + b_len + sums_len).as_mut_ptr();
    // The packing tasks write disjoint slots (passed as an address: raw pointers are not Sync).
    let addr = base as usize;
    for kb0 in (0..k_blocks).step_by(chunk) {
        let len = chunk.min(k_blocks - kb0);
        // (Both counts fit: their values were checked above.)
        let a_tasks = if share_a && kb0 == 0 { a.blocks(k_blocks).unwrap_or(0) } else { 0 };
        let b_tasks = if share_b { b.blocks(len).unwrap_or(0) } else { 0 };
        for_each_task(a_tasks + b_tasks, threads, &|i| {
            let k_range = |kb: usize| (kb * M::KC * M::KU, ((kb + 1) * M::KC * M::KU).min(job.spec.k));
            if i < a_tasks {
                let (g, t, kb, rb) = a.block(i, 0, k_blocks);
                let mt = tl.tile_m.min(tl.rows - t * tl.tile_m);
                if rb * M::MC >= mt {
                    return;
                }
                let (mc, (k0, k1)) = (M::MC.min(mt - rb * M::MC), k_range(kb));
                let off = tl.operand_offsets(&Tile { z: g, i0: t * tl.tile_m + rb * M::MC, j0: 0, mt: mc, nt: 0 }).0 + k0 as isize * tl.a_cs;
                let dst = std::slice::from_raw_parts_mut((addr as *mut u32).add(i * a.slot), steps::<M>(k1 - k0) * mc.next_multiple_of(M::MR));
                pack_a::<M>(job.a.0.offset(off), mc, k1 - k0, tl.a_rs, tl.a_cs, dst);
            } else {
                let i = i - a_tasks;
                let (g, t, kb, _) = b.block(i, kb0, len);
                let (j0, (k0, k1)) = (t * tl.tile_n, k_range(kb));
                let nt = tl.tile_n.min(job.spec.n - j0);
                let off = tl.operand_offsets(&Tile { z: g, i0: 0, j0, mt: 0, nt }).1 + k0 as isize * tl.b_rs;
                let dst = std::slice::from_raw_parts_mut((addr as *mut u32).add(a_len + i * b.slot), steps::<M>(k1 - k0) * nt.next_multiple_of(M::NR));
                pack_b::<M>(job.b.0.offset(off), k1 - k0, nt, tl.b_rs, tl.b_cs, dst);
            }
        });
        let shared = Shared {
            a: share_a.then_some(Panels { base, layout: a, kb0: 0, k_blocks }),
            b: share_b.then(|| Panels { base: base.add(a_len), layout: b, kb0, k_blocks: len }),
            blocks: Some(kb0..kb0 + len),
            sums: chunked.then(|| (base.add(a_len + b_len) as *mut f32, sums_slot)),
        };
        for_each_task(tl.tasks(), threads, &|t| tile::<M>(job, t, &shared));
    }
}
