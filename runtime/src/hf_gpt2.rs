//! Hugging Face GPT-2 weights ↔ llm.c checkpoints (`fusec import hf`, `fusec export-weights`).
//!
//! A Hugging Face GPT-2 (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`) is a `model.safetensors`
//! and a `config.json` (`n_embd`, `n_layer`, `n_head`, `n_positions` or `n_ctx`, `vocab_size`).
//! Its keys are `wte.weight`, `wpe.weight`, `h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
//! mlp.c_proj}.{weight, bias}` and `ln_f.{weight, bias}`, with or without a `transformer.`
//! prefix. Its projections are `Conv1D` layers, stored `[in, out]` (`y = x·W + b`); llm.c stores
//! them `[out, in]`, so they are transposed each way. llm.c pads the vocabulary (`wte`'s rows)
//! to a multiple of 128 with zeros. The `attn.bias` / `attn.masked_bias` buffers some files carry
//! (the causal mask) are ignored; an `lm_head.weight` must equal `wte.weight` (the head is tied).
//! Both directions go one tensor at a time: no whole model is held in memory.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use fusec_models::Gpt2Config;
use serde_json::Value;

use crate::atomic::{write_atomic, PendingFile};
use crate::checkpoint::{graph_param_names, read_params, write_params, Checkpoint};
use crate::file_error::FileError;
use crate::safetensors_io::{readable, SafetensorsReader, SafetensorsWriter};

/// The multiple llm.c pads the vocabulary to.
const VOCAB_PAD: usize = 128;

/// The prefix some files put before every key (`GPT2LMHeadModel`'s transformer).
const PREFIX: &str = "transformer.";

/// Reads a Hugging Face GPT-2 `config.json`: the sizes, with the vocabulary padded to a multiple
/// of 128. Settings fusec's GPT-2 does not compute (another activation, LayerNorm epsilon, MLP
/// width or attention scaling) are refused, naming the key.
pub fn read_config(path: &Path) -> Result<Gpt2Config, FileError> {
    let err = |m: String| FileError::new(path, m);
    let text = std::fs::read_to_string(path).map_err(|e| FileError::io(path, "cannot read", &e))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| err(format!("not JSON: {e}")))?;
    let obj = json.as_object().ok_or_else(|| err("expected a JSON object (a Hugging Face config.json)".into()))?;
    let size = |keys: &[&str]| -> Result<usize, FileError> {
        let (key, v) =
            keys.iter().find_map(|k| obj.get(*k).map(|v| (k, v))).ok_or_else(|| err(format!("missing `{}`", keys.join("` or `"))))?;
        v.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| err(format!("`{key}` is {v}; expected a positive integer")))
    };
    let (channels, vocab) = (size(&["n_embd"])?, size(&["vocab_size"])?);
    let cfg = Gpt2Config {
        layers: size(&["n_layer"])?,
        heads: size(&["n_head"])?,
        channels,
        vocab,
        padded_vocab: vocab.div_ceil(VOCAB_PAD) * VOCAB_PAD,
        max_seq: size(&["n_positions", "n_ctx"])?,
    };
    let unsupported = |key: &str, v: &Value, ok: bool, what: &str| -> Result<(), FileError> {
        if ok {
            Ok(())
        } else {
            Err(err(format!("`{key}` is {v}: fusec's GPT-2 supports only {what}")))
        }
    };
    for (key, v) in obj {
        match key.as_str() {
            "model_type" => unsupported(key, v, v == "gpt2", "\"gpt2\"")?,
            "activation_function" => unsupported(key, v, v == "gelu_new" || v == "gelu_pytorch_tanh", "the tanh GELU (\"gelu_new\")")?,
            "layer_norm_epsilon" => unsupported(key, v, v.as_f64().is_some_and(|e| (e - 1e-5).abs() < 1e-12), "1e-05")?,
            "n_inner" => unsupported(key, v, v.is_null() || v.as_u64() == Some(4 * channels as u64), "null (4 × n_embd)")?,
            "scale_attn_weights" => unsupported(key, v, v != &Value::Bool(false), "true")?,
            "scale_attn_by_inverse_layer_idx" => unsupported(key, v, v != &Value::Bool(true), "false")?,
            _ => {}
        }
    }
    cfg.validate().map_err(err)?;
    Ok(cfg)
}

