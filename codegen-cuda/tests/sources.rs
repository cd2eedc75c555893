//! The generated CUDA C, without a GPU: deterministic text, names, the shape of a few kernels
//! of the tiny GPT-2 training step, and (when libnvrtc can be loaded) that every generated
//! kernel of the tiny and 124M training steps and the hand-written module compile with NVRTC.

use std::collections::BTreeMap;

mod common;

use fusec_codegen_cuda::{flash, gemm, native, nvrtc, KernelSource};
use fusec_ir::{Bindings, DType};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};

/// Every distinct kernel source of a preset's training step under B x T.
fn step_sources(preset: &str, b: u64, t: u64) -> (Vec<KernelSource>, usize) {
    step_sources_with(preset, b, t, &PipelineOptions::default())
}

fn step_sources_with(preset: &str, b: u64, t: u64, opts: &PipelineOptions) -> (Vec<KernelSource>, usize) {
    let cfg = Gpt2Config::preset(preset).unwrap();
    let g = build_gpt2(&cfg, preset);
    let mut bind = Bindings::default();
    bind.set("B", b).set("T", t);
    common::distinct_sources(&compile(&g, "schedule", Mode::Step, opts, &bind).unwrap().graph, &bind)
}

fn by_name(sources: &[KernelSource]) -> BTreeMap<String, &KernelSource> {
    sources.iter().map(|s| (s.name.clone(), s)).collect()
}

/// Every generated kernel of the tiny GPT-2's training step (B=2, T=8) as CUDA C, without the
/// shared prelude: any change to the generated code shows up in review.
#[test]
fn tiny_step_cuda_sources_snapshot() {
    let (sources, _) = step_sources("tiny", 2, 8);
    let mut text = String::new();
    for s in &sources {
        let launches: Vec<String> = s.launches.iter().map(|l| format!("{} grid {:?} block {:?}", l.entry, l.grid, l.block)).collect();
        text.push_str(&format!("// ===== {} ({}; scratch {} B)\n", s.name, launches.join(", "), s.scratch_bytes));
        text.push_str(&s.source.replacen(fusec_codegen_cuda::prelude::PRELUDE, "", 1));
    }
    insta::assert_snapshot!("tiny_step_cuda", text);
}

#[test]
fn sources_are_deterministic_and_shared_across_layers() {
    let (a, kernels) = step_sources("tiny", 2, 8);
    let (b, _) = step_sources("tiny", 2, 8);
    assert_eq!(a, b, "same graph, same text");
    // 18 kernels in the tiny step, but identical layers give identical text.
    assert_eq!(kernels, 18);
    let names: Vec<&str> = a.iter().map(|s| s.name.as_str()).collect();
    assert!(a.len() < 15, "{} distinct sources: {names:?}", a.len());
    for s in &a {
        assert!(s.source.contains("void __launch_bounds__("), "{}", s.name);
        assert!(s.source.starts_with(&format!("// {} (fusec: ", s.name)));
        assert!(!s.source.contains("#include"), "no headers: NVRTC 11.8 has no cuda_bf16.h");
        for l in &s.launches {
            assert!(l.entry.starts_with(&s.ident), "entry {} of {}", l.entry, s.name);
            assert!(s.source.contains(&format!(" {}(", l.entry)));
            assert!(l.block.iter().product::<u32>() <= 1024 && l.grid.iter().all(|&g| g >= 1));
        }
    }
}

#[test]
fn layernorm_kernel_is_a_warp_per_row_with_three_passes() {
    let (s, _) = step_sources("tiny", 2, 8);
    let m = by_name(&s);
    let ln = m["add_layernorm"];
    assert_eq!(ln.launches.len(), 1);
    assert_eq!(ln.launches[0].block, [256, 1, 1]);
    assert_eq!(ln.launches[0].grid, [2, 1, 1], "16 rows, 8 warps a block");
    let src = &ln.source;
    // One 4-wide step a lane, lanes 16-31 past the row's end.
    let step = "const int c0 = (lane + k4 * 32) * 4;\n      if (c0 < 64) {";
    assert_eq!(src.matches(step).count(), 3, "mean, variance, output:\n{src}");
    // 16-byte accesses: the row operands, gamma/beta (broadcast over rows) and both outputs.
    assert!(src.contains("q0 = *(const float4*)&in0[r * 64 + c];") && src.contains("q2 = *(const float4*)&in2[c];"), "{src}");
    assert!(src.contains("*(float4*)&out1[r * 64 + c] = w5;"), "{src}");
    assert_eq!(src.matches("team_sum<32>(a").count(), 2);
    assert!(src.contains("const float v14 = 1.0f / sqrtf(v13);"), "exact rsqrt:\n{src}");
    assert!(src.contains("if (lane == 0) {\n      out2[r] = v7;\n      out3[r] = v14;"), "mean and rstd once per row:\n{src}");
    assert!(src.contains("const float v12 = 1e-5f;"));
}

