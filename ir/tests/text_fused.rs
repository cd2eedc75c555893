//! The `.graph` text of the fused ops: `gemm` flags, nested `kernel` bodies (exact printed
//! form, round trips, nesting), generator coverage of every epilogue, and parse errors inside
//! bodies at the right `line:col`.

use std::collections::BTreeSet;

use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::random_graph;
use fusec_ir::text::{parse, print, Diagnostic, MAX_KERNEL_DEPTH};
use fusec_ir::verify::verify;
use fusec_ir::{BinaryOp, DType, Dim, Gemm, Graph, Kernel, Op, Shape, Type, UnaryOp};

const BLOCK: &str = r#"graph block(B, T) {
  %0 = input "x" : f32[B, T, 64]
  %1 = param "ln.w" : f32[64]
  %2 = param "ln.b" : f32[64]
  %3 = param "w" : f32[64, 64]
  %4 = gemm %0, %3 {trans_a = false, trans_b = true, bias = false, gelu = false, accumulate = false} : f32[B, T, 64]
  %5, %6 = kernel "add_layernorm" %0, %4, %1, %2 : f32[B, T, 64], f32[B, T] {
    %0 = input "x0" : f32[B, T, 64]
    %1 = input "x1" : f32[B, T, 64]
    %2 = input "x2" : f32[64]
    %3 = input "x3" : f32[64]
    %4 = add %0, %1 : f32[B, T, 64]
    %5, %6, %7 = layernorm %4, %2, %3 {eps = 1e-5} : f32[B, T, 64], f32[B, T], f32[B, T]
    output "y0" = %5
    output "y1" = %7
  }
  %7 = param "fc.w" : f32[256, 64]
  %8 = param "fc.b" : f32[256]
  %9, %10 = gemm %5, %7, %8 {trans_a = false, trans_b = true, bias = true, gelu = true, accumulate = false} : f32[B, T, 256], f32[B, T, 256]
  %11 = input "acc" : bf16[B, T, 256]
  %12 = gemm %5, %7, %11 {trans_a = false, trans_b = true, bias = false, gelu = false, accumulate = true} : bf16[B, T, 256]
  output "y" = %9
  output "pre" = %10
  output "rstd" = %6
  output "acc" = %12
}
"#;

fn bt(c: u64) -> Shape {
    Shape(vec![Dim::sym("B"), Dim::sym("T"), Dim::lit(c)].into())
}

/// [`BLOCK`] built through the API.
fn block() -> Graph {
    let f32t = |s: Shape| Type::new(DType::F32, s);
    let gm = |bias, gelu, out, accumulate| Op::Gemm(Gemm { trans_a: false, trans_b: true, bias, gelu, out, accumulate });
    let mut g = Graph::new("block", &["B", "T"]);
    let x = g.add1(Op::Input { name: "x".into(), ty: f32t(bt(64)) }, &[]);
    let lw = g.add1(Op::Param { name: "ln.w".into(), ty: f32t(Shape::lits(&[64])) }, &[]);
    let lb = g.add1(Op::Param { name: "ln.b".into(), ty: f32t(Shape::lits(&[64])) }, &[]);
    let w = g.add1(Op::Param { name: "w".into(), ty: f32t(Shape::lits(&[64, 64])) }, &[]);
    let h = g.add1(gm(false, false, DType::F32, false), &[x, w]);
    let mut body = Graph::new("add_layernorm", &["B", "T"]);
    let ins: Vec<_> = [bt(64), bt(64), Shape::lits(&[64]), Shape::lits(&[64])]
        .into_iter()
        .enumerate()
        .map(|(i, s)| body.add1(Op::Input { name: format!("x{i}"), ty: f32t(s) }, &[]))
        .collect();
    let s = body.add1(Op::Binary(BinaryOp::Add), &ins[..2]);
    let ln = body.add(Op::LayerNorm { eps: 1e-5 }, &[s, ins[2], ins[3]]);
    body.output("y0", ln[0]);
    body.output("y1", ln[2]);
    let k = g.add(Op::Kernel(Box::new(Kernel { name: "add_layernorm".into(), body })), &[x, h, lw, lb]);
    let fw = g.add1(Op::Param { name: "fc.w".into(), ty: f32t(Shape::lits(&[256, 64])) }, &[]);
    let fb = g.add1(Op::Param { name: "fc.b".into(), ty: f32t(Shape::lits(&[256])) }, &[]);
    let y = g.add(gm(true, true, DType::F32, false), &[k[0], fw, fb]);
    let acc = g.add1(Op::Input { name: "acc".into(), ty: Type::new(DType::BF16, bt(256)) }, &[]);
    let a = g.add1(gm(false, false, DType::BF16, true), &[k[0], fw, acc]);
    g.output("y", y[0]);
    g.output("pre", y[1]);
    g.output("rstd", k[1]);
    g.output("acc", a);
    g
}

