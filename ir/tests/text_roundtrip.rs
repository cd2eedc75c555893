//! Round-trip property of the `.graph` text over generated graphs, hand-written texts, float
//! edge cases, and the position and wording of each kind of parse error.

use std::collections::BTreeSet;

use fusec_ir::rng::Rng;
use fusec_ir::testkit::gen::random_graph;
use fusec_ir::text::{parse, print, Diagnostic};
use fusec_ir::{DType, Graph, Op, Shape, Type};

const SEEDS: u64 = 2500;

#[test]
fn generated_graphs_round_trip() {
    for seed in 0..SEEDS {
        let g = random_graph(&mut Rng::new(seed));
        let text = print(&g);
        let g2 = parse(&text, "gen.graph").unwrap_or_else(|e| panic!("seed {seed}: {e}\n{text}"));
        let text2 = print(&g2);
        assert_eq!(text2, text, "seed {seed}: print(parse(print(g))) != print(g)");
        assert!(g2 == g, "seed {seed}: parse(print(g)) != g\n{text}");
    }
}

#[test]
fn generator_is_deterministic_and_covers_every_op() {
    let all = [
        "param",
        "input",
        "const",
        "iota",
        "neg",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "tanh",
        "recip",
        "add",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "lt",
        "le",
        "gt",
        "ge",
        "eq",
        "ne",
        "select",
        "cast",
        "reshape",
        "broadcast",
        "permute",
        "slice",
        "concat",
        "reduce_sum",
        "reduce_max",
        "matmul",
        "gather",
        "scatter_add",
        "gelu",
        "gelu_grad",
        "layernorm",
        "layernorm_grad",
        "softmax",
        "softmax_grad",
        "cross_entropy",
        "cross_entropy_grad",
        "attention",
        "attention_grad",
        "adamw",
        "gemm",
        "kernel",
    ];
    let mut seen = BTreeSet::new();
    let mut casts = BTreeSet::new();
    let mut matmuls = BTreeSet::new();
    let (mut sym_reshape, mut shared_b) = (false, false);
    for seed in 0..SEEDS {
        let g = random_graph(&mut Rng::new(seed));
        assert_eq!(print(&g), print(&random_graph(&mut Rng::new(seed))), "seed {seed} not deterministic");
        for n in &g.nodes {
            seen.insert(n.op.mnemonic());
            match &n.op {
                Op::Cast { to } => {
                    casts.insert((g.ty(n.inputs[0]).dtype, *to));
                }
                Op::MatMul { trans_a, trans_b } => {
                    matmuls.insert((*trans_a, *trans_b));
                    shared_b |= g.ty(n.inputs[0]).shape.rank() > 2 && g.ty(n.inputs[1]).shape.rank() == 2;
                }
                Op::Reshape { shape } => sym_reshape |= shape.0.iter().any(|d| d.syms.len() >= 2 || (d.coef > 1 && !d.syms.is_empty())),
                _ => {}
            }
        }
    }
    let missing: Vec<_> = all.iter().filter(|m| !seen.contains(*m)).collect();
    assert!(missing.is_empty(), "ops never generated: {missing:?}");
    assert_eq!(casts.len(), 16, "cast pairs seen: {casts:?}");
    assert_eq!(matmuls.len(), 4);
    assert!(sym_reshape && shared_b);
}

