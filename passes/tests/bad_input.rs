//! Bad input to the passes gets a clear error, never a panic: sizes that overflow 64 bits.

use fusec_ir::text::parse;
use fusec_ir::{Bindings, Graph};
use fusec_passes::memplan::{memplan, MemplanOptions};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};
use fusec_passes::schedule::schedule_with;

const TINY: &str = include_str!("../../models/gpt2-tiny.graph");

fn tiny() -> Graph {
    parse(TINY, "gpt2-tiny.graph").expect("the shipped graph parses")
}

fn bind(b: u64, t: u64) -> Bindings {
    let mut x = Bindings::default();
    x.set("B", b).set("T", t);
    x
}

/// Compiles `g` to `memplan` and returns the error, failing if it compiles.
fn compile_err(g: &Graph, mode: Mode, opts: &PipelineOptions, b: &Bindings) -> String {
    match compile(g, "memplan", mode, opts, b) {
        Ok(_) => panic!("compiled, but an error was expected"),
        Err(e) => e,
    }
}

#[test]
fn a_huge_batch_is_an_overflow_error_not_a_wrapped_plan() {
    let opts = PipelineOptions::default();
    for b in [1u64 << 63, u64::MAX, 1 << 50] {
        let e = compile_err(&tiny(), Mode::Step, &opts, &bind(b, 64));
        assert!(e.contains("overflows 64 bits") || e.contains("more than 2^64 bytes"), "B = {b}: {e}");
    }
    // B*T itself overflows: the message shows the product.
    let e = compile_err(&tiny(), Mode::Forward, &opts, &bind(1 << 63, 64));
    assert!(e.contains("= 9223372036854775808*64") && e.contains("overflows 64 bits"), "{e}");
    // Each tensor fits, but not all of them together.
    let e = compile_err(&tiny(), Mode::Forward, &opts, &bind(1 << 26, 1 << 26));
    assert!(e.contains("the program's tensors total more than 2^64 bytes under B = 67108864, T = 67108864"), "{e}");

    // The passes called directly: schedule sizes tensors too.
    let g = tiny();
    assert!(schedule_with(&g, &bind(1 << 63, 64)).unwrap_err().contains("overflows 64 bits"));
    assert!(memplan(&g, &bind(u64::MAX, u64::MAX), &MemplanOptions::default()).unwrap_err().starts_with("memplan: "));
    // A large but representable binding plans fine, and every offset is in the allocation.
    let c = compile(&g, "memplan", Mode::Step, &opts, &bind(1 << 20, 64)).expect("2^20 x 64 tokens fit in 64 bits");
    let plan = c.plan.unwrap();
    assert!(plan.values.iter().all(|v| v.offset.checked_add(v.bytes).is_some_and(|e| e <= plan.total_bytes())));
}
