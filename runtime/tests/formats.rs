//! llm.c file formats: checkpoint and token file round trips, every error case, the data
//! loader, random initialisation, and the shipped llmc-odd reference files.

use std::path::{Path, PathBuf};

use fusec_ir::testkit::TempDir;

use fusec_runtime::checkpoint::{graph_param_names, param_layout, random_init, Checkpoint, Gpt2Config};
use fusec_runtime::data::DataLoader;
use fusec_runtime::file_error::FileError;
use fusec_runtime::tokens::{read_tokens, write_tokens};

/// A fresh temp folder for one test (unique per process and test name), removed when dropped.
fn temp_dir(test: &str) -> TempDir {
    TempDir::new(&format!("formats-{test}"))
}

/// The llmc-odd reference folder, or None (with a printed skip reason) when absent.
fn refs() -> Option<PathBuf> {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/refs/llmc-odd"));
    if dir.is_dir() {
        Some(dir.to_path_buf())
    } else {
        fusec_ir::testkit::skip("runtime formats", &format!("reference folder {} not found", dir.display()));
        None
    }
}

fn tiny() -> Gpt2Config {
    Gpt2Config { max_seq: 8, vocab: 10, padded_vocab: 16, layers: 2, heads: 2, channels: 4 }
}

fn odd() -> Gpt2Config {
    Gpt2Config { max_seq: 48, vocab: 500, padded_vocab: 512, layers: 3, heads: 2, channels: 32 }
}

/// Asserts `r` is a FileError naming `path` whose message contains every piece in `want`.
fn expect_err<T: std::fmt::Debug>(r: Result<T, FileError>, path: &Path, want: &[&str]) {
    let e = r.expect_err("expected an error");
    let shown = e.to_string();
    assert_eq!(e.path, path);
    assert!(shown.starts_with(&format!("{}: ", path.display())), "{shown}");
    for w in want {
        assert!(shown.contains(w), "message {shown:?} lacks {w:?}");
    }
}

/// A checkpoint header with the given slots 0..8.
fn header(slots: &[i32]) -> Vec<u8> {
    let mut h = [0i32; 256];
    h[..slots.len()].copy_from_slice(slots);
    h.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn checkpoint_round_trip() {
    let dir = temp_dir("ckpt_rt");
    let ck = random_init(&tiny(), 7).unwrap();
    let p = dir.join("c.bin");
    ck.write(&p).unwrap();
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 1024 + 4 * tiny().num_params() as u64);
    let back = Checkpoint::read(&p).unwrap();
    assert_eq!(back, ck);
    assert_eq!(Checkpoint::read_header(&p).unwrap(), tiny());
}

#[test]
fn tokens_round_trip() {
    let dir = temp_dir("tok_rt");
    let toks: Vec<u16> = (0..1000u32).map(|i| (i * 7919 % 65536) as u16).collect();
    let p = dir.join("t.bin");
    write_tokens(&p, &toks).unwrap();
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 1024 + 2000);
    assert_eq!(read_tokens(&p).unwrap(), toks);
    let empty = dir.join("e.bin");
    write_tokens(&empty, &[]).unwrap();
    assert_eq!(read_tokens(&empty).unwrap(), Vec::<u16>::new());
}

