//! The parser of the `.graph` text (grammar in the parent module's docs).
//!
//! The grammar is flat except for kernel bodies, whose nesting is bounded by
//! [`MAX_KERNEL_DEPTH`]; every number is converted with checked arithmetic, and every node is
//! type-checked against [`result_types`] as soon as it is read, so a bad input is reported at
//! the first offending token and never panics (nor overflows the stack).

use std::collections::{HashMap, HashSet};

use super::build::{AttrVal, Attrs, NodeParts};
use super::kind::{kind_of, Kind};
use super::lex::{clip, tokenize, Pos, Tok, Token};
use super::Diagnostic;
use crate::infer::result_types;
use crate::{DType, Dim, Graph, Op, Shape, Type, ValueId};

/// How deeply kernel bodies may nest in the text (the verifier allows only one level; the
/// parser accepts more so that the verifier can say what is wrong, but bounds the recursion).
pub const MAX_KERNEL_DEPTH: usize = 8;

/// Parses `.graph` text; `file` is only used in diagnostics. Checks syntax, that the n-th
/// defined value is named `%n` (each kernel body numbering its own values from `%0`), that
/// operands are defined before use, that symbols are declared in the header, and that every
/// declared result type is what the op produces.
pub fn parse(src: &str, file: &str) -> Result<Graph, Diagnostic> {
    let toks = tokenize(src, file)?;
    let mut p = Parser { toks, i: 0, file, syms: HashSet::new(), g: Graph::default(), depth: 0, names: Names::default() };
    p.graph()?;
    Ok(p.g)
}

/// The parser state: tokens, the cursor, and the graph being built (a kernel body while one
/// is being read; the enclosing graph is set aside meanwhile).
pub(super) struct Parser<'a> {
    toks: Vec<Token>,
    i: usize,
    file: &'a str,
    syms: HashSet<String>,
    g: Graph,
    /// How many kernel bodies enclose the current position.
    depth: usize,
    /// The names declared so far in the graph being built.
    names: Names,
}

/// The names declared in one graph (a kernel body has its own), each with the line of its
/// first declaration.
#[derive(Default)]
struct Names {
    /// Parameter and input names (one namespace): kind (`parameter` or `input`) and line.
    sources: HashMap<String, (&'static str, usize)>,
    /// Output names and their lines.
    outputs: HashMap<String, usize>,
}

/// A parse result.
pub(super) type R<T> = Result<T, Diagnostic>;

impl<'a> Parser<'a> {
    fn peek(&self) -> &Token {
        // `tokenize` always ends with `Eof`, and `bump` never moves past it.
        &self.toks[self.i.min(self.toks.len() - 1)]
    }

    fn bump(&mut self) -> Token {
        let t = self.peek().clone();
        if t.tok != Tok::Eof {
            self.i += 1;
        }
        t
    }

    /// An error at `pos`.
    pub(super) fn err<T>(&self, pos: Pos, msg: String) -> R<T> {
        Err(Diagnostic { file: self.file.to_string(), line: pos.line, col: pos.col, msg })
    }

    /// An error at the next token: "expected {what}, found {token}".
    fn expected<T>(&self, what: &str) -> R<T> {
        let t = self.peek();
        self.err(t.pos, format!("expected {what}, found {}", t.tok.describe()))
    }

    fn is_punct(&self, c: char) -> bool {
        self.peek().tok == Tok::Punct(c)
    }

    fn eat_punct(&mut self, c: char) -> bool {
        let yes = self.is_punct(c);
        if yes {
            self.bump();
        }
        yes
    }

    fn expect_punct(&mut self, c: char, context: &str) -> R<Pos> {
        if self.is_punct(c) {
            Ok(self.bump().pos)
        } else {
            self.expected(&format!("`{c}` {context}"))
        }
    }

    fn ident(&mut self, what: &str) -> R<(String, Pos)> {
        match &self.peek().tok {
            Tok::Ident(_) => match self.bump() {
                Token { tok: Tok::Ident(s), pos } => Ok((s, pos)),
                t => self.err(t.pos, format!("expected {what}")),
            },
            _ => self.expected(what),
        }
    }

    fn string(&mut self, what: &str) -> R<String> {
        match &self.peek().tok {
            Tok::Str(_) => match self.bump().tok {
                Tok::Str(s) => Ok(s),
                _ => self.expected(what),
            },
            _ => self.expected(what),
        }
    }

