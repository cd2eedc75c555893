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

    /// The product of two dims; the constant factor saturates at `u64::MAX` (use
    /// [`Dim::checked_mul`] where an overflow must be caught).
    pub fn mul(&self, other: &Dim) -> Dim {
        let mut syms: SmallVec<[String; 2]> = self.syms.iter().chain(other.syms.iter()).cloned().collect();
        syms.sort();
        Dim { coef: self.coef.saturating_mul(other.coef), syms }
    }

    /// The product of two dims, or `None` when the constant factor overflows 64 bits.
    pub fn checked_mul(&self, other: &Dim) -> Option<Dim> {
        let coef = self.coef.checked_mul(other.coef)?;
        Some(Dim { coef, ..self.mul(other) })
    }

    /// The constant value, if the dim has no symbols.
    pub fn as_lit(&self) -> Option<u64> {
        self.syms.is_empty().then_some(self.coef)
    }

    /// The value under a binding of every symbol; an error names the first unbound symbol, or
    /// the factors of a product that overflows 64 bits (`B*T = 9223372036854775808*64 ...`).
    pub fn eval(&self, b: &Bindings) -> Result<u64, String> {
        let mut factors: SmallVec<[u64; 3]> = SmallVec::new();
        for s in &self.syms {
            factors.push(b.get(s).ok_or_else(|| format!("symbolic dim `{s}` is not bound"))?);
        }
        if self.coef == 0 || factors.contains(&0) {
            return Ok(0);
        }
        factors.iter().try_fold(self.coef, |v, &x| v.checked_mul(x)).ok_or_else(|| {
            let mut vals: Vec<String> = factors.iter().map(u64::to_string).collect();
            if self.coef != 1 {
                vals.insert(0, self.coef.to_string());
            }
            format!("dim {self} = {} overflows 64 bits", vals.join("*"))
        })
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
    /// The product of all dims, or `None` when its constant factor overflows 64 bits.
    pub fn checked_numel(&self) -> Option<Dim> {
        self.0.iter().try_fold(Dim::lit(1), |a, d| a.checked_mul(d))
    }
    /// Concrete sizes under a binding; every dim must fit in 64 bits and in this host's `usize`.
    pub fn eval(&self, b: &Bindings) -> Result<Vec<usize>, String> {
        self.0
            .iter()
            .map(|d| {
                let v = d.eval(b)?;
                usize::try_from(v).map_err(|_| format!("dim {d} = {v} does not fit in this host's {}-bit usize", usize::BITS))
            })
            .collect()
    }
    /// The element count under a binding, checked: an error shows the sizes whose product
    /// overflows 64 bits.
    pub fn eval_numel(&self, b: &Bindings) -> Result<u64, String> {
        let dims = self.0.iter().map(|d| d.eval(b)).collect::<Result<Vec<u64>, String>>()?;
        if dims.contains(&0) {
            return Ok(0);
        }
        dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or_else(|| {
            let vals: Vec<String> = dims.iter().map(u64::to_string).collect();
            format!("the element count of {self} = {} overflows 64 bits", vals.join("*"))
        })
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
    /// Bytes taken under a binding, checked: an error says which product overflows 64 bits or
    /// does not fit in this host's `usize`.
    pub fn bytes(&self, b: &Bindings) -> Result<usize, String> {
        let n = self.shape.eval_numel(b)?;
        let bytes = n
            .checked_mul(self.dtype.size_bytes() as u64)
            .ok_or_else(|| format!("the size of {self} = {n} elements * {} bytes overflows 64 bits", self.dtype.size_bytes()))?;
        usize::try_from(bytes)
            .map_err(|_| format!("the size of {self} = {bytes} bytes does not fit in this host's {}-bit usize", usize::BITS))
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}