#[test]
fn checkpoint_errors() {
    let dir = temp_dir("ckpt_err");
    let good = dir.join("good.bin");
    random_init(&tiny(), 1).unwrap().write(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, b: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        p
    };

    let missing = dir.join("missing.bin");
    expect_err(Checkpoint::read(&missing), &missing, &["cannot open"]);

    let mut b = bytes.clone();
    b[0..4].copy_from_slice(&123i32.to_le_bytes());
    let p = write("magic.bin", &b);
    expect_err(Checkpoint::read(&p), &p, &["wrong magic", "expected 20240326", "found 123"]);
    expect_err(Checkpoint::read_header(&p), &p, &["wrong magic"]);

    let mut b = bytes.clone();
    b[0..4].copy_from_slice(&20240520i32.to_le_bytes());
    let p = write("tokmagic.bin", &b);
    expect_err(Checkpoint::read(&p), &p, &["wrong magic", "token file"]);

    let mut b = bytes.clone();
    b[4..8].copy_from_slice(&5i32.to_le_bytes());
    let p = write("version.bin", &b);
    expect_err(Checkpoint::read(&p), &p, &["unsupported checkpoint version 5", "bf16"]);

    let p = write("header.bin", &bytes[..500]);
    expect_err(Checkpoint::read(&p), &p, &["truncated header", "500 bytes"]);
    let p = write("empty.bin", &[]);
    expect_err(Checkpoint::read(&p), &p, &["truncated header"]);

    let n = tiny().num_params();
    let p = write("short.bin", &bytes[..bytes.len() - 6]);
    let want_n = format!("expected {} bytes of parameters after the header", 4 * n);
    let found = format!("found {}", 4 * n - 6);
    expect_err(Checkpoint::read(&p), &p, &["truncated", &want_n, "for config", "num_layers 2", &found]);
    expect_err(Checkpoint::read_header(&p), &p, &["truncated"]);

    let mut b = bytes.clone();
    b.extend_from_slice(&[0, 0, 0]);
    let p = write("long.bin", &b);
    expect_err(Checkpoint::read(&p), &p, &["trailing bytes", "3 trailing bytes"]);

    // Bad configs: [magic, version, maxT, V, L, NH, C, Vp].
    let m = 20240326;
    let cases: &[(&str, [i32; 8], &[&str])] = &[
        ("zero_layers", [m, 3, 8, 10, 0, 2, 4, 16], &["bad config", "num_layers is 0"]),
        ("neg_layers", [m, 3, 8, 10, -3, 2, 4, 16], &["num_layers is -3", "slot 4"]),
        ("huge_layers", [m, 3, 8, 10, 1 << 30, 2, 4, 16], &["num_layers", "absurdly large"]),
        ("heads", [m, 3, 8, 10, 2, 3, 4, 16], &["channels 4 is not divisible by num_heads 3"]),
        ("vp", [m, 3, 8, 10, 2, 2, 4, 8], &["padded_vocab_size 8 is smaller than vocab_size 10"]),
        ("neg_c", [m, 3, 8, 10, 2, 2, -4, 16], &["channels is -4"]),
        ("zero_t", [m, 3, 0, 10, 2, 2, 4, 16], &["max_seq_len is 0"]),
        ("many", [m, 3, 1 << 20, 1 << 24, 4096, 1, 1 << 16, 1 << 24], &["absurdly many parameters"]),
    ];
    for (name, slots, want) in cases {
        let mut b = header(slots);
        b.extend_from_slice(&bytes[1024..]);
        let p = write(&format!("{name}.bin"), &b);
        expect_err(Checkpoint::read(&p), &p, want);
    }

    // Writing refuses a params array that does not match the config.
    let mut ck = random_init(&tiny(), 1).unwrap();
    ck.params.pop();
    let p = dir.join("bad_write.bin");
    expect_err(ck.write(&p), &p, &["cannot write checkpoint", "parameters"]);
    assert!(!p.exists());
}

#[test]
fn token_errors() {
    let dir = temp_dir("tok_err");
    let good = dir.join("good.bin");
    write_tokens(&good, &[1, 2, 3, 4, 5]).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, b: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let missing = dir.join("missing.bin");
    expect_err(read_tokens(&missing), &missing, &["cannot open"]);

    let p = write("short.bin", &bytes[..bytes.len() - 1]);
    expect_err(read_tokens(&p), &p, &["truncated", "expected 10 bytes of tokens", "found 9"]);
    let mut b = bytes.clone();
    b.extend_from_slice(&[7, 7]);
    let p = write("long.bin", &b);
    expect_err(read_tokens(&p), &p, &["trailing bytes", "2 trailing bytes"]);
    let p = write("header.bin", &bytes[..100]);
    expect_err(read_tokens(&p), &p, &["truncated header", "100 bytes"]);

    let mut b = bytes.clone();
    b[0..4].copy_from_slice(&20240326i32.to_le_bytes());
    let p = write("magic.bin", &b);
    expect_err(read_tokens(&p), &p, &["wrong magic", "expected 20240520", "checkpoint"]);
    let mut b = bytes.clone();
    b[4..8].copy_from_slice(&2i32.to_le_bytes());
    let p = write("version.bin", &b);
    expect_err(read_tokens(&p), &p, &["unsupported token file version 2"]);
    let mut b = bytes.clone();
    b[8..12].copy_from_slice(&(-1i32).to_le_bytes());
    let p = write("neg.bin", &b);
    expect_err(read_tokens(&p), &p, &["token count is -1"]);
}

