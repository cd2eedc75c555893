//! llm.c GPT-2 checkpoints (`gpt2_*.bin`, version 3 = fp32): reading, writing, the tensor
//! layout, the mapping to graph parameter names, and GPT-2-style random initialisation.
//!
//! Format (all little-endian): a header of 256 int32 — magic 20240326, version 3, max_seq_len,
//! vocab_size, num_layers, num_heads, channels, padded_vocab_size, the rest 0 — then the 16
//! parameter tensors as one flat float32 array in the order of [`param_layout`]. The per-layer
//! tensors hold all layers together (leading dimension L); in the graph each layer's slice is
//! its own parameter, named `NAME.l` (e.g. `qkvw.2`).

use std::path::Path;

use fusec_ir::rng::Rng;
pub use fusec_models::Gpt2Config;

use crate::atomic::PendingFile;
pub use crate::file_error::CHECKPOINT_MAGIC;
use crate::file_error::{self, FileError, HEADER_BYTES, TOKENS_MAGIC};
use crate::normals;

/// The only supported checkpoint version (fp32 weights).
pub const CHECKPOINT_VERSION: i32 = 3;

/// The 16 llm.c tensor names in checkpoint order.
const NAMES: [&str; 16] = [
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw",
    "lnfb",
];

/// Whether the llm.c tensor `name` has a leading layer dimension (split per layer in graphs).
fn is_per_layer(name: &str) -> bool {
    !matches!(name, "wte" | "wpe" | "lnfw" | "lnfb")
}

