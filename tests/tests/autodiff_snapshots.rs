//! Snapshots of `dump --pass autodiff`: a reviewer reads these diffs to see what a change did.
//! (One GPT-2 block's autodiff is `pass_snapshots__block_autodiff.snap`.)

use fusec_ir::{DType, Graph, Op, ReduceOp, Shape, Type};
use fusec_passes::pipeline::{compile, Mode, PipelineOptions};

fn dump(g: &Graph, pass: &str) -> String {
    let bind = fusec_passes::schedule::default_bindings(g);
    fusec_ir::text::print(&compile(g, pass, Mode::Step, &PipelineOptions::default(), &bind).unwrap().graph)
}

#[test]
fn two_op_toy_graph() {
    let mut g = Graph::new("toy", &["N"]);
    let ty = Type::new(DType::F32, vec![fusec_ir::Dim::sym("N"), fusec_ir::Dim::lit(4)].into());
    let w = g.add1(Op::Param { name: "w".into(), ty: Type::new(DType::F32, Shape::lits(&[4])) }, &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: ty.clone() }, &[]);
    let wb = g.add1(Op::Broadcast { dims: vec![1], shape: ty.shape.clone() }, &[w]);
    let y = g.add1(Op::Binary(fusec_ir::BinaryOp::Mul), &[x, wb]);
    let loss = g.add1(Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1] }, &[y]);
    g.output("loss", loss);
    insta::assert_snapshot!(dump(&g, "autodiff"));
}
