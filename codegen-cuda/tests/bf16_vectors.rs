//! Vector loads and stores of bf16 views (`uint2`/`uint4`) in generated kernels: which widths
//! the emitter picks for which rows (row, pointwise and column kernels), the 124M bf16 training
//! step's kernels, and (when libnvrtc can be loaded) that the vector paths compile to vector
//! instructions without local memory.

mod common;

use fusec_codegen_cuda::{kernel_source, nvrtc, KernelSource};
use fusec_ir::text::parse;
use fusec_ir::{Bindings, Op};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::amp::Precision;
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};

/// A kernel's source without the shared prelude.
fn body(src: &str) -> String {
    src.replacen(fusec_codegen_cuda::prelude::PRELUDE, "", 1)
}

/// The source of the one kernel of a graph written in the text form.
fn source(text: &str) -> KernelSource {
    let g = parse(text, "test.graph").unwrap_or_else(|e| panic!("{e:?}\n{text}"));
    let k = g.nodes.iter().find_map(|n| if let Op::Kernel(k) = &n.op { Some(k) } else { None }).expect("a kernel");
    kernel_source(k, &Bindings::default()).unwrap_or_else(|e| panic!("{e}"))
}

/// A LayerNorm backward over `[r, c]` reading bf16 `dy`, `x` and residual gradient, writing a
/// bf16 `dx` and accumulating f32 `grad.w`, `grad.b` (column reductions).
/// A kernel source as compiled below sm_90: without the code under `#if __CUDA_ARCH__ >= 900`
/// (a cluster team's body and its `__cluster_dims__`) up to its `#else` or `#endif`.
fn below_sm90(src: &str) -> String {
    let (mut out, mut rest) = (String::new(), src);
    while let Some((before, after)) = rest.split_once("#if __CUDA_ARCH__ >= 900\n") {
        out.push_str(before);
        let end = |m: &str| after.find(m).map(|i| i + m.len());
        let skip = match (end("#else\n"), end("#endif\n")) {
            (Some(e), Some(f)) => e.min(f),
            (e, f) => e.or(f).unwrap_or(after.len()),
        };
        rest = &after[skip..];
    }
    out + rest
}

fn layernorm_grad_bf16(r: u64, c: u64) -> KernelSource {
    let (rc, b) = (format!("[{r}, {c}]"), format!("bf16[{r}, {c}]"));
    let ins = format!(
        "%0 = input \"{{p}}0\" : {b}\n  %1 = input \"{{p}}1\" : {b}\n  %2 = input \"{{p}}2\" : f32[{c}]\n  %3 = input \"{{p}}3\" : f32[{r}]\n  %4 = input \"{{p}}4\" : f32[{r}]\n  %5 = input \"{{p}}5\" : {b}\n  %6 = input \"{{p}}6\" : f32[{c}]\n  %7 = input \"{{p}}7\" : f32[{c}]"
    );
    source(&format!(
        "graph g() {{
  {outer}
  %8, %9, %10 = kernel \"ln_grad_bf16\" %0, %1, %2, %3, %4, %5, %6, %7 : {b}, f32[{c}], f32[{c}] {{
    {inner}
    %8 = cast %0 : f32{rc}
    %9 = cast %1 : f32{rc}
    %10, %11, %12 = layernorm_grad %8, %9, %2, %3, %4 : f32{rc}, f32[{c}], f32[{c}]
    %13 = cast %5 : f32{rc}
    %14 = add %13, %10 : f32{rc}
    %15 = cast %14 : {b}
    %16 = add %6, %11 : f32[{c}]
    %17 = add %7, %12 : f32[{c}]
    output \"out0\" = %15
    output \"out1\" = %16
    output \"out2\" = %17
  }}
  output \"dx\" = %8
  output \"gw\" = %9
  output \"gb\" = %10
}}",
        outer = ins.replace("{p}", "x"),
        inner = ins.replace("{p}", "in").replace("\n  ", "\n    "),
    ))
}

