//! GPT-2 model sizes and the named presets.

/// The sizes that define a GPT-2 model (llm.c's header fields).
#[derive(Clone, Debug, PartialEq, Eq)]
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

    /// Checks that the sizes describe a buildable model; says what is wrong otherwise.
    pub fn validate(&self) -> Result<(), String> {
        let fields = [
            ("layers", self.layers),
            ("heads", self.heads),
            ("channels", self.channels),
            ("vocab", self.vocab),
            ("padded vocab", self.padded_vocab),
            ("max sequence length", self.max_seq),
        ];
        for (name, v) in fields {
            if v == 0 || v > 1 << 24 {
                return Err(format!("{name} must be in 1..=16777216, found {v}"));
            }
        }
        if self.channels % self.heads != 0 {
            return Err(format!("channels ({}) must be divisible by heads ({})", self.channels, self.heads));
        }
        if self.padded_vocab < self.vocab {
            return Err(format!("padded vocab ({}) must be at least vocab ({})", self.padded_vocab, self.vocab));
        }
        Ok(())
    }

    /// Number of trainable parameters.
    pub fn num_params(&self) -> usize {
        let (l, c) = (self.layers, self.channels);
        self.padded_vocab * c + self.max_seq * c + l * (12 * c * c + 13 * c) + 2 * c
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
        let wte = shape_of("wte")?;
        let wpe = shape_of("wpe")?;
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
