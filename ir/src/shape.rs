//! Shapes with symbolic dimensions.
//!
//! A dimension is a monomial `coef * S1 * S2 * ...` over symbols declared in the graph header
//! (`B`, `T`). Monomials are closed under the products that reshapes need (`[B, T, C]` to
//! `[B*T, C]`), and two dims are equal exactly when their normalized forms are equal.

use smallvec::SmallVec;
use std::collections::BTreeMap;
use std::fmt;

use crate::DType;

/// One dimension: `coef` times the product of `syms` (sorted, repeats allowed).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Dim {
    /// Constant factor.
    pub coef: u64,
    /// Symbolic factors, sorted by name.
    pub syms: SmallVec<[String; 2]>,
}

impl Dim {
    /// A constant dimension.
    pub fn lit(n: u64) -> Dim {
        Dim { coef: n, syms: SmallVec::new() }
    }

    /// A single symbol.
    pub fn sym(name: &str) -> Dim {
        Dim { coef: 1, syms: SmallVec::from_vec(vec![name.to_string()]) }
    }

    /// The product of two dims.
    pub fn mul(&self, other: &Dim) -> Dim {
        let mut syms: SmallVec<[String; 2]> = self.syms.iter().chain(other.syms.iter()).cloned().collect();
        syms.sort();
        Dim { coef: self.coef.saturating_mul(other.coef), syms }
    }

    /// The constant value, if the dim has no symbols.
    pub fn as_lit(&self) -> Option<u64> {
        self.syms.is_empty().then_some(self.coef)
    }

    /// The value under a binding of every symbol, or the first unbound symbol.
    pub fn eval(&self, b: &Bindings) -> Result<u64, String> {
        let mut v = self.coef;
        for s in &self.syms {
            let x = b.get(s).ok_or_else(|| format!("symbolic dim `{s}` is not bound"))?;
            v = v.saturating_mul(x);
        }
        Ok(v)
    }

    /// This dim with every bound symbol replaced by its value.
    pub fn bind(&self, b: &Bindings) -> Dim {
        let mut d = Dim::lit(self.coef);
        for s in &self.syms {
            d = match b.get(s) {
                Some(v) => d.mul(&Dim::lit(v)),
                None => d.mul(&Dim::sym(s)),
            };
        }
        d
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.syms.is_empty() {
            return write!(f, "{}", self.coef);
        }
        if self.coef != 1 {
            write!(f, "{}*", self.coef)?;
        }
        write!(f, "{}", self.syms.join("*"))
    }
}

/// Values of symbolic dims, e.g. `B = 4, T = 64`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bindings(pub BTreeMap<String, u64>);

impl Bindings {
    /// Binds `name` to `value`.
    pub fn set(&mut self, name: &str, value: u64) -> &mut Self {
        self.0.insert(name.to_string(), value);
        self
    }
    /// The value of `name`, if bound.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.0.get(name).copied()
    }
}

/// A tensor shape: a list of dims, outermost first (row-major).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub SmallVec<[Dim; 4]>);

impl Shape {
    /// A shape of constant dims.
    pub fn lits(dims: &[u64]) -> Shape {
        Shape(dims.iter().map(|&d| Dim::lit(d)).collect())
    }
    /// The scalar shape `[]`.
    pub fn scalar() -> Shape {
        Shape(SmallVec::new())
    }
    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// The product of all dims (the element count), as a dim.
    pub fn numel(&self) -> Dim {
        self.0.iter().fold(Dim::lit(1), |a, d| a.mul(d))
    }
    /// Concrete sizes under a binding.
    pub fn eval(&self, b: &Bindings) -> Result<Vec<usize>, String> {
        self.0.iter().map(|d| d.eval(b).map(|v| v as usize)).collect()
    }
    /// This shape with bound symbols replaced by their values.
    pub fn bind(&self, b: &Bindings) -> Shape {
        Shape(self.0.iter().map(|d| d.bind(b)).collect())
    }
    /// The dims as a slice.
    pub fn dims(&self) -> &[Dim] {
        &self.0
    }
}

impl From<Vec<Dim>> for Shape {
    fn from(v: Vec<Dim>) -> Shape {
        Shape(SmallVec::from_vec(v))
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The type of a value: element type and shape, printed `f32[B, T, 768]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Type {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
}

impl Type {
    /// Builds a type.
    pub fn new(dtype: DType, shape: Shape) -> Type {
        Type { dtype, shape }
    }
    /// A rank-0 type.
    pub fn scalar(dtype: DType) -> Type {
        Type { dtype, shape: Shape::scalar() }
    }
    /// Same shape, other dtype.
    pub fn with_dtype(&self, dtype: DType) -> Type {
        Type { dtype, shape: self.shape.clone() }
    }
    /// Bytes taken under a binding.
    pub fn bytes(&self, b: &Bindings) -> Result<usize, String> {
        Ok(self.shape.eval(b)?.iter().product::<usize>() * self.dtype.size_bytes())
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}