    /// A non-negative integer literal.
    pub(super) fn int_of(&self, lexeme: &str, pos: Pos) -> R<u64> {
        if !lexeme.bytes().all(|b| b.is_ascii_digit()) {
            return self.err(pos, format!("expected a non-negative integer, found `{}`", clip(lexeme)));
        }
        match lexeme.parse::<u64>() {
            Ok(n) => Ok(n),
            Err(_) => self.err(pos, format!("integer `{}` does not fit in 64 bits", clip(lexeme))),
        }
    }

    fn int(&mut self, what: &str) -> R<u64> {
        match &self.peek().tok {
            Tok::Num(s) => {
                let (s, pos) = (s.clone(), self.peek().pos);
                let n = self.int_of(&s, pos)?;
                self.bump();
                Ok(n)
            }
            _ => self.expected(what),
        }
    }

    /// A float literal (`inf`, `-inf` and `nan` included).
    pub(super) fn float_of(&self, lexeme: &str, pos: Pos) -> R<f64> {
        let x = match lexeme {
            "inf" => return Ok(f64::INFINITY),
            "-inf" => return Ok(f64::NEG_INFINITY),
            "nan" => return Ok(f64::NAN),
            s => s.parse::<f64>(),
        };
        match x {
            Ok(x) if x.is_finite() => Ok(x),
            Ok(_) => self.err(pos, format!("float `{}` is out of range (write `inf` for infinity)", clip(lexeme))),
            Err(_) => self.err(pos, format!("expected a float, found `{}`", clip(lexeme))),
        }
    }

    fn float(&mut self, what: &str) -> R<f64> {
        let t = self.peek();
        match &t.tok {
            Tok::Num(s) => {
                let x = self.float_of(s, t.pos)?;
                self.bump();
                Ok(x)
            }
            Tok::Ident(s) if s == "inf" || s == "nan" => {
                let x = self.float_of(s, t.pos)?;
                self.bump();
                Ok(x)
            }
            _ => self.expected(what),
        }
    }

    /// `%N` naming an already-defined value.
    fn value_ref(&mut self, what: &str) -> R<ValueId> {
        let t = self.peek().clone();
        let Tok::Value(d) = &t.tok else {
            return self.expected(what);
        };
        let n = d.parse::<u64>().ok().filter(|&n| n < self.g.values.len() as u64);
        match n {
            Some(n) => {
                self.bump();
                Ok(ValueId(n as u32))
            }
            None => self.err(t.pos, format!("value %{} used before it is defined", clip(d))),
        }
    }

    fn graph(&mut self) -> R<()> {
        match &self.peek().tok {
            Tok::Ident(s) if s == "graph" => {
                self.bump();
            }
            _ => return self.expected("`graph` at the start of the text"),
        }
        self.g.name = match &self.peek().tok {
            Tok::Ident(_) => self.ident("the graph name")?.0,
            Tok::Str(_) => self.string("the graph name")?,
            _ => return self.expected("the graph name"),
        };
        self.expect_punct('(', "after the graph name")?;
        if !self.eat_punct(')') {
            loop {
                let (s, pos) = self.ident("a symbol name")?;
                if !self.syms.insert(s.clone()) {
                    return self.err(pos, format!("symbol `{}` is declared twice", clip(&s)));
                }
                self.g.syms.push(s);
                if self.eat_punct(')') {
                    break;
                }
                self.expect_punct(',', "or `)` after a symbol")?;
            }
        }
        self.expect_punct('{', "to open the graph body")?;
        self.statements("the graph")?;
        if self.peek().tok != Tok::Eof {
            return self.expected("end of input after the closing `}`");
        }
        Ok(())
    }

    /// Nodes and outputs up to and including the closing `}` of `what`.
    fn statements(&mut self, what: &str) -> R<()> {
        loop {
            match &self.peek().tok {
                Tok::Value(_) => self.node()?,
                Tok::Ident(s) if s == "output" => self.output()?,
                Tok::Punct('}') => {
                    self.bump();
                    return Ok(());
                }
                Tok::Eof => return self.expected(&format!("`}}` to close {what}")),
                _ => return self.expected("a node `%N = ...`, `output` or `}`"),
            }
        }
    }

    /// A kernel body after its opening `{` (at `open`): a graph of its own, numbered from
    /// `%0`, over the enclosing graph's symbols, named after the kernel.
    fn kernel_body(&mut self, name: &str, open: Pos) -> R<Graph> {
        if self.depth >= MAX_KERNEL_DEPTH {
            return self.err(open, format!("kernel bodies nest more than {MAX_KERNEL_DEPTH} deep"));
        }
        let body = Graph { name: name.to_string(), syms: self.g.syms.clone(), ..Graph::default() };
        let outer = std::mem::replace(&mut self.g, body);
        let outer_names = std::mem::take(&mut self.names);
        self.depth += 1;
        let r = self.statements("the kernel body");
        self.depth -= 1;
        self.names = outer_names;
        let body = std::mem::replace(&mut self.g, outer);
        r.map(|()| body)
    }

