//! The fusec IR, at two levels:
//!
//! - the op graph: dtypes, symbolic shapes, ops with their type rules, the graph, its canonical
//!   `.graph` text form, the verifier and the reference interpreter (the oracle every pass and
//!   backend is tested against), and [`GemmSpec`], the concrete shape of one matrix product;
//! - the row programs ([`rows`]): what one fused kernel computes, as the backends want it (a
//!   domain of rows and columns, values per element / row / column / kernel, reduction levels),
//!   with their text form and the analyses every backend runs first. `fusec_passes::lower_rows`
//!   lowers a `kernel` node's body into them.
//!
//! Nothing here depends on a backend; the one backend-specific part is two lists of a row
//! program that only the CPU code generator fills in ([`rows::Prog::offloads`],
//! [`rows::Prog::native_maxes`]).

mod dtype;
mod gemm_spec;
mod graph;
pub mod infer;
pub mod interp;
mod op;
pub mod rng;
pub mod rows;
mod shape;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod text;
pub mod verify;

pub use dtype::DType;
pub use gemm_spec::GemmSpec;
pub use graph::{Graph, Node, NodeId, ValueId, ValueInfo};
pub use op::{BinaryOp, CmpOp, Gemm, Kernel, Op, ReduceOp, UnaryOp};
pub use shape::{Bindings, Dim, Shape, Type};
