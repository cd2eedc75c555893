//! The GPT-2 decoder with a key/value cache: one graph per number of new positions `S` (the
//! prompt's length for the prefill, 1 for a decoding step), built from the same pieces as
//! [`crate::build_gpt2`] and compiled by the same pipeline (`Mode::Forward`).
//!
//! Inputs: the new tokens (`i32[S]`, named by [`decoder_tokens_input`]), `pos` (`f32[]`: the
//! position of the first new token, the number of tokens already cached) and, per layer `l`,
//! the caches `cache.k.l` and `cache.v.l` (`f32[H, Tmax, D]`, `Tmax` the model's maximum
//! sequence length, `D = C / H`). Outputs: `logits` (`f32[1, Vp]`, the last new position's)
//! and the updated caches under the same names, which the executors write back in place (the
//! mechanism AdamW's parameters use: an output named like an input).
//!
//! Only ops every compiled target runs are used. Per layer, with `qkv: [S, 3C]` viewed as
//! `[3SH, D]` rows (row `s*3H + j*H + h` is head `h` of the query, key or value `j` of position
//! `s`), `gather` picks each head's rows; the cache update is `select(pos <= t < pos + S,
//! new rows, cache)`; scores are a batched `matmul` over all `Tmax` cached keys, masked to keys
//! `t <= pos + s`, then `softmax` and a batched `matmul` with the values; a last `gather` puts
//! the heads back in `[S, C]` order. Index arithmetic is in f32 (exact below 2^24) and cast to
//! i32.

use fusec_ir::{BinaryOp, CmpOp, DType, Graph, Op, Shape, Type, ValueId};

use crate::gpt2::{Builder, Params};
use crate::Gpt2Config;

/// The name of the new-tokens input of the decoder for `new` positions: `token` for a decoding
/// step (one position), `prompt` for a prefill of several.
pub fn decoder_tokens_input(new: usize) -> &'static str {
    if new == 1 {
        "token"
    } else {
        "prompt"
    }
}

/// The key cache input (and output) of layer `layer`.
pub fn key_cache_name(layer: usize) -> String {
    format!("cache.k.{layer}")
}

/// The value cache input (and output) of layer `layer`.
pub fn value_cache_name(layer: usize) -> String {
    format!("cache.v.{layer}")
}

/// The shape of every cache: `[heads, max_seq, channels / heads]`.
pub fn cache_shape(cfg: &Gpt2Config) -> [usize; 3] {
    [cfg.heads, cfg.max_seq, cfg.channels / cfg.heads]
}

/// Builds the decoder graph for `new` new positions (1..=max_seq) of a GPT-2 of config `cfg`
/// (which must pass [`Gpt2Config::validate`]).
pub fn decoder_graph(cfg: &Gpt2Config, new: usize) -> Result<Graph, String> {
    cfg.validate()?;
    if new == 0 || new > cfg.max_seq {
        return Err(format!("a decoder step takes 1..={} new positions, not {new}", cfg.max_seq));
    }
    // Gather rows are computed in f32: exact below 2^24.
    let rows = cfg.max_seq.checked_mul(3 * cfg.heads).filter(|&r| r < 1 << 24);
    if rows.is_none() {
        return Err(format!("a decoder needs 3 x max_seq x heads below 2^24 (f32 indices); {cfg} has more"));
    }
    let mut d = Decoder { b: Builder { g: Graph::new(&format!("gpt2_decode_{new}"), &[]) }, cfg: *cfg, s: new as u64 };
    let p = d.b.params(cfg);
    let tokens = d.b.input(decoder_tokens_input(new), DType::I32, Shape::lits(&[d.s]).dims());
    let pos = d.b.input("pos", DType::F32, &[]);

    // Embeddings of the new tokens at positions pos..pos+S.
    let tok_emb = d.b.g.add1(Op::Gather, &[p.wte, tokens]);
    let at = d.iota(&[d.s], 0);
    let pos_b = d.b.broadcast_to(pos, at, true);
    let positions = d.b.bin(BinaryOp::Add, at, pos_b);
    let positions = d.b.g.add1(Op::Cast { to: DType::I32 }, &[positions]);
    let pos_emb = d.b.g.add1(Op::Gather, &[p.wpe, positions]);
    let mut x = d.b.bin(BinaryOp::Add, tok_emb, pos_emb);
    let c = cfg.channels as u64;
    let mut caches = vec![];
    for l in 0..cfg.layers {
        let ln1 = d.b.layernorm(x, p.ln1w[l], p.ln1b[l], c);
        let qkv = d.b.linear(ln1, p.qkvw[l], p.qkvb[l]);
        let (att, k, v) = d.attention(qkv, pos, l);
        caches.push((key_cache_name(l), k));
        caches.push((value_cache_name(l), v));
        let proj = d.b.linear(att, p.attprojw[l], p.attprojb[l]);
        x = d.b.bin(BinaryOp::Add, x, proj);
        let ln2 = d.b.layernorm(x, p.ln2w[l], p.ln2b[l], c);
        let fc = d.b.linear(ln2, p.fcw[l], p.fcb[l]);
        let act = d.b.g.add1(Op::Gelu, &[fc]);
        let fcproj = d.b.linear(act, p.fcprojw[l], p.fcprojb[l]);
        x = d.b.bin(BinaryOp::Add, x, fcproj);
    }
    let logits = d.logits(x, &p);
    d.b.g.output("logits", logits);
    for (name, v) in caches {
        d.b.g.output(&name, v);
    }
    Ok(d.b.g)
}