/// A pointwise kernel over `[r, c]`: f32 `x * y` of a bf16 and an f32 operand, stored as bf16.
fn mul_cast_bf16(r: u64, c: u64) -> KernelSource {
    let (f, b) = (format!("f32[{r}, {c}]"), format!("bf16[{r}, {c}]"));
    source(&format!(
        "graph g() {{
  %0 = input \"x\" : {b}
  %1 = input \"y\" : {f}
  %2 = kernel \"mul_cast\" %0, %1 : {b} {{
    %0 = input \"in0\" : {b}
    %1 = input \"in1\" : {f}
    %2 = cast %0 : {f}
    %3 = mul %2, %1 : {f}
    %4 = cast %3 : {b}
    output \"out0\" = %4
  }}
  output \"z\" = %2
}}"
    ))
}

/// A softmax over the rows of a bf16 `[r, c]`, written as bf16.
fn softmax_bf16(r: u64, c: u64) -> KernelSource {
    let (f, b) = (format!("f32[{r}, {c}]"), format!("bf16[{r}, {c}]"));
    source(&format!(
        "graph g() {{
  %0 = input \"x\" : {b}
  %1 = kernel \"softmax_cast\" %0 : {b} {{
    %0 = input \"in0\" : {b}
    %1 = cast %0 : {f}
    %2 = softmax %1 : {f}
    %3 = cast %2 : {b}
    output \"out0\" = %3
  }}
  output \"y\" = %1
}}"
    ))
}

#[test]
fn bf16_softmax_rows_take_the_maximum_and_the_sum_in_one_online_pass() {
    // 64 columns: 8-column steps, the running maximum moved once a step; 37: a column at a time.
    for (c, step) in [(64, true), (37, false)] {
        let s = body(&softmax_bf16(16, c).source);
        assert!(s.contains("if (x > a") && s.contains("* fast_exp(a"), "{c}: the online update\n{s}");
        assert_eq!(s.matches("x = max_nan(x, x").count(), step as usize, "{c}\n{s}");
        // Two passes: the online one, then the output.
        assert_eq!(s.matches("team_max<").count() + s.matches("team_sum<").count(), 2, "{c}\n{s}");
    }
}

/// A bias gradient over `[r, c]`: the f32 column sums of a bf16 `dy` times an f32 `x`, and
/// the product stored as bf16 (a column kernel with an element store).
fn col_sum_bf16(r: u64, c: u64) -> KernelSource {
    let (f, b) = (format!("f32[{r}, {c}]"), format!("bf16[{r}, {c}]"));
    source(&format!(
        "graph g() {{
  %0 = input \"x\" : {b}
  %1 = input \"y\" : {f}
  %2, %3 = kernel \"mul_cast_reduce_sum\" %0, %1 : {b}, f32[{c}] {{
    %0 = input \"in0\" : {b}
    %1 = input \"in1\" : {f}
    %2 = cast %0 : {f}
    %3 = mul %2, %1 : {f}
    %4 = cast %3 : {b}
    %5 = reduce_sum %3 {{axes = [0]}} : f32[{c}]
    output \"out0\" = %4
    output \"out1\" = %5
  }}
  output \"z\" = %2
  output \"s\" = %3
}}"
    ))
}

/// Whether a source has bf16 vector accesses.
fn vectors(src: &str) -> bool {
    let b = body(src);
    b.contains("uint2") || b.contains("uint4")
}

