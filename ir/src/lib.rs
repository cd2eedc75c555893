//! The fusec op-graph IR: dtypes, symbolic shapes, ops with their type rules, the graph, its
//! canonical `.graph` text form, the verifier and the reference interpreter (the oracle every
//! pass and backend is tested against). Nothing here knows that a backend exists.

mod dtype;
mod graph;
pub mod infer;
pub mod interp;
mod op;
pub mod rng;
mod shape;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod text;
pub mod verify;

pub use dtype::DType;
pub use graph::{Graph, Node, NodeId, ValueId, ValueInfo};
pub use op::{BinaryOp, CmpOp, Gemm, Kernel, Op, ReduceOp, UnaryOp};
pub use shape::{Bindings, Dim, Shape, Type};
