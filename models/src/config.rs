//! GPT-2 model sizes and the named presets: the one config type of the builder and of llm.c's
//! checkpoint header (`fusec_runtime::checkpoint` reads and writes it).

use std::fmt;

/// Largest accepted values, to reject garbage headers and flags before allocating anything.
const MAX_SEQ: usize = 1 << 20;
const MAX_VOCAB: usize = 1 << 24;
const MAX_LAYERS: usize = 4096;
const MAX_CHANNELS: usize = 1 << 16;
const MAX_PARAMS: usize = 1 << 40;

/// The sizes that define a GPT-2 model (llm.c's header fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Gpt2Config {
    /// Number of transformer blocks (L).
    pub layers: usize,
    /// Attention heads per block (NH).
    pub heads: usize,
    /// Embedding width (C); must be divisible by `heads`.
    pub channels: usize,
    /// Real vocabulary size (V): the loss covers these logits.
    pub vocab: usize,
    /// Padded vocabulary (Vp >= V): rows of wte and columns of the logits.
    pub padded_vocab: usize,
    /// Rows of the position table: the longest sequence the model accepts.
    pub max_seq: usize,
}

/// The named presets: (name, config, what it is).
pub fn presets() -> Vec<(&'static str, Gpt2Config, &'static str)> {
    let c = |layers, heads, channels, vocab, padded_vocab, max_seq| Gpt2Config { layers, heads, channels, vocab, padded_vocab, max_seq };
    vec![
        ("tiny", c(2, 2, 64, 250, 256, 64), "2 layers, 64 channels: tests and the embedded demo"),
        ("small", c(4, 4, 256, 8192, 8192, 256), "4 layers, 256 channels: the CPU benchmark"),
        ("d12", c(12, 12, 768, 50257, 50304, 1024), "GPT-2 124M"),
        ("d24", c(24, 16, 1024, 50257, 50304, 1024), "GPT-2 350M"),
        ("d36", c(36, 20, 1280, 50257, 50304, 1024), "GPT-2 774M"),
        ("d48", c(48, 25, 1600, 50257, 50304, 1024), "GPT-2 1.5B"),
    ]
}

impl Gpt2Config {
    /// The preset of that name.
    pub fn preset(name: &str) -> Option<Gpt2Config> {
        presets().into_iter().find(|(n, _, _)| *n == name).map(|(_, c, _)| c)
    }

    /// Checks that every size is positive and sane (the limits reject garbage checkpoint
    /// headers and configs whose parameters could not be allocated): channels divisible by
    /// heads, padded vocab ≥ vocab. The error names the value by its llm.c header name.
    pub fn validate(&self) -> Result<(), String> {
        let fields = [
            ("max_seq_len", self.max_seq, MAX_SEQ),
            ("vocab_size", self.vocab, MAX_VOCAB),
            ("padded_vocab_size", self.padded_vocab, MAX_VOCAB),
            ("num_layers", self.layers, MAX_LAYERS),
            ("num_heads", self.heads, MAX_CHANNELS),
            ("channels", self.channels, MAX_CHANNELS),
        ];
        for (name, value, limit) in fields {
            if value == 0 {
                return Err(format!("bad config: {name} is 0; it must be positive"));
            }
            if value > limit {
                return Err(format!("bad config: {name} {value} is absurdly large (limit {limit})"));
            }
        }
        if !self.channels.is_multiple_of(self.heads) {
            return Err(format!("bad config: channels {} is not divisible by num_heads {}", self.channels, self.heads));
        }
        if self.padded_vocab < self.vocab {
            return Err(format!("bad config: padded_vocab_size {} is smaller than vocab_size {}", self.padded_vocab, self.vocab));
        }
        match self.checked_num_params() {
            Some(n) if n <= MAX_PARAMS => Ok(()),
            _ => Err(format!("bad config: {self} has absurdly many parameters")),
        }
    }

    /// Number of trainable parameters. Saturates for absurd configs; call
    /// [`Gpt2Config::validate`] first.
    pub fn num_params(&self) -> usize {
        self.checked_num_params().unwrap_or(usize::MAX)
    }

    fn checked_num_params(&self) -> Option<usize> {
        let (l, c) = (self.layers, self.channels);
        let per_layer = c.checked_mul(c)?.checked_mul(12)?.checked_add(c.checked_mul(13)?)?;
        let embeddings = self.padded_vocab.checked_add(self.max_seq)?.checked_mul(c)?;
        embeddings.checked_add(l.checked_mul(per_layer)?)?.checked_add(c.checked_mul(2)?)
    }
}

impl fmt::Display for Gpt2Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "(max_seq_len {}, vocab_size {}, padded_vocab_size {}, num_layers {}, num_heads {}, channels {})",
            self.max_seq, self.vocab, self.padded_vocab, self.layers, self.heads, self.channels
        )
    }
}

impl Gpt2Config {
    /// Recovers the sizes from a GPT-2 graph built by [`crate::build_gpt2`]: shapes of `wte`,
    /// `wpe` and `ln1w.*`, the attention scale (head size) and the loss's vocabulary slice.
    pub fn from_graph(g: &fusec_ir::Graph) -> Result<Gpt2Config, String> {
        use fusec_ir::{Bindings, Op};
        let shape_of = |name: &str| -> Result<Vec<usize>, String> {
            let (_, v) = g
                .params()
                .into_iter()
                .find(|(n, _)| *n == name)
                .ok_or_else(|| format!("graph `{}` has no parameter `{name}`: not a GPT-2 graph", g.name))?;
            g.ty(v).shape.eval(&Bindings::default())
        };
        let matrix = |name: &str| -> Result<Vec<usize>, String> {
            let s = shape_of(name)?;
            if s.len() == 2 {
                Ok(s)
            } else {
                Err(format!("parameter `{name}` has shape {s:?}; a GPT-2 graph's is a matrix"))
            }
        };
        let wte = matrix("wte")?;
        let wpe = matrix("wpe")?;
        let layers = g.params().iter().filter(|(n, _)| n.starts_with("ln1w.")).count();
        let mut head_size = None;
        let mut vocab = None;
        for n in &g.nodes {
            match &n.op {
                Op::Attention { heads, .. } if head_size.is_none() => head_size = Some(wte[1] / (*heads as usize).max(1)),
                Op::Slice { axis, start: 0, end }
                    if vocab.is_none()
                        && g.ty(n.inputs[0]).shape.0.last().and_then(|d| d.as_lit()) == Some(wte[0] as u64)
                        && *axis + 1 == g.ty(n.inputs[0]).shape.rank() =>
                {
                    vocab = Some(*end as usize)
                }
                _ => {}
            }
        }
        let hs = head_size.filter(|&h| h > 0).ok_or("the graph has no attention op: not a GPT-2 graph")?;
        let cfg = Gpt2Config {
            layers,
            heads: wte[1] / hs,
            channels: wte[1],
            vocab: vocab.ok_or("the graph has no vocabulary slice of the logits: not a GPT-2 graph")?,
            padded_vocab: wte[0],
            max_seq: wpe[0],
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