#[test]
fn bf16_row_loops_move_eight_or_four_columns_a_thread() {
    // 768 columns, a warp a row, 24 register partials a lane: every pass 8 wide (16-byte
    // `uint4` for bf16, two `float4` for f32), partials of 8 adjacent columns.
    let s = body(&layernorm_grad_bf16(64, 768).source);
    assert!(s.contains("for (int k4 = 0; k4 < 3; ++k4) {\n      const int c0 = (lane + k4 * 32) * 8;"), "{s}");
    assert!(s.contains("const int c = c0 + j, k = k4 * 8 + j;"), "{s}");
    assert!(s.contains("q0 = *(const uint4*)&in0[r * 768 + c];"), "{s}");
    assert!(s.contains("const float4* vp = (const float4*)&in2[c]; q2[0] = vp[0]; q2[1] = vp[1];"), "gamma: two float4\n{s}");
    assert!(s.contains("bf16_to_f32(((unsigned short*)&q0)[j])"), "{s}");
    // The output pass too: three unrolled vector steps a lane (all loads in flight at once).
    assert_eq!(s.matches("for (int k4 = 0; k4 < 3; ++k4) {\n      const int c0 = (lane + k4 * 32) * 8;").count(), 2, "{s}");
    assert!(s.contains("((unsigned short*)&w") && s.contains("st_b32x4(&out0[r * 768 + c], w"), "{s}");
    // 48 partials a lane: in the warps' slices of shared memory, summed per block (in warp
    // order) and written from the same layout, one set a block.
    assert!(s.contains("for (int t = 1; t < 8; ++t) a = red_sum(a, s[t * 768]);"), "{s}");
    assert!(s.contains("const int c = (i % 32 + (i / 32 / 8) * 32) * 8 + (i / 32) % 8;"), "scratch from the same layout:\n{s}");
    assert!(s.contains("scratch[0 + blockIdx.x * 768ll + c] = a;"), "{s}");
    assert!(!s.contains("bf16_to_f32(in") && !s.contains("out0[r * 768 + c] = f32_to_bf16"), "no scalar bf16 access:\n{s}");

    // 384 columns: register partials 8 wide in two unrolled steps, the second only for the
    // lanes it does not take past the row (16 slots a reduction, 12 used); the output pass too.
    let s = body(&layernorm_grad_bf16(64, 384).source);
    assert!(s.contains("float p20[16];") && s.contains("const int c = c0 + j, k = k4 * 8 + j;"), "{s}");
    let two_steps = "for (int k4 = 0; k4 < 2; ++k4) {\n      const int c0 = (lane + k4 * 32) * 8;\n      if (c0 < 384) {";
    assert_eq!(s.matches(two_steps).count(), 2, "{s}");
    assert!(s.contains("q0 = *(const uint4*)&in0[r * 384 + c];") && s.contains("st_b32x4(&out0[r * 384 + c], w"), "{s}");
    assert!(s.contains("const int c = (lane + (k / 8) * 32) * 8 + k % 8;\n    if (c < 384)"), "{s}");

    // 36 columns: 4 wide (8-byte `uint2`), one guarded step.
    let s = body(&layernorm_grad_bf16(64, 36).source);
    assert!(s.contains("const int c0 = (lane + k4 * 32) * 4;\n      if (c0 < 36) {") && s.contains("st_b32x2(&out0[r * 36 + c], w"), "{s}");
    assert!(!s.contains("uint4") && s.contains("q0 = *(const uint2*)&in0[r * 36 + c];"), "{s}");

    // 1,600 columns (GPT-2 1.5B): per-warp partials would not fit registers or shared memory,
    // so a block of 256 takes a row, 8 columns a thread, 8 register partials a reduction, and
    // 512 blocks walk the rows.
    let s = body(&layernorm_grad_bf16(1024, 1600).source);
    assert!(s.contains("const int lane = threadIdx.x % 256;") && s.contains("if (team >= 512) return;"), "{s}");
    assert!(s.contains("float p20[8];") && s.contains("team_sum<256>"), "{s}");
    assert!(s.contains("const int c0 = (lane + k4 * 256) * 8;\n      if (c0 < 1600) {"), "{s}");
    assert!(!s.contains("p20[c] = "), "no partials in global memory:\n{s}");

    // 30 columns: scalar accesses only.
    let s = layernorm_grad_bf16(64, 30).source;
    assert!(!vectors(&s) && !s.contains("c0"), "{s}");
}

#[test]
fn bf16_pointwise_kernels_move_eight_or_four_elements_a_thread() {
    let k = mul_cast_bf16(64, 24);
    let s = &k.source;
    assert!(s.contains("* 256u + threadIdx.x) * 8u;") && s.contains("for (int j = 0; j < 8; ++j)"), "{s}");
    assert!(s.contains("q0 = *(const uint4*)&in0[r * 24 + c];") && s.contains("st_b32x4(&out0[r * 24 + c], w2);"), "{s}");
    assert_eq!(k.launches[0].grid, [1, 1, 1], "64 x 24 elements, 8 a thread");
    let k = mul_cast_bf16(64, 20);
    assert!(k.source.contains("* 256u + threadIdx.x) * 4u;") && k.source.contains("st_b32x2(&out0[r * 20 + c], w2);"), "{}", k.source);
    assert_eq!(k.launches[0].grid, [2, 1, 1], "64 x 20 elements, 4 a thread");
    let k = mul_cast_bf16(64, 6);
    assert!(!vectors(&k.source) && k.source.contains("out0[r * 6 + c] = f32_to_bf16("), "{}", k.source);
}