#[test]
fn config_and_names() {
    let c = tiny();
    assert!(c.validate().is_ok());
    let layout = param_layout(&c);
    assert_eq!(layout.len(), 16);
    assert_eq!(layout[4], ("qkvw", vec![2, 12, 4]));
    assert_eq!(layout[12], ("fcprojw", vec![2, 4, 16]));
    let total: usize = layout.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    assert_eq!(total, c.num_params());

    let names = graph_param_names(&c);
    assert_eq!(names.len(), 4 + 12 * 2);
    assert_eq!(names[0], ("wte".to_string(), vec![16, 4]));
    assert_eq!(names[2], ("ln1w.0".to_string(), vec![4]));
    assert_eq!(names[3], ("ln1w.1".to_string(), vec![4]));
    assert_eq!(names[6], ("qkvw.0".to_string(), vec![12, 4]));
    assert_eq!(names.last().unwrap().0, "lnfb");

    let ck = random_init(&c, 3).unwrap();
    let named = ck.named_tensors();
    let lookup = |n: &str| named.iter().find(|t| t.0 == n).map(|t| t.2.to_vec());
    assert_eq!(Checkpoint::from_named(c, lookup).unwrap(), ck);
    assert_eq!(ck.tensor("qkvw.1").unwrap(), lookup("qkvw.1").unwrap().as_slice());
    assert_eq!(ck.tensor("qkvw").unwrap().len(), 2 * 12 * 4);
    assert!(ck.tensor("qkvw.2").is_none() && ck.tensor("wte.0").is_none());

    let e = Checkpoint::from_named(c, |n| if n == "fcb.1" { None } else { lookup(n) });
    assert!(e.unwrap_err().contains("missing tensor fcb.1"));
    let e = Checkpoint::from_named(c, |n| {
        let mut v = lookup(n)?;
        if n == "wpe" {
            v.push(0.0);
        }
        Some(v)
    });
    let msg = e.unwrap_err();
    assert!(msg.contains("tensor wpe has 33 values, expected 32"), "{msg}");
}

#[test]
fn random_init_properties() {
    let c = odd();
    let a = random_init(&c, 42).unwrap();
    assert_eq!(a, random_init(&c, 42).unwrap());
    assert_ne!(a.params, random_init(&c, 43).unwrap().params);
    assert_eq!(a.params.len(), 56096);
    let wte = a.tensor("wte").unwrap();
    assert!(wte[500 * 32..].iter().all(|&v| v == 0.0));
    let real = &wte[..500 * 32];
    let std = (real.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / real.len() as f64).sqrt();
    assert!((std - 0.02).abs() < 0.002, "wte std {std}");
    let proj = a.tensor("fcprojw").unwrap();
    let pstd = (proj.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / proj.len() as f64).sqrt();
    assert!((pstd - 0.02 / 6f64.sqrt()).abs() < 0.001, "fcprojw std {pstd}");
    assert!(a.tensor("ln2w").unwrap().iter().all(|&v| v == 1.0));
    assert!(a.tensor("qkvb").unwrap().iter().all(|&v| v == 0.0));
}

#[test]
fn data_loader_semantics() {
    let toks: Vec<u16> = (0..10).collect();
    assert!(DataLoader::new(toks.clone(), 3, 3).is_ok());
    assert!(DataLoader::new(toks.clone(), 3, 4).unwrap_err().contains("at least 13"));
    assert!(DataLoader::new(toks[..9].to_vec(), 2, 4).is_ok());
    assert!(DataLoader::new(toks.clone(), 0, 4).is_err());
    let msg = DataLoader::new(toks[..8].to_vec(), 2, 4).unwrap_err();
    assert!(msg.contains("needs at least 9") && msg.contains("found 8"), "{msg}");

    // 10 tokens, B*T = 4: offsets 0, 4, 8, 2 (=12 mod 10), ...
    let dl = DataLoader::new(toks.clone(), 2, 2).unwrap();
    assert_eq!(dl.num_tokens(), 10);
    assert_eq!(dl.batch(0), (vec![0, 1, 2, 3], vec![1, 2, 3, 4]));
    assert_eq!(dl.batch(1), (vec![4, 5, 6, 7], vec![5, 6, 7, 8]));
    assert_eq!(dl.batch(2), (vec![8, 9, 0, 1], vec![9, 0, 1, 2]));
    assert_eq!(dl.offset(3), 2);
    assert_eq!(dl.batch(3), (vec![2, 3, 4, 5], vec![3, 4, 5, 6]));
    // Ends exactly at the last token: the target of the last input is token 0.
    let dl = DataLoader::new((0..5).collect(), 1, 4).unwrap();
    assert_eq!(dl.batch(0), (vec![0, 1, 2, 3], vec![1, 2, 3, 4]));
    assert_eq!(dl.batch(1), (vec![4, 0, 1, 2], vec![0, 1, 2, 3]));

    assert!(dl.check_vocab(5).is_ok());
    let msg = dl.check_vocab(3).unwrap_err();
    assert!(msg.contains("position 3") && msg.contains("is 3"), "{msg}");
}