#[test]
fn column_reductions_have_a_finalize_kernel() {
    let (s, _) = step_sources("tiny", 2, 8);
    let m = by_name(&s);
    let lg = m["layernorm_grad_add"];
    assert_eq!(lg.launches.iter().map(|l| l.entry.as_str()).collect::<Vec<_>>(), ["layernorm_grad_add", "layernorm_grad_add_fin"]);
    assert!(lg.source.contains("[4];\n#pragma unroll"), "dw, db partials in registers (64 columns, 4 a lane):\n{}", lg.source);
    assert!(lg.scratch_bytes >= 2 * 16 * 64 * 4);
    // The qkv bias gradient (LayerNorm gradients add the other bias gradients to their rows).
    let rs = s.iter().find(|k| k.name == "reduce_sum_add" && k.source.contains("if (g < 48) {")).expect("a 192-column bias gradient");
    assert_eq!(rs.launches[0].block, [32, 8, 1], "4 columns a thread, 8 row slices a block");
    assert!(rs.source.contains("for (long long r = r0 + y; r < r1; r += 8)"), "{}", rs.source);
    assert!(rs.source.contains("q0 = *(const float4*)&in0[r * 192 + c];"), "f32 rows 16 bytes a thread:\n{}", rs.source);
    assert!(rs.source.contains("for (int k = 1; k < 8; ++k) a = red_sum(a, sh[k][i]);"), "row slices in order");
    assert!(rs.source.contains("for (int j = 1; j < 32; ++j) v2 = red_sum(v2, f2[j][x]);"), "fixed combine order");
    assert!(rs.source.contains("f2[y][x] = red_sum(red_sum(a0, a1), red_sum(a2, a3));"), "four interleaved partial sums a slice");
    assert_eq!(rs.launches[1].block, [32, 32, 1], "32 columns by 32 slices of the partials");
    let ce = m["cross_entropy_with_grad"];
    assert!(ce.source.contains("expf(") && !ce.source.contains("__expf"), "accurate exp, no fast math");
    let adam = m["adamw"];
    assert_eq!(adam.launches.len(), 1, "one launch for every parameter's update");
    assert!(adam.param_table, "pointers through the table");
    // Tiny's 28 parameter tensors share four bodies (one or two gradient operands, addressed as
    // rows or as columns): each is compiled once, called through the segment table.
    assert!(adam.source.contains("adamw_g3(") && !adam.source.contains("adamw_g4("), "{}", adam.source);
    assert!(adam.source.contains("__constant__ unsigned long long adamw_first[29]"));
    assert!(adam.source.contains("if (adamw_first[mid] <= blockIdx.x) lo = mid;"));
}

#[test]
fn bf16_and_special_values_print_exactly() {
    assert!(fusec_codegen_cuda::prelude::PRELUDE.contains("(u + 0x7fffu + ((u >> 16) & 1u)) >> 16"));
    let (s, _) = step_sources("tiny", 2, 8);
    let ce = by_name(&s)["cross_entropy_with_grad"];
    assert!(ce.source.contains("__uint_as_float(0xff800000u)"), "-inf as bits");
    assert_eq!(fusec_codegen_cuda::ident("9 odd-name"), "k_9_odd_name");
}

#[test]
fn gemm_mapping_matches_a_row_major_product() {
    // c[m, n] = op(a) op(b), row-major, every transpose combination, against a naive product.
    let (m, n, k) = (3usize, 5usize, 4usize);
    let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] };
        let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] };
        let call = gemm::row_major(m, n, k, ta, tb, if ta { m } else { k }, if tb { k } else { n }, n).unwrap();
        let mut c = vec![0f32; m * n];
        gemm::colmajor_reference(&call, &b, &a, &mut c);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|p| at(i, p) * bt(p, j)).sum();
                assert!((c[i * n + j] - want).abs() < 1e-5, "ta {ta} tb {tb} ({i}, {j})");
            }
        }
    }
}

/// NVRTC, or `None` with the reason printed.
fn nvrtc_or_skip() -> Option<nvrtc::Compiler> {
    match nvrtc::Compiler::with_cache_dir("sm_80", None) {
        Ok(c) => Some(c),
        Err(e) => {
            fusec_ir::testkit::skip("NVRTC compile tests", &e);
            None
        }
    }
}