#[test]
fn bf16_column_kernels_move_eight_or_four_columns_a_thread() {
    // 768 columns: 8 a thread (bf16 `uint4`, f32 two `float4`), 96 column groups, blocks of 32
    // groups x 8 row slices, 8 rows a thread (2048 rows: 32 row chunks).
    let k = col_sum_bf16(2048, 768);
    let s = body(&k.source);
    assert_eq!(k.launches[0].grid, [3, 32, 1], "{:?}", k.launches);
    assert_eq!(k.launches[0].block, [32, 8, 1]);
    assert!(s.contains("if (g < 96) {\n    const int c0 = g * 8;"), "{s}");
    assert!(s.contains("for (long long r = r0 + y; r < r1; r += 8) {"), "{s}");
    assert!(s.contains("q0 = *(const uint4*)&in0[r * 768 + c];"), "{s}");
    assert!(s.contains("const float4* vp = (const float4*)&in1[r * 768 + c]; q1[0] = vp[0]; q1[1] = vp[1];"), "{s}");
    assert!(s.contains("bf16_to_f32(((unsigned short*)&q0)[j])") && s.contains("= f32_to_bf16(v"), "per-lane RNE:\n{s}");
    assert!(s.contains("st_b32x4(&out0[r * 768 + c], w"), "{s}");
    assert!(s.contains("p4[j] = red_sum(p4[j], v2);"), "{s}");
    assert!(s.contains("sh[y][threadIdx.x * 8 + j] = p4[j];") && s.contains("scratch[0 + (long long)blockIdx.y * 768 + c] = a;"), "{s}");
    assert!(!s.contains("bf16_to_f32(in") && !s.contains("out0[r * 768 + c] = f32_to_bf16"), "no scalar bf16 access:\n{s}");
    assert_eq!(k.scratch_bytes, 32 * 768 * 4, "one partial per column and row chunk");

    // 36 columns: 4 a thread (8-byte `uint2`, one `float4`).
    let s = body(&col_sum_bf16(64, 36).source);
    assert!(s.contains("const int c0 = g * 4;") && s.contains("q0 = *(const uint2*)&in0[r * 36 + c];"), "{s}");
    assert!(s.contains("st_b32x2(&out0[r * 36 + c], w") && !s.contains("uint4"), "{s}");

    // 30 columns: a column a thread, scalar accesses.
    let s = col_sum_bf16(64, 30).source;
    assert!(!vectors(&s) && s.contains("const int c0 = g * 1;") && s.contains("out0[r * 30 + c] = f32_to_bf16("), "{s}");
    assert!(s.contains("p4[0] = red_sum(p4[0], v2);"), "{s}");
}

/// `ks` compiled by NVRTC for sm_80 and sm_90 (cubins, checked), and its sm_90 PTX; `None` (a
/// skip) where NVRTC is missing.
fn compiled_ptx(ks: &KernelSource) -> Option<String> {
    if let Err(e) = nvrtc::available() {
        fusec_ir::testkit::skip("NVRTC compile tests", &e);
        return None;
    }
    for arch in ["sm_80", "sm_90"] {
        let img = nvrtc::compile(&ks.source, &ks.ident, arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(!img.ptx && !img.bytes.is_empty());
    }
    let ptx = nvrtc::compile(&ks.source, &ks.ident, "compute_90").unwrap_or_else(|e| panic!("{e}"));
    Some(String::from_utf8_lossy(&ptx.bytes).replace('\0', ""))
}

/// Every distinct kernel source of the 124M step (B=16, T=1024) at `precision`.
fn step_124m(precision: Precision) -> Vec<KernelSource> {
    let cfg = Gpt2Config::preset("d12").unwrap();
    let g = build_gpt2(&cfg, "d12");
    let mut bind = Bindings::default();
    bind.set("B", 16).set("T", 1024);
    let opts = PipelineOptions { precision, ..PipelineOptions::default() };
    common::distinct_sources(&compile(&g, "schedule", Mode::Step, &opts, &bind).unwrap().graph, &bind).0
}

/// A fused bf16 classifier over `[r, vp]` logits (`vocab` real columns), with a scalar
/// `dloss` broadcast to the rows or, with `per_row`, one `dloss` a row.
fn classifier_bf16(r: u64, vp: u64, vocab: u64, per_row: bool) -> KernelSource {
    let (b, f) = (format!("bf16[{r}, {vp}]"), format!("f32[{r}, {vp}]"));
    let (dt, dl) = if per_row { (format!("f32[{r}]"), "%2".to_string()) } else { ("f32[]".to_string(), "%4".to_string()) };
    let (n, g, c) = if per_row { (4, 5, 6) } else { (5, 6, 7) };
    let bcast = if per_row { String::new() } else { format!("    %4 = broadcast %2 {{dims = []}} : f32[{r}]\n") };
    source(&format!(
        "graph g() {{
  %0 = input \"logits\" : {b}
  %1 = input \"targets\" : i32[{r}]
  %2 = input \"dloss\" : {dt}
  %3, %4 = kernel \"cast_cross_entropy_with_grad\" %0, %1, %2 : f32[{r}], {b} {{
    %0 = input \"in0\" : {b}
    %1 = input \"in1\" : i32[{r}]
    %2 = input \"in2\" : {dt}
    %3 = cast %0 : {f}
{bcast}    %{n}, %{g} = cross_entropy_with_grad %3, %1, {dl} {{vocab = {vocab}}} : f32[{r}], {f}
    %{c} = cast %{g} : {b}
    output \"out0\" = %{n}
    output \"out1\" = %{c}
  }}
  output \"loss\" = %3
  output \"dlogits\" = %4
}}"
    ))
}

