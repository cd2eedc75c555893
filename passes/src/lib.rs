//! Graph-to-graph passes, one per file, each named as on the command line
//! (`fusec dump --pass NAME`). See [`pipeline`] for the order.

pub mod autodiff;
pub mod explain;
pub mod optimizer;
pub mod pipeline;
mod rewrite;
