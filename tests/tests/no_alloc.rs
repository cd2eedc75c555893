//! A CPU training step allocates nothing of its own: the arena is allocated once, launches are
//! built once, scratch buffers grow once. A counting global allocator checks it (its own test
//! binary), in fp32 and in bf16 on each bf16 product path. The one exception is outside fusec:
//! the `gemm` crate allocates its packing buffers (at most two) inside every call, so a launch
//! that calls it may allocate that much and every other launch must allocate nothing.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use fusec_codegen_cpu::gemm::crate_calls;
use fusec_codegen_cpu::isa::Isa;
use fusec_ir::interp::Tensor;
use fusec_ir::rng::Rng;
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::amp::Precision;
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::checkpoint::random_init;
use fusec_runtime::executor::Executor;
use fusec_runtime::params::params_from_checkpoint;
use fusec_runtime::programs::Program;
use fusec_runtime::train::init_state;

struct Counting;

static ALLOCS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn cpu_training_steps_allocate_nothing() {
    let bf16 = PipelineOptions { precision: Precision::Bf16, ..PipelineOptions::default() };
    let mut runs = vec![(PipelineOptions::default(), fusec_codegen_cpu::isa::current()), (bf16.clone(), Isa::Scalar)];
    if Isa::Avx512Bf16.supported() {
        runs.push((bf16.clone(), Isa::Avx512Bf16));
    }
    if Isa::Amx.supported() {
        runs.push((bf16, Isa::Amx));
    }
    for (opts, isa) in runs {
        steps_allocate_nothing(&opts, isa);
    }
}

fn steps_allocate_nothing(opts: &PipelineOptions, isa: Isa) {
    let cfg = Gpt2Config { layers: 2, heads: 2, channels: 32, vocab: 100, padded_vocab: 128, max_seq: 32 };
    let (b, t) = (2, 32);
    let fwd = build_gpt2(&cfg, "t");
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    pool.install(|| {
        let (mut ex, step) = common::cpu_executor_with(&fwd, opts, b, t, 2, isa);
        init_state(&mut ex, &step, &params_from_checkpoint(&fwd, &random_init(&cfg, 1).unwrap()).unwrap()).unwrap();
        let mut rng = Rng::new(3);
        let toks: Vec<i32> = (0..b * t).map(|_| rng.below(100) as i32).collect();
        let (x, y) = (Tensor::from_i32(vec![b, t], &toks), Tensor::from_i32(vec![b, t], &toks));
        for (name, v) in [
            ("tokens", x),
            ("targets", y),
            ("dloss", Tensor::scalar(fusec_ir::DType::F32, 1.0)),
            ("lr", Tensor::scalar(fusec_ir::DType::F32, 1e-3)),
            ("bc1", Tensor::scalar(fusec_ir::DType::F32, 0.1)),
            ("bc2", Tensor::scalar(fusec_ir::DType::F32, 0.001)),
        ] {
            ex.set(name, v).unwrap();
        }
        // Warm-up: thread-local scratch and the thread pool grow to their sizes here.
        for _ in 0..3 {
            ex.run(Program::Step).unwrap();
            ex.zero_grads().unwrap();
        }
        let mut per_step = vec![];
        for _ in 0..5 {
            let (before, calls) = (ALLOCS.load(Ordering::SeqCst), crate_calls());
            let out = ex.run(Program::Step).unwrap();
            assert!(out.loss.unwrap().is_finite());
            ex.zero_grads().unwrap();
            per_step.push((ALLOCS.load(Ordering::SeqCst) - before, crate_calls() - calls));
        }
        eprintln!("{:?} {isa:?}: (allocations, gemm-crate calls) per step: {per_step:?}", opts.precision);
        // Per launch, allocations beyond the gemm crate's (at most 2 a call). rayon may grow a job
        // queue now and then, so a launch fails only if it allocates beyond that in every one of
        // several runs: an allocation made every step cannot hide.
        let mut excess: Vec<(String, usize)> = vec![];
        for run in 0..4 {
            let mut last = (ALLOCS.load(Ordering::SeqCst), crate_calls());
            let mut k = 0;
            ex.run_traced(
                Program::Step,
                |_| true,
                |name| {
                    let (allocs, calls) = (ALLOCS.load(Ordering::SeqCst) - last.0, (crate_calls() - last.1) as usize);
                    let extra = allocs.saturating_sub(2 * calls);
                    if run == 0 {
                        excess.push((name.to_string(), extra));
                    } else {
                        excess[k].1 = excess[k].1.min(extra);
                    }
                    k += 1;
                    last = (ALLOCS.load(Ordering::SeqCst), crate_calls());
                },
            )
            .unwrap();
        }
        assert!(excess.len() > 20);
        for (name, extra) in &excess {
            assert_eq!(*extra, 0, "{:?} {isa:?}: launch {name} allocates on every run", opts.precision);
        }
    });
}
