//! Test harness: building kernel bodies, running compiled kernels on tensors, and comparing
//! them with the interpreter.

use std::collections::HashMap;

use fusec_codegen_cpu::{CompiledKernel, KernelCompiler};
use fusec_ir::interp::{self, Rounding, Tensor};
use fusec_ir::rng::Rng;
use fusec_ir::{BinaryOp, Bindings, DType, Dim, Graph, Kernel, Op, Shape, Type, UnaryOp, ValueId};

/// Bindings of the two symbolic dims.
pub fn bind(b: u64, t: u64) -> Bindings {
    let mut x = Bindings::default();
    x.set("B", b).set("T", t);
    x
}

/// The body's input types, in order.
pub fn input_types(k: &Kernel) -> Vec<Type> {
    k.body.nodes.iter().filter_map(|n| if let Op::Input { ty, .. } = &n.op { Some(ty.clone()) } else { None }).collect()
}

/// The interpreter's results for the kernel node alone.
pub fn reference(k: &Kernel, b: &Bindings, ins: &[Tensor]) -> Vec<Tensor> {
    let mut g = Graph::new("ref", &["B", "T"]);
    let mut feeds = HashMap::new();
    let mut vs = vec![];
    for (i, ty) in input_types(k).into_iter().enumerate() {
        let name = format!("x{i}");
        vs.push(g.add1(Op::Input { name: name.clone(), ty }, &[]));
        feeds.insert(name, ins[i].clone());
    }
    let outs = g.add(Op::Kernel(Box::new(k.clone())), &vs);
    for (i, o) in outs.iter().enumerate() {
        g.output(&format!("y{i}"), *o);
    }
    interp::run(&g, b, &feeds, Rounding::F32).unwrap_or_else(|e| panic!("interpreter on `{}`: {e}", k.name))
}

/// Raw little-endian bytes of a tensor in its storage type.
pub fn to_bytes(t: &Tensor) -> Vec<u8> {
    match t.dtype {
        DType::F32 => t.data.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
        DType::BF16 => t.data.iter().flat_map(|&x| (((x as f32).to_bits() >> 16) as u16).to_le_bytes()).collect(),
        DType::I32 => t.data.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
        DType::F16 => panic!("f16"),
    }
}