/// Builds a config from a checkpoint header (magic and version already checked); rejects
/// negative values, naming the header slot.
fn config_from_header(h: &[i32; 256]) -> Result<Gpt2Config, String> {
    let slot = |i: usize, name: &str| -> Result<usize, String> {
        usize::try_from(h[i]).map_err(|_| format!("bad config: {name} is {} (header slot {i}); it must be positive", h[i]))
    };
    let cfg = Gpt2Config {
        max_seq: slot(2, "max_seq_len")?,
        vocab: slot(3, "vocab_size")?,
        layers: slot(4, "num_layers")?,
        heads: slot(5, "num_heads")?,
        channels: slot(6, "channels")?,
        padded_vocab: slot(7, "padded_vocab_size")?,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The checkpoint header for a valid config (magic, version 3, sizes, zeros).
fn header(cfg: &Gpt2Config) -> [i32; 256] {
    let mut h = [0i32; 256];
    h[0] = CHECKPOINT_MAGIC;
    h[1] = CHECKPOINT_VERSION;
    // validate() bounds every field well below i32::MAX.
    h[2] = cfg.max_seq as i32;
    h[3] = cfg.vocab as i32;
    h[4] = cfg.layers as i32;
    h[5] = cfg.heads as i32;
    h[6] = cfg.channels as i32;
    h[7] = cfg.padded_vocab as i32;
    h
}

/// The 16 llm.c tensors in checkpoint order with their full shapes (per-layer tensors
/// have a leading dimension L).
pub fn param_layout(cfg: &Gpt2Config) -> Vec<(&'static str, Vec<usize>)> {
    let (l, c, vp, t) = (cfg.layers, cfg.channels, cfg.padded_vocab, cfg.max_seq);
    let shapes: [Vec<usize>; 16] = [
        vec![vp, c],
        vec![t, c],
        vec![l, c],
        vec![l, c],
        vec![l, 3 * c, c],
        vec![l, 3 * c],
        vec![l, c, c],
        vec![l, c],
        vec![l, c],
        vec![l, c],
        vec![l, 4 * c, c],
        vec![l, 4 * c],
        vec![l, c, 4 * c],
        vec![l, c],
        vec![c],
        vec![c],
    ];
    NAMES.into_iter().zip(shapes).collect()
}

/// Every graph parameter name and shape in checkpoint order: `wte`, `wpe`, then each
/// per-layer tensor split by layer (`ln1w.0` … `ln1w.{L-1}`, `ln1b.0` …), then `lnfw`, `lnfb`.
pub fn graph_param_names(cfg: &Gpt2Config) -> Vec<(String, Vec<usize>)> {
    pieces(cfg).into_iter().map(|(name, shape, _)| (name, shape)).collect()
}

/// [`graph_param_names`] with the llm.c tensor each graph parameter is (a slice of).
fn pieces(cfg: &Gpt2Config) -> Vec<(String, Vec<usize>, &'static str)> {
    let mut out = Vec::new();
    for (name, shape) in param_layout(cfg) {
        if is_per_layer(name) {
            for layer in 0..cfg.layers {
                out.push((format!("{name}.{layer}"), shape[1..].to_vec(), name));
            }
        } else {
            out.push((name.to_string(), shape, name));
        }
    }
    out
}

/// Receives one graph parameter at a time: its name, shape and values (checkpoint order). The
/// values are a buffer holding exactly the tensor; a sink may take it (e.g. to send it to another
/// thread) and leave another buffer, which the producer then resizes for the next tensor.
pub type ParamSink<'a> = dyn FnMut(&str, &[usize], &mut Vec<f32>) -> Result<(), String> + 'a;

/// Makes `buf` hold `n` values: a longer buffer is cut (no fill), a shorter one grown with zeros.
fn fit(buf: &mut Vec<f32>, n: usize) {
    if buf.len() >= n {
        buf.truncate(n)
    } else {
        buf.resize(n, 0.0)
    }
}

/// Puts the values of one graph parameter, by name and shape, into the buffer it is given
/// (checkpoint order; one buffer serves every parameter).
pub type ParamFetch<'a> = dyn FnMut(&str, &[usize], &mut Vec<f32>) -> Result<(), String> + 'a;

/// An llm.c checkpoint: the config and all parameters as one flat array in checkpoint order.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The model configuration from the header.
    pub config: Gpt2Config,
    /// All `config.num_params()` parameters, in the order of [`param_layout`].
    pub params: Vec<f32>,
}

/// Opens a checkpoint, checks magic, version, config and the exact file size.
/// Returns the open file (positioned after the header), the header, the config and the
/// parameter count.
fn open_checkpoint(path: &Path) -> Result<(std::fs::File, [i32; 256], Gpt2Config, usize), FileError> {
    let (mut file, len) = file_error::open_with_len(path)?;
    let h = file_error::read_header(path, &mut file, len, "checkpoint")?;
    if h[0] != CHECKPOINT_MAGIC {
        let hint = if h[0] == TOKENS_MAGIC { " (that is the magic of a token file, not a checkpoint)" } else { "" };
        return Err(FileError::new(
            path,
            format!(
                "wrong magic number: expected {CHECKPOINT_MAGIC} (llm.c GPT-2 checkpoint), \
                 found {}{hint}",
                h[0]
            ),
        ));
    }
    if h[1] != CHECKPOINT_VERSION {
        let hint = if h[1] == 5 { " (version 5 holds bf16 weights)" } else { "" };
        return Err(FileError::new(
            path,
            format!(
                "unsupported checkpoint version {}{hint}: only version {CHECKPOINT_VERSION} \
                 (fp32 weights) is supported",
                h[1]
            ),
        ));
    }
    let config = config_from_header(&h).map_err(|m| FileError::new(path, m))?;
    let n = config.num_params();
    let expected = 4 * n as u64;
    let found = len - HEADER_BYTES as u64;
    if found != expected {
        let what = format!("bytes of parameters after the header for config {config}");
        return Err(FileError::new(path, file_error::size_mismatch(expected, found, &what)));
    }
    Ok((file, h, config, n))
}

impl Checkpoint {
    /// Reads a version-3 (fp32) llm.c checkpoint, checking the header and that the file
    /// holds exactly the parameters its config needs.
    pub fn read(path: &Path) -> Result<Checkpoint, FileError> {
        let (mut file, _, config, n) = open_checkpoint(path)?;
        let mut params = vec![0f32; n];
        file_error::read_f32s(&mut file, &mut params, &mut Default::default())
            .map_err(|e| FileError::io(path, "cannot read the data after the header", &e))?;
        Ok(Checkpoint { config, params })
    }

    /// Reads and validates only the config of a checkpoint (for `--like CKPT`); the file
    /// size is still checked, the parameters are not read.
    pub fn read_header(path: &Path) -> Result<Gpt2Config, FileError> {
        open_checkpoint(path).map(|(_, _, config, _)| config)
    }

    /// Writes the checkpoint in llm.c's version-3 format. Fails (without creating the file)
    /// if the config is invalid or the parameter count does not match it.
    pub fn write(&self, path: &Path) -> Result<(), FileError> {
        self.config.validate().map_err(|m| FileError::new(path, format!("cannot write checkpoint: {m}")))?;
        let n = self.config.num_params();
        if self.params.len() != n {
            return Err(FileError::new(
                path,
                format!("cannot write checkpoint: config {} needs {n} parameters, have {}", self.config, self.params.len()),
            ));
        }
        let mut chunks = self.params.chunks(1 << 18);
        file_error::write_file(path, &header(&self.config), |buf| match chunks.next() {
            Some(c) => {
                buf.extend(c.iter().flat_map(|v| v.to_le_bytes()));
                true
            }
            None => false,
        })
    }

    /// Every graph parameter in checkpoint order with its shape and its slice of `params`
    /// (per-layer tensors split by layer; see [`graph_param_names`]).
    pub fn named_tensors(&self) -> Vec<(String, Vec<usize>, &[f32])> {
        let mut offset = 0;
        graph_param_names(&self.config)
            .into_iter()
            .map(|(name, shape)| {
                let n: usize = shape.iter().product();
                let data = &self.params[offset..offset + n];
                offset += n;
                (name, shape, data)
            })
            .collect()
    }

    /// The data of one tensor, by llm.c name (`qkvw`: all layers) or graph name (`qkvw.2`).
    pub fn tensor(&self, name: &str) -> Option<&[f32]> {
        let mut offset = 0;
        for (full, shape) in param_layout(&self.config) {
            let n: usize = shape.iter().product();
            if full == name {
                return Some(&self.params[offset..offset + n]);
            }
            if let Some(layer) = name
                .strip_prefix(full)
                .and_then(|rest| rest.strip_prefix('.'))
                .and_then(|l| l.parse::<usize>().ok())
                .filter(|&l| is_per_layer(full) && l < self.config.layers)
            {
                let per = n / self.config.layers;
                return Some(&self.params[offset + layer * per..offset + (layer + 1) * per]);
            }
            offset += n;
        }
        None
    }

    /// Assembles a checkpoint from per-graph-parameter tensors: `lookup(name)` must return
    /// the data of every name in [`graph_param_names`] with the right number of values.
    pub fn from_named(config: Gpt2Config, lookup: impl Fn(&str) -> Option<Vec<f32>>) -> Result<Checkpoint, String> {
        config.validate()?;
        let mut params = Vec::with_capacity(config.num_params());
        for (name, shape) in graph_param_names(&config) {
            let n: usize = shape.iter().product();
            let data = lookup(&name).ok_or_else(|| format!("missing tensor {name} (shape {shape:?})"))?;
            if data.len() != n {
                return Err(format!("tensor {name} has {} values, expected {n} for shape {shape:?}", data.len()));
            }
            params.extend_from_slice(&data);
        }
        Ok(Checkpoint { config, params })
    }
}

/// Reads a checkpoint in one sequential pass, one graph parameter at a time (in one buffer
/// that `sink` may swap), handing each to `sink` in checkpoint order. Returns the config and
/// the CRC-32 of the whole file.
pub fn read_params(path: &Path, sink: &mut ParamSink) -> Result<(Gpt2Config, u32), String> {
    let (mut file, h, config, _) = open_checkpoint(path)?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
    let mut buf = vec![];
    for (name, shape, _) in &pieces(&config) {
        fit(&mut buf, shape.iter().product::<usize>());
        file_error::read_f32s(&mut file, &mut buf, &mut crc)
            .map_err(|e| FileError::io(path, &format!("cannot read tensor `{name}`"), &e))?;
        sink(name, shape, &mut buf)?;
    }
    Ok((config, crc.finalize()))
}

/// Writes an llm.c checkpoint of `cfg` into `out`: the header, then each graph parameter in
/// checkpoint order as `fetch(name, shape, buffer)` puts it in one buffer.
pub fn write_params(out: &mut PendingFile, cfg: &Gpt2Config, fetch: &mut ParamFetch) -> Result<(), String> {
    cfg.validate()?;
    out.write(&header(cfg).iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    let mut v = vec![];
    for (name, shape) in graph_param_names(cfg) {
        fetch(&name, &shape, &mut v)?;
        let n: usize = shape.iter().product();
        if v.len() != n {
            return Err(format!("cannot write checkpoint: `{name}` has {} values, its shape {shape:?} holds {n}", v.len()));
        }
        out.write(&file_error::f32_le_bytes(&v))?;
    }
    Ok(())
}

/// What `--init random` puts in an llm.c tensor.
enum Init {
    /// Normal samples with this standard deviation.
    Normal(f64),
    /// All ones (LayerNorm scales).
    Ones,
    /// All zeros (biases).
    Zeros,
}

/// GPT-2-style random initialisation, deterministic per seed, one graph parameter at a time
/// (checkpoint order, in one buffer that `sink` may swap): `wte`, `wpe`, `qkvw`, `fcw`
/// normal with std 0.02; `attprojw`, `fcprojw` std 0.02/√(2L); biases 0; LayerNorm scales 1;
/// `wte` padding rows (V..Vp) exactly 0. The normals are one SplitMix64 stream (Box-Muller, two
/// outputs per normal) in checkpoint order, drawn in parallel slices by [`normals::fill`] with
/// exactly the values of drawing them in order with `Rng::normal`. An invalid config is an
/// error (nothing is allocated).
pub fn random_params(cfg: &Gpt2Config, seed: u64, sink: &mut ParamSink) -> Result<(), String> {
    cfg.validate()?;
    let stream = Rng::new(seed);
    let proj_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
    let mut buf = vec![];
    // Normals drawn so far: where the next tensor's slice of the stream starts.
    let mut drawn = 0u64;
    for (name, shape, llmc) in &pieces(cfg) {
        fit(&mut buf, shape.iter().product::<usize>());
        let data = &mut buf[..];
        let init = match *llmc {
            "wte" | "wpe" | "qkvw" | "fcw" => Init::Normal(0.02),
            "attprojw" | "fcprojw" => Init::Normal(proj_std),
            "ln1w" | "ln2w" | "lnfw" => Init::Ones,
            _ => Init::Zeros,
        };
        match init {
            Init::Normal(std) => {
                // Only the real vocabulary rows of `wte` are drawn; the padding stays 0.
                let real = if *llmc == "wte" { cfg.vocab * cfg.channels } else { data.len() };
                data[real..].fill(0.0);
                normals::par_fill(&stream, drawn, &mut data[..real], std, normals::fill);
                drawn += real as u64;
            }
            Init::Ones => data.fill(1.0),
            Init::Zeros => data.fill(0.0),
        }
        sink(name, shape, &mut buf)?;
    }
    Ok(())
}

/// [`random_params`] as one checkpoint (all parameters in memory).
pub fn random_init(cfg: &Gpt2Config, seed: u64) -> Result<Checkpoint, String> {
    cfg.validate()?;
    let mut params = Vec::with_capacity(cfg.num_params());
    random_params(cfg, seed, &mut |_, _, d| {
        params.extend_from_slice(d);
        Ok(())
    })?;
    Ok(Checkpoint { config: *cfg, params })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The initialization drawn one value after another from one generator, as the original
    /// sequential code did.
    fn sequential_init(cfg: &Gpt2Config, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let proj_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
        let mut out = vec![];
        for (name, shape) in param_layout(cfg) {
            let n: usize = shape.iter().product();
            match name {
                "wte" => {
                    let real = cfg.vocab * cfg.channels;
                    out.extend((0..real).map(|_| (0.02 * rng.normal()) as f32));
                    out.extend(std::iter::repeat_n(0.0, n - real));
                }
                "wpe" | "qkvw" | "fcw" => out.extend((0..n).map(|_| (0.02 * rng.normal()) as f32)),
                "attprojw" | "fcprojw" => out.extend((0..n).map(|_| (proj_std * rng.normal()) as f32)),
                "ln1w" | "ln2w" | "lnfw" => out.extend(std::iter::repeat_n(1.0, n)),
                _ => out.extend(std::iter::repeat_n(0.0, n)),
            }
        }
        out
    }

    #[test]
    fn parallel_init_draws_exactly_the_sequential_stream() {
        // wte (2000·40 = 80,000 normals) and qkvw (3·120·40 = 14,400 a layer) cross the parallel
        // slice size (65,536) and start mid-slice of the stream; padding rows 2000..2048.
        let cfg = Gpt2Config { max_seq: 64, vocab: 2000, padded_vocab: 2048, layers: 3, heads: 2, channels: 40 };
        let want = sequential_init(&cfg, 7);
        let got = random_init(&cfg, 7).unwrap();
        assert_eq!(got.params.len(), want.len());
        let diff = got.params.iter().zip(&want).position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(diff, None, "first differing value");
        // The per-parameter stream hands out the same values, in checkpoint order, with the
        // graph's names and shapes.
        let mut seen = vec![];
        let mut values = vec![];
        random_params(&cfg, 7, &mut |n, s, d| {
            seen.push((n.to_string(), s.to_vec()));
            values.extend_from_slice(d);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, graph_param_names(&cfg));
        assert!(values.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_ne!(random_init(&cfg, 8).unwrap().params, got.params);
        // A sink that keeps each buffer and leaves one of another length, full of NaN, sees the
        // same values (the producer resizes what it is left and overwrites every value).
        let mut kept = vec![];
        random_params(&cfg, 7, &mut |_, _, d| {
            let spare = vec![f32::NAN; [0, 7, 100_000][kept.len() % 3]];
            kept.extend_from_slice(&std::mem::replace(d, spare));
            Ok(())
        })
        .unwrap();
        assert!(kept.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()) && kept.len() == want.len());
    }

    #[test]
    fn streamed_read_and_write_round_trip_with_the_file_crc() {
        let cfg = Gpt2Config { max_seq: 16, vocab: 50, padded_vocab: 64, layers: 2, heads: 2, channels: 8 };
        let ck = random_init(&cfg, 3).unwrap();
        let p = std::env::temp_dir().join(format!("fusec-ckpt-stream-{}.bin", std::process::id()));
        let mut f = PendingFile::create(&p).unwrap();
        write_params(&mut f, &cfg, &mut |name, _, v| {
            *v = ck.tensor(name).unwrap().to_vec();
            Ok(())
        })
        .unwrap();
        let crc = f.crc();
        f.finish().unwrap().commit().unwrap();
        assert_eq!(Checkpoint::read(&p).unwrap(), ck);
        let mut back = vec![];
        let (got_cfg, got_crc) = read_params(&p, &mut |_, _, d| {
            back.extend_from_slice(d);
            Ok(())
        })
        .unwrap();
        assert_eq!((got_cfg, got_crc, back), (cfg, crc, ck.params.clone()));
        assert_eq!(crc, crc32fast::hash(&std::fs::read(&p).unwrap()));
        let _ = std::fs::remove_file(&p);
    }
}