/// The builder of one decoder graph: GPT-2's pieces plus the cache and index arithmetic.
struct Decoder {
    b: Builder,
    cfg: Gpt2Config,
    /// New positions.
    s: u64,
}

impl Decoder {
    /// `f32` index along `axis` of a tensor of shape `dims`.
    fn iota(&mut self, dims: &[u64], axis: usize) -> ValueId {
        self.b.g.add1(Op::Iota { axis, ty: Type::new(DType::F32, Shape::lits(dims)) }, &[])
    }

    /// An f32 constant of shape `dims`.
    fn konst(&mut self, value: f64, dims: &[u64]) -> ValueId {
        self.b.g.add1(Op::Const { value, ty: Type::new(DType::F32, Shape::lits(dims)) }, &[])
    }

    /// `a * k + b` with an f32 constant `k` (index arithmetic).
    fn mul_add(&mut self, a: ValueId, k: f64, b: ValueId) -> ValueId {
        let dims: Vec<u64> = self.dims(a);
        let kk = self.konst(k, &dims);
        let ak = self.b.bin(BinaryOp::Mul, a, kk);
        self.b.bin(BinaryOp::Add, ak, b)
    }

    /// `x + k` with an f32 constant `k`.
    fn add_const(&mut self, x: ValueId, k: f64) -> ValueId {
        let dims = self.dims(x);
        let kk = self.konst(k, &dims);
        self.b.bin(BinaryOp::Add, x, kk)
    }

    /// `min(max(x, lo), hi)` with constants.
    fn clamp(&mut self, x: ValueId, lo: f64, hi: f64) -> ValueId {
        let dims = self.dims(x);
        let (l, h) = (self.konst(lo, &dims), self.konst(hi, &dims));
        let m = self.b.bin(BinaryOp::Max, x, l);
        self.b.bin(BinaryOp::Min, m, h)
    }

    /// The literal dims of `v` (every decoder shape is literal).
    fn dims(&self, v: ValueId) -> Vec<u64> {
        self.b.g.ty(v).shape.dims().iter().map(|d| d.as_lit().unwrap_or(1)).collect()
    }

    /// `t - pos` along `axis` of a tensor of shape `dims`: a cache row's offset from the first
    /// new position.
    fn offset_from_pos(&mut self, dims: &[u64], axis: usize, pos: ValueId) -> ValueId {
        let t = self.iota(dims, axis);
        let pos_b = self.b.broadcast_to(pos, t, true);
        self.b.bin(BinaryOp::Sub, t, pos_b)
    }

