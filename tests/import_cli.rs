//! `fusec import hf` and `fusec export-weights` end to end, on a small GPT-2 built here in the
//! Hugging Face layout (Conv1D weights `[in, out]`, keys without prefix, the `attn.bias` mask
//! buffers) with known values: the values in the llm.c checkpoint (transposes, zero padding),
//! the round trip back to safetensors, F16/BF16 and `transformer.`-prefixed files, errors that
//! name the tensor, and the converted model's loss through `--target ref` against a forward pass
//! written here in f64 on the Hugging Face tensors.

use fusec_ir::testkit::TempDir;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use fusec_runtime::checkpoint::Checkpoint;
use serde_json::{json, Value};

const L: usize = 2;
const C: usize = 32;
const H: usize = 2;
const V: usize = 100;
const VP: usize = 128;
const T: usize = 16;

/// Tensors as (name, shape, values).
type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;
/// Tensors by name: (shape, values).
type ByName = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn fusec(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fusec")).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A fresh folder for one test.
fn dir(name: &str) -> TempDir {
    TempDir::new(&format!("import-{name}"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The tensors of a Hugging Face GPT-2 with known values, in the official file's order.
/// Every value has at most 8 significant bits: exact in F16 and BF16.
fn hf_model() -> Tensors {
    let mut shapes = vec![("wte.weight".to_string(), vec![V, C]), ("wpe.weight".to_string(), vec![T, C])];
    for l in 0..L {
        for (part, shape) in [
            ("ln_1.weight", vec![C]),
            ("ln_1.bias", vec![C]),
            ("attn.c_attn.weight", vec![C, 3 * C]),
            ("attn.c_attn.bias", vec![3 * C]),
            ("attn.c_proj.weight", vec![C, C]),
            ("attn.c_proj.bias", vec![C]),
            ("ln_2.weight", vec![C]),
            ("ln_2.bias", vec![C]),
            ("mlp.c_fc.weight", vec![C, 4 * C]),
            ("mlp.c_fc.bias", vec![4 * C]),
            ("mlp.c_proj.weight", vec![4 * C, C]),
            ("mlp.c_proj.bias", vec![C]),
        ] {
            shapes.push((format!("h.{l}.{part}"), shape));
        }
    }
    shapes.push(("ln_f.weight".to_string(), vec![C]));
    shapes.push(("ln_f.bias".to_string(), vec![C]));
    shapes
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let n: usize = shape.iter().product();
            // LayerNorm scales 1 + j/128, everything else j/256, for j in -16..=16.
            let (one, step) = if name.contains("ln_") && name.ends_with("weight") { (1.0, 128.0) } else { (0.0, 256.0) };
            let values = (0..n).map(|i| one + ((((i as u64 * 2654435761 + k as u64 * 97) >> 5) % 33) as f32 - 16.0) / step).collect();
            (name, shape, values)
        })
        .collect()
}

/// Writes a safetensors file: `(name, dtype, shape, little-endian bytes)` in this order.
fn write_safetensors(path: &Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0;
    for (name, dtype, shape, bytes) in tensors {
        header.insert(name.clone(), json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()]}));
        offset += bytes.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    tensors.iter().for_each(|t| out.extend(&t.3));
    std::fs::write(path, out).unwrap();
}

/// `values` stored as `dtype` (F32, F16 or BF16).
fn encode(values: &[f32], dtype: &str) -> Vec<u8> {
    match dtype {
        "F32" => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        "F16" => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
    }
}