fn compile_all(c: &mut nvrtc::Compiler, sources: &[KernelSource]) {
    let items: Vec<(String, String)> = sources.iter().map(|s| (s.ident.clone(), s.source.clone())).collect();
    for (s, r) in sources.iter().zip(c.compile_all(&items)) {
        let img = r.unwrap_or_else(|e| panic!("{e}\n--- source of {} ---\n{}", s.name, s.source));
        assert!(!img.bytes.is_empty() && !img.ptx, "{}: a CUBIN", s.name);
    }
}

#[test]
fn every_kernel_of_the_tiny_and_124m_steps_compiles_with_nvrtc() {
    let Some(mut c) = nvrtc_or_skip() else { return };
    eprintln!("NVRTC {:?}", c.nvrtc_version());
    let img = nvrtc::compile(&native::source(), native::NAME, "sm_80").unwrap_or_else(|e| panic!("{e}"));
    assert!(!img.ptx);
    // The hand-written kernels as the build compiles them: each module with its own entries only.
    for (i, entries) in native::MODULES.iter().enumerate() {
        let src = native::module_source(i);
        let defined = src.lines().filter(|l| l.starts_with("extern \"C\"")).count();
        assert_eq!(defined, entries.len(), "module {i}");
        assert!(entries.iter().all(|e| src.contains(&format!(" {e}("))), "module {i}");
        let img = nvrtc::compile(&src, &native::module_name(i), "sm_80").unwrap_or_else(|e| panic!("{e}"));
        assert!(!img.ptx);
    }
    for d in [8, 16, 32, 64] {
        let img = nvrtc::compile(&flash::source(d, DType::F32), &flash::name(d, DType::F32), "sm_80").unwrap_or_else(|e| panic!("{e}"));
        assert!(!img.ptx, "flash attention, head size {d}: a CUBIN");
    }
    let (tiny, _) = step_sources("tiny", 4, 64);
    compile_all(&mut c, &tiny);
    let (big, _) = step_sources("d12", 16, 1024);
    compile_all(&mut c, &big);
    // Gradient clipping (a global norm: full reductions), weight decay, and bf16 matmul
    // operands (casts to bf16 inside the kernels).
    let mut opts = PipelineOptions::default();
    opts.adamw.clip = true;
    opts.adamw.weight_decay = 0.1;
    opts.precision = fusec_passes::amp::Precision::Bf16;
    let (other, _) = step_sources_with("tiny", 4, 64, &opts);
    assert!(other.iter().any(|s| s.source.contains("f32_to_bf16(")), "bf16 stores");
    compile_all(&mut c, &other);
    eprintln!("compiled {} tiny, {} 124M and {} clip/bf16 modules ({} NVRTC runs)", tiny.len(), big.len(), other.len(), c.compiled);
    eprintln!("slowest: {:?}", &c.times[..c.times.len().min(5)]);
    assert!(c.times.iter().all(|t| !t.1), "no disk cache here: every module compiled");
}