#[test]
fn llmc_odd_reference_files() {
    let Some(dir) = refs() else { return };
    let ckpt_path = dir.join("gpt2_odd_s4242.bin");
    let ck = Checkpoint::read(&ckpt_path).unwrap();
    assert_eq!(ck.config, odd());
    assert_eq!(Checkpoint::read_header(&ckpt_path).unwrap(), odd());
    assert_eq!(ck.config.num_params(), 56096);
    assert_eq!(ck.params.len(), 56096);
    let wte = ck.tensor("wte").unwrap();
    assert!(wte[500 * 32..512 * 32].iter().all(|&v| v == 0.0));
    assert!(wte[..500 * 32].iter().any(|&v| v != 0.0));

    // Offsets from the README's layout table.
    let offsets = [0, 16384, 17920, 18016, 18112, 27328, 27616, 30688, 30784, 30880, 30976, 43264, 43648, 55936, 56032, 56064];
    let mut off = 0;
    for ((_, shape), want) in param_layout(&ck.config).iter().zip(offsets) {
        assert_eq!(off, want);
        off += shape.iter().product::<usize>();
    }

    let named = ck.named_tensors();
    assert_eq!(named.len(), 4 + 12 * 3);
    let shape_of = |n: &str| named.iter().find(|t| t.0 == n).unwrap().1.clone();
    assert_eq!(shape_of("wte"), vec![512, 32]);
    assert_eq!(shape_of("wpe"), vec![48, 32]);
    assert_eq!(shape_of("ln1w.0"), vec![32]);
    assert_eq!(shape_of("qkvw.2"), vec![96, 32]);
    assert_eq!(shape_of("qkvb.1"), vec![96]);
    assert_eq!(shape_of("attprojw.0"), vec![32, 32]);
    assert_eq!(shape_of("fcw.1"), vec![128, 32]);
    assert_eq!(shape_of("fcb.2"), vec![128]);
    assert_eq!(shape_of("fcprojw.2"), vec![32, 128]);
    assert_eq!(shape_of("lnfb"), vec![32]);
    for (name, shape, data) in &named {
        assert_eq!(data.len(), shape.iter().product::<usize>(), "{name}");
    }
    // qkvw.1 lives at float offset 18112 + 96*32.
    assert_eq!(ck.tensor("qkvw.1").unwrap()[0], ck.params[18112 + 96 * 32]);

    let rebuilt = Checkpoint::from_named(ck.config, |n| named.iter().find(|t| t.0 == n).map(|t| t.2.to_vec())).unwrap();
    assert_eq!(rebuilt.params.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), ck.params.iter().map(|v| v.to_bits()).collect::<Vec<_>>());

    let tmp = temp_dir("llmc_odd");
    let out = tmp.join("copy.bin");
    rebuilt.write(&out).unwrap();
    assert!(std::fs::read(&out).unwrap() == std::fs::read(&ckpt_path).unwrap());

    let toks = read_tokens(&dir.join("tokens_train_s11.bin")).unwrap();
    assert_eq!(toks.len(), 12000);
    assert!(toks.iter().all(|&t| t < 500));
    let val = read_tokens(&dir.join("tokens_val_s12.bin")).unwrap();
    assert_eq!(val.len(), 2048);

    let dl = DataLoader::new(toks.clone(), 3, 48).unwrap();
    dl.check_vocab(500).unwrap();
    let as_i32 = |r: std::ops::Range<usize>| toks[r].iter().map(|&t| t as i32).collect::<Vec<_>>();
    let (x, y) = dl.batch(0);
    assert_eq!(x, as_i32(0..144));
    assert_eq!(y, as_i32(1..145));
    let (x, y) = dl.batch(1);
    assert_eq!(x, as_i32(144..288));
    assert_eq!(y, as_i32(145..289));
    assert_eq!(dl.offset(9), 9 * 144);
}

#[test]
fn random_init_drawn_in_parallel_equals_drawing_in_order() {
    // Several 65536-value slices per tensor: the same values as one sequential stream.
    let cfg = Gpt2Config { max_seq: 256, vocab: 1000, padded_vocab: 1024, layers: 2, heads: 4, channels: 128 };
    let got = random_init(&cfg, 42).unwrap().params;
    let mut rng = fusec_ir::rng::Rng::new(42);
    let proj_std = 0.02 / (2.0 * cfg.layers as f64).sqrt();
    let mut want = vec![];
    for (name, shape) in param_layout(&cfg) {
        let n: usize = shape.iter().product();
        let normals = |k: usize, std: f64, rng: &mut fusec_ir::rng::Rng| (0..k).map(|_| (std * rng.normal()) as f32).collect::<Vec<_>>();
        match name {
            "wte" => {
                want.extend(normals(cfg.vocab * cfg.channels, 0.02, &mut rng));
                want.extend(std::iter::repeat_n(0.0, n - cfg.vocab * cfg.channels));
            }
            "wpe" | "qkvw" | "fcw" => want.extend(normals(n, 0.02, &mut rng)),
            "attprojw" | "fcprojw" => want.extend(normals(n, proj_std, &mut rng)),
            "ln1w" | "ln2w" | "lnfw" => want.extend(std::iter::repeat_n(1.0, n)),
            _ => want.extend(std::iter::repeat_n(0.0, n)),
        }
    }
    assert_eq!(got.len(), want.len());
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "bit-identical to the sequential stream");
}