/// The model as a file: every tensor as `dtype`, keys with `prefix`, plus the mask buffers.
fn hf_file(dir: &Path, model: &[(String, Vec<usize>, Vec<f32>)], dtype: &str, prefix: &str) -> PathBuf {
    let mut tensors: Vec<_> = model.iter().map(|(n, shape, v)| (format!("{prefix}{n}"), dtype, shape.clone(), encode(v, dtype))).collect();
    let mask: Vec<f32> = (0..T * T).map(|i| if i % T <= i / T { 1.0 } else { 0.0 }).collect();
    for l in 0..L {
        tensors.push((format!("{prefix}h.{l}.attn.bias"), "F32", vec![1, 1, T, T], encode(&mask, "F32")));
        tensors.push((format!("{prefix}h.{l}.attn.masked_bias"), "F32", vec![], encode(&[-1e4], "F32")));
    }
    let p = dir.join("model.safetensors");
    write_safetensors(&p, &tensors);
    std::fs::write(dir.join("config.json"), config_json()).unwrap();
    p
}

/// A `config.json` as Hugging Face ships one (with keys fusec does not read).
fn config_json() -> String {
    json!({"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
           "layer_norm_epsilon": 1e-5, "model_type": "gpt2", "n_ctx": T, "n_embd": C, "n_head": H,
           "n_layer": L, "n_positions": T, "vocab_size": V, "task_specific_params": {"text-generation": {"do_sample": true}}})
    .to_string()
}

/// Reads every tensor of a safetensors file (F32 only) by name, and its metadata.
fn read_safetensors(path: &Path) -> (ByName, Value) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut out = BTreeMap::new();
    for (name, info) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        assert_eq!(info["dtype"], "F32", "{name}");
        let shape = info["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
        let (a, b) = (info["data_offsets"][0].as_u64().unwrap() as usize, info["data_offsets"][1].as_u64().unwrap() as usize);
        out.insert(name.clone(), (shape, data[a..b].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()));
    }
    (out, header["__metadata__"].clone())
}