    fn output(&mut self) -> R<()> {
        self.bump();
        let pos = self.peek().pos;
        let name = self.string("the quoted output name after `output`")?;
        if let Some(&first) = self.names.outputs.get(&name) {
            return self.err(pos, format!("output {} is declared twice (first at line {first})", super::quote(&clip(&name))));
        }
        self.names.outputs.insert(name.clone(), pos.line);
        self.expect_punct('=', "after the output name")?;
        let v = self.value_ref("the output value `%N`")?;
        self.g.output(&name, v);
        Ok(())
    }

    fn node(&mut self) -> R<()> {
        let node_pos = self.peek().pos;
        // Result names: the n-th defined value must be `%n`.
        let mut n_results = 0u64;
        loop {
            let t = self.peek().clone();
            let want = self.g.values.len() as u64 + n_results;
            match &t.tok {
                Tok::Value(d) if d.parse::<u64>().ok() == Some(want) => {}
                Tok::Value(d) => {
                    return self
                        .err(t.pos, format!("expected `%{want}` (values are numbered in order of definition), found `%{}`", clip(d)))
                }
                _ => return self.expected("a result name `%N` after `,`"),
            }
            self.bump();
            n_results += 1;
            if !self.eat_punct(',') {
                break;
            }
        }
        self.expect_punct('=', "after the result names")?;
        let (m, op_pos) = self.ident("an op name after `=`")?;
        let Some(kind) = kind_of(&m) else {
            return self.err(op_pos, format!("unknown op `{}`", clip(&m)));
        };

        // Operands (or the name / value of a source).
        let mut name = String::new();
        let mut value = 0.0;
        let mut inputs: Vec<ValueId> = Vec::new();
        match kind {
            Kind::Param | Kind::Input => {
                let pos = self.peek().pos;
                name = self.string(&format!("the quoted name of the {m}"))?;
                self.declare_source(kind, &name, pos)?;
            }
            Kind::Kernel => name = self.string(&format!("the quoted name of the {m}"))?,
            Kind::Const => value = self.float("the constant's value (a float)")?,
            _ => {}
        }
        if !matches!(kind, Kind::Param | Kind::Input | Kind::Const) && matches!(self.peek().tok, Tok::Value(_)) {
            loop {
                inputs.push(self.value_ref("an operand `%N`")?);
                if !self.eat_punct(',') {
                    break;
                }
            }
        }
        // A kernel takes no attributes: its `{` opens the body, after the result types.
        let attrs = if kind != Kind::Kernel && self.is_punct('{') { self.attrs()? } else { Attrs { items: Vec::new() } };
        self.expect_punct(':', "before the result type")?;
        let mut types: Vec<(Type, Pos)> = Vec::new();
        loop {
            types.push(self.ty()?);
            if !self.eat_punct(',') {
                break;
            }
        }

        let body = if kind == Kind::Kernel {
            let open = self.expect_punct('{', "to open the kernel body after the result types")?;
            Some(self.kernel_body(&name, open)?)
        } else {
            None
        };
        let op = self.build_op(NodeParts { kind, m: m.clone(), op_pos, name, value, attrs, types: types.clone(), body })?;
        if types.len() as u64 != n_results {
            let msg = format!("{n_results} result name(s) but {} result type(s)", types.len());
            return self.err(node_pos, msg);
        }
        let ins: Vec<&Type> = inputs.iter().map(|v| &self.g.values[v.0 as usize].ty).collect();
        if let Op::Concat { axis } = &op {
            // Guard the element-count sum that `result_types` adds up unchecked.
            let total = ins.iter().try_fold(0u64, |acc, t| match t.shape.0.get(*axis).and_then(Dim::as_lit) {
                Some(n) => acc.checked_add(n).ok_or(()),
                None => Ok(acc),
            });
            if total.is_err() {
                return self.err(op_pos, "concat result dimension overflows 64 bits".to_string());
            }
        }
        let produced = match result_types(&op, &ins) {
            Ok(t) => t,
            Err(e) => return self.err(op_pos, e),
        };
        if produced.len() != types.len() {
            let msg = format!("`{m}` produces {} result(s), found {} declared", produced.len(), types.len());
            return self.err(node_pos, msg);
        }
        for (i, (want, (got, pos))) in produced.iter().zip(&types).enumerate() {
            if want != got {
                let which = if types.len() > 1 { format!(" for result {i}") } else { String::new() };
                return self.err(*pos, format!("declared type {got}{which} but `{m}` produces {want}"));
            }
        }
        let tys = types.into_iter().map(|(t, _)| t).collect();
        self.g.push_unchecked(op, &inputs, tys);
        Ok(())
    }

