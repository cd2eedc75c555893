//! Graph builders: GPT-2 forward + loss for any configuration, with symbolic batch `B` and
//! sequence length `T` (the shipped `.graph` files in this folder are their output), and causal
//! attention alone for kernel tests and benchmarks, and the decoder with a key/value cache
//! that sampling runs.

mod attention;
mod config;
mod decode;
mod gpt2;

pub use attention::{bf16_attention_graph, f32_attention_graph};
pub use config::{presets, Gpt2Config};
pub use decode::{cache_shape, decoder_graph, decoder_tokens_input, key_cache_name, value_cache_name};
pub use gpt2::{build_gpt2, logits_graph};
