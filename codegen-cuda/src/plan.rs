//! How a row program ([`Prog`]) maps onto the GPU, and which nodes each generated function
//! computes.
//!
//! Three mappings, picked from what the program reduces:
//!
//! - [`Mapping::Flat`] (no reductions: pointwise chains, AdamW): one thread per element, 256
//!   threads a block, row values recomputed per element.
//! - [`Mapping::Cols`] (column reductions only: bias gradients): blocks of 32 x 8 threads, a
//!   block per `32 W` columns and chunk of rows, each thread taking `W` adjacent columns
//!   (vector accesses, `W` = 1, 4 or 8: see `emit/cols.rs`) and every 8th row of the chunk in
//!   order, keeping its column partials in registers; the block adds its 8 row slices in
//!   order before writing one partial per column and chunk.
//! - [`Mapping::Rows`] (row reductions, with or without column reductions: LayerNorm, softmax,
//!   cross-entropy, their gradients): a *team* of threads per row — one warp for rows up to
//!   4096 columns (1024 with column reductions), else a block of 256 (1024 when there are few
//!   rows) — making one pass over
//!   the row's columns per reduction level, as in the CPU backend's plan, with team reductions
//!   between passes. With column reductions a fixed number of teams walk the rows (team `t`
//!   takes rows `t, t + teams, ...`) and keep column partials per team. f32 rows of
//!   [`CLUSTER_MIN_COLS`] or more get a cluster of [`CLUSTER`] blocks a row on sm_90, which
//!   keeps the row in registers between passes (one read from DRAM instead of one a pass).
//!
//! Column partials land in scratch (`[parts, C]` per reduction); a *finalize* kernel sums them
//! in a fixed order (each of [`FIN_SLICES`] thread rows sums a contiguous slice of the partials,
//! then the slice sums are added in order) and runs the column-space epilogue. It also
//! stores every result that has no row axis (as on the CPU: written once, after every row has
//! read the operands it might overwrite in place). Nothing depends on timing: same inputs,
//! same bits.
//!
//! Unlike the CPU backend nothing is stashed between passes: element values a later pass needs
//! are recomputed from the inputs (GPU arithmetic is cheap next to the loads it saves).

use fusec_ir::rows::{liveness, Expr, Liveness, NodeId, Prog};

/// Threads per block of the flat, column and finalize kernels, and of row kernels with
/// warp-wide teams.
pub(crate) const BLOCK: u32 = 256;
/// Row-kernel teams when the program has column reductions (each keeps its own partials).
pub(crate) const MAX_TEAMS: u64 = 2048;
/// Row-kernel teams of a block or more when the program has column reductions: about one wave
/// of 256-thread blocks on an H100 (132 SMs, four blocks each), each writing one partial set.
pub(crate) const MAX_BLOCK_TEAMS: u64 = 512;
/// Blocks of a cluster team (`Mapping::Rows`).
pub(crate) const CLUSTER: u32 = 8;
/// The shortest f32 rows given a cluster team (shorter ones keep a block a row).
pub(crate) const CLUSTER_MIN_COLS: u64 = 16384;
/// Column-kernel blocks: `COL_BX` threads along the columns (`W` columns each) by `COL_BY`
/// row slices.
pub(crate) const COL_BX: u32 = 32;
pub(crate) const COL_BY: u32 = 8;
/// Thread rows of a finalize kernel's block (32 columns wide): slices of the partials summed
/// side by side.
pub(crate) const FIN_SLICES: u32 = 32;
/// Rows each column-kernel thread aims to walk (a chunk is `COL_BY` times that).
pub(crate) const ROWS_PER_THREAD: u64 = 8;
/// The most row chunks (blocks along the rows) of a column kernel.
pub(crate) const MAX_CHUNKS: u64 = 1024;
/// Column partials kept in registers per thread at most (beyond: in scratch).
pub(crate) const MAX_REG_PARTIALS: u64 = 32;
/// Dynamic shared memory a row kernel may use (`emit/rows.rs`): for copies of the row views
/// that several passes read (one team a block), or for the column partials of warp-wide teams
/// (never both): 99 KiB, the most a block may opt into on sm_86/sm_89 (sm_80: 163 KiB, sm_90:
/// 227 KiB), less room for the team reduction's 128 bytes; two such blocks fit an H100's SM.
pub(crate) const STAGE_MAX_BYTES: u64 = 99 * 1024 - 256;

