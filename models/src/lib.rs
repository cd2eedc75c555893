//! Graph builders: GPT-2 forward + loss for any configuration, with symbolic batch `B` and
//! sequence length `T` (the shipped `.graph` files in this folder are their output), and causal
//! attention alone for kernel tests and benchmarks.

mod attention;
mod config;
mod gpt2;

pub use attention::bf16_attention_graph;
pub use config::{presets, Gpt2Config};
pub use gpt2::{build_gpt2, logits_graph};