#[test]
fn kernel_and_gemm_print_exactly_and_round_trip() {
    let g = block();
    verify(&g).unwrap();
    assert_eq!(print(&g), BLOCK);
    let parsed = parse(BLOCK, "block.graph").unwrap_or_else(|e| panic!("{e}"));
    assert!(parsed == g, "parse(text) differs from the graph built through the API");
    let Op::Kernel(k) = &parsed.nodes[5].op else { panic!("node 5 is not a kernel") };
    assert_eq!((k.body.name.as_str(), k.body.syms.as_slice()), ("add_layernorm", &["B".to_string(), "T".to_string()][..]));
    // Comments, blank lines and loose whitespace inside bodies parse to the same graph.
    let loose = BLOCK.replace('\n', "  # c\n\n").replace(" : ", "   :\t").replace(", ", " ,  ").replace(" {\n", "{ # open\n");
    assert_eq!(print(&parse(&loose, "loose.graph").unwrap_or_else(|e| panic!("{e}\n{loose}"))), BLOCK);
}

/// A kernel nested `depth` levels deep, each body negating its input.
fn nested(depth: usize) -> String {
    let mut s = String::from("graph n() {\n  %0 = input \"a\" : f32[2]\n");
    for d in 0..depth {
        let pad = "  ".repeat(d + 1);
        s.push_str(&format!("{pad}%1 = kernel \"k{d}\" %0 : f32[2] {{\n{pad}  %0 = input \"x\" : f32[2]\n"));
    }
    for d in (0..depth).rev() {
        let pad = "  ".repeat(d + 2);
        let last = if d == depth - 1 { format!("{pad}%1 = neg %0 : f32[2]\n") } else { String::new() };
        s.push_str(&format!("{last}{pad}output \"y\" = %1\n{}}}\n", "  ".repeat(d + 1)));
    }
    s.push_str("  output \"o\" = %1\n}\n");
    s
}

#[test]
fn nested_kernels_parse_to_the_depth_limit_and_the_verifier_rejects_them() {
    let two = nested(2);
    assert_eq!(
        two,
        "graph n() {\n  %0 = input \"a\" : f32[2]\n  %1 = kernel \"k0\" %0 : f32[2] {\n    %0 = input \"x\" : f32[2]\n    \
         %1 = kernel \"k1\" %0 : f32[2] {\n      %0 = input \"x\" : f32[2]\n      %1 = neg %0 : f32[2]\n      output \"y\" = %1\n    }\n    \
         output \"y\" = %1\n  }\n  output \"o\" = %1\n}\n"
    );
    for depth in 1..=MAX_KERNEL_DEPTH {
        let src = nested(depth);
        let g = parse(&src, "n.graph").unwrap_or_else(|e| panic!("depth {depth}: {e}\n{src}"));
        assert_eq!(print(&g), src);
        match verify(&g) {
            Ok(()) => assert_eq!(depth, 1),
            Err(e) => {
                let s = e.to_string();
                assert!(s.starts_with("node 1 (`kernel`): in the body of kernel `k0`: node 1 (`kernel`)"), "{s}");
                assert!(s.contains("kernel `k1` is nested in a kernel body"), "{s}");
            }
        }
    }
    let e = parse(&nested(MAX_KERNEL_DEPTH + 1), "n.graph").unwrap_err();
    assert!(e.msg.contains("kernel bodies nest more than 8 deep"), "{e}");
    assert_eq!((e.line, e.col), (2 + MAX_KERNEL_DEPTH * 2 + 1, 2 * (MAX_KERNEL_DEPTH + 1) + 30), "{e}");
    // Malicious depth: bounded recursion, no stack overflow.
    let deep = format!(
        "graph d() {{\n  %0 = input \"a\" : f32[]\n{}",
        "%1 = kernel \"k\" %0 : f32[] {\n%0 = input \"x\" : f32[]\n".repeat(200_000)
    );
    let e = parse(&deep, "deep.graph").unwrap_err();
    assert!(e.msg.contains("nest more than"), "{e}");
}