#[test]
fn only_the_exact_bf16_classifier_body_gets_the_hand_written_kernel() {
    let hand = |k: &KernelSource| k.source.contains("hand-written bf16 classifier");
    let k = classifier_bf16(5, 72, 70, false);
    assert!(hand(&k), "{}", k.source);
    assert!(k.source.contains("const int NCH = 72 / 8, FULL = 70 / 8;"), "{}", k.source);
    assert_eq!((k.launches[0].grid, k.launches[0].shared), ([5, 1, 1], 144));
    // One `dloss` a row, a padded vocabulary not a multiple of 8, rows over 99 KiB: generated.
    for k in [classifier_bf16(5, 72, 70, true), classifier_bf16(5, 68, 60, false), classifier_bf16(2, 50_696, 50_257, false)] {
        assert!(!hand(&k) && k.source.contains("team_max<"), "{}", k.source);
    }
}

#[test]
fn the_bf16_classifier_is_one_kernel_that_reads_each_row_once() {
    // GPT-2's bf16 classifier: each thread copies its 16-byte chunks of the row into shared
    // memory (`cp.async`) and reads back only those; three passes over the copy; the gradient
    // stored 16 bytes a thread, two values packed by one conversion.
    let bf = step_124m(Precision::Bf16);
    let ce = bf.iter().find(|s| s.name == "cast_cross_entropy_with_grad").expect("classifier");
    let src = body(&ce.source);
    for (what, n) in [
        ("const int NCH = 50304 / 8, FULL = 50257 / 8;", 1),
        ("cp.async.cg.shared.global [%0], [%1], 16;", 1),
        ("for (int k = lane; k < NCH; k += 512) {", 4),
        ("team_max<512>(", 1),
        ("team_sum<512>(", 1),
        ("st_b32x4(&out1[r * 50304 + c0], o);", 1),
        ("bf16_to_f32(x[tgt])", 1),
    ] {
        assert_eq!(src.matches(what).count(), n, "{what}\n{src}");
    }
    let Some(ptx) = compiled_ptx(ce) else { return };
    for what in ["cp.async.cg.shared.global", "cp.async.wait_group 0", "max.NaN.bf16x2", "cvt.rn.bf16x2.f32", "ex2.approx.ftz.f32"] {
        assert!(ptx.contains(what), "{what}\n{ptx}");
    }
    assert!(!ptx.contains(".local"), "no local memory\n{ptx}");
}