pub fn from_bytes(dtype: DType, shape: Vec<usize>, b: &[u8]) -> Tensor {
    let data = match dtype {
        DType::F32 => b.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        DType::BF16 => b.chunks(2).map(|c| f32::from_bits((u16::from_le_bytes(c.try_into().unwrap()) as u32) << 16) as f64).collect(),
        DType::I32 => b.chunks(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        DType::F16 => panic!("f16"),
    };
    Tensor::new(dtype, shape, data)
}

/// Runs a compiled kernel on tensors.
pub fn execute(ck: &CompiledKernel, k: &Kernel, b: &Bindings, ins: &[Tensor], threads: usize) -> Vec<Tensor> {
    let in_bytes: Vec<Vec<u8>> = ins.iter().map(to_bytes).collect();
    let out_tys: Vec<Type> = k.body.outputs.iter().map(|(_, v)| k.body.ty(*v).clone()).collect();
    let mut out_bytes: Vec<Vec<u8>> = out_tys.iter().map(|t| vec![0xAAu8; t.bytes(b).unwrap()]).collect();
    let ops: Vec<*const u8> = in_bytes.iter().map(|v| v.as_ptr()).collect();
    let res: Vec<*mut u8> = out_bytes.iter_mut().map(|v| v.as_mut_ptr()).collect();
    unsafe { ck.run(&ops, &res, threads) };
    out_tys.iter().zip(&out_bytes).map(|(t, bytes)| from_bytes(t.dtype, interp::concrete_shape(t, b).unwrap(), bytes)).collect()
}

/// Runs a compiled kernel with result `j` written in place over operand `i` for each `(j, i)`
/// in `alias` (as the memory planner may arrange), returning the results.
pub fn execute_in_place(
    ck: &CompiledKernel,
    k: &Kernel,
    b: &Bindings,
    ins: &[Tensor],
    alias: &[(usize, usize)],
    threads: usize,
) -> Vec<Tensor> {
    let mut in_bytes: Vec<Vec<u8>> = ins.iter().map(to_bytes).collect();
    let out_tys: Vec<Type> = k.body.outputs.iter().map(|(_, v)| k.body.ty(*v).clone()).collect();
    let mut out_bytes: Vec<Vec<u8>> = out_tys.iter().map(|t| vec![0xAAu8; t.bytes(b).unwrap()]).collect();
    let ops: Vec<*const u8> = in_bytes.iter_mut().map(|v| v.as_mut_ptr() as *const u8).collect();
    let res: Vec<*mut u8> = out_bytes
        .iter_mut()
        .enumerate()
        .map(|(j, v)| match alias.iter().find(|(r, _)| *r == j) {
            Some(&(_, i)) => ops[i] as *mut u8,
            None => v.as_mut_ptr(),
        })
        .collect();
    unsafe { ck.run(&ops, &res, threads) };
    out_tys
        .iter()
        .enumerate()
        .map(|(j, t)| {
            let bytes = match alias.iter().find(|(r, _)| *r == j) {
                Some(&(_, i)) => &in_bytes[i],
                None => &out_bytes[j],
            };
            from_bytes(t.dtype, interp::concrete_shape(t, b).unwrap(), bytes)
        })
        .collect()
}

/// Random operands: normal floats (|x| for the inputs listed in `positive`), i32 in `0..int_hi`.
pub fn random_inputs(k: &Kernel, b: &Bindings, seed: u64, int_hi: u64, positive: &[usize]) -> Vec<Tensor> {
    let mut rng = Rng::new(seed);
    input_types(k)
        .iter()
        .enumerate()
        .map(|(i, ty)| {
            let mut t = Tensor::random(&mut rng, interp::concrete_shape(ty, b).unwrap(), ty.dtype, int_hi);
            if positive.contains(&i) {
                t.data.iter_mut().for_each(|x| *x = x.abs());
            }
            t
        })
        .collect()
}

/// Compiles, runs and compares a kernel with the interpreter.
pub fn check(c: &mut KernelCompiler, k: &Kernel, b: &Bindings, ins: &[Tensor]) {
    let ck = c.compile(k, b).unwrap_or_else(|e| panic!("compile `{}`: {e}\n{}", k.name, fusec_ir::text::print(&k.body)));
    let want = reference(k, b, ins);
    let got = execute(&ck, k, b, ins, 1);
    // A value rounded to bf16 inside the kernel may land one bf16 step away from the
    // interpreter's (f32 arithmetic, then rounding, against f64 then rounding): any result that
    // depends on one (a bias gradient summing bf16 values) gets bf16's tolerance.
    let rounds_bf16 = k.body.values.iter().any(|v| v.ty.dtype == DType::BF16);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let tol = if w.dtype == DType::BF16 || rounds_bf16 { 2e-2 } else { 1e-5 };
        if let Err(e) = g.check_close(w, tol, tol) {
            panic!("kernel `{}` result {i}: {e}\nbody:\n{}\nclif:\n{}", k.name, fusec_ir::text::print(&k.body), ck.clif);
        }
    }
}

/// A kernel body under construction.
pub struct Body {
    pub g: Graph,
    pub n_in: usize,
}

impl Body {
    pub fn new() -> Body {
        Body { g: Graph::new("k", &["B", "T"]), n_in: 0 }
    }
    pub fn input(&mut self, dtype: DType, dims: &[Dim]) -> ValueId {
        self.n_in += 1;
        let ty = Type::new(dtype, Shape::from(dims.to_vec()));
        self.g.add1(Op::Input { name: format!("in{}", self.n_in - 1), ty }, &[])
    }
    pub fn op(&mut self, op: Op, ins: &[ValueId]) -> ValueId {
        self.g.add1(op, ins)
    }
    pub fn bin(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> ValueId {
        self.op(Op::Binary(op), &[a, b])
    }
    pub fn un(&mut self, op: UnaryOp, a: ValueId) -> ValueId {
        self.op(Op::Unary(op), &[a])
    }
    pub fn bcast(&mut self, x: ValueId, dims: &[usize], to: &[Dim]) -> ValueId {
        self.op(Op::Broadcast { dims: dims.to_vec(), shape: Shape::from(to.to_vec()) }, &[x])
    }
    pub fn constant(&mut self, v: f64, dtype: DType, dims: &[Dim]) -> ValueId {
        self.op(Op::Const { value: v, ty: Type::new(dtype, Shape::from(dims.to_vec())) }, &[])
    }
    pub fn kernel(mut self, name: &str, outs: &[ValueId]) -> Kernel {
        for (i, o) in outs.iter().enumerate() {
            self.g.output(&format!("out{i}"), *o);
        }
        fusec_ir::verify::verify(&self.g).unwrap_or_else(|e| panic!("test body `{name}` does not verify: {e}"));
        Kernel { name: name.to_string(), body: self.g }
    }
}

/// A symbolic dim.
pub fn s(n: &str) -> Dim {
    Dim::sym(n)
}
/// A literal dim.
pub fn l(n: u64) -> Dim {
    Dim::lit(n)
}