    /// Rows of `table` (`[rows, D]`) at the f32 indices `idx` (cast to i32): `idx.shape + [D]`.
    fn gather_rows(&mut self, table: ValueId, idx: ValueId) -> ValueId {
        let idx = self.b.g.add1(Op::Cast { to: DType::I32 }, &[idx]);
        self.b.g.add1(Op::Gather, &[table, idx])
    }

    /// Which new position each of `dims` reads along `axis`: `clamp(t - pos, 0, S - 1)` (f32),
    /// where `t` is the absolute position: the index along `axis` itself for a cache row, or
    /// `pos` plus it for a new position (`absolute` false). Every gather index is built from
    /// this, so all of them read `pos` (index arithmetic without an operand has no kernel).
    fn new_position(&mut self, dims: &[u64], axis: usize, absolute: bool, pos: ValueId) -> ValueId {
        let mut t = self.iota(dims, axis);
        if !absolute {
            let pos_b = self.b.broadcast_to(pos, t, true);
            t = self.b.bin(BinaryOp::Add, t, pos_b);
        }
        let pos_b = self.b.broadcast_to(pos, t, true);
        let u = self.b.bin(BinaryOp::Sub, t, pos_b);
        self.clamp(u, 0.0, (self.s - 1) as f64)
    }

    /// Head `h` of part `part` (0 queries, 1 keys, 2 values) of new position
    /// [`Decoder::new_position`] for every `[h, t]` of `[H, rows]`: rows of `qkv_rows` as
    /// `[H, rows, D]`. `cache_rows`: `t` is a cache row (`rows` = Tmax), else the `t`-th new
    /// position (`rows` = S).
    fn heads(&mut self, qkv_rows: ValueId, part: u64, rows: u64, cache_rows: bool, pos: ValueId) -> ValueId {
        let h = self.cfg.heads as u64;
        let dims = [h, rows];
        let s = self.new_position(&dims, 1, cache_rows, pos);
        let head = self.iota(&dims, 0);
        let row = self.mul_add(s, (3 * h) as f64, head);
        let row = self.add_const(row, (part * h) as f64);
        self.gather_rows(qkv_rows, row)
    }

    /// The cache of part `part` (1 keys, 2 values) of layer `layer` with the new positions
    /// written into rows `pos..pos+S`.
    fn update_cache(&mut self, qkv_rows: ValueId, part: u64, pos: ValueId, name: &str) -> ValueId {
        let [h, tmax, hs] = cache_shape(&self.cfg).map(|x| x as u64);
        let cache = self.b.input(name, DType::F32, Shape::lits(&[h, tmax, hs]).dims());
        let new_rows = if self.s == 1 {
            // One new position: its rows, broadcast over the cache's positions.
            let one = self.heads(qkv_rows, part, 1, false, pos);
            self.b.g.add1(Op::Broadcast { dims: vec![0, 1, 2], shape: Shape::lits(&[h, tmax, hs]) }, &[one])
        } else {
            self.heads(qkv_rows, part, tmax, true, pos)
        };
        // Row t is new when t - pos is its own clamp to 0..S-1.
        let u = self.offset_from_pos(&[h, tmax, hs], 1, pos);
        let clamped = self.clamp(u, 0.0, (self.s - 1) as f64);
        let inside = self.b.g.add1(Op::Compare(CmpOp::Eq), &[clamped, u]);
        self.b.g.add1(Op::Select, &[inside, new_rows, cache])
    }