#[test]
fn the_124m_bf16_step_reads_and_writes_bf16_rows_16_bytes_a_thread() {
    let bf = step_124m(Precision::Bf16);
    let names: Vec<&str> = bf.iter().map(|s| s.name.as_str()).collect();
    let get = |name: &str| &bf.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name} in {names:?}")).source;
    // The fused classifier over bf16 logits [16384, 50304]: the hand-written kernel
    // (`classifier.rs`), a 512-thread block a row, the row staged once in shared memory.
    let ce = get("cast_cross_entropy_with_grad");
    assert!(ce.contains("hand-written bf16 classifier"), "{ce}");
    let rule = &bf.iter().find(|s| s.name == "cast_cross_entropy_with_grad").expect("classifier").launches[0];
    assert_eq!((rule.grid, rule.block, rule.shared), ([16384, 1, 1], [512, 1, 1], 50304 * 2));
    // The LayerNorm gradient's three column sums (24 partials a lane each): in each warp's
    // slice of shared memory, not 72 registers.
    let lg = bf.iter().find(|s| s.name == "cast_layernorm_grad_add_reduce_sum").expect("LayerNorm gradient");
    assert!(lg.source.contains("(float*)(stage + 0) + (threadIdx.x / 32) * 768 + lane;"), "{}", lg.source);
    assert_eq!(lg.launches[0].shared, 3 * 24 * 32 * 8 * 4);
    // The LayerNorm forward's bf16 output (the f32 passes of the mean and variance stay 4 wide).
    let ln = get("add_layernorm_cast");
    assert!(ln.contains("for (int k4 = 0; k4 < 6; ++k4) {\n      const int c0 = (lane + k4 * 32) * 4;"), "{ln}");
    assert!(ln.contains("for (int k4 = 0; k4 < 3; ++k4) {\n      const int c0 = (lane + k4 * 32) * 8;"), "{ln}");
    assert!(ln.contains("st_b32x4(&out3[r * 768 + c], w"), "{ln}");
    // AdamW's bf16 weight copies: 8 bytes a thread (the f32 segments keep one 4-wide body).
    assert!(get("adamw").contains("st_b32x2(&a"), "{}", get("adamw"));
    // Bias gradients (column kernels): 8 columns a thread, 16-byte loads and stores.
    let gg = get("gelu_grad_cast_reduce_sum_add");
    assert!(gg.contains("q0 = *(const uint4*)&in0[r * 3072 + c];") && gg.contains("st_b32x4(&out0[r * 3072 + c], w"), "{gg}");
    // The LayerNorm gradient sums the projection's bias gradient with its own column partials;
    // with gradient accumulation the residual gradient's bf16 copy is a flat kernel.
    let rc = get("cast");
    assert!(rc.contains("(const float4*)&in0[") && rc.contains("st_b32x4(&out0["), "{rc}");
    assert!(get("cast_reduce_sum_add").contains("q0 = *(const uint4*)&in0[r * 2304 + c];"));
    // fp32 kernels print no bf16 vectors.
    for s in step_124m(Precision::F32) {
        assert!(!vectors(&s.source), "{}", s.name);
        assert!(!body(&s.source).contains(" = fast_exp("), "{}", s.name);
    }
}

#[test]
fn bf16_vector_paths_compile_to_vector_instructions_without_local_memory() {
    if let Err(e) = nvrtc::available() {
        fusec_ir::testkit::skip("NVRTC compile tests", &e);
        return;
    }
    let mut sources = step_124m(Precision::Bf16);
    for c in [768, 192, 36, 30] {
        sources.push(layernorm_grad_bf16(64, c));
    }
    for c in [24, 20, 6] {
        sources.push(mul_cast_bf16(64, c));
    }
    for c in [768, 36, 30] {
        sources.push(col_sum_bf16(2048, c));
    }
    for c in [64, 37] {
        sources.push(softmax_bf16(16, c));
    }
    for s in &sources {
        let img =
            nvrtc::compile(&s.source, &s.ident, "sm_80").unwrap_or_else(|e| panic!("{e}\n--- source of {} ---\n{}", s.name, s.source));
        assert!(!img.ptx && !img.bytes.is_empty(), "{}: a CUBIN", s.name);
        if !vectors(&s.source) {
            continue;
        }
        // PTX (a virtual architecture): one vector instruction per vector load and store of the
        // source, and the 16-bit lanes of the registers are register moves, not a stack copy.
        let img = nvrtc::compile(&s.source, &s.ident, "compute_80").unwrap_or_else(|e| panic!("{e}"));
        assert!(img.ptx);
        let ptx = String::from_utf8_lossy(&img.bytes).replace('\0', "");
        assert!(!ptx.contains(".local"), "{}: local memory\n{ptx}", s.name);
        let count = |pat: &str| ptx.lines().filter(|l| l.trim_start().starts_with(pat)).count();
        let loads = |v: &str| count(&format!("ld.global.{v}")) + count(&format!("ld.global.nc.{v}"));
        let src = below_sm90(&body(&s.source));
        assert!(loads("v4.u32") >= src.matches("= *(const uint4*)&").count(), "{}: uint4 loads\n{ptx}", s.name);
        assert!(loads("v2.u32") >= src.matches("= *(const uint2*)&").count(), "{}: uint2 loads\n{ptx}", s.name);
        assert!(count("st.global.v4.b32") >= src.matches(" st_b32x4(").count(), "{}\n{ptx}", s.name);
        assert!(count("st.global.v2.b32") >= src.matches(" st_b32x2(").count(), "{}\n{ptx}", s.name);
        assert!(!ptx.contains("st.global.u16") && !ptx.contains("st.global.v2.u16"), "{}: no 2-byte stores of bf16 rows\n{ptx}", s.name);
    }
}

