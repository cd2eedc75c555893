#[path = "kernels/harness.rs"]
mod harness;
use harness::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use fusec_codegen_cpu::KernelCompiler;
use fusec_ir::{DType, BinaryOp, Op};
struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 { ALLOCS.fetch_add(1, Ordering::Relaxed); System.alloc(l) }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) { System.dealloc(p, l) }
}
#[global_allocator]
static GLOBAL: Counting = Counting;
#[test]
fn probe() {
    let mut c = KernelCompiler::new().unwrap();
    let d = [s("B"), s("T"), l(256)];
    let mut k = Body::new();
    let a = k.input(DType::F32, &d);
    let r = k.input(DType::F32, &d);
    let w = k.input(DType::F32, &[l(256)]);
    let bias = k.input(DType::F32, &[l(256)]);
    let x = k.bin(BinaryOp::Add, a, r);
    let ln = k.g.add(Op::LayerNorm { eps: 1e-5 }, &[x, w, bias]);
    let kernel = k.kernel("add_layernorm", &[x, ln[0], ln[1], ln[2]]);
    let b = bind(8, 64);
    let ins = random_inputs(&kernel, &b, 21, 1, &[]);
    let ck = c.compile(&kernel, &b).unwrap();
    let bufs: Vec<Vec<u8>> = ins.iter().map(to_bytes).collect();
    let mut outs: Vec<Vec<u8>> = kernel.body.outputs.iter().map(|(_, v)| vec![0u8; kernel.body.ty(*v).bytes(&b).unwrap()]).collect();
    let ops: Vec<usize> = bufs.iter().map(|v| v.as_ptr() as usize).collect();
    let res: Vec<usize> = outs.iter_mut().map(|v| v.as_mut_ptr() as usize).collect();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    for threads in [1, 2] {
        pool.install(|| {
            let ops: Vec<*const u8> = ops.iter().map(|&p| p as *const u8).collect();
            let res: Vec<*mut u8> = res.iter().map(|&p| p as *mut u8).collect();
            for _ in 0..3 { unsafe { ck.run(&ops, &res, threads) }; }
            let before = ALLOCS.load(Ordering::SeqCst);
            for _ in 0..10 { unsafe { ck.run(&ops, &res, threads) }; }
            eprintln!("threads {threads}: {} allocs / 10 runs, segs {}", ALLOCS.load(Ordering::SeqCst) - before, ck.segments());
        });
    }
}
