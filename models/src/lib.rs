//! Graph builders: GPT-2 forward + loss for any configuration, with symbolic batch `B` and
//! sequence length `T`. The shipped `.graph` files in this folder are their output.

mod config;
mod gpt2;

pub use config::{presets, Gpt2Config};
pub use gpt2::{build_gpt2, logits_graph};