/// A Hugging Face `config.json` for `cfg` (as `transformers` writes one for `GPT2LMHeadModel`).
pub fn config_json(cfg: &Gpt2Config) -> String {
    let mut v = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "n_ctx": cfg.max_seq,
        "n_embd": cfg.channels,
        "n_head": cfg.heads,
        "n_inner": null,
        "n_layer": cfg.layers,
        "n_positions": cfg.max_seq,
        "vocab_size": cfg.vocab,
    });
    if cfg.vocab == 50257 {
        // GPT-2's tokenizer: <|endoftext|> begins and ends texts.
        v["bos_token_id"] = 50256.into();
        v["eos_token_id"] = 50256.into();
    }
    serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
}

/// Where one graph parameter lives in a Hugging Face file.
struct HfTensor {
    /// The key, without the `transformer.` prefix.
    key: String,
    /// Its shape there.
    shape: Vec<usize>,
    /// Stored `[in, out]` (a `Conv1D` weight): the transpose of llm.c's `[out, in]`.
    transposed: bool,
}

/// The Hugging Face tensor of graph parameter `name` (`qkvw.3`, `wte`, ...).
fn hf_tensor(name: &str, cfg: &Gpt2Config) -> HfTensor {
    let (base, layer) = name.split_once('.').map_or((name, ""), |(b, l)| (b, l));
    let c = cfg.channels;
    let (key, shape, transposed) = match base {
        "wte" => ("wte.weight".to_string(), vec![cfg.vocab, c], false),
        "wpe" => ("wpe.weight".to_string(), vec![cfg.max_seq, c], false),
        "lnfw" => ("ln_f.weight".to_string(), vec![c], false),
        "lnfb" => ("ln_f.bias".to_string(), vec![c], false),
        _ => {
            let (part, shape, transposed) = match base {
                "ln1w" => ("ln_1.weight", vec![c], false),
                "ln1b" => ("ln_1.bias", vec![c], false),
                "qkvw" => ("attn.c_attn.weight", vec![c, 3 * c], true),
                "qkvb" => ("attn.c_attn.bias", vec![3 * c], false),
                "attprojw" => ("attn.c_proj.weight", vec![c, c], true),
                "attprojb" => ("attn.c_proj.bias", vec![c], false),
                "ln2w" => ("ln_2.weight", vec![c], false),
                "ln2b" => ("ln_2.bias", vec![c], false),
                "fcw" => ("mlp.c_fc.weight", vec![c, 4 * c], true),
                "fcb" => ("mlp.c_fc.bias", vec![4 * c], false),
                "fcprojw" => ("mlp.c_proj.weight", vec![4 * c, c], true),
                // fcprojb; graph_param_names gives no other name.
                _ => ("mlp.c_proj.bias", vec![c], false),
            };
            (format!("h.{layer}.{part}"), shape, transposed)
        }
    };
    HfTensor { key, shape, transposed }
}

/// `src`, a row-major `rows × cols` matrix, transposed into `dst`.
fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut Vec<f32>) {
    dst.clear();
    dst.extend((0..cols).flat_map(|j| (0..rows).map(move |i| src[i * cols + j])));
}

/// Whether `key` (prefix removed) is a buffer that files carry and models recompute: the
/// causal mask `h.N.attn.bias` and `h.N.attn.masked_bias`.
fn is_ignored_buffer(key: &str) -> bool {
    key.starts_with("h.") && (key.ends_with(".attn.bias") || key.ends_with(".attn.masked_bias"))
}

/// What [`import_hf`] read.
#[derive(Debug, Clone, PartialEq)]
pub struct Imported {
    /// The model's sizes (vocabulary padded).
    pub config: Gpt2Config,
    /// The dtypes the tensors were stored in (`F32`, `BF16`, ...).
    pub dtypes: BTreeSet<String>,
    /// Keys of the file that were ignored (mask buffers; a tied `lm_head.weight`).
    pub ignored: usize,
}

