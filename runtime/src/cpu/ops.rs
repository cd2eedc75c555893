//! Native CPU implementations of the embedding ops that stay their own launches after fusion:
//! gather and its scatter-add adjoint. f32 data, rayon parallelism over independent rows or
//! column bands, deterministic (every sum has one order). Attention is `attention.rs`.

use fusec_codegen_cpu::thread_spans::task;
use rayon::prelude::*;

/// `out[s, :] = table[idx[s], :]`; an index outside the table is an error.
pub fn gather(table: &[f32], cols: usize, idx: &[i32], out: &mut [f32]) -> Result<(), String> {
    let rows = table.len() / cols;
    if let Some((s, &i)) = idx.iter().enumerate().find(|(_, &i)| i < 0 || i as usize >= rows) {
        return Err(format!("gather: index {i} at position {s} is outside the table's {rows} rows"));
    }
    out.par_chunks_mut(cols).zip(idx.par_iter()).for_each(|(o, &i)| {
        let i = i as usize;
        task(|| o.copy_from_slice(&table[i * cols..(i + 1) * cols]));
    });
    Ok(())
}

/// `out = 0; out[idx[s], :] += src[s, :]` in increasing `s` (columns split across threads).
pub fn scatter_add(src: &[f32], cols: usize, idx: &[i32], out: &mut [f32]) -> Result<(), String> {
    let rows = out.len() / cols;
    if let Some((s, &i)) = idx.iter().enumerate().find(|(_, &i)| i < 0 || i as usize >= rows) {
        return Err(format!("scatter_add: index {i} at position {s} is outside the {rows} rows"));
    }
    out.fill(0.0);
    // Each thread owns a band of columns of every row: rows are visited in order by all bands.
    let band = cols.div_ceil(rayon::current_num_threads().max(1)).max(16).min(cols);
    let out_ptr = SyncPtr(out.as_mut_ptr());
    (0..cols.div_ceil(band)).into_par_iter().for_each(|b| {
        let (c0, c1) = (b * band, ((b + 1) * band).min(cols));
        task(|| {
            for (s, &i) in idx.iter().enumerate() {
                let (src_row, dst) = (&src[s * cols..], i as usize * cols);
                for c in c0..c1 {
                    // SAFETY: bands are disjoint column ranges, so no two threads touch one element.
                    unsafe { *out_ptr.get().add(dst + c) += src_row[c] };
                }
            }
        })
    });
    Ok(())
}

/// A raw pointer that may cross threads (disjoint writes are the caller's promise).
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}