    /// Records the name of a parameter or input (at `pos`), refusing one already declared by
    /// either kind: they share one namespace (feeds and checkpoints bind them by name).
    fn declare_source(&mut self, kind: Kind, name: &str, pos: Pos) -> R<()> {
        let what = if kind == Kind::Param { "parameter" } else { "input" };
        let q = super::quote(&clip(name));
        match self.names.sources.get(name) {
            Some(&(first, line)) if first == what => self.err(pos, format!("{what} {q} is declared twice (first at line {line})")),
            Some(&(first, line)) => self.err(
                pos,
                format!("{what} {q} has the name of {first} {q} (declared at line {line}; parameters and inputs share one namespace)"),
            ),
            None => {
                self.names.sources.insert(name.to_string(), (what, pos.line));
                Ok(())
            }
        }
    }

    fn attrs(&mut self) -> R<Attrs> {
        self.bump(); // `{`
        let mut items: Vec<(String, Pos, Pos, AttrVal)> = Vec::new();
        if self.eat_punct('}') {
            return Ok(Attrs { items });
        }
        loop {
            let (k, pos) = self.ident("an attribute name")?;
            if items.iter().any(|(n, _, _, _)| *n == k) {
                return self.err(pos, format!("duplicate attribute `{}`", clip(&k)));
            }
            self.expect_punct('=', &format!("after attribute `{}`", clip(&k)))?;
            let t = self.peek().clone();
            let vpos = t.pos;
            let v = match &t.tok {
                Tok::Num(s) => AttrVal::Num(s.clone()),
                Tok::Ident(s) if s == "true" || s == "false" => AttrVal::Bool(s == "true"),
                Tok::Ident(s) if s == "inf" || s == "nan" => AttrVal::Num(s.clone()),
                Tok::Punct('[') => {
                    self.bump();
                    let mut xs = Vec::new();
                    if !self.is_punct(']') {
                        loop {
                            xs.push(self.int("an integer in the list")?);
                            if !self.eat_punct(',') {
                                break;
                            }
                        }
                    }
                    if !self.is_punct(']') {
                        return self.expected("`,` or `]` in the list");
                    }
                    AttrVal::List(xs)
                }
                _ => return self.expected("an attribute value (a number, `true`, `false` or `[...]`)"),
            };
            self.bump();
            items.push((k, pos, vpos, v));
            if self.eat_punct('}') {
                return Ok(Attrs { items });
            }
            self.expect_punct(',', "or `}` after an attribute")?;
        }
    }

    /// `dtype[dim, ...]`.
    fn ty(&mut self) -> R<(Type, Pos)> {
        let (d, pos) = self.ident("a result type such as `f32[B, 4]`")?;
        let Some(dtype) = DType::from_name(&d) else {
            return self.err(pos, format!("unknown dtype `{}` (expected f32, bf16, f16 or i32)", clip(&d)));
        };
        self.expect_punct('[', &format!("after dtype `{d}`"))?;
        let mut dims = Vec::new();
        if !self.eat_punct(']') {
            loop {
                dims.push(self.dim()?);
                if self.eat_punct(']') {
                    break;
                }
                self.expect_punct(',', "or `]` in the shape")?;
            }
        }
        Ok((Type::new(dtype, Shape::from(dims)), pos))
    }

    /// A product of integers and declared symbols, normalized.
    fn dim(&mut self) -> R<Dim> {
        let mut d = Dim::lit(1);
        loop {
            let t = self.peek().clone();
            match &t.tok {
                Tok::Num(s) => {
                    let n = self.int_of(s, t.pos)?;
                    let Some(c) = d.coef.checked_mul(n) else {
                        return self.err(t.pos, "dimension overflows 64 bits".to_string());
                    };
                    d.coef = c;
                }
                Tok::Ident(s) => {
                    if !self.syms.contains(s) {
                        let mut declared: Vec<&str> = self.g.syms.iter().map(|s| s.as_str()).collect();
                        declared.truncate(8);
                        let msg = format!(
                            "symbol `{}` is not declared in the graph header (declared: {})",
                            clip(s),
                            if declared.is_empty() { "none".to_string() } else { declared.join(", ") }
                        );
                        return self.err(t.pos, msg);
                    }
                    d.syms.push(s.clone());
                }
                _ => return self.expected("a dimension (an integer or a declared symbol)"),
            }
            self.bump();
            if !self.eat_punct('*') {
                break;
            }
        }
        d.syms.sort();
        Ok(d)
    }
}