/// Imports `st` into `out` and checks that it succeeded.
fn import(st: &Path, out: &Path) -> String {
    let o = fusec(&["import", "hf", s(st), "-o", s(out)]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    text(&o.stdout)
}

#[test]
fn import_puts_every_value_where_llmc_expects_it() {
    let d = dir("values");
    let model = hf_model();
    let bin = d.join("model.bin");
    let said = import(&hf_file(&d, &model, "F32", ""), &bin);
    assert!(said.contains("vocabulary 100 padded to 128") && said.contains("ignored 4 tensor"), "{said}");
    let ck = Checkpoint::read(&bin).unwrap();
    assert_eq!(
        (ck.config.layers, ck.config.heads, ck.config.channels, ck.config.vocab, ck.config.padded_vocab, ck.config.max_seq),
        (L, H, C, V, VP, T)
    );
    let hf: BTreeMap<&str, &Vec<f32>> = model.iter().map(|(n, _, v)| (n.as_str(), v)).collect();
    // wte: the real rows as they are, the padding rows zero.
    let wte = ck.tensor("wte").unwrap();
    assert_eq!(&wte[..V * C], &hf["wte.weight"][..]);
    assert!(wte[V * C..].iter().all(|&x| x == 0.0) && wte.len() == VP * C);
    assert_eq!(ck.tensor("wpe").unwrap(), &hf["wpe.weight"][..]);
    assert_eq!(ck.tensor("lnfw").unwrap(), &hf["ln_f.weight"][..]);
    for l in 0..L {
        // Conv1D [in, out] -> llm.c [out, in].
        for (llmc, key, out_dim, in_dim) in [
            ("qkvw", "attn.c_attn.weight", 3 * C, C),
            ("attprojw", "attn.c_proj.weight", C, C),
            ("fcw", "mlp.c_fc.weight", 4 * C, C),
            ("fcprojw", "mlp.c_proj.weight", C, 4 * C),
        ] {
            let (got, want) = (ck.tensor(&format!("{llmc}.{l}")).unwrap(), hf[format!("h.{l}.{key}").as_str()]);
            for o in 0..out_dim {
                for i in 0..in_dim {
                    assert_eq!(got[o * in_dim + i], want[i * out_dim + o], "{llmc}.{l}[{o}][{i}]");
                }
            }
        }
        for (llmc, key) in [
            ("ln1w", "ln_1.weight"),
            ("ln1b", "ln_1.bias"),
            ("qkvb", "attn.c_attn.bias"),
            ("attprojb", "attn.c_proj.bias"),
            ("ln2w", "ln_2.weight"),
            ("ln2b", "ln_2.bias"),
            ("fcb", "mlp.c_fc.bias"),
            ("fcprojb", "mlp.c_proj.bias"),
        ] {
            assert_eq!(ck.tensor(&format!("{llmc}.{l}")).unwrap(), &hf[format!("h.{l}.{key}").as_str()][..], "{llmc}.{l}");
        }
    }
}

#[test]
fn export_goes_back_to_the_same_tensors_and_config() {
    let d = dir("roundtrip");
    let model = hf_model();
    let bin = d.join("model.bin");
    import(&hf_file(&d, &model, "F32", ""), &bin);
    let out = d.join("back").join("model.safetensors");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let o = fusec(&["export-weights", s(&bin), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (back, meta) = read_safetensors(&out);
    assert_eq!(meta, json!({"format": "pt"}));
    // The same keys, shapes and values; the mask buffers are not written.
    assert_eq!(back.len(), model.len());
    for (name, shape, values) in &model {
        let (s2, v2) = &back[name];
        assert_eq!((s2, v2), (shape, values), "{name}");
    }
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(out.with_file_name("config.json")).unwrap()).unwrap();
    for (k, v) in [("n_embd", C), ("n_layer", L), ("n_head", H), ("n_positions", T), ("vocab_size", V)] {
        assert_eq!(cfg[k].as_u64(), Some(v as u64), "{k}");
    }
    // And imported again, the same checkpoint, byte for byte.
    let again = d.join("again.bin");
    import(&out, &again);
    assert!(std::fs::read(&again).unwrap() == std::fs::read(&bin).unwrap(), "the re-imported checkpoint differs");
}

#[test]
fn f16_bf16_and_prefixed_files_give_the_same_checkpoint() {
    let model = hf_model();
    let d = dir("f32");
    let want = d.join("model.bin");
    import(&hf_file(&d, &model, "F32", ""), &want);
    for (dtype, prefix) in [("F16", ""), ("BF16", ""), ("F32", "transformer."), ("BF16", "transformer.")] {
        let d = dir(&format!("{dtype}{prefix}"));
        let bin = d.join("model.bin");
        let said = import(&hf_file(&d, &model, dtype, prefix), &bin);
        assert!(said.contains(dtype), "{said}");
        assert!(std::fs::read(&bin).unwrap() == std::fs::read(&want).unwrap(), "{dtype} {prefix}: the checkpoints differ");
    }
}

#[test]
fn a_tied_lm_head_is_accepted_and_an_untied_one_refused() {
    let mut model = hf_model();
    let wte = model[0].2.clone();
    let d = dir("head");
    model.push(("lm_head.weight".into(), vec![V, C], wte));
    import(&hf_file(&d, &model, "F32", ""), &d.join("a.bin"));
    model.last_mut().unwrap().2[5] += 1.0 / 256.0;
    let o = fusec(&["import", "hf", s(&hf_file(&d, &model, "F32", "")), "-o", s(&d.join("b.bin"))]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("`lm_head.weight` differs from `wte.weight`"), "{}", text(&o.stderr));
}

#[test]
fn bad_files_get_errors_that_name_the_tensor() {
    let d = dir("bad");
    let model = hf_model();
    let refused = |model: &[(String, Vec<usize>, Vec<f32>)], dtype: &str, want: &[&str]| {
        let st = hf_file(&d, model, dtype, "");
        let out = d.join("out.bin");
        let o = fusec(&["import", "hf", s(&st), "-o", s(&out)]);
        let err = text(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(want.iter().all(|w| err.contains(w)) && !err.contains("panicked"), "{want:?}: {err}");
        assert!(!out.exists(), "nothing is written");
    };
    let without = |name: &str| model.iter().filter(|t| t.0 != name).cloned().collect::<Vec<_>>();
    refused(&without("h.1.ln_2.bias"), "F32", &["model.safetensors", "missing tensor `h.1.ln_2.bias`", "[32]"]);
    // A Conv1D weight stored [out, in] (as llm.c or nn.Linear would).
    let mut wrong = model.clone();
    let fc = wrong.iter_mut().find(|t| t.0 == "h.0.mlp.c_fc.weight").unwrap();
    fc.1 = vec![4 * C, C];
    refused(&wrong, "F32", &["tensor `h.0.mlp.c_fc.weight` has shape [128, 32]", "[32, 128]", "Conv1D"]);
    // A layer more than config.json says.
    let mut extra = model.clone();
    extra.push(("h.2.ln_1.weight".into(), vec![C], vec![1.0; C]));
    refused(&extra, "F32", &["unexpected tensor `h.2.ln_1.weight`", "2 layers"]);
    // An integer tensor where a float one belongs.
    let st = hf_file(&d, &model, "F32", "");
    let mut tensors: Vec<_> = model.iter().map(|(n, shape, v)| (n.clone(), "F32", shape.clone(), encode(v, "F32"))).collect();
    tensors[1].1 = "I32";
    write_safetensors(&st, &tensors);
    let o = fusec(&["import", "hf", s(&st), "-o", s(&d.join("x.bin"))]);
    assert!(text(&o.stderr).contains("tensor `wpe.weight` is stored as I32"), "{}", text(&o.stderr));
    // Not a safetensors file; a truncated one; no config.json.
    std::fs::write(&st, b"hello").unwrap();
    let o = fusec(&["import", "hf", s(&st), "-o", s(&d.join("x.bin"))]);
    assert!(text(&o.stderr).contains("not a safetensors file"), "{}", text(&o.stderr));
    let good = hf_file(&d, &model, "F32", "");
    let bytes = std::fs::read(&good).unwrap();
    std::fs::write(&good, &bytes[..bytes.len() - 4]).unwrap();
    let o = fusec(&["import", "hf", s(&good), "-o", s(&d.join("x.bin"))]);
    assert!(text(&o.stderr).contains("truncated"), "{}", text(&o.stderr));
    std::fs::remove_file(d.join("config.json")).unwrap();
    let o = fusec(&["import", "hf", s(&good), "-o", s(&d.join("x.bin"))]);
    assert!(text(&o.stderr).contains("config.json: cannot read"), "{}", text(&o.stderr));
    // export-weights of something that is not a checkpoint.
    let o = fusec(&["export-weights", s(&good), "-o", s(&d.join("y.safetensors"))]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("model.safetensors"), "{}", text(&o.stderr));
}

// ---- The loss of the converted model against a forward pass written here, in f64, on the
// ---- Hugging Face tensors (Conv1D: y = x·W + b with W [in, out]).

/// `x · W + b` for a Conv1D weight `w` of `n_in × n_out`.
fn conv1d(x: &[f64], w: &[f32], b: &[f32], n_out: usize) -> Vec<f64> {
    (0..n_out).map(|o| b[o] as f64 + x.iter().enumerate().map(|(i, xi)| xi * w[i * n_out + o] as f64).sum::<f64>()).collect()
}

fn layernorm(x: &[f64], w: &[f32], b: &[f32]) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let r = 1.0 / (var + 1e-5).sqrt();
    x.iter().enumerate().map(|(i, v)| (v - mean) * r * w[i] as f64 + b[i] as f64).collect()
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// The mean cross-entropy of GPT-2 predicting `tokens[1..]` from `tokens[..n-1]`.
fn reference_loss(model: &[(String, Vec<usize>, Vec<f32>)], tokens: &[u16]) -> f64 {
    let p: BTreeMap<&str, &[f32]> = model.iter().map(|(n, _, v)| (n.as_str(), &v[..])).collect();
    let (inputs, targets) = (&tokens[..tokens.len() - 1], &tokens[1..]);
    let n = inputs.len();
    let mut x: Vec<Vec<f64>> = (0..n)
        .map(|t| (0..C).map(|c| (p["wte.weight"][inputs[t] as usize * C + c] + p["wpe.weight"][t * C + c]) as f64).collect())
        .collect();
    let hs = C / H;
    for l in 0..L {
        let w = |k: &str| p[format!("h.{l}.{k}").as_str()];
        let qkv: Vec<Vec<f64>> = x
            .iter()
            .map(|xt| conv1d(&layernorm(xt, w("ln_1.weight"), w("ln_1.bias")), w("attn.c_attn.weight"), w("attn.c_attn.bias"), 3 * C))
            .collect();
        for t in 0..n {
            let mut y = vec![0.0; C];
            for h in 0..H {
                let q = &qkv[t][h * hs..(h + 1) * hs];
                let scores: Vec<f64> = (0..=t)
                    .map(|s| q.iter().zip(&qkv[s][C + h * hs..C + (h + 1) * hs]).map(|(a, b)| a * b).sum::<f64>() / (hs as f64).sqrt())
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (s, sc) in scores.iter().enumerate() {
                    for d in 0..hs {
                        y[h * hs + d] += (sc - max).exp() / z * qkv[s][2 * C + h * hs + d];
                    }
                }
            }
            let a = conv1d(&y, w("attn.c_proj.weight"), w("attn.c_proj.bias"), C);
            x[t].iter_mut().zip(a).for_each(|(xv, av)| *xv += av);
        }
        for xt in x.iter_mut() {
            let f: Vec<f64> = conv1d(&layernorm(xt, w("ln_2.weight"), w("ln_2.bias")), w("mlp.c_fc.weight"), w("mlp.c_fc.bias"), 4 * C)
                .into_iter()
                .map(gelu)
                .collect();
            let m = conv1d(&f, w("mlp.c_proj.weight"), w("mlp.c_proj.bias"), C);
            xt.iter_mut().zip(m).for_each(|(xv, mv)| *xv += mv);
        }
    }
    let mut loss = 0.0;
    for (xt, &target) in x.iter().zip(targets) {
        let h = layernorm(xt, p["ln_f.weight"], p["ln_f.bias"]);
        // The output layer is tied to wte: logits over the real vocabulary.
        let logits: Vec<f64> = (0..V).map(|v| h.iter().enumerate().map(|(c, hc)| hc * p["wte.weight"][v * C + c] as f64).sum()).collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + logits.iter().map(|z| (z - max).exp()).sum::<f64>().ln();
        loss += lse - logits[target as usize];
    }
    loss / n as f64
}

#[test]
fn the_converted_model_has_the_loss_of_a_forward_pass_on_the_hf_tensors() {
    let d = dir("loss");
    let model = hf_model();
    let bin = d.join("model.bin");
    import(&hf_file(&d, &model, "F32", ""), &bin);
    let graph = d.join("model.graph");
    let o = fusec(&["export", "gpt2", "--like", s(&bin), "-o", s(&graph)]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let tokens: Vec<u16> = (0..T as u32 + 1).map(|i| ((i * 37 + 11) % V as u32) as u16).collect();
    let data = d.join("tokens.bin");
    fusec_runtime::tokens::write_tokens(&data, &tokens).unwrap();
    let seq = T.to_string();
    let o =
        fusec(&["run", s(&graph), "--target", "ref", "--init", s(&bin), "--data", s(&data), "--batch", "1", "--seq", &seq, "--steps", "0"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let got: f64 = out.lines().find_map(|l| l.strip_prefix("step 0: loss ")).unwrap_or_else(|| panic!("{out}")).trim().parse().unwrap();
    let want = reference_loss(&model, &tokens);
    assert!((got - want).abs() <= 1e-5 * want, "fusec {got}, reference {want}");
    // Not a degenerate model: the loss is not that of uniform predictions.
    assert!((want - (V as f64).ln()).abs() > 1e-3, "{want}");
}