#[test]
fn the_f32_classifier_reads_its_rows_once_through_a_cluster_on_sm_90() {
    // GPT-2's fp32 classifier rows (50,304 f32 logits, three passes): on sm_90 a cluster of
    // eight blocks a row keeps the row in registers (seven float4 a thread) and reduces through
    // distributed shared memory; below sm_90 a block a row, as before.
    let f32 = step_124m(Precision::F32);
    let ce = f32.iter().find(|s| s.name == "cross_entropy_with_grad").expect("classifier");
    let src = body(&ce.source);
    assert!(src.contains("#if __CUDA_ARCH__ >= 900\n__cluster_dims__(8, 1, 1)\n#endif\n__launch_bounds__(256)"), "{src}");
    assert_eq!(ce.launches[0].grid, [16384 * 8, 1, 1]);
    let (cluster, classic) = src.split_once("cross_entropy_with_grad(").unwrap().1.split_once("#else\n").expect("two bodies");
    assert!(cluster.contains("const int lane = (int)cluster_rank() * 256 + threadIdx.x;"), "{cluster}");
    assert_eq!(cluster.matches("= *(const float4*)&in0[r * 50304 + c]").count(), 1, "one read of the row:\n{cluster}");
    assert!(cluster.contains("float4 rk0[7];") && cluster.contains("cluster_max<8>(") && cluster.contains("cluster_sum<8>("), "{cluster}");
    assert!(cluster.contains("    cluster_sync();\n  }"), "{cluster}");
    assert_eq!(classic.matches("= *(const float4*)&in0[r * 50304 + c]").count(), 3, "{classic}");
    assert_eq!(below_sm90(&src).matches("*(const float4*)&in0[").count(), 3);
    let Some(ptx) = compiled_ptx(ce) else { return };
    assert!(ptx.contains(".reqnctapercluster 8, 1, 1"), "{ptx}");
    assert!(ptx.contains("barrier.cluster.arrive.aligned") && ptx.contains("mapa.shared::cluster.u32"), "{ptx}");
    assert!(ptx.contains("ld.shared::cluster.f32") && !ptx.contains(".local"), "{ptx}");
}

#[test]
fn a_bf16_residual_layernorm_reads_its_rows_once_and_keeps_the_sum_for_its_later_passes() {
    // `bf16+residual`: the residual sum `x = round(round(proj + bias) + residual)` is computed
    // by the mean's pass and stashed as bf16 in registers (`sk0`, 3 vector steps of 8 columns
    // at C = 768) for the variance and output passes, which load no row view of their own.
    let res = step_124m(Precision::Bf16Residual);
    let stashed: Vec<&KernelSource> = res.iter().filter(|s| s.name == "add_cast_layernorm").collect();
    assert!(!stashed.is_empty(), "{:?}", res.iter().map(|s| &s.name).collect::<Vec<_>>());
    for s in stashed {
        let src = body(&s.source);
        assert!(src.contains("uint4 sk0[3];") && src.contains("((unsigned short*)&sk0[k4])[j] = f32_to_bf16(v"), "{src}");
        assert_eq!(src.matches("= bf16_to_f32(((unsigned short*)&sk0[k4])[j]);").count(), 2, "{src}");
        assert_eq!(src.matches("&in0[r * 768 + c]").count(), 1, "{src}");
        if let Some(ptx) = compiled_ptx(s) {
            assert!(!ptx.contains(".local"), "{}: local memory\n{ptx}", s.name);
        }
    }
}