    /// Attention of the new positions over the cache of layer `layer` after writing their keys
    /// and values into it: (`[S, C]`, the new key cache, the new value cache).
    fn attention(&mut self, qkv: ValueId, pos: ValueId, layer: usize) -> (ValueId, ValueId, ValueId) {
        let (s, c) = (self.s, self.cfg.channels as u64);
        let [h, tmax, hs] = cache_shape(&self.cfg).map(|x| x as u64);
        let qkv_rows = self.b.g.add1(Op::Reshape { shape: Shape::lits(&[3 * s * h, hs]) }, &[qkv]);
        let q = self.heads(qkv_rows, 0, s, false, pos);
        let k = self.update_cache(qkv_rows, 1, pos, &key_cache_name(layer));
        let v = self.update_cache(qkv_rows, 2, pos, &value_cache_name(layer));
        let scores = self.b.g.add1(Op::MatMul { trans_a: false, trans_b: true }, &[q, k]);
        let scale = self.konst(1.0 / (hs as f64).sqrt(), &[h, s, tmax]);
        let scaled = self.b.bin(BinaryOp::Mul, scores, scale);
        // Key t is visible to new position i when t <= pos + i.
        let key = self.iota(&[h, s, tmax], 2);
        let query = self.iota(&[h, s, tmax], 1);
        let pos_b = self.b.broadcast_to(pos, query, true);
        let last_visible = self.b.bin(BinaryOp::Add, query, pos_b);
        let visible = self.b.g.add1(Op::Compare(CmpOp::Le), &[key, last_visible]);
        let hidden = self.konst(f64::NEG_INFINITY, &[h, s, tmax]);
        let masked = self.b.g.add1(Op::Select, &[visible, scaled, hidden]);
        let probs = self.b.g.add1(Op::Softmax, &[masked]);
        let out = self.b.g.add1(Op::MatMul { trans_a: false, trans_b: false }, &[probs, v]);
        let att = if s == 1 {
            self.b.g.add1(Op::Reshape { shape: Shape::lits(&[1, c]) }, &[out])
        } else {
            // [H, S, D] → [S, H, D]: row h*S + s of the [H*S, D] view goes to row s*H + h.
            let rows = self.b.g.add1(Op::Reshape { shape: Shape::lits(&[h * s, hs]) }, &[out]);
            let pos_in = self.new_position(&[s, h], 0, false, pos);
            let head = self.iota(&[s, h], 1);
            let idx = self.mul_add(head, s as f64, pos_in);
            let back = self.gather_rows(rows, idx);
            self.b.g.add1(Op::Reshape { shape: Shape::lits(&[s, c]) }, &[back])
        };
        (att, k, v)
    }

    /// The logits `[1, Vp]` of the last new position of the residual stream `x: [S, C]`.
    fn logits(&mut self, x: ValueId, p: &Params) -> ValueId {
        let last = if self.s == 1 {
            x
        } else {
            let idx = self.b.g.add1(Op::Const { value: (self.s - 1) as f64, ty: Type::new(DType::I32, Shape::lits(&[1])) }, &[]);
            self.b.g.add1(Op::Gather, &[x, idx])
        };
        let lnf = self.b.layernorm(last, p.lnfw, p.lnfb, self.cfg.channels as u64);
        self.b.g.add1(Op::MatMul { trans_a: false, trans_b: true }, &[lnf, p.wte])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Gpt2Config {
        Gpt2Config { layers: 2, heads: 2, channels: 8, vocab: 11, padded_vocab: 16, max_seq: 6 }
    }

    #[test]
    fn the_decoder_graphs_verify_with_their_inputs_and_outputs() {
        for new in [1, 3, 6] {
            let g = decoder_graph(&cfg(), new).unwrap();
            fusec_ir::verify::verify(&g).unwrap();
            let inputs: Vec<&str> = g.inputs().into_iter().map(|(n, _)| n).collect();
            assert!(inputs.contains(&decoder_tokens_input(new)) && inputs.contains(&"pos") && inputs.contains(&"cache.v.1"));
            let outs: Vec<&str> = g.outputs.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(outs, ["logits", "cache.k.0", "cache.v.0", "cache.k.1", "cache.v.1"]);
            assert_eq!(g.ty(g.outputs[0].1).shape, Shape::lits(&[1, 16]));
            assert_eq!(g.ty(g.outputs[1].1).shape, Shape::lits(&[2, 6, 4]));
        }
    }

    #[test]
    fn new_positions_outside_the_window_are_refused() {
        assert!(decoder_graph(&cfg(), 0).unwrap_err().contains("1..=6"));
        assert!(decoder_graph(&cfg(), 7).unwrap_err().contains("1..=6"));
    }
}
