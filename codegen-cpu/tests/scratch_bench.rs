use std::time::Instant;
use fusec_codegen_cpu::KernelCompiler;
use fusec_ir::{Bindings, Graph, Op, interp};

#[test]
fn bench() {
    let path = std::env::var("GRAPH").unwrap_or(concat!(env!("CARGO_MANIFEST_DIR"), "/../models/gpt2-124m.graph").to_string());
    let path = path.as_str();
    let src = std::fs::read_to_string(path).unwrap();
    let fwd = fusec_ir::text::parse(&src, path).unwrap();
    let mut b = Bindings::default();
    b.set("B", 4).set("T", 64);
    use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
    let g: Graph = compile(&fwd, "fuse", Mode::Step, &PipelineOptions::default(), &b).unwrap().graph;
    let mut c = KernelCompiler::new().unwrap();
    let threads: usize = std::env::var("THREADS").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let mut seen = std::collections::HashSet::new();
    for n in &g.nodes {
        let Op::Kernel(k) = &n.op else { continue };
        if let Ok(w) = std::env::var("KNAME") { if k.name != w { continue; } }
        let ck = c.compile(k, &b).unwrap();
        if !seen.insert(ck.name.clone() + &format!("{:p}", std::sync::Arc::as_ptr(&ck))) { continue; }
        let ins: Vec<Vec<f32>> = k.body.nodes.iter().filter_map(|n| if let Op::Input{ty, ..} = &n.op { Some(ty) } else { None })
            .map(|ty| { let n = interp::concrete_shape(ty, &b).unwrap().iter().product::<usize>(); (0..n).map(|i| if ty.dtype == fusec_ir::DType::I32 { f32::from_bits((i % 100) as u32) } else { 0.5 + (i % 7) as f32 * 0.1 }).collect() }).collect();
        let mut outs: Vec<Vec<f32>> = k.body.outputs.iter().map(|(_, v)| vec![0f32; interp::concrete_shape(k.body.ty(*v), &b).unwrap().iter().product()]).collect();
        let ops: Vec<*const u8> = ins.iter().map(|v| v.as_ptr() as *const u8).collect();
        let res: Vec<*mut u8> = outs.iter_mut().map(|v| v.as_mut_ptr() as *mut u8).collect();
        unsafe { ck.run(&ops, &res, threads) };
        let reps = (2e8 / ck.bytes_moved() as f64).clamp(1.0, 200.0) as usize;
        let t0 = Instant::now();
        for _ in 0..reps { unsafe { ck.run(&ops, &res, threads) }; }
        let dt = t0.elapsed().as_secs_f64() / reps as f64;
        println!("{:40} {:>10.1} us {:>7.2} GB/s {:>7.2} GFLOP/s  segs {}", ck.name, dt * 1e6, ck.bytes_moved() as f64 / dt / 1e9, ck.flops() as f64 / dt / 1e9, ck.segments());
    }
}

#[test]
fn disasm() {
    use cranelift_codegen::settings::{self, Configurable};
    let mut flags = settings::builder();
    flags.set("opt_level", "speed").unwrap();
    let isa = cranelift_native::builder().unwrap().finish(settings::Flags::new(flags)).unwrap();
    let path = std::env::var("GRAPH").unwrap_or(concat!(env!("CARGO_MANIFEST_DIR"), "/../models/gpt2-124m.graph").to_string());
    let path = path.as_str();
    let src = std::fs::read_to_string(path).unwrap();
    let fwd = fusec_ir::text::parse(&src, path).unwrap();
    let mut b = Bindings::default();
    b.set("B", 4).set("T", 64);
    use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
    let g: Graph = compile(&fwd, "fuse", Mode::Step, &PipelineOptions::default(), &b).unwrap().graph;
    let want = std::env::var("KNAME").unwrap_or("cross_entropy".into());
    for n in &g.nodes {
        let Op::Kernel(k) = &n.op else { continue };
        if k.name != want { continue; }
        let progs = fusec_codegen_cpu::lower::lower_kernel(k, &b).unwrap();
        std::fs::write("/tmp/prog.txt", progs.iter().map(|p| p.text()).collect::<String>() + &fusec_ir::text::print(&k.body)).unwrap();
        let mut fctx = cranelift_frontend::FunctionBuilderContext::new();
        let built = fusec_codegen_cpu::clif::build(&progs[0], isa.default_call_conv(), isa.frontend_config(), &mut fctx).unwrap();
        std::fs::write("/tmp/func.clif", built.main.display().to_string()).unwrap();
        let mut ctx = cranelift_codegen::Context::for_function(built.main);
        let mut ctrl = cranelift_codegen::control::ControlPlane::default();
        let code = ctx.compile(&*isa, &mut ctrl).unwrap();
        std::fs::write("/tmp/func.bin", code.code_buffer()).unwrap();
        std::fs::write("/tmp/func.opt.clif", ctx.func.display().to_string()).unwrap();
        break;
    }
}
