//! Causal attention launches on CUDA: the flash kernels (forward, `dq`, `dk/dv`) where a module
//! was compiled for the head size and storage, otherwise the score-matrix path — per
//! (sequence, head) pointer-array cuBLAS products on `[B·H, T, T]` score matrices in scratch,
//! with softmax kernels between them.
//!
//! On bf16 storage (`qkv`, `out`, `dout`, `dqkv`; `lse` is f32) attention runs only on the flash
//! kernels, also under `--no-tf32` and without `flash`: the score-matrix path is f32 only. Head
//! sizes 16, 32, 64 and 128 run on the bf16 tensor-core kernels; the other multiples of 8 up to
//! 64 on the TF32 kernels with bf16 tiles widened to f32 (bf16 values are exact in TF32). A head
//! size without a bf16 module is an error, not a silent fallback.

use fusec_codegen_cuda::flash;
use fusec_codegen_cuda::gemm::row_major;
use fusec_ir::DType;

use super::launch::{blocks, Addr, Arg, Builder, Step};
use crate::launches::{self, Attention, LaunchOp};

/// A launch's steps, its profile name and its FLOPs.
type Launch = (Vec<Step>, &'static str, u64);

/// The profile name of the launch that adds the partial column sums of the attention backward.
pub(crate) const COLSUM_LAUNCH: &str = "flash_attention_grad_colsum";

/// The partial column sums an attention backward writes for the launch after it (see
/// [`Builder::column_sums`]): `rows` rows of `cols` f32 at `at`; `accumulates`: that launch adds
/// their total to its second operand.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ColumnSums {
    pub at: Addr,
    pub rows: usize,
    pub cols: usize,
    pub accumulates: bool,
}

