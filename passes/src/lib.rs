//! Graph-to-graph passes, one per file, each named as on the command line
//! (`fusec dump --pass NAME`). See [`pipeline`] for the order.

pub mod amp;
pub mod autodiff;
pub mod canonicalize;
pub mod explain;
pub mod fuse_elementwise;
pub mod fuse_epilogue;
pub mod fuse_grad_accum;
pub mod fuse_layernorm;
pub mod memplan;
pub mod optimizer;
mod pattern;
pub mod pipeline;
mod rewrite;
pub mod schedule;
