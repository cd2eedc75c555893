//! GPT-2 tokenizer (known ids, round trips, rendering) and token sampling.

use fusec_ir::rng::Rng;
use fusec_runtime::sample::{generate, sample_next};
use fusec_runtime::tokenizer::{describe_tokens, Gpt2Tokenizer, GPT2_VOCAB};

fn tok() -> Gpt2Tokenizer {
    Gpt2Tokenizer::new().expect("the GPT-2 ranks are bundled")
}

#[test]
fn known_gpt2_ids() {
    let t = tok();
    assert_eq!(t.encode("Hello world"), vec![15496, 995]);
    assert_eq!(t.encode(" the"), vec![262]);
    assert_eq!(t.encode("\n"), vec![198]);
    assert_eq!(t.encode("\n\n"), vec![628]);
    assert_eq!(Gpt2Tokenizer::EOT, 50256);
    assert_eq!(GPT2_VOCAB, 50257);
    assert_eq!(t.decode(&[Gpt2Tokenizer::EOT]), "<|endoftext|>");
}

#[test]
fn special_tokens_in_text_are_ordinary_text() {
    let t = tok();
    let ids = t.encode("a<|endoftext|>b");
    assert!(!ids.contains(&Gpt2Tokenizer::EOT), "{ids:?}");
    assert_eq!(t.decode(&ids), "a<|endoftext|>b");
}

#[test]
fn round_trips() {
    let t = tok();
    for text in [
        "",
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
        "  leading and trailing spaces  \t\n\n\n",
        "It's 3.14159 o'clock; we'll see—maybe.",
        "naïve café, Grüße, 日本語のテキスト, emoji 🦀🚀, Ελληνικά, עברית",
    ] {
        let ids = t.encode(text);
        assert!(ids.iter().all(|&i| (i as usize) < GPT2_VOCAB));
        assert_eq!(t.decode(&ids), text, "{ids:?}");
    }
}

#[test]
fn decode_is_lossy_not_failing() {
    let t = tok();
    let ids = t.encode("🦀");
    assert!(ids.len() > 1, "the crab is several byte tokens: {ids:?}");
    // Half a character, and an id outside the vocabulary, become U+FFFD.
    assert!(t.decode(&ids[..1]).contains('\u{FFFD}'));
    assert_eq!(t.decode(&[15496, 60000]), "Hello\u{FFFD}");
}

#[test]
fn describe_tokens_modes() {
    assert_eq!(describe_tokens(&[15496, 995], 50257), "Hello world");
    assert_eq!(describe_tokens(&[15496, 995], 50304), "15496 995");
    assert_eq!(describe_tokens(&[3, 1, 4], 64), "3 1 4");
    assert_eq!(describe_tokens(&[], 64), "");
}

#[test]
fn sample_argmax_at_zero_temperature() {
    let mut rng = Rng::new(1);
    let logits = [0.5, 3.0, -1.0, 2.9, 100.0];
    for _ in 0..10 {
        // The padding logit (index 4) is ignored.
        assert_eq!(sample_next(&logits, 4, 0.0, &mut rng), 1);
    }
    assert_eq!(sample_next(&[1.0, f32::NAN, 2.0], 3, 0.0, &mut rng), 2);
}

#[test]
fn sample_never_draws_padding() {
    let mut rng = Rng::new(7);
    let mut logits = vec![0.0f32; 8];
    logits[5..].fill(1e4); // padding with huge logits
    for t in [0.0, 0.5, 1.0, 10.0] {
        for _ in 0..2000 {
            assert!(sample_next(&logits, 5, t, &mut rng) < 5);
        }
    }
}

#[test]
fn sample_follows_softmax() {
    let logits = [1.0f32, 2.0, 0.0, -1.0, 1.5];
    for temperature in [1.0f32, 0.5, 2.0] {
        let mut rng = Rng::new(42);
        let draws = 20_000;
        let mut counts = [0usize; 5];
        for _ in 0..draws {
            counts[sample_next(&logits, 5, temperature, &mut rng) as usize] += 1;
        }
        let w: Vec<f64> = logits.iter().map(|&l| (l as f64 / temperature as f64).exp()).collect();
        let z: f64 = w.iter().sum();
        for (i, (&c, &wi)) in counts.iter().zip(&w).enumerate() {
            let p = wi / z;
            let f = c as f64 / draws as f64;
            // Five standard deviations of a binomial proportion, plus a little.
            let tol = 5.0 * (p * (1.0 - p) / draws as f64).sqrt() + 1e-3;
            assert!((f - p).abs() < tol, "T={temperature} token {i}: {f} vs {p} (tol {tol})");
        }
    }
}

#[test]
fn generate_grows_the_context() {
    let prompt = [7u16, 8];
    let mut seen: Vec<Vec<u16>> = Vec::new();
    let out = generate(
        |ctx| {
            seen.push(ctx.to_vec());
            // Always favour (last token + 1) mod 10; row padded to 16.
            let mut row = vec![-1e9f32; 16];
            row[(*ctx.last().unwrap() as usize + 1) % 10] = 0.0;
            Ok(row)
        },
        &prompt,
        5,
        10,
        1.0,
        3,
    )
    .unwrap();
    assert_eq!(out, vec![9, 0, 1, 2, 3]);
    assert_eq!(seen.len(), 5);
    for (i, ctx) in seen.iter().enumerate() {
        assert_eq!(ctx.len(), prompt.len() + i);
        assert_eq!(&ctx[..2], &prompt);
        assert_eq!(&ctx[2..], &out[..i]);
    }
}

#[test]
fn generate_is_deterministic_and_passes_errors() {
    let flat = |_: &[u16]| Ok(vec![0.0f32; 50]);
    let a = generate(flat, &[1], 20, 50, 1.0, 9).unwrap();
    let b = generate(flat, &[1], 20, 50, 1.0, 9).unwrap();
    assert_eq!(a, b);
    assert!(generate(flat, &[1], 0, 50, 1.0, 9).unwrap().is_empty());

    let err = generate(|_| Err("boom".to_string()), &[1], 3, 50, 1.0, 9).unwrap_err();
    assert_eq!(err, "boom");
    let err = generate(|_| Ok(vec![0.0; 4]), &[1], 3, 50, 1.0, 9).unwrap_err();
    assert!(err.contains("4 logits") && err.contains("50"), "{err}");
}