#[test]
fn generator_covers_every_gemm_epilogue_and_kernels_that_verify() {
    let (mut flags, mut outs, mut shared_b, mut kernels, mut names) = (BTreeSet::new(), BTreeSet::new(), false, 0, BTreeSet::new());
    for seed in 0..2500 {
        let g = random_graph(&mut Rng::new(seed));
        verify(&g).unwrap_or_else(|e| panic!("seed {seed}: generated graph does not verify: {e}\n{}", print(&g)));
        for n in &g.nodes {
            match &n.op {
                Op::Gemm(gm) => {
                    flags.insert((gm.trans_a, gm.trans_b, gm.bias, gm.gelu, gm.accumulate));
                    outs.insert((g.ty(n.inputs[0]).dtype, gm.out));
                    shared_b |= g.ty(n.inputs[0]).shape.rank() > 2 && g.ty(n.inputs[1]).shape.rank() == 2;
                }
                Op::Kernel(k) => {
                    kernels += 1;
                    names.insert(k.name.clone());
                    assert_eq!(k.body.name, k.name);
                    assert!(k.body.nodes.iter().any(|n| !n.op.is_source()) || k.name == "copy");
                }
                _ => {}
            }
        }
    }
    assert_eq!(flags.len(), 32, "gemm flag combinations seen: {flags:?}");
    assert!(outs.contains(&(DType::F32, DType::BF16)) && outs.contains(&(DType::F32, DType::F32)), "{outs:?}");
    assert!(outs.contains(&(DType::BF16, DType::F32)) && outs.iter().all(|(_, o)| o.is_float()), "{outs:?}");
    assert!(shared_b);
    assert!(kernels > 200 && names.len() > 50, "{kernels} kernels, {} names", names.len());
}

fn err(src: &str) -> Diagnostic {
    match parse(src, "bad.graph") {
        Ok(g) => panic!("parsed, expected an error:\n{src}\n{}", print(&g)),
        Err(e) => e,
    }
}

#[track_caller]
fn check(src: &str, line: usize, col: usize, msg: &str) {
    let e = err(src);
    assert!(e.msg.contains(msg), "message {:?} lacks {msg:?}", e.msg);
    assert_eq!((e.line, e.col), (line, col), "{e}");
}

const HEAD: &str = "graph g(B) {\n  %0 = param \"w\" : f32[B, 4]\n";

/// `HEAD`, then a kernel over `%0` whose body lines are `body`, then the closing lines.
fn kernel_src(decl: &str, body: &str) -> String {
    format!("{HEAD}  %1 = kernel \"k\" %0 : {decl} {{\n    %0 = input \"x\" : f32[B, 4]\n{body}  }}\n}}\n")
}

#[test]
fn errors_inside_bodies_point_at_the_offending_token() {
    check(
        &kernel_src("f32[B, 4]", "    %1 = neg %0 : f32[B, 5]\n    output \"y\" = %1\n"),
        5,
        19,
        "declared type f32[B, 5] but `neg` produces f32[B, 4]",
    );
    check(
        &kernel_src("f32[B, 4]", "    %2 = neg %0 : f32[B, 4]\n"),
        5,
        5,
        "expected `%1` (values are numbered in order of definition), found `%2`",
    );
    check(&kernel_src("f32[B, 4]", "    %1 = neg %3 : f32[B, 4]\n"), 5, 14, "value %3 used before it is defined");
    check(
        &kernel_src("f32[B, 4]", "    %1 = param \"p\" : f32[Q]\n"),
        5,
        26,
        "symbol `Q` is not declared in the graph header (declared: B)",
    );
    check(&kernel_src("f32[B, 4]", "    %1 = frob %0 : f32[B, 4]\n"), 5, 10, "unknown op `frob`");
    check(
        &kernel_src("f32[B, 4]", "    output \"y\" = %0\n    output \"z\" = %0\n"),
        3,
        3,
        "`kernel` produces 2 result(s), found 1 declared",
    );
    check(&kernel_src("f32[B, 5]", "    output \"y\" = %0\n"), 3, 24, "declared type f32[B, 5] but `kernel` produces f32[B, 4]");
    check(&kernel_src("f32[B, 4]", ""), 3, 8, "kernel `k` has no outputs");
    check(&format!("{HEAD}  %1 = param \"v\" : f32[4]\n  %2 = kernel \"k\" %1 : f32[B, 4] {{\n    %0 = input \"x\" : f32[B, 4]\n    output \"y\" = %0\n  }}\n}}\n"), 4, 8, "kernel `k` operand 0 (`x`) must be f32[B, 4], found f32[4]");
    check(
        &format!("{HEAD}  %1 = kernel \"k\" %0 : f32[B, 4]\n}}\n"),
        4,
        1,
        "expected `{` to open the kernel body after the result types, found `}`",
    );
    check(
        &format!("{HEAD}  %1 = kernel \"k\" %0 {{}} : f32[B, 4] {{\n  }}\n}}\n"),
        3,
        22,
        "expected `:` before the result type, found `{`",
    );
    check(&format!("{HEAD}  %1 = kernel %0 : f32[B, 4] {{\n  }}\n}}\n"), 3, 15, "expected the quoted name of the kernel, found `%0`");
    check(
        &format!("{HEAD}  %1 = kernel \"k\" %0 : f32[B, 4] {{\n    %0 = input \"x\" : f32[B, 4]\n"),
        5,
        1,
        "expected `}` to close the kernel body, found end of input",
    );
    check(
        &format!("{HEAD}  %1 = kernel \"k\" %0 : f32[B, 4] {{\n    %0 = input \"x\" : f32[B, 4]\n    output \"y\" = %0\n  }}\n"),
        7,
        1,
        "expected `}` to close the graph, found end of input",
    );
    // Outer numbering resumes after the body.
    check(&format!("{HEAD}  %1 = kernel \"k\" %0 : f32[B, 4] {{\n    %0 = input \"x\" : f32[B, 4]\n    output \"y\" = %0\n  }}\n  %1 = neg %0 : f32[B, 4]\n}}\n"), 7, 3, "expected `%2`");
}

