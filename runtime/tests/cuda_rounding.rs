//! bf16 rounding in generated CUDA kernels is the interpreter's, bit for bit: narrowing to bf16
//! (a bf16 store) and rounding inside f32 code (`cast` to bf16 and back), on the values where
//! round-to-nearest-even is easy to get wrong — ties, subnormals, the largest finite values that
//! round to infinity, signed zeros, infinities — and on random bit patterns. On sm_80+ the
//! kernels narrow with the hardware's `cvt.rn.bf16.f32` (see `fusec_codegen_cuda::prelude`).
//! NaN is checked separately: NaN in, NaN out.
//!
//! Without a GPU only the graph is checked against the interpreter's own rules. With one:
//! `cargo test -p fusec-runtime --test cuda_rounding -- --ignored`.

use std::collections::HashMap;

use fusec_ir::interp::{self, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::{Bindings, DType, Graph};
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::cuda::{CudaExecutor, CudaOptions};
use fusec_runtime::executor::Executor;
use fusec_runtime::programs::{Program, RunPrograms};

/// Random bit patterns checked besides the special values.
const RANDOM: usize = 1 << 16;

/// One kernel: `x` narrowed to a bf16 result, and `x` rounded to bf16 inside f32 code.
fn graph(n: usize) -> Graph {
    let text = format!(
        "graph rounding() {{
  %0 = input \"x\" : f32[{n}]
  %1, %2 = kernel \"round_bf16\" %0 : bf16[{n}], f32[{n}] {{
    %0 = input \"in0\" : f32[{n}]
    %1 = cast %0 : bf16[{n}]
    %2 = cast %1 : f32[{n}]
    output \"out0\" = %1
    output \"out1\" = %2
  }}
  output \"narrowed\" = %1
  output \"rounded\" = %2
}}"
    );
    fusec_ir::text::parse(&text, "rounding.graph").unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// The f32 inputs: round-to-nearest-even's hard cases, then random bit patterns (no NaN).
fn inputs() -> Vec<f32> {
    let special: [u32; 22] = [
        0x0000_0000,
        0x8000_0000, // signed zeros
        0x0000_0001,
        0x0000_7fff,
        0x0000_8000,
        0x0000_8001,
        0x0001_8000,
        0x007f_ffff, // subnormals, ties among them
        0x8000_8000,
        0x8001_8000, // negative subnormal ties
        0x3f80_8000,
        0x3f81_8000,
        0x3f80_7fff,
        0x3f80_8001, // ties to even around 1.0
        0x7f7f_7fff,
        0x7f7f_8000,
        0x7f7f_ffff,
        0xff7f_ffff, // largest finite: stays, or rounds to infinity
        0x7f80_0000,
        0xff80_0000, // infinities
        0x0080_0000,
        0x00ff_8000, // smallest normals
    ];
    let mut v: Vec<f32> = special.iter().map(|&b| f32::from_bits(b)).collect();
    let mut rng = Rng::new(11);
    while v.len() < special.len() + RANDOM {
        let x = f32::from_bits(rng.next_u64() as u32);
        if !x.is_nan() {
            v.push(x);
        }
    }
    v
}

/// The f32 bits of every element (a bf16 element widened), so signed zeros count.
fn bits(t: &Tensor) -> Vec<u32> {
    t.data.iter().map(|&x| (x as f32).to_bits()).collect()
}

fn run(n: usize, x: &[f32]) -> (HashMap<String, Tensor>, Vec<(String, Tensor)>) {
    let g = graph(n);
    let feeds = HashMap::from([("x".to_string(), Tensor::from_f32(vec![n], x))]);
    let outs = interp::run(&g, &Bindings::default(), &feeds, Rounding::F32).unwrap_or_else(|e| panic!("{e}"));
    (feeds, g.outputs.iter().map(|(n, _)| n.clone()).zip(outs).collect())
}

#[test]
fn the_interpreter_rounds_the_hard_cases_to_nearest_even() {
    let x = inputs();
    let (_, outs) = run(x.len(), &x);
    let narrowed = bits(&outs[0].1);
    assert_eq!(outs[0].1.dtype, DType::BF16);
    // Independent of the interpreter: round-to-nearest-even on the bits.
    for (i, xi) in x.iter().enumerate() {
        let u = xi.to_bits();
        let want = (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) << 16;
        assert_eq!(narrowed[i], want, "element {i}: {u:#010x}");
    }
    assert_eq!(bits(&outs[1].1), narrowed, "rounding inside f32 code equals narrowing");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_kernels_round_to_bf16_like_the_interpreter() {
    let mut x = inputs();
    x.extend([f32::NAN, -f32::NAN, f32::from_bits(0x7fa0_0001)]);
    let n = x.len();
    let (feeds, want) = run(n, &x);
    let run = RunPrograms {
        graphs: HashMap::from([(Program::Step, graph(n))]),
        bind: Bindings::default(),
        opts: PipelineOptions::default(),
        pass_runs: vec![],
    };
    let (mut ex, _) = CudaExecutor::new(&run, &CudaOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    for (name, t) in &feeds {
        ex.set(name, t.clone()).unwrap();
    }
    ex.run(Program::Step).unwrap();
    for (name, w) in &want {
        let got = ex.output(Program::Step, name).unwrap();
        let (g, w) = (bits(&got), bits(w));
        for i in 0..n {
            if x[i].is_nan() {
                assert!(f32::from_bits(g[i]).is_nan(), "`{name}` element {i}: NaN in, {:#010x} out", g[i]);
            } else {
                assert_eq!(g[i], w[i], "`{name}` element {i}: input {:#010x}", x[i].to_bits());
            }
        }
    }
}
