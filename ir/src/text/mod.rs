//! The canonical `.graph` text form: printer and parser.
//!
//! ```text
//! graph gpt2_tiny(B, T) {
//!   %0 = param "wte" : f32[512, 64]
//!   %1 = input "tokens" : i32[B, T]
//!   %2 = gather %0, %1 : f32[B, T, 64]
//!   %3 = matmul %2, %0 {trans_a = false, trans_b = true} : f32[B, T, 512]
//!   %4, %5, %6 = layernorm %2, %w, %b {eps = 1e-5} : f32[B, T, 64], f32[B, T], f32[B, T]
//!   output "logits" = %3
//! }
//! ```
//!
//! One node per line, values named `%N` by position of definition (node order, results left to
//! right), every result type printed, attributes in a fixed order. Attributes that the result
//! type implies (the type of sources, `cast`'s target, `reshape`/`broadcast`'s shape,
//! `scatter_add`'s rows) are not printed; the parser takes them from the declared type.
//! Floats print with round-trip precision (`inf`, `-inf`, `nan` for the non-finite ones).
//! `print(parse(print(g))) == print(g)` for every graph whose name and symbols are identifiers.
//!
//! The fused ops follow the same rules. `gemm` prints its flags (its `out` dtype is the first
//! result type's, like `cast`); `kernel` prints its quoted name before its operands and its
//! body after the result types, as a nested block numbered from `%0` whose `input` nodes
//! receive the operands in order and whose outputs are the results:
//!
//! ```text
//!   %5, %6 = gemm %1, %2, %3 {trans_a = false, trans_b = true, bias = true, gelu = true, accumulate = false} : f32[B, 256], f32[B, 256]
//!   %7 = kernel "add_tanh" %5, %6 : f32[B, 256] {
//!     %0 = input "x0" : f32[B, 256]
//!     %1 = input "x1" : f32[B, 256]
//!     %2 = add %0, %1 : f32[B, 256]
//!     %3 = tanh %2 : f32[B, 256]
//!     output "y0" = %3
//!   }
//! ```
//!
//! A body shares the enclosing graph's symbols and is named after its kernel.
//!
//! The parser checks syntax, value numbering, definition before use, declared symbols, and
//! every declared result type against [`crate::infer::result_types`]; errors are
//! [`Diagnostic`]s with `file:line:col`. It never panics, whatever the input.

mod build;
mod kind;
mod lex;
mod parse;

use std::fmt::{self, Write};

use crate::{Graph, Op, ReduceOp, ValueId};

pub use parse::{parse, MAX_KERNEL_DEPTH};

/// A parse error: where it is and what was expected versus found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// The file name given to [`parse`].
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub col: usize,
    /// What is wrong.
    pub msg: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: {}", self.file, self.line, self.col, self.msg)
    }
}

impl std::error::Error for Diagnostic {}

/// `s` as a quoted `.graph` string literal (escaping `"`, `\`, newline and tab).
pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    quote_into(&mut out, s);
    out
}

