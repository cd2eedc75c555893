//! Bad input to the IR gets a clear error: parameters, inputs and outputs declared twice (with
//! `file:line:col` from the parser, without a position from the verifier).

use fusec_ir::text::parse;
use fusec_ir::verify::verify;
use fusec_ir::{DType, Graph, Op, Shape, Type};

const TINY: &str = include_str!("../../models/gpt2-tiny.graph");

/// The parse error of `src` as `file:line:col: message`.
fn parse_err(src: &str) -> String {
    match parse(src, "g.graph") {
        Ok(_) => panic!("parsed, but an error was expected:\n{src}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_parameter_declared_twice_is_refused_at_its_name() {
    // The reproduction: `wpe` renamed to `wte` (different shapes).
    let src = TINY.replace("%1 = param \"wpe\"", "%1 = param \"wte\"");
    assert_eq!(parse_err(&src), "g.graph:3:14: parameter \"wte\" is declared twice (first at line 2)");
    // Same shape, same verdict.
    let src = "graph g() {\n  %0 = param \"w\" : f32[2]\n  %1 = param \"w\" : f32[2]\n  output \"y\" = %1\n}\n";
    assert_eq!(parse_err(src), "g.graph:3:14: parameter \"w\" is declared twice (first at line 2)");
}

#[test]
fn inputs_and_parameters_share_one_namespace() {
    let src = "graph g() {\n  %0 = input \"x\" : f32[2]\n  %1 = input \"x\" : f32[2]\n  output \"y\" = %1\n}\n";
    assert_eq!(parse_err(src), "g.graph:3:14: input \"x\" is declared twice (first at line 2)");
    let src = "graph g() {\n  %0 = param \"x\" : f32[2]\n\n  %1 = input \"x\" : f32[2]\n  output \"y\" = %1\n}\n";
    assert_eq!(
        parse_err(src),
        "g.graph:4:14: input \"x\" has the name of parameter \"x\" (declared at line 2; parameters and inputs share one namespace)"
    );
    // Names are compared exactly, escapes resolved.
    let src = "graph g() {\n  %0 = param \"a\\\"b\" : f32[2]\n  %1 = param \"a\\\"b\" : f32[2]\n  output \"y\" = %1\n}\n";
    assert_eq!(parse_err(src), "g.graph:3:14: parameter \"a\\\"b\" is declared twice (first at line 2)");
    parse("graph g() {\n  %0 = param \"a\" : f32[2]\n  %1 = param \"A\" : f32[2]\n  output \"y\" = %1\n}\n", "g").unwrap();
}

#[test]
fn an_output_declared_twice_is_refused() {
    let src = "graph g() {\n  %0 = input \"x\" : f32[2]\n  output \"y\" = %0\n  output \"y\" = %0\n}\n";
    assert_eq!(parse_err(src), "g.graph:4:10: output \"y\" is declared twice (first at line 3)");
}

#[test]
fn a_kernel_body_has_its_own_names() {
    // The body's inputs may reuse the graph's names (they are operands, bound by position) ...
    let ok = "graph g() {\n  %0 = input \"x\" : f32[2]\n  %1 = kernel \"k\" %0 : f32[2] {\n    %0 = input \"x\" : f32[2]\n    %1 = neg %0 : f32[2]\n    output \"y\" = %1\n  }\n  output \"y\" = %1\n}\n";
    let g = parse(ok, "g").unwrap();
    verify(&g).unwrap();
    // ... but not each other's.
    let bad = ok
        .replace("%1 = neg %0 : f32[2]\n", "%1 = input \"x\" : f32[2]\n    %2 = add %0, %1 : f32[2]\n")
        .replace("output \"y\" = %1\n  }", "output \"y\" = %2\n  }");
    assert_eq!(parse_err(&bad), "g.graph:5:16: input \"x\" is declared twice (first at line 4)");
}

#[test]
fn the_verifier_refuses_duplicates_built_in_code() {
    let t = Type::new(DType::F32, Shape::lits(&[2]));
    let mut g = Graph::new("g", &[]);
    g.add1(Op::Param { name: "w".into(), ty: t.clone() }, &[]);
    let w = g.add1(Op::Param { name: "w".into(), ty: Type::new(DType::F32, Shape::lits(&[3])) }, &[]);
    g.output("y", w);
    assert_eq!(verify(&g).unwrap_err().to_string(), "node 1 (`param`): name `w` is already used by node 0");
    let mut g = Graph::new("g", &[]);
    let x = g.add1(Op::Input { name: "x".into(), ty: t }, &[]);
    g.output("y", x);
    g.output("y", x);
    assert!(verify(&g).unwrap_err().to_string().contains("`y` is used twice"));
}