/// Converts a Hugging Face GPT-2 (`model.safetensors` with its `config.json`) into an llm.c
/// checkpoint at `dest`. Every tensor is checked (present, shape, dtype) before anything is
/// written; an error names the tensor. Unknown tensors are refused.
pub fn import_hf(st: &Path, config: &Path, dest: &Path) -> Result<Imported, String> {
    let cfg = read_config(config)?;
    let mut file = SafetensorsReader::open(st)?;
    let err = |m: String| FileError::new(st, m).to_string();
    // The file's key for each graph parameter, checked.
    let mut keys = HashMap::new();
    let mut dtypes = BTreeSet::new();
    for (name, _) in graph_param_names(&cfg) {
        let hf = hf_tensor(&name, &cfg);
        let key = resolve(&file, &hf.key, &hf.shape).map_err(err)?;
        let info = file.info(&key).ok_or_else(|| err(format!("internal: no `{key}`")))?;
        if info.shape != hf.shape {
            let layout = if hf.transposed { " (a Conv1D weight, stored [in, out])" } else { "" };
            return Err(err(format!(
                "tensor `{key}` has shape {:?}; config.json (n_embd {}, n_positions {}, vocab_size {}) gives {:?}{layout}",
                info.shape, cfg.channels, cfg.max_seq, cfg.vocab, hf.shape
            )));
        }
        if !readable(info.dtype) {
            return Err(err(format!("tensor `{key}` is stored as {}; only F32, F16, BF16 and F64 can be imported", info.dtype)));
        }
        dtypes.insert(info.dtype.to_string());
        keys.insert(name, (key, hf));
    }
    let used: BTreeSet<&str> = keys.values().map(|(k, _)| k.as_str()).collect();
    let mut ignored = 0;
    let mut head = None;
    for key in file.names() {
        let bare = key.strip_prefix(PREFIX).unwrap_or(&key);
        if used.contains(key.as_str()) {
            continue;
        } else if is_ignored_buffer(bare) {
            ignored += 1;
        } else if key == "lm_head.weight" {
            head = Some(key);
            ignored += 1;
        } else {
            return Err(err(format!(
                "unexpected tensor `{key}`: not part of a GPT-2 language model of config.json's sizes \
                 ({} layers; expected wte, wpe, h.0 … h.{}, ln_f and optionally lm_head)",
                cfg.layers,
                cfg.layers.saturating_sub(1)
            )));
        }
    }
    let mut out = PendingFile::create(dest)?;
    let mut buf = vec![];
    write_params(&mut out, &cfg, &mut |name, _, v| {
        let (key, hf) = keys.get(name).ok_or_else(|| format!("internal: no tensor for `{name}`"))?;
        file.read_f32(key, &mut buf)?;
        if hf.transposed {
            transpose(&buf, hf.shape[0], hf.shape[1], v);
        } else {
            std::mem::swap(v, &mut buf);
        }
        if name == "wte" {
            if let Some(head) = &head {
                file.read_f32(head, &mut buf)?;
                if buf != *v {
                    return Err(err(format!("`{head}` differs from `{key}`: fusec's GPT-2 ties the output layer to the token embedding")));
                }
            }
            v.resize(cfg.padded_vocab * cfg.channels, 0.0);
        }
        Ok(())
    })?;
    out.finish()?.commit()?;
    Ok(Imported { config: cfg, dtypes, ignored })
}

/// The key under which `file` holds `key`: as is or with the `transformer.` prefix; missing, the
/// error names it with the shape it should have.
fn resolve(file: &SafetensorsReader, key: &str, shape: &[usize]) -> Result<String, String> {
    let prefixed = format!("{PREFIX}{key}");
    match (file.info(key).is_some(), file.info(&prefixed).is_some()) {
        (true, false) => Ok(key.to_string()),
        (false, true) => Ok(prefixed),
        (true, true) => Err(format!("both `{key}` and `{prefixed}` are present: which one is the model's is unclear")),
        (false, false) => Err(format!("missing tensor `{key}` (shape {shape:?}; looked for it with and without `{PREFIX}`)")),
    }
}