const HANDWRITTEN: &str = r#"graph gpt2_tiny(B, T) {
  %0 = param "wte" : f32[512, 64]
  %1 = input "tokens" : i32[B, T]
  %2 = const 0.5 : f32[]
  %3 = iota {axis = 1} : i32[T, T]
  %4 = gather %0, %1 : f32[B, T, 64]
  %5 = broadcast %2 {dims = []} : f32[B, T, 64]
  %6 = reshape %4 : f32[B*T, 64]
  %7 = matmul %6, %0 {trans_a = false, trans_b = true} : f32[B*T, 512]
  %8 = param "ln.w" : f32[64]
  %9 = param "ln.b" : f32[64]
  %10, %11, %12 = layernorm %4, %8, %9 {eps = 1e-5} : f32[B, T, 64], f32[B, T], f32[B, T]
  %13 = cast %10 : bf16[B, T, 64]
  %14 = scatter_add %4, %1 : f32[512, 64]
  %15 = reduce_sum %4 {axes = [2]} : f32[B, T]
  %16 = slice %4 {axis = 2, start = 0, end = 32} : f32[B, T, 32]
  %17 = permute %16 {perm = [2, 0, 1]} : f32[32, B, T]
  %18 = concat %16, %16 {axis = 2} : f32[B, T, 64]
  %19 = add %18, %5 : f32[B, T, 64]
  %20 = lt %3, %3 : i32[T, T]
  %21 = reshape %1 : i32[B*T]
  %22 = cross_entropy %7, %21 {vocab = 500} : f32[B*T]
  output "loss" = %15
  output "na\"me\\\n\t" = %19
}
"#;

#[test]
fn handwritten_text_prints_back_identically() {
    let src = HANDWRITTEN.to_string();
    let g = parse(&src, "hand.graph").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(print(&g), src);
    assert_eq!(g.outputs[1].0, "na\"me\\\n\t");
    assert_eq!(g.syms, ["B", "T"]);
    // Comments, blank lines and loose whitespace parse to the same graph.
    let loose = src.replace("\n", "  # a comment\n\n").replace(" : ", "   :\t").replace(", ", " ,  ");
    assert_eq!(print(&parse(&loose, "loose.graph").unwrap_or_else(|e| panic!("{e}\n{loose}"))), src);
}

#[test]
fn float_edge_cases_round_trip() {
    let cases = [
        ("1e-5", 1e-5),
        ("0.1", 0.1),
        ("-0.0", -0.0),
        ("1e300", 1e300),
        ("5e-324", 5e-324),
        ("inf", f64::INFINITY),
        ("-inf", f64::NEG_INFINITY),
        ("1.0", 1.0),
        ("1.7976931348623157e308", f64::MAX),
        ("0.30000000000000004", 0.1 + 0.2),
    ];
    for (text, x) in cases {
        let mut g = Graph::new("f", &[]);
        g.add1(Op::Const { value: x, ty: Type::scalar(DType::F32) }, &[]);
        let s = print(&g);
        assert!(s.contains(&format!("const {text} : f32[]")), "{x:?} printed as\n{s}");
        let g2 = parse(&s, "f.graph").unwrap();
        match g2.nodes[0].op {
            Op::Const { value, .. } => assert_eq!(value.to_bits(), x.to_bits(), "{text}"),
            _ => unreachable!(),
        }
    }
    // NaN prints as `nan` and comes back as a NaN.
    let mut g = Graph::new("f", &[]);
    g.add1(Op::Const { value: f64::NAN, ty: Type::new(DType::F32, Shape::lits(&[2])) }, &[]);
    let s = print(&g);
    assert!(s.contains("const nan : f32[2]"), "{s}");
    assert!(matches!(parse(&s, "f").unwrap().nodes[0].op, Op::Const { value, .. } if value.is_nan()));
    // Other spellings are accepted and printed canonically.
    let g = parse("graph f() { %0 = const 1.0e-5 : f32[]  %1 = const 2 : f32[]  %2 = const 3E+2 : f32[] }", "f").unwrap();
    assert!(print(&g).contains("%0 = const 1e-5 : f32[]\n  %1 = const 2.0 : f32[]\n  %2 = const 300.0 : f32[]"));
}

#[test]
fn non_identifier_graph_names_are_quoted() {
    let g = Graph::new("my graph\n", &[]);
    let s = print(&g);
    assert_eq!(s, "graph \"my graph\\n\"() {\n}\n");
    assert_eq!(parse(&s, "q").unwrap(), g);
}

