//! Bad input to the IR gets a clear error: parameters, inputs and outputs declared twice (with
//! `file:line:col` from the parser, without a position from the verifier), and size arithmetic
//! that overflows 64 bits (dims, element counts, bytes, reshapes).

use fusec_ir::infer::result_types;
use fusec_ir::text::parse;
use fusec_ir::verify::verify;
use fusec_ir::{Bindings, DType, Dim, Graph, Op, Shape, Type};

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

fn b(pairs: &[(&str, u64)]) -> Bindings {
    let mut b = Bindings::default();
    for (k, v) in pairs {
        b.set(k, *v);
    }
    b
}

#[test]
fn dim_evaluation_is_checked() {
    let bt = Dim::sym("B").mul(&Dim::sym("T"));
    assert_eq!(bt.eval(&b(&[("B", 4), ("T", 64)])), Ok(256));
    assert_eq!(bt.eval(&b(&[("B", 1 << 63), ("T", 64)])), Err("dim B*T = 9223372036854775808*64 overflows 64 bits".to_string()));
    let three_b = Dim::lit(3).mul(&Dim::sym("B"));
    assert_eq!(three_b.eval(&b(&[("B", u64::MAX / 2)])), Err("dim 3*B = 3*9223372036854775807 overflows 64 bits".to_string()));
    assert_eq!(bt.eval(&b(&[("B", 2)])), Err("symbolic dim `T` is not bound".to_string()));
    // Checked products of dims, where saturation would hide an overflow.
    assert_eq!(Dim::lit(1 << 40).checked_mul(&Dim::lit(1 << 40)), None);
    assert_eq!(Dim::lit(1 << 20).checked_mul(&Dim::sym("B")), Some(Dim::lit(1 << 20).mul(&Dim::sym("B"))));
}

#[test]
fn element_counts_and_bytes_are_checked() {
    let s = Shape(vec![Dim::sym("B"), Dim::sym("T"), Dim::lit(64)].into());
    let t = Type::new(DType::F32, s.clone());
    let ok = b(&[("B", 4), ("T", 64)]);
    assert_eq!(s.eval_numel(&ok), Ok(4 * 64 * 64));
    assert_eq!(t.bytes(&ok), Ok(4 * 64 * 64 * 4));
    let huge = b(&[("B", 1 << 40), ("T", 1 << 20)]);
    assert_eq!(s.eval(&huge), Ok(vec![1 << 40, 1 << 20, 64]), "every dim fits");
    assert_eq!(s.eval_numel(&huge), Err("the element count of [B, T, 64] = 1099511627776*1048576*64 overflows 64 bits".to_string()));
    assert!(t.bytes(&huge).unwrap_err().contains("overflows 64 bits"));
    // The count fits, the bytes do not.
    let edge = b(&[("B", 1 << 60), ("T", 1)]);
    assert_eq!(s.eval_numel(&edge), Err("the element count of [B, T, 64] = 1152921504606846976*1*64 overflows 64 bits".to_string()));
    let s2 = Shape(vec![Dim::sym("B")].into());
    let t2 = Type::new(DType::F32, s2);
    assert_eq!(
        t2.bytes(&b(&[("B", 1 << 62)])),
        Err("the size of f32[B] = 4611686018427387904 elements * 4 bytes overflows 64 bits".to_string())
    );
}

#[test]
fn a_reshape_whose_element_count_overflows_is_ill_typed() {
    // Both counts saturate at u64::MAX: without checked products they would compare equal.
    let x = Type::new(DType::F32, Shape::lits(&[1 << 40, 1 << 40]));
    let op = Op::Reshape { shape: Shape::lits(&[1 << 50, 1 << 50]) };
    let e = result_types(&op, &[&x]).unwrap_err();
    assert_eq!(
        e,
        "the element count of reshape from [1099511627776, 1099511627776] to [1125899906842624, 1125899906842624] overflows 64 bits"
    );
    let src = "graph g() {\n  %0 = input \"x\" : f32[1099511627776, 1099511627776]\n  %1 = reshape %0 : f32[1125899906842624, 1125899906842624]\n  output \"y\" = %1\n}\n";
    assert!(parse_err(src).starts_with("g.graph:3:8: the element count of reshape"), "{}", parse_err(src));
}