fn quote_into(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as `.graph` text: shortest round-trip form that always looks like a float
/// (`0.5`, `1e-5`, `1.0`, `-0.0`), or `inf`, `-inf`, `nan`.
pub fn format_f64(x: f64) -> String {
    if x.is_nan() {
        "nan".to_string()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.to_string()
    } else {
        format!("{x:?}")
    }
}

/// Whether `s` can be printed bare as a graph name or symbol (`[A-Za-z_][A-Za-z0-9_.-]*`).
pub fn is_ident(s: &str) -> bool {
    let mut cs = s.chars();
    cs.next().is_some_and(lex::ident_start) && cs.all(lex::ident_char)
}

/// The canonical text of `g`. Values are renumbered by position of definition; a graph whose
/// name is not an identifier gets a quoted name (which the parser also accepts). Kernel bodies
/// are printed nested, indented two more spaces, with their own numbering from `%0`.
pub fn print(g: &Graph) -> String {
    let mut out = String::with_capacity(64 + 48 * g.nodes.len());
    out.push_str("graph ");
    if is_ident(&g.name) {
        out.push_str(&g.name);
    } else {
        quote_into(&mut out, &g.name);
    }
    out.push('(');
    out.push_str(&g.syms.join(", "));
    out.push_str(") {\n");
    print_body(&mut out, g, 2);
    out.push_str("}\n");
    out
}

/// Appends the nodes and outputs of `g`, one per line, each indented by `indent` spaces.
fn print_body(out: &mut String, g: &Graph, indent: usize) {
    // Value id -> position number.
    let mut num = vec![u32::MAX; g.values.len()];
    let mut next = 0u32;
    for n in &g.nodes {
        for r in &n.results {
            if let Some(slot) = num.get_mut(r.0 as usize) {
                *slot = next;
            }
            next = next.wrapping_add(1);
        }
    }
    let name = |out: &mut String, v: ValueId| match num.get(v.0 as usize) {
        Some(&n) if n != u32::MAX => {
            let _ = write!(out, "%{n}");
        }
        // A malformed graph: printed so that it is visibly wrong (and does not parse).
        _ => {
            let _ = write!(out, "%?{}", v.0);
        }
    };
    let pad = |out: &mut String| out.extend(std::iter::repeat_n(' ', indent));

    for n in &g.nodes {
        pad(out);
        for (i, r) in n.results.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            name(out, *r);
        }
        out.push_str(" = ");
        out.push_str(n.op.mnemonic());
        match &n.op {
            Op::Param { name, .. } | Op::Input { name, .. } => {
                out.push(' ');
                quote_into(out, name);
            }
            Op::Const { value, .. } => {
                out.push(' ');
                out.push_str(&format_f64(*value));
            }
            Op::Kernel(k) => {
                out.push(' ');
                quote_into(out, &k.name);
            }
            _ => {}
        }
        for (i, v) in n.inputs.iter().enumerate() {
            out.push_str(if i == 0 { " " } else { ", " });
            name(out, *v);
        }
        print_attrs(out, &n.op);
        out.push_str(" : ");
        for (i, r) in n.results.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            match g.values.get(r.0 as usize) {
                Some(info) => {
                    let _ = write!(out, "{}", info.ty);
                }
                None => out.push('?'),
            }
        }
        if let Op::Kernel(k) = &n.op {
            out.push_str(" {\n");
            print_body(out, &k.body, indent + 2);
            pad(out);
            out.push('}');
        }
        out.push('\n');
    }
    for (oname, v) in &g.outputs {
        pad(out);
        out.push_str("output ");
        quote_into(out, oname);
        out.push_str(" = ");
        name(out, *v);
        out.push('\n');
    }
}

/// Appends ` {k = v, ...}` for the op's printed attributes (nothing for ops without any).
fn print_attrs(out: &mut String, op: &Op) {
    fn list(xs: &[usize]) -> String {
        let items: Vec<String> = xs.iter().map(|x| x.to_string()).collect();
        format!("[{}]", items.join(", "))
    }
    let f = format_f64;
    let attrs: Vec<(&str, String)> = match op {
        Op::Iota { axis, .. } => vec![("axis", axis.to_string())],
        Op::Broadcast { dims, .. } => vec![("dims", list(dims))],
        Op::Permute { perm } => vec![("perm", list(perm))],
        Op::Slice { axis, start, end } => {
            vec![("axis", axis.to_string()), ("start", start.to_string()), ("end", end.to_string())]
        }
        Op::Concat { axis } => vec![("axis", axis.to_string())],
        Op::Reduce { op: ReduceOp::Sum | ReduceOp::Max, axes } => vec![("axes", list(axes))],
        Op::FromOwners { owners } => vec![("owners", list(owners))],
        Op::MatMul { trans_a, trans_b } => vec![("trans_a", trans_a.to_string()), ("trans_b", trans_b.to_string())],
        Op::Gemm(gm) => vec![
            ("trans_a", gm.trans_a.to_string()),
            ("trans_b", gm.trans_b.to_string()),
            ("bias", gm.bias.to_string()),
            ("gelu", gm.gelu.to_string()),
            ("accumulate", gm.accumulate.to_string()),
        ],
        Op::LayerNorm { eps } => vec![("eps", f(*eps))],
        Op::CrossEntropy { vocab } | Op::CrossEntropyGrad { vocab } | Op::CrossEntropyWithGrad { vocab } => {
            vec![("vocab", vocab.to_string())]
        }
        Op::Attention { heads, scale } | Op::AttentionGrad { heads, scale } => {
            vec![("heads", heads.to_string()), ("scale", f(*scale))]
        }
        Op::AdamW { beta1, beta2, eps, weight_decay } => {
            vec![("beta1", f(*beta1)), ("beta2", f(*beta2)), ("eps", f(*eps)), ("weight_decay", f(*weight_decay))]
        }
        _ => return,
    };
    out.push_str(" {");
    for (i, (k, v)) in attrs.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(k);
        out.push_str(" = ");
        out.push_str(v);
    }
    out.push('}');
}