fn err(src: &str) -> Diagnostic {
    match parse(src, "bad.graph") {
        Ok(g) => panic!("parsed, expected an error:\n{src}\n{}", print(&g)),
        Err(e) => e,
    }
}

/// Asserts the error's `line:col` and that its message contains `msg`.
#[track_caller]
fn check(src: &str, line: usize, col: usize, msg: &str) {
    let e = err(src);
    assert!(e.msg.contains(msg), "message {:?} lacks {msg:?}", e.msg);
    assert_eq!((e.line, e.col), (line, col), "{e}");
    assert_eq!(e.file, "bad.graph");
    assert!(e.to_string().starts_with(&format!("bad.graph:{line}:{col}: ")));
}

const HEAD: &str = "graph g(B) {\n  %0 = param \"w\" : f32[B, 4]\n";

#[test]
fn errors_point_at_the_offending_token() {
    check(&format!("{HEAD}  %1 = foo %0 : f32[B, 4]\n}}\n"), 3, 8, "unknown op `foo`");
    check(&format!("{HEAD}  %1 = neg %0 : f64[B, 4]\n}}\n"), 3, 17, "unknown dtype `f64`");
    check(
        &format!("{HEAD}  %2 = neg %0 : f32[B, 4]\n}}\n"),
        3,
        3,
        "expected `%1` (values are numbered in order of definition), found `%2`",
    );
    check(&format!("{HEAD}  %1 = add %0, %7 : f32[B, 4]\n}}\n"), 3, 16, "value %7 used before it is defined");
    check(&format!("{HEAD}  %1 = add %0, %1 : f32[B, 4]\n}}\n"), 3, 16, "value %1 used before it is defined");
    check(&format!("{HEAD}  output \"o\" = %3\n}}\n"), 3, 16, "value %3 used before it is defined");
    check(&format!("{HEAD}  %1 = add %0, %0 : f32[B, 5]\n}}\n"), 3, 21, "declared type f32[B, 5] but `add` produces f32[B, 4]");
    check(&format!("{HEAD}  %1 = add %0 %0 : f32[B, 4]\n}}\n"), 3, 15, "expected `:` before the result type, found `%0`");
    check(&format!("{HEAD}  %1 = neg %0 : f32[B, 4]\n"), 4, 1, "expected `}` to close the graph, found end of input");
    check(&format!("{HEAD}  %1 = param \"abc : f32[]\n}}\n"), 3, 14, "unterminated string");
    check(
        &format!("{HEAD}  %1 = iota {{axis = 99999999999999999999}} : i32[4]\n}}\n"),
        3,
        21,
        "integer `99999999999999999999` does not fit in 64 bits",
    );
    check(&format!("{HEAD}  %1 = param \"v\" : f32[N]\n}}\n"), 3, 24, "symbol `N` is not declared in the graph header (declared: B)");
    check(&format!("{HEAD}  %1 = add %0, %0 : f32[B, 4], f32[B, 4]\n}}\n"), 3, 3, "1 result name(s) but 2 result type(s)");
    check(&format!("{HEAD}  %1, %2 = add %0, %0 : f32[B, 4], f32[B, 4]\n}}\n"), 3, 3, "`add` produces 1 result(s), found 2 declared");
    check(&format!("{HEAD}  %1, %2 = add %0, %0 : f32[B, 4]\n}}\n"), 3, 3, "2 result name(s) but 1 result type(s)");
    check(&format!("{HEAD}  %1 = add %0 : f32[B, 4]\n}}\n"), 3, 8, "`add` takes 2 operand(s), found 1");
    check(&format!("{HEAD}  %1 = slice %0 {{axis = 1, start = 0}} : f32[B, 2]\n}}\n"), 3, 8, "`slice` is missing attribute `end`");
    check(&format!("{HEAD}  %1 = neg %0 {{axis = 1}} : f32[B, 4]\n}}\n"), 3, 16, "unknown attribute `axis` for `neg` (it takes none)");
    check(
        &format!("{HEAD}  %1 = matmul %0, %0 {{trans_a = 1, trans_b = true}} : f32[B, B]\n}}\n"),
        3,
        33,
        "attribute `trans_a` of `matmul` must be `true` or `false`, found `1`",
    );
    check(&format!("{HEAD}  %1 = const 1e999 : f32[]\n}}\n"), 3, 14, "float `1e999` is out of range");
    check(&format!("{HEAD}  %1 = param \"x\\q\" : f32[]\n}}\n"), 3, 16, "unknown escape `\\q`");
    check(&format!("{HEAD}  %1 = param \"x\" : f32[99999999999*99999999999]\n}}\n"), 3, 36, "dimension overflows 64 bits");
    check(&format!("{HEAD}}}\n}}\n"), 4, 1, "expected end of input after the closing `}`, found `}`");
    check(&format!("{HEAD}  %1 = neg %0 : f32[B, 4] @\n}}\n"), 3, 27, "unexpected character `@`");
    check(&format!("{HEAD}  % = neg %0 : f32[B, 4]\n}}\n"), 3, 3, "expected a value number after `%`, found ` `");
    check("graph g(B, B) {\n}\n", 1, 12, "symbol `B` is declared twice");
    check("grph g() {}", 1, 1, "expected `graph` at the start of the text, found `grph`");
    check("", 1, 1, "expected `graph` at the start of the text, found end of input");
    check("graph g() {\n  %0 = const 1.0 : f32[]\n  %1 = concat %0 {axis = 0} : f32[]\n}\n", 3, 8, "concat axis 0 out of range");
    let big = "graph g() {\n  %0 = param \"a\" : f32[18446744073709551615]\n  %1 = concat %0, %0 {axis = 0} : f32[1]\n}\n";
    check(big, 3, 8, "concat result dimension overflows 64 bits");
    check("graph g() {\n  %0 = iota {axis = 0} : i32[]\n}\n", 2, 8, "iota axis 0 out of range");
    check("graph g() {\n  %0 = scatter_add : f32[]\n}\n", 2, 22, "`scatter_add` produces a rank-2 type");
    // Columns count characters, not bytes.
    check("graph g() {\n  %0 = param \"ü☃\" : f32[Q]\n}\n", 2, 25, "symbol `Q` is not declared in the graph header (declared: none)");
}

