//! Running a compiled kernel: argument arrays, chunks over rayon, the finalize step.
//!
//! Each segment's rows are cut into a fixed number of chunks (a function of the segment's shape,
//! see [`fusec_passes::lower_rows::chunk_count`]); with `threads > 1` the chunks run on a rayon
//! pool of that many threads, otherwise in order on the calling thread. A chunk writes only its own rows and
//! its own column-reduction partials, and the finalize function combines partials in chunk
//! order, so the results are the same bits for every thread count.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use fusec_ir::rows::chunk_bounds;
use rayon::prelude::*;

use crate::jit::Code;
use crate::narrow::{self, Narrow};
use crate::thread_spans::task;

/// What an argument-array slot points at when a segment runs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SlotRef {
    /// Operand `k`.
    Operand(usize),
    /// Result `j`.
    Result(usize),
    /// The kernel's scratch buffer `i`.
    Scratch(usize),
}

/// One segment: its compiled code, what its slots point at, and the bf16 copies rounded after
/// each block of rows ([`crate::narrow`]).
pub(crate) struct SegmentRun {
    pub code: Arc<Code>,
    pub slots: Vec<SlotRef>,
    pub rows: u64,
    pub cols: u64,
    pub chunks: u64,
    pub narrows: Vec<Narrow>,
}

/// A compiled kernel, ready to run on buffers (see [`CompiledKernel::run`]).
pub struct CompiledKernel {
    /// The kernel's name (from `fuse-elementwise`).
    pub name: String,
    /// The Cranelift IR text of its functions (for `fusec dump --pass lower-cpu`).
    pub clif: String,
    pub(crate) segments: Vec<SegmentRun>,
    /// Scratch and the argument array, allocated at compile time (locked while the kernel runs,
    /// so a run allocates nothing).
    pub(crate) state: Mutex<RunState>,
    pub(crate) n_operands: usize,
    pub(crate) n_results: usize,
    pub(crate) bytes: u64,
    pub(crate) flops: u64,
}

/// What a run writes besides the results: column-reduction partials and stash rows, and the
/// argument array handed to the compiled functions.
pub(crate) struct RunState {
    /// Scratch buffers (by [`SlotRef::Scratch`] index).
    pub scratch: Vec<Vec<f32>>,
    /// The argument array (capacity for the largest segment).
    pub args: Vec<*mut u8>,
}

// SAFETY: the raw pointers in `args` are only written and read during `run`, under the lock.
unsafe impl Send for RunState {}

/// A raw pointer that may cross to rayon's threads (each chunk touches disjoint rows).
#[derive(Clone, Copy)]
struct SendPtr(*const *mut u8);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *const *mut u8 {
        self.0
    }
}

/// Rayon pools by thread count, created on first use and kept for the process: the pool the
/// kernels run on when called from outside a pool of `threads` (the CPU executor drives whole
/// programs from inside it).
pub fn pool(threads: usize) -> Arc<rayon::ThreadPool> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let mut m = POOLS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    m.entry(threads).or_insert_with(|| Arc::new(rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("rayon pool"))).clone()
}

/// Runs `f(k)` for every `k < n` on `threads` threads.
fn par_for(threads: usize, n: u64, f: &(dyn Fn(u64) + Sync)) {
    if rayon::current_thread_index().is_some() && rayon::current_num_threads() == threads {
        (0..n).into_par_iter().for_each(|k| task(|| f(k)));
    } else {
        pool(threads).install(|| (0..n).into_par_iter().for_each(|k| task(|| f(k))));
    }
}

impl CompiledKernel {
    /// Runs the kernel. `operands[i]` points at operand `i`'s data (dtype and shape as the body's
    /// `i`-th input under the binding it was compiled for), `results[i]` at result `i`'s buffer.
    /// A result may alias an operand only where the memory planner allowed in-place (same index
    /// mapping, elementwise): every operand element is read before the result element at the same
    /// index is written. `threads` ≤ 1 runs on the calling thread.
    ///
    /// # Safety
    /// Every pointer must be valid for its whole tensor (reads; writes for results), and no other
    /// thread may access the result buffers during the call.
    pub unsafe fn run(&self, operands: &[*const u8], results: &[*mut u8], threads: usize) {
        assert_eq!(operands.len(), self.n_operands, "kernel `{}`: operand count", self.name);
        assert_eq!(results.len(), self.n_results, "kernel `{}`: result count", self.name);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let RunState { scratch, args } = &mut *state;
        for seg in &self.segments {
            args.clear();
            args.extend(seg.slots.iter().map(|s| match *s {
                SlotRef::Operand(k) => operands[k] as *mut u8,
                SlotRef::Result(j) => results[j],
                SlotRef::Scratch(i) => scratch[i].as_mut_ptr() as *mut u8,
            }));
            let ap = SendPtr(args.as_ptr());
            let (chunk_fn, rows, cols, chunks, narrows) = (seg.code.chunk, seg.rows, seg.cols, seg.chunks, &seg.narrows);
            let body = move |k: u64| {
                let (b, e) = chunk_bounds(rows, chunks, k);
                // SAFETY: the caller guarantees the buffers; chunks write disjoint rows and
                // their own partials.
                unsafe {
                    if narrows.is_empty() {
                        chunk_fn(ap.get(), b as i64, e as i64, k as i64);
                    } else {
                        // A block of rows at a time, its copies rounded while it is in cache.
                        let step = (narrow::BLOCK / cols.max(1)).max(1);
                        let mut r = b;
                        while r < e {
                            let s = (r + step).min(e);
                            chunk_fn(ap.get(), r as i64, s as i64, k as i64);
                            narrow::run(narrows, ap.get(), cols, r, s);
                            r = s;
                        }
                    }
                }
            };
            if threads <= 1 || chunks <= 1 {
                (0..chunks).for_each(body);
            } else {
                par_for(threads, chunks, &body);
            }
            if let Some(fin) = seg.code.finalize {
                fin(args.as_ptr());
            }
        }
    }

    /// Bytes read and written (every operand and result once), for the profiler.
    pub fn bytes_moved(&self) -> u64 {
        self.bytes
    }

    /// Approximate float operations (one per element op per element), for the profiler.
    pub fn flops(&self) -> u64 {
        self.flops
    }

    /// How many independent segments (compiled functions) the kernel runs.
    pub fn segments(&self) -> usize {
        self.segments.len()
    }

    /// How many bf16 copies of f32 results are rounded natively after each block of rows instead
    /// of in the generated code ([`crate::narrow`]).
    pub fn native_narrows(&self) -> usize {
        self.segments.iter().map(|s| s.narrows.len()).sum()
    }
}

impl std::fmt::Debug for CompiledKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledKernel").field("name", &self.name).field("segments", &self.segments.len()).finish()
    }
}