impl Builder<'_> {
    /// Where the backward `a` writes partial column sums of its `dqkv`, when its kernels can
    /// (`flash::sums_columns`) and the launch right after it, `next`, is a fused kernel that only
    /// sums `dqkv`'s columns (`launches::sums_columns`, or adds them to an accumulator): that
    /// launch then adds the partial rows (`fusec_sum_rows`) instead of reading `dqkv` again.
    /// The partials live in scratch after the row statistics; nothing runs between the two
    /// launches, so nothing else uses it.
    pub(crate) fn column_sums(&mut self, a: &Attention, next: Option<&launches::Launch>) -> Result<Option<ColumnSums>, String> {
        let (s, t, h, d) = (a.dims.s, a.dims.t, a.dims.h, a.dims.d);
        let folds = match next.map(|l| &l.op) {
            Some(LaunchOp::Kernel { kernel, ins, outs }) if !a.forward && ins.first() == a.at.dqkv.as_ref() && outs.len() == 1 => {
                launches::sums_columns(kernel)
            }
            _ => None,
        };
        let Some(accumulates) = folds else { return Ok(None) };
        if !self.native.flash.contains_key(&(d, a.dtype)) || !flash::sums_columns(d, a.dtype, &self.native.flash_arch) {
            return Ok(None);
        }
        let rows = s.checked_mul(t.div_ceil(flash::COLSUM_TILE));
        let cols = h.checked_mul(d).and_then(|c| c.checked_mul(3));
        let (Some(rows), Some(cols)) = (rows.filter(|r| i32::try_from(*r).is_ok()), cols.filter(|c| i32::try_from(*c).is_ok())) else {
            return Ok(None);
        };
        let start = flash::stats_bytes(d, a.dtype, s, h, t).div_ceil(256) * 256;
        let bytes = (rows as u64).checked_mul(cols as u64 * 4).and_then(|b| b.checked_add(start)).ok_or("attention: partial sums overflow 64 bits")?;
        self.need_scratch(bytes);
        Ok(Some(ColumnSums { at: Addr::Scratch(start), rows, cols, accumulates }))
    }

    /// The launches of one attention node; `colsum`: where the Hopper backward writes partial
    /// column sums of `dqkv` ([`Builder::column_sums`]), if anywhere.
    pub(crate) fn attention(&mut self, a: &Attention, colsum: Option<Addr>) -> Result<Vec<Launch>, String> {
        let (s, t, h, d) = (a.dims.s, a.dims.t, a.dims.h, a.dims.d);
        let (qkv, out_v, lse) = (Addr::Plan(a.at.qkv), Addr::Plan(a.at.out), Addr::Plan(a.at.lse));
        let grads = a.at.dout.zip(a.at.dqkv).map(|(o, q)| (Addr::Plan(o), Addr::Plan(q)));
        let scale = a.scale;
        let flash_fns = self.native.flash.get(&(d, a.dtype));
        match a.dtype {
            DType::F32 => {}
            DType::BF16 if flash_fns.is_none() => {
                let sizes = flash::head_sizes(DType::BF16).iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ");
                let why = if flash::supported(d, DType::BF16) {
                    "they need an sm_80 or newer GPU".to_string()
                } else {
                    format!("they handle head sizes {sizes}, not {d}")
                };
                return Err(format!("attention on bf16 storage runs only on the flash kernels, and {why} (use --precision fp32)"));
            }
            DType::BF16 => {}
            dt => return Err(format!("attention on {dt} storage is not supported by the CUDA target (f32 or bf16)")),
        }
        if let Some(f) = flash_fns {
            let geo = flash::geometry(d, a.dtype, &self.native.flash_arch);
            let kernel =
                |i: usize, args: Vec<Arg>| Step::Kernel { f: f[i], grid: geo[i].grid(t, h, s), block: geo[i].block(), shared: geo[i].shared, args };
            // Products done, the causal half: 2 forward, 3 for dq and 4 for dk, dv.
            let half = (s * h * t * t * d) as u64;
            let (ti, hi) = (Arg::I32(t as i32), Arg::I32(h as i32));
            let Some((dout, dqkv)) = grads.filter(|_| !a.forward) else {
                let args = vec![Arg::Ptr(qkv), Arg::Ptr(out_v), Arg::Ptr(lse), ti, hi, Arg::F32(scale)];
                return Ok(vec![(vec![kernel(0, args)], "flash_attention", 2 * half)]);
            };
            self.need_scratch(flash::stats_bytes(d, a.dtype, s, h, t));
            let stats = Arg::Ptr(Addr::Scratch(0));
            let (q, o, l, dd, dq) = (Arg::Ptr(qkv), Arg::Ptr(out_v), Arg::Ptr(lse), Arg::Ptr(dout), Arg::Ptr(dqkv));
            let mut args_q = vec![q, o, l, dd, dq, stats, ti, hi, Arg::F32(scale)];
            let mut args_kv = vec![q, l, dd, stats, dq, ti, hi, Arg::F32(scale)];
            if flash::sums_columns(d, a.dtype, &self.native.flash_arch) {
                let sums = colsum.map_or(Arg::I64(0), Arg::Ptr);
                args_q.push(sums);
                args_kv.push(sums);
            }
            let grad_q = (vec![kernel(1, args_q)], "flash_attention_grad_q", 3 * half);
            let grad_kv = (vec![kernel(2, args_kv)], "flash_attention_grad_kv", 4 * half);
            return Ok(vec![grad_q, grad_kv]);
        }
        let c = h * d;
        let (bh, tt) = (s * h, (t * t) as u64);
        let p_bytes = bh as u64 * tt * 4;
        self.need_scratch(if a.forward { p_bytes } else { 2 * p_bytes });
        let (p, dp) = (0u64, p_bytes);
        let plan_off = |a: Addr| match a {
            Addr::Plan(o) => o,
            _ => unreachable!("planned"),
        };
        // Per (batch row, head): its q, k, v (row stride 3C), its score matrix, its output
        // columns (row stride C).
        let head = |base: Addr, stride: usize, part: usize| -> Vec<Addr> {
            (0..bh)
                .map(|b| {
                    let (si, hi) = (b / h, b % h);
                    Addr::Plan(plan_off(base) + 4 * (si * t * stride + part * c + hi * d) as u64)
                })
                .collect()
        };
        let scores = |o: u64| -> Vec<Addr> { (0..bh as u64).map(|b| Addr::Scratch(o + b * tt * 4)).collect() };
        let (qs, ks, vs) = (head(qkv, 3 * c, 0), head(qkv, 3 * c, 1), head(qkv, 3 * c, 2));
        let arrays = |this: &mut Self, a: Vec<Addr>, b: Vec<Addr>, cc: Vec<Addr>| this.table(a.into_iter().chain(b).chain(cc));
        let flops = (2 * bh * t * t * d) as u64;
        let nrows = (bh * t) as i64;
        let rows_grid = blocks(nrows as u64, fusec_codegen_cuda::native::ATTN_ROWS_PER_BLOCK as u64);
        let batch = bh as i32;
        let mut out = vec![];
        // scores = q k^T (cuBLAS A = k, B = q).
        let sc = row_major(t, t, d, false, true, 3 * c, 3 * c, t)?;
        let sc_arr = arrays(self, ks.clone(), qs.clone(), scores(p));
        out.push((vec![Step::GemmArrays { call: sc, arrays: sc_arr, batch }], "gemm_attn_scores", flops));
        let softmax_args = vec![Arg::Ptr(Addr::Scratch(p)), Arg::Ptr(lse), Arg::I32(t as i32), Arg::I64(nrows), Arg::F32(scale)];
        let Some((dout, dqkv)) = grads.filter(|_| !a.forward) else {
            let f = self.native.attn_softmax;
            out.push((vec![Step::Kernel { f, grid: rows_grid, block: [256, 1, 1], shared: 0, args: softmax_args }], "attn_softmax", 0));
            // out = p v (cuBLAS A = v, B = p).
            let pv = row_major(t, d, t, false, false, t, 3 * c, c)?;
            let pv_arr = arrays(self, vs, scores(p), head(out_v, c, 0));
            out.push((vec![Step::GemmArrays { call: pv, arrays: pv_arr, batch }], "gemm_attn_values", flops));
            return Ok(out);
        };
        let f = self.native.attn_probs;
        out.push((vec![Step::Kernel { f, grid: rows_grid, block: [256, 1, 1], shared: 0, args: softmax_args }], "attn_softmax", 0));
        // dp = dout v^T (cuBLAS A = v, B = dout).
        let dpc = row_major(t, t, d, false, true, c, 3 * c, t)?;
        let dp_arr = arrays(self, vs.clone(), head(dout, c, 0), scores(dp));
        out.push((vec![Step::GemmArrays { call: dpc, arrays: dp_arr, batch }], "gemm_attn_dp", flops));
        let args = vec![
            Arg::Ptr(Addr::Scratch(p)),
            Arg::Ptr(Addr::Scratch(dp)),
            Arg::Ptr(out_v),
            Arg::Ptr(dout),
            Arg::I32(t as i32),
            Arg::I32(h as i32),
            Arg::I32(d as i32),
            Arg::I64(nrows),
            Arg::F32(scale),
        ];
        let f = self.native.attn_dscores;
        out.push((vec![Step::Kernel { f, grid: rows_grid, block: [256, 1, 1], shared: 0, args }], "attn_softmax_grad", 0));
        // dq = ds k, dk = ds^T q, dv = p^T dout.
        let dq = row_major(t, d, t, false, false, t, 3 * c, 3 * c)?;
        let dk = row_major(t, d, t, true, false, t, 3 * c, 3 * c)?;
        let dv = row_major(t, d, t, true, false, t, c, 3 * c)?;
        let dq_arr = arrays(self, ks, scores(dp), head(dqkv, 3 * c, 0));
        let dk_arr = arrays(self, qs, scores(dp), head(dqkv, 3 * c, 1));
        let dv_arr = arrays(self, head(dout, c, 0), scores(p), head(dqkv, 3 * c, 2));
        let steps = vec![
            Step::GemmArrays { call: dq, arrays: dq_arr, batch },
            Step::GemmArrays { call: dk, arrays: dk_arr, batch },
            Step::GemmArrays { call: dv, arrays: dv_arr, batch },
        ];
        out.push((steps, "gemm_attn_dqkv", 3 * flops));
        Ok(out)
    }
}