#[test]
fn big_graph_parses_and_prints_fast() {
    let mut g = Graph::new("big", &["B", "T"]);
    let t = Type::new(DType::F32, Shape(vec![fusec_ir::Dim::sym("B"), fusec_ir::Dim::sym("T"), fusec_ir::Dim::lit(64)].into()));
    let mut v = g.add1(Op::Param { name: "x".into(), ty: t.clone() }, &[]);
    let w = g.add1(Op::Param { name: "w".into(), ty: Type::new(DType::F32, Shape::lits(&[64])) }, &[]);
    while g.nodes.len() < 20_000 {
        let y = g.add1(Op::Unary(fusec_ir::UnaryOp::Tanh), &[v]);
        v = g.add1(Op::Binary(fusec_ir::BinaryOp::Add), &[y, v]);
        let ln = g.add(Op::LayerNorm { eps: 1e-5 }, &[v, w, w]);
        v = ln[0];
    }
    g.output("y", v);
    let t0 = std::time::Instant::now();
    let s = print(&g);
    let t1 = std::time::Instant::now();
    let g2 = parse(&s, "big.graph").unwrap();
    let t2 = std::time::Instant::now();
    assert!(g2 == g);
    eprintln!("20k nodes, {} bytes: print {:?}, parse {:?}", s.len(), t1 - t0, t2 - t1);
    // Generous even for an unoptimized build on a busy machine; release takes tens of ms.
    assert!(t2 - t0 < std::time::Duration::from_secs(5));
}
