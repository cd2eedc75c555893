//! The sampling decoder's kernels as CUDA C, without a GPU: every kernel of the key/value-cache
//! decoder programs (a prefill and a one-token step, tiny and 124M) generates, including the
//! index kernels that build its gather rows, and (when libnvrtc can be loaded) compiles.

mod common;

use fusec_codegen_cuda::{nvrtc, KernelSource};
use fusec_ir::Bindings;
use fusec_models::{decoder_graph, Gpt2Config};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};

/// Every distinct kernel source of the decoder of `preset` for `new` positions.
fn decoder_sources(preset: &str, new: usize) -> Vec<KernelSource> {
    let cfg = Gpt2Config::preset(preset).unwrap();
    let bind = Bindings::default();
    let g = compile(&decoder_graph(&cfg, new).unwrap(), "schedule", Mode::Forward, &PipelineOptions::default(), &bind).unwrap().graph;
    common::distinct_sources(&g, &bind).0
}

#[test]
fn every_decoder_kernel_generates_and_compiles_with_nvrtc() {
    let mut all = vec![];
    for (preset, new) in [("tiny", 1), ("tiny", 7), ("d12", 1), ("d12", 9)] {
        let sources = decoder_sources(preset, new);
        let names: Vec<&str> = sources.iter().map(|s| s.name.as_str()).collect();
        assert!(names.iter().any(|n| n.contains("softmax")), "{preset} {new}: {names:?}");
        assert!(names.iter().any(|n| n.contains("select")), "{preset} {new}: the cache update: {names:?}");
        all.extend(sources);
    }
    let mut c = match nvrtc::Compiler::with_cache_dir("sm_80", None) {
        Ok(c) => c,
        Err(e) => return fusec_ir::testkit::skip("NVRTC compile of the decoder's kernels", &e),
    };
    let items: Vec<(String, String)> = all.iter().map(|s| (s.ident.clone(), s.source.clone())).collect();
    for (s, r) in all.iter().zip(c.compile_all(&items)) {
        let img = r.unwrap_or_else(|e| panic!("{e}\n--- source of {} ---\n{}", s.name, s.source));
        assert!(!img.bytes.is_empty(), "{}", s.name);
    }
}
