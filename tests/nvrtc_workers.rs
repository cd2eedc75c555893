//! Cold CUDA builds compile in worker processes (`fusec nvrtc-worker`, see
//! `fusec_codegen_cuda::nvrtc::workers`): the same images as compiling in this process, errors
//! carried back with NVRTC's log, and a clean exit when the parent closes the pipe. Needs
//! libnvrtc (CI installs it), not a GPU.

use std::path::PathBuf;

use fusec_codegen_cuda::nvrtc::{self, workers, Compiler};

/// Small modules in the style of the generated ones, and one that does not compile.
fn items() -> Vec<(String, String)> {
    let k = |name: &str, body: &str| {
        (name.to_string(), format!("extern \"C\" __global__ void {name}(const float* a, float* b, int n) {{\n  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < n) {body}\n}}\n"))
    };
    vec![
        k("scale", "b[i] = 2.0f * a[i];"),
        k("expo", "b[i] = expf(a[i]);"),
        k("tanh_of", "b[i] = tanhf(a[i]) + a[i];"),
        ("broken".to_string(), "extern \"C\" __global__ void broken() { undeclared = 1; }".to_string()),
    ]
}

#[test]
fn cold_builds_compile_in_worker_processes_with_the_same_images() {
    if let Err(e) = nvrtc::available() {
        fusec_ir::testkit::skip("NVRTC worker processes", &e);
        return;
    }
    let items = items();
    let here = Compiler::with_cache_dir("sm_80", None).unwrap().compile_all(&items);
    // Two workers whatever the cores (the default is half of them, so none on two cores).
    std::env::set_var("FUSEC_NVRTC_PROCS", "2");
    workers::enable(PathBuf::from(env!("CARGO_BIN_EXE_fusec")));
    let mut c = Compiler::with_cache_dir("sm_80", None).unwrap();
    let there = c.compile_all(&items);
    assert_eq!((c.compiled, c.in_workers), (3, 3), "three modules compiled in workers, one error");
    for (i, (a, b)) in here.iter().zip(&there).enumerate() {
        match (a, b) {
            (Ok(a), Ok(b)) => assert!(a.bytes == b.bytes && !b.ptx && !b.bytes.is_empty(), "{}: same CUBIN", items[i].0),
            (Err(a), Err(b)) => {
                assert!(b.contains("undeclared") && b.contains("broken"), "NVRTC's log comes back: {b}");
                assert_eq!(a, b);
            }
            _ => panic!("{}: {a:?} in this process, {b:?} in a worker", items[i].0),
        }
    }
}

#[test]
fn a_worker_exits_cleanly_when_its_input_ends() {
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_fusec")).arg("nvrtc-worker").stdin(std::process::Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout.is_empty());
}