/// The thread layout of a program's main kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mapping {
    /// One thread per element.
    Flat,
    /// `team` threads per row, `tpb` teams a block, `teams` teams in all. With `cluster` > 1
    /// (one block a team of 256), on sm_90 a thread-block cluster of that many blocks takes each
    /// row instead (a team of `cluster * team` threads, see `emit/rows.rs`); the grid has
    /// `cluster` blocks a team either way.
    Rows { team: u32, tpb: u32, teams: u64, cluster: u32 },
    /// Blocks of [`COL_BX`] x [`COL_BY`] threads; `chunks` row chunks (blocks along the rows).
    Cols { chunks: u64 },
}

/// One pass over the columns of a row (row mapping).
pub(crate) struct Pass {
    pub level: u32,
    /// Row reductions finished by this pass.
    pub rowreds: Vec<NodeId>,
    /// Column reductions of element values accumulated in this pass.
    pub colreds: Vec<NodeId>,
    /// Element stores (last pass only), as indices into `Prog::stores`.
    pub stores: Vec<usize>,
}

/// What the generated functions compute.
pub(crate) struct Plan {
    pub mapping: Mapping,
    pub main_live: Vec<bool>,
    pub fin_live: Vec<bool>,
    pub row_stores: Vec<usize>,
    pub elem_stores: Vec<usize>,
    /// Stores of the finalize kernel (column-reduction results, results without a row axis).
    pub fin_stores: Vec<usize>,
    /// Every column reduction the finalize kernel combines.
    pub colreds: Vec<NodeId>,
    /// Column reductions of per-row values (accumulated once per row).
    pub row_colreds: Vec<NodeId>,
    /// Row-mapping passes.
    pub passes: Vec<Pass>,
    /// Partial sets per column reduction (teams, blocks or row chunks).
    pub parts: u64,
    /// Row mapping with warp-wide teams: the column partials live in each warp's slice of
    /// shared memory (more than [`MAX_REG_PARTIALS`] a thread), and each block sums its warps'
    /// slices before writing one partial set a block (`parts` = blocks).
    pub smem_partials: bool,
}

/// The argument of a reduction node.
pub(crate) fn arg(p: &Prog, id: NodeId) -> NodeId {
    p.node(id).expr.args()[0]
}

