//! Operands packed once for a whole call and shared by its tiles.
//!
//! Each tile packs its rows of `op(a)` and its columns of `op(b)` for itself
//! ([`super::packed::tile`]), so `op(a)` is packed once per column tile and `op(b)` once per row
//! tile. Packing costs one to four cycles a value, against the micro-kernels' 16 to 64 products
//! a cycle: at four tiles a core on 2 cores (the 16-core Xeon cuts 64 tiles), the 124M step's
//! AVX2 products spent 22% of their time packing, the classifier's input gradient 32%. [`run`] packs
//! each operand that more than one tile would pack (within [`MAX_VALUES`]) into a buffer first,
//! in the layout the tiles read, and the tiles take its panels: the same values multiplied in
//! the same order, so the same bits.

use std::sync::Mutex;

use super::super::for_each_task;
use super::packed::{pack_a, pack_b, steps, take, tile, Micro};
use super::{Job, Tile};

/// Packed values (`u32`) one shared operand may take: 128 MiB (the classifier's weight, 50,304
/// x 768 values, is packed per tile instead).
const MAX_VALUES: usize = 32 << 20;

/// The shared panels' buffer (grown, never shrunk). A call that finds it in use (another
/// thread's product) packs per tile.
static BUFFER: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// One operand's packed blocks: a slot of `slot` values for every `(group, tile, k block,
/// row block)`, in that order; `op(b)` has one row block.
pub(super) struct Panels {
    base: *const u32,
    slot: usize,
    tiles: usize,
    k_blocks: usize,
    row_blocks: usize,
}

impl Panels {
    /// The packed block of group `g` (batch), tile `t` (row tile for `op(a)`, column tile for
    /// `op(b)`), k block `kb` and row block `rb`.
    pub(super) fn at(&self, g: usize, t: usize, kb: usize, rb: usize) -> *const u32 {
        let i = ((g * self.tiles + t) * self.k_blocks + kb) * self.row_blocks + rb;
        self.base.wrapping_add(i * self.slot)
    }
}

/// The operands a call packed once ([`run`]); `None` where each tile packs its own.
#[derive(Default)]
pub(super) struct Shared {
    pub a: Option<Panels>,
    pub b: Option<Panels>,
}

// SAFETY: the tiles only read the panels, which are written before any tile starts.
unsafe impl Sync for Shared {}

/// Where each shared operand's blocks go: (groups, tiles, row blocks, slot values).
struct Layout {
    groups: usize,
    tiles: usize,
    row_blocks: usize,
    slot: usize,
}

impl Layout {
    fn blocks(&self, k_blocks: usize) -> usize {
        self.groups * self.tiles * k_blocks * self.row_blocks
    }
}

/// Runs every tile of `job` with micro-kernel `M` on `threads` threads, packing first each
/// operand that several tiles would pack.
///
/// # Safety
/// As [`tile`], for every tile.
pub(super) unsafe fn run<M: Micro>(job: &Job, threads: usize) {
    let tl = &job.tiling;
    let k_blocks = job.spec.k.div_ceil(M::KU).div_ceil(M::KC);
    let full = steps::<M>(M::KC * M::KU);
    let a = Layout { groups: tl.batches, tiles: tl.row_tiles, row_blocks: tl.tile_m.div_ceil(M::MC), slot: full * M::MC };
    let b_groups = if tl.b_batch == 0 { 1 } else { tl.batches };
    let b = Layout { groups: b_groups, tiles: tl.col_tiles, row_blocks: 1, slot: full * tl.tile_n.next_multiple_of(M::NR) };
    let fits = |l: &Layout| l.blocks(k_blocks).checked_mul(l.slot).is_some_and(|v| v <= MAX_VALUES);
    let share_a = tl.col_tiles > 1 && fits(&a);
    let share_b = tl.row_tiles > 1 && fits(&b);
    let buffer = if (share_a || share_b) && k_blocks > 0 { BUFFER.try_lock().ok() } else { None };
    let Some(mut buffer) = buffer else {
        return for_each_task(tl.tasks(), threads, &|t| tile::<M>(job, t, &Shared::default()));
    };
    let a_blocks = if share_a { a.blocks(k_blocks) } else { 0 };
    let b_blocks = if share_b { b.blocks(k_blocks) } else { 0 };
    let a_len = a_blocks * a.slot;
    let base = take(&mut buffer, a_len + b_blocks * b.slot).as_mut_ptr();
    // The packing tasks write disjoint slots (passed as an address: raw pointers are not Sync).
    let addr = base as usize;
    for_each_task(a_blocks + b_blocks, threads, &|i| {
        let (op_b, i) = if i < a_blocks { (false, i) } else { (true, i - a_blocks) };
        let l = if op_b { &b } else { &a };
        let (rb, kb) = (i % l.row_blocks, i / l.row_blocks % k_blocks);
        let (t, g) = (i / (l.row_blocks * k_blocks) % l.tiles, i / (l.row_blocks * k_blocks * l.tiles));
        let (k0, k1) = (kb * M::KC * M::KU, ((kb + 1) * M::KC * M::KU).min(job.spec.k));
        let dst = (addr as *mut u32).add(if op_b { a_len } else { 0 } + i * l.slot);
        let kp = steps::<M>(k1 - k0);
        if op_b {
            let j0 = t * tl.tile_n;
            let nt = tl.tile_n.min(job.spec.n - j0);
            let off = tl.operand_offsets(&Tile { z: g, i0: 0, j0, mt: 0, nt }).1 + k0 as isize * tl.b_rs;
            let dst = std::slice::from_raw_parts_mut(dst, kp * nt.next_multiple_of(M::NR));
            pack_b::<M>(job.b.0.offset(off), k1 - k0, nt, tl.b_rs, tl.b_cs, dst);
        } else {
            let i0 = t * tl.tile_m + rb * M::MC;
            let mt = tl.tile_m.min(tl.rows - t * tl.tile_m);
            if rb * M::MC >= mt {
                return;
            }
            let mc = M::MC.min(mt - rb * M::MC);
            let off = tl.operand_offsets(&Tile { z: g, i0, j0: 0, mt: mc, nt: 0 }).0 + k0 as isize * tl.a_cs;
            let dst = std::slice::from_raw_parts_mut(dst, kp * mc.next_multiple_of(M::MR));
            pack_a::<M>(job.a.0.offset(off), mc, k1 - k0, tl.a_rs, tl.a_cs, dst);
        }
    });
    let panels = |l: &Layout, start: usize| Panels { base: base.add(start), slot: l.slot, tiles: l.tiles, k_blocks, row_blocks: l.row_blocks };
    let shared = Shared { a: share_a.then(|| panels(&a, 0)), b: share_b.then(|| panels(&b, a_len)) };
    for_each_task(tl.tasks(), threads, &|t| tile::<M>(job, t, &shared));
}
