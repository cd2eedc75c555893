//! Executes compiled plans and everything around them: llm.c checkpoints and token files, the
//! data loader, parameter binding, executors and the training loop.

pub mod checkpoint;
pub mod corpus;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod executor;
pub mod file_error;
pub mod launches;
pub mod layout;
pub mod params;
pub mod profile;
pub mod programs;
pub mod sample;
pub mod tokenizer;
pub mod tokens;
pub mod train;