#[test]
fn gemm_parse_errors() {
    let g = "graph g() {\n  %0 = param \"a\" : f32[2, 3]\n  %1 = param \"b\" : f32[3, 4]\n  %2 = param \"c\" : f32[5]\n";
    let flags = "trans_a = false, trans_b = false";
    check(
        &format!("{g}  %3 = gemm %0, %1 {{{flags}, bias = false, gelu = false}} : f32[2, 4]\n}}\n"),
        5,
        8,
        "`gemm` is missing attribute `accumulate`",
    );
    check(
        &format!("{g}  %3 = gemm %0, %1, %2 {{{flags}, bias = true, gelu = false, accumulate = false}} : f32[2, 4]\n}}\n"),
        5,
        8,
        "gemm bias must be f32[4], found f32[5]",
    );
    check(
        &format!("{g}  %3 = gemm %0, %1 {{{flags}, bias = false, gelu = true, accumulate = false}} : f32[2, 4]\n}}\n"),
        5,
        3,
        "`gemm` produces 2 result(s), found 1 declared",
    );
    check(
        &format!("{g}  %3 = gemm %0, %1 {{{flags}, bias = false, gelu = false, accumulate = true}} : f32[2, 4]\n}}\n"),
        5,
        8,
        "`gemm` takes 3 operand(s), found 2",
    );
    check(
        &format!("{g}  %3 = gemm %0, %1 {{{flags}, bias = false, gelu = 0, accumulate = false}} : f32[2, 4]\n}}\n"),
        5,
        76,
        "attribute `gelu` of `gemm` must be `true` or `false`",
    );
    check(
        &format!("{g}  %3, %4 = gemm %0, %1 {{{flags}, bias = false, gelu = true, accumulate = false}} : bf16[2, 4], bf16[2, 4]\n}}\n"),
        5,
        120,
        "declared type bf16[2, 4] for result 1 but `gemm` produces f32[2, 4]",
    );
    // The result dtype is the first declared type's.
    let ok = format!("{g}  %3, %4 = gemm %0, %1 {{{flags}, bias = false, gelu = true, accumulate = false}} : bf16[2, 4], f32[2, 4]\n}}\n");
    let parsed = parse(&ok, "ok.graph").unwrap();
    assert!(matches!(&parsed.nodes[3].op, Op::Gemm(gm) if gm.out == DType::BF16 && gm.gelu));
    assert_eq!(print(&parsed), ok);
}

#[test]
fn printing_garbage_kernels_does_not_panic() {
    let mut g = block();
    let Op::Kernel(k) = &mut g.nodes[5].op else { unreachable!() };
    k.body.outputs.push(("bad".into(), fusec_ir::ValueId(999)));
    k.body.nodes[4].inputs.push(fusec_ir::ValueId(12345));
    k.body.nodes[0].op = Op::Unary(UnaryOp::Exp);
    let s = print(&g);
    assert!(s.contains("output \"bad\" = %?999") && s.contains("%?12345"), "{s}");
    assert!(parse(&s, "garbage").is_err());
}