#[test]
fn flash_attention_on_bf16_storage_compiles_with_nvrtc() {
    // The bf16 modules: own names; bf16 tensor-core kernels at head sizes 16, 32, 64, 128, the
    // TF32 kernels on widened bf16 tiles at the other multiples of 8 up to 64; the f32 modules
    // keep f32 elements and need no prelude.
    assert_eq!(flash::name(64, DType::BF16), "fusec_flash_d64_bf16");
    assert_eq!(flash::name(64, DType::F32), "fusec_flash_d64");
    let (f32_src, bf16_src, d48_src) = (flash::source(64, DType::F32), flash::source(64, DType::BF16), flash::source(48, DType::BF16));
    assert!(f32_src.contains("typedef float elem;") && !f32_src.contains("f32_to_bf16"));
    assert!(bf16_src.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") && bf16_src.contains("ldmatrix"));
    assert!(d48_src.contains("typedef unsigned short elem;") && d48_src.contains("f32_to_bf16(a)"), "head size 48: TF32 kernels");
    assert!(flash::storage_supported(DType::BF16) && !flash::storage_supported(DType::F16));
    assert_eq!(flash::head_sizes(DType::F32), vec![8, 16, 24, 32, 40, 48, 56, 64]);
    assert_eq!(flash::head_sizes(DType::BF16), vec![8, 16, 24, 32, 40, 48, 56, 64, 128]);
    assert_eq!(flash::family(64, DType::BF16), Some(flash::Family::Bf16));
    assert_eq!(flash::family(48, DType::BF16), Some(flash::Family::Tf32));
    assert_eq!(flash::family(128, DType::F32), None);
    // bf16 launches: heaviest tiles first, in the grid's slowest dimension.
    let geo = flash::geometry(64, DType::BF16, "sm_80");
    assert!(geo.iter().all(|g| g.tiles_in_z && g.rows % 16 == 0));
    assert_eq!(geo[0].grid(1000, 12, 16), [12, 16, 1000u32.div_ceil(geo[0].rows)]);
    assert_eq!(flash::stats_bytes(64, DType::BF16, 2, 3, 5), 2 * 3 * 5 * 8);
    let Some(c) = nvrtc_or_skip() else { return };
    // sm_90a (the Hopper forward's wgmma) needs NVRTC 12 or newer.
    let mut archs = vec!["sm_80", "sm_90"];
    if c.nvrtc_version().0 >= 12 {
        archs.push("sm_90a");
    } else {
        // Not a skip of this test: its other architectures compile, and the Hopper branch's C++
        // goes to PTX below (its wgmma assembly is checked where NVRTC 12+ runs: the device's
        // GPU tests build these modules for sm_90a).
        eprintln!("sm_90a flash kernels not assembled: NVRTC {:?} predates sm_90a", c.nvrtc_version());
        let src = format!("#define __CUDA_ARCH_FEAT_SM90_ALL 1\n{}", flash::source(64, DType::BF16));
        let img = nvrtc::compile(&src, "hopper_branch", "compute_90").unwrap_or_else(|e| panic!("{e}"));
        let ptx = String::from_utf8_lossy(&img.bytes);
        assert!(ptx.contains("wgmma.mma_async") && flash::ENTRIES.iter().all(|e| ptx.contains(&format!(".entry {e}("))), "the Hopper kernels");
    }
    assert_eq!(flash::geometry(64, DType::BF16, "sm_90a")[0].threads, 128, "one warpgroup");
    for d in [8, 16, 32, 48, 64, 128] {
        let (src, name) = (flash::source(d, DType::BF16), flash::name(d, DType::BF16));
        for &arch in &archs {
            let img = nvrtc::compile(&src, &name, arch).unwrap_or_else(|e| panic!("{e}\n--- source of {name} ---\n{src}"));
            assert!(!img.ptx && !img.bytes.is_empty(), "bf16 flash attention, head size {d}, {arch}: a CUBIN");
        }
    }
}

#[test]
fn each_flash_entry_compiles_alone_as_its_own_module() {
    for (d, dt) in [(64, DType::BF16), (48, DType::BF16), (64, DType::F32)] {
        for (i, entry) in flash::ENTRIES.iter().enumerate() {
            let src = flash::entry_source(d, dt, i);
            let defined = |e: &str| src.lines().any(|l| l.starts_with("extern \"C\"") && l.contains(&format!(" {e}(")));
            // Every kernel is in the text; the guard keeps only `entry` (checked by NVRTC below).
            assert!(flash::ENTRIES.iter().all(|e| defined(e)), "{d} {dt}");
            assert!(src.starts_with(&format!("#define FUSEC_FLASH_ONLY {i}\n")), "{entry}");
        }
    }
    let Some(_) = nvrtc_or_skip() else { return };
    for (d, dt) in [(64, DType::BF16), (48, DType::BF16)] {
        for (i, entry) in flash::ENTRIES.iter().enumerate() {
            let name = format!("{}_{i}", flash::name(d, dt));
            let img = nvrtc::compile(&flash::entry_source(d, dt, i), &name, "compute_80").unwrap_or_else(|e| panic!("{e}"));
            let ptx = String::from_utf8_lossy(&img.bytes).to_string();
            let entries: Vec<&str> = flash::ENTRIES.iter().copied().filter(|e| ptx.contains(&format!(".entry {e}("))).collect();
            assert_eq!(entries, vec![*entry], "head size {d} {dt}: module {i}");
        }
    }
}

#[test]
fn the_disk_cache_hits_on_the_second_compiler() {
    let Some(_) = nvrtc_or_skip() else { return };
    let dir = std::env::temp_dir().join(format!("fusec-nvrtc-cache-test-{}", std::process::id()));
    let (tiny, _) = step_sources("tiny", 2, 8);
    let items: Vec<(String, String)> = tiny.iter().take(3).map(|s| (s.ident.clone(), s.source.clone())).collect();
    let mut a = nvrtc::Compiler::with_cache_dir("sm_80", Some(dir.clone())).unwrap();
    assert!(a.compile_all(&items).iter().all(|r| r.is_ok()));
    assert_eq!((a.compiled, a.disk_hits), (3, 0));
    assert!(a.compile_all(&items).iter().all(|r| r.is_ok()));
    assert_eq!(a.memory_hits, 3, "same process: no second compile");
    let mut b = nvrtc::Compiler::with_cache_dir("sm_80", Some(dir.clone())).unwrap();
    assert!(b.compile_all(&items).iter().all(|r| r.is_ok()));
    assert_eq!((b.compiled, b.disk_hits), (0, 3));
    let _ = std::fs::remove_dir_all(&dir);
}
