//! Element types of IR values.

use std::fmt;

/// The element type of a tensor value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16: 8 exponent bits, 7 mantissa bits, round-to-nearest-even on conversion.
    BF16,
    /// IEEE binary16.
    F16,
    /// 32-bit signed integer (token ids, indices, masks).
    I32,
}

impl DType {
    /// All dtypes, in printing order.
    pub const ALL: [DType; 4] = [DType::F32, DType::BF16, DType::F16, DType::I32];

    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }

    /// The spelling used in `.graph` text.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
        }
    }

    /// Parses the `.graph` spelling.
    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