/// Writes the llm.c checkpoint `ckpt` as a Hugging Face GPT-2: `dest` (safetensors, F32, keys
/// without prefix, `Conv1D` weights `[in, out]`, the vocabulary's padding rows dropped) and a
/// `config.json` beside it. Returns the config's path.
pub fn export_hf(ckpt: &Path, dest: &Path) -> Result<PathBuf, String> {
    let cfg = Checkpoint::read_header(ckpt)?;
    let tensors: Vec<(String, HfTensor)> = graph_param_names(&cfg).into_iter().map(|(n, _)| (n.clone(), hf_tensor(&n, &cfg))).collect();
    let declared = tensors.iter().map(|(_, hf)| (hf.key.clone(), hf.shape.clone())).collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut out = SafetensorsWriter::create(dest, declared, meta)?;
    let mut next = tensors.iter();
    let mut buf = vec![];
    read_params(ckpt, &mut |name, _, data| {
        let (_, hf) = next.next().filter(|(n, _)| n == name).ok_or_else(|| format!("internal: unexpected parameter `{name}`"))?;
        let data = if hf.transposed {
            transpose(data, hf.shape[1], hf.shape[0], &mut buf);
            &buf[..]
        } else {
            // `wte` without the padding rows.
            &data[..hf.shape.iter().product()]
        };
        Ok(out.write(&hf.key, data)?)
    })?;
    out.finish()?;
    let config = dest.with_file_name("config.json");
    write_atomic(&config, |f| f.write(config_json(&cfg).as_bytes()))?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parameter_maps_to_a_distinct_key_with_its_element_count() {
        let cfg = Gpt2Config { layers: 3, heads: 2, channels: 8, vocab: 100, padded_vocab: 128, max_seq: 16 };
        let mut seen = BTreeSet::new();
        for (name, shape) in graph_param_names(&cfg) {
            let hf = hf_tensor(&name, &cfg);
            assert!(seen.insert(hf.key.clone()), "{}", hf.key);
            let n: usize = shape.iter().product();
            let want = if name == "wte" { 100 * 8 } else { n };
            assert_eq!(hf.shape.iter().product::<usize>(), want, "{name}");
            if hf.transposed {
                assert_eq!((hf.shape[0], hf.shape[1]), (shape[1], shape[0]), "{name}");
            }
        }
        assert!(seen.contains("h.2.mlp.c_proj.bias") && seen.contains("h.0.attn.c_attn.weight"));
    }

    #[test]
    fn transpose_swaps_rows_and_columns() {
        let mut t = vec![];
        transpose(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3, &mut t);
        assert_eq!(t, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    }

    #[test]
    fn config_json_reads_back_and_unsupported_settings_are_named() {
        let dir = std::env::temp_dir().join(format!("fusec-hfcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("config.json");
        let cfg = Gpt2Config { layers: 2, heads: 2, channels: 32, vocab: 100, padded_vocab: 128, max_seq: 16 };
        std::fs::write(&p, config_json(&cfg)).unwrap();
        assert_eq!(read_config(&p).unwrap(), cfg);
        for (text, want) in [
            (
                r#"{"n_embd": 32, "n_layer": 2, "n_head": 2, "n_ctx": 16, "vocab_size": 100, "activation_function": "relu"}"#,
                "`activation_function`",
            ),
            (r#"{"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 100}"#, "missing `n_positions` or `n_ctx`"),
            (r#"{"n_embd": -3, "n_layer": 2, "n_head": 2, "n_ctx": 16, "vocab_size": 100}"#, "`n_embd` is -3"),
            (r#"{"n_embd": 32, "n_layer": 2, "n_head": 3, "n_ctx": 16, "vocab_size": 100}"#, "divisible"),
            ("[1, 2]", "JSON object"),
        ] {
            std::fs::write(&p, text).unwrap();
            let e = read_config(&p).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("config.json"), "{e}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
