//! Runs the programs of a run and everything around them.
//!
//! - [`programs`]: the programs a training run needs (Eval, Grad, Step, Logits) or the
//!   decoder's (Prefill, Decode), compiled once
//!   through the pass pipeline ([`programs::RunPrograms`]);
//! - [`launches`]: the launch plan, every program as a backend-neutral list of launches over
//!   one [`layout::SharedLayout`] (the memory plans of all programs, persistent tensors shared);
//! - [`executor`]: the interface the training loop drives, and the interpreter's executor;
//!   [`cpu`] and [`cuda`] translate the launch plan into their own launch records;
//! - [`profile`]: per-launch timings by kernel name (any executor) and one step's launches in
//!   order; [`roofline`]: the device limits they are compared with; [`trace`]: timelines in the
//!   Chrome trace-event format;
//! - [`train`]: the training loop and [`schedule`] its learning rate; [`data`], [`tokens`],
//!   [`checkpoint`], [`params`]: llm.c's token files and checkpoints and the data loader
//!   ([`normals`]: the random initialization's normals, fast and exact);
//!   [`savedir`]: checkpoint folders (`model.bin` + [`state`]) for exact resume, written
//!   through [`atomic`] so that they are never torn; [`host`]: the process's host memory;
//!   [`tokenizer`], [`sample`]: GPT-2 BPE and sampling; [`decoder`]: sampling through the
//!   compiled decoder with a key/value cache; [`corpus`]: the embedded demo corpus;
//!   [`hf_gpt2`]: Hugging Face GPT-2 weights to and from llm.c checkpoints, through
//!   [`safetensors_io`]; [`dist`]: data-parallel plans, launch environment and rendezvous
//!   (no GPU needed; the NCCL side is not built yet).

pub mod atomic;
pub mod checkpoint;
pub mod corpus;
pub mod cpu;
pub mod cuda;
pub mod data;
pub mod decoder;
pub mod dist;
pub mod executor;
pub mod file_error;
pub mod hf_gpt2;
pub mod host;
pub mod launches;
pub mod layout;
pub mod normals;
pub mod params;
pub mod profile;
pub mod programs;
pub mod roofline;
pub mod safetensors_io;
pub mod sample;
pub mod savedir;
pub mod schedule;
pub mod state;
pub mod tokenizer;
pub mod tokens;
pub mod trace;
pub mod train;