pub(crate) fn plan(p: &Prog) -> Plan {
    let n = p.nodes.len();
    let Liveness { main_live, fin_live, row_stores, elem_stores, fin_stores, colreds } = liveness(p);
    let rowreds: Vec<NodeId> =
        (0..n as NodeId).filter(|&i| main_live[i as usize] && matches!(p.node(i).expr, Expr::RowReduce(..))).collect();
    let col_colreds: Vec<NodeId> = colreds.iter().copied().filter(|&c| p.node(arg(p, c)).space.has_col()).collect();
    let row_colreds: Vec<NodeId> = colreds.iter().copied().filter(|&c| !p.node(arg(p, c)).space.has_col()).collect();
    let (rows, cols) = (p.rows, p.cols);
    let mapping = if rowreds.is_empty() && colreds.is_empty() {
        Mapping::Flat
    } else if rowreds.is_empty() && row_colreds.is_empty() && row_stores.is_empty() {
        Mapping::Cols { chunks: (rows / (ROWS_PER_THREAD * COL_BY as u64)).clamp(1, MAX_CHUNKS) }
    } else {
        // A warp keeps at most MAX_REG_PARTIALS column partials a lane in registers or shared
        // memory; wider rows with column reductions get a block per row instead of per-warp
        // partials in global memory (the LayerNorm gradient at C = 1600: 0.418 ms, 17% of the
        // bandwidth on the H100).
        let warp_partials_fit = col_colreds.is_empty() || cols.div_ceil(32) <= MAX_REG_PARTIALS;
        let team: u32 = if cols <= 4096 && warp_partials_fit {
            32
        } else if rows >= 256 {
            256
        } else {
            1024
        };
        let tpb = (BLOCK / team).max(1);
        let teams = match (colreds.is_empty(), team) {
            (true, _) => rows,
            (false, 32) => rows.min(MAX_TEAMS),
            (false, _) => rows.min(MAX_BLOCK_TEAMS),
        };
        // f32 rows too long to keep in one block's registers between passes (the fp32
        // classifier's 50,304 logits, read by three passes): a cluster of blocks keeps them, so
        // the row is read from DRAM once (H100: 4.41 -> 3.05 ms). Not for bf16 rows: their
        // online softmax reads them twice, and the cluster's barriers cost more than the
        // second read saved (1.68 -> 1.93 ms).
        let f32_rows = !crate::emit::reads_bf16(p);
        let cluster = if f32_rows && colreds.is_empty() && team == 256 && cols >= CLUSTER_MIN_COLS { CLUSTER } else { 1 };
        Mapping::Rows { team, tpb, teams: teams.max(1), cluster }
    };
    // The LayerNorm gradient's three sums took 72 registers a thread in registers (occupancy
    // 25%): in shared memory 0.112 -> 0.097 ms on the H100; summed per block before they go
    // out, 2,048 partial sets become 256 (the finalize kernel had taken 14 of the 98 us).
    let smem_partials = match mapping {
        Mapping::Rows { team: 32, tpb, teams, .. } => {
            let k_count = cols.div_ceil(32);
            // The slots of 8-wide passes whose last step runs past the row (`emit/rows.rs`).
            let k_slots = k_count.max(cols.div_ceil(256) * 8);
            let col_parts = col_colreds.len() as u64;
            let bytes = col_parts * k_slots * 32 * tpb as u64 * 4;
            // (A warp team with column reductions has k_count <= MAX_REG_PARTIALS: see `team`.)
            col_parts * k_count > MAX_REG_PARTIALS && bytes <= STAGE_MAX_BYTES && row_colreds.is_empty() && teams.is_multiple_of(tpb as u64)
        }
        _ => false,
    };
    let parts = match mapping {
        Mapping::Flat => 0,
        Mapping::Rows { tpb, teams, .. } if smem_partials => teams / tpb as u64,
        Mapping::Rows { teams, .. } => teams,
        Mapping::Cols { chunks, .. } => chunks,
    };
    let last = rowreds
        .iter()
        .chain(&col_colreds)
        .map(|&r| p.node(arg(p, r)).level)
        .chain(elem_stores.iter().map(|&s| p.node(p.stores[s].value).level))
        .max();
    let mut passes = vec![];
    if let Some(last) = last {
        for level in 0..=last {
            let rr: Vec<NodeId> = rowreds.iter().copied().filter(|&r| p.node(arg(p, r)).level == level).collect();
            let cr: Vec<NodeId> = col_colreds.iter().copied().filter(|&r| p.node(arg(p, r)).level == level).collect();
            let st: Vec<usize> = if level == last { elem_stores.clone() } else { vec![] };
            if !(rr.is_empty() && cr.is_empty() && st.is_empty()) {
                passes.push(Pass { level, rowreds: rr, colreds: cr, stores: st });
            }
        }
    }
    Plan { mapping, main_live, fin_live, row_stores, elem_stores, fin_stores, colreds, row_colreds, passes, parts, smem_partials }
}
