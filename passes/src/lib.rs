//! Graph-to-graph passes, one per file, each named as on the command line
//! (`fusec dump --pass NAME`). See [`pipeline`] for the order.
//!
//! One step leaves the graph: [`lower_rows`] (`--pass lower-rows`, after `memplan`) lowers each
//! `kernel` node's body into row programs ([`fusec_ir::rows`]), the kernel-level IR that both
//! backends generate code from.

pub mod amp;
pub mod autodiff;
pub mod canonicalize;
pub mod data_parallel;
pub mod explain;
pub mod fuse_classifier;
pub mod fuse_elementwise;
pub mod fuse_epilogue;
pub mod fuse_grad_accum;
pub mod fuse_layernorm;
pub mod lower_rows;
pub mod memplan;
pub mod optimizer;
mod pattern;
pub mod pipeline;
pub mod recompute;
mod rewrite;
pub mod schedule;
pub mod schedule_colsum;
mod schedule_overlap;
pub mod zero;
