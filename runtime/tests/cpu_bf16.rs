//! bf16 training on the CPU target against the interpreter (the CPU counterpart of
//! `cuda.rs`'s `tiny_gpt2_in_bf16_trains_like_the_interpreter`): every precision, recompute mode
//! and product path (AVX512-BF16 dot products where the host has them, widened operands
//! everywhere); and fp32 training at every instruction-set level the host supports, which must
//! give the same bits (the levels differ only in native routines that are ports of the
//! generated code).

use fusec_codegen_cpu::isa::Isa;
use fusec_ir::interp::{Rounding, Tensor};
use fusec_ir::{DType, Graph};
use fusec_models::{build_gpt2, Gpt2Config};
use fusec_passes::amp::Precision;
use fusec_passes::pipeline::PipelineOptions;
use fusec_passes::recompute::Recompute;
use fusec_runtime::checkpoint::random_init;
use fusec_runtime::cpu::CpuExecutor;
use fusec_runtime::data::DataLoader;
use fusec_runtime::executor::{Executor, RefExecutor};
use fusec_runtime::params::params_from_checkpoint;
use fusec_runtime::programs::{Program, RunPrograms};
use fusec_runtime::train::{eval_loss, init_state, train, TrainConfig};

const B: usize = 4;
const T: usize = 64;
const STEPS: usize = 3;

fn tiny() -> (Gpt2Config, Graph) {
    let cfg = Gpt2Config::preset("tiny").unwrap();
    let fwd = build_gpt2(&cfg, "tiny");
    (cfg, fwd)
}

fn programs(fwd: &Graph, opts: &PipelineOptions) -> RunPrograms {
    RunPrograms::compile(fwd, opts, &RunPrograms::bindings(B, T), false).unwrap()
}

/// The levels whose bf16 products differ: the widened path (lowest level with native row
/// routines, else `scalar`), the dot products where the host has AVX512-BF16 and the AMX tiles
/// where it has AMX.
fn product_paths() -> Vec<Isa> {
    let widen = if Isa::Avx2.supported() { Isa::Avx2 } else { Isa::Scalar };
    let mut v = vec![widen];
    if Isa::Avx512Bf16.supported() {
        v.push(Isa::Avx512Bf16);
    } else {
        fusec_ir::testkit::skip("bf16 dot-product training", "this host has no AVX512-BF16 (the widened path is tested)");
    }
    if Isa::Amx.supported() {
        v.push(Isa::Amx);
    } else {
        fusec_ir::testkit::not_on_this_host("bf16 training on AMX tiles", "this host has no AMX (or Linux did not grant its tile state)");
    }
    v
}

/// The validation loss before training, then each step's loss, of the tiny GPT-2 (random
/// init, the embedded corpus).
fn losses(ex: &mut dyn Executor, step: &Graph, cfg: &Gpt2Config, fwd: &Graph) -> Vec<f64> {
    let params = params_from_checkpoint(fwd, &random_init(cfg, 1337).unwrap()).unwrap();
    init_state(ex, step, &params).unwrap();
    let data = DataLoader::new(fusec_runtime::corpus::markov_tokens(cfg.vocab, 20_000, 42, 1), B, T).unwrap();
    let mut out = vec![eval_loss(ex, &data, 2, B, T).unwrap()];
    out.extend(train(ex, &TrainConfig::new(B, T, STEPS, 1e-3), &data, None, |_| {}).unwrap().iter().map(|l| l.loss));
    out
}

fn cpu(run: &RunPrograms, threads: usize, isa: Isa) -> CpuExecutor {
    CpuExecutor::with_isa(run, threads, false, isa).unwrap_or_else(|e| panic!("{isa:?}: {e}")).0
}

#[test]
fn tiny_gpt2_in_bf16_trains_like_the_interpreter() {
    // Against the interpreter on the same fused programs (the same rounding points: 1e-3 on the
    // loss covers f32 accumulation order and a bf16 rounding that falls the other way), and on
    // the unfused programs (which round after every op: 2e-2, the numerics target of
    // `--precision bf16`), as on CUDA. The interpreter's values do not depend on the recompute
    // mode (`passes/tests/recompute.rs`), so one reference serves all three.
    let (cfg, fwd) = tiny();
    for precision in [Precision::Bf16, Precision::Bf16Residual] {
        let bf16 = PipelineOptions { precision, ..PipelineOptions::default() };
        let run = programs(&fwd, &bf16);
        let same = losses(&mut RefExecutor::new(&run, Rounding::F32), run.step().unwrap(), &cfg, &fwd);
        let unfused = programs(&fwd, &PipelineOptions { no_fusion: true, ..bf16.clone() });
        let per_op = losses(&mut RefExecutor::new(&unfused, Rounding::F32), unfused.step().unwrap(), &cfg, &fwd);
        for recompute in [Recompute::None, Recompute::Gelu, Recompute::GeluLayernorm] {
            let run = programs(&fwd, &PipelineOptions { recompute, ..bf16.clone() });
            for isa in product_paths() {
                let got = losses(&mut cpu(&run, 2, isa), run.step().unwrap(), &cfg, &fwd);
                let what = format!("{precision:?}, recompute {recompute:?}, {isa:?}");
                eprintln!("{what}: cpu {got:?}\n  interpreter {same:?}\n  unfused {per_op:?}");
                for (i, ((g, w), u)) in got.iter().zip(&same).zip(&per_op).enumerate() {
                    assert!(g.is_finite() && (g - w).abs() <= 1e-3 * w.abs(), "{what}: loss {i}: cpu {g} vs interpreter {w}");
                    assert!((g - u).abs() <= 2e-2 * u.abs(), "{what}: loss {i}: cpu {g} vs unfused interpreter {u}");
                }
                let one = losses(&mut cpu(&run, 1, isa), run.step().unwrap(), &cfg, &fwd);
                assert_eq!(one, got, "{what}: 1 and 2 threads differ");
            }
        }
    }
}

/// The loss and every parameter gradient of one Grad run on the first batch.
fn loss_and_grads(ex: &mut dyn Executor, fwd: &Graph, step: &Graph, cfg: &Gpt2Config) -> (f64, Vec<(String, Vec<f32>)>) {
    init_state(ex, step, &params_from_checkpoint(fwd, &random_init(cfg, 7).unwrap()).unwrap()).unwrap();
    let data = DataLoader::new(fusec_runtime::corpus::markov_tokens(cfg.vocab, 20_000, 42, 1), B, T).unwrap();
    let (x, y) = data.batch(0);
    ex.set("tokens", Tensor::from_i32(vec![B, T], &x)).unwrap();
    ex.set("targets", Tensor::from_i32(vec![B, T], &y)).unwrap();
    ex.set("dloss", Tensor::scalar(DType::F32, 1.0)).unwrap();
    let loss = ex.run(Program::Grad).unwrap().loss.unwrap();
    let grads = fwd.params().into_iter().map(|(n, _)| (n.to_string(), ex.get(&format!("grad.{n}")).unwrap().to_f32())).collect();
    (loss, grads)
}

#[test]
fn bf16_parameter_gradients_match_the_interpreter() {
    // Each parameter gradient within 2e-2 relative L2 of the interpreter's on the same fused
    // programs (bf16 activations make single elements move by a bf16 rounding; the interpreter
    // also rounds the weight-gradient products to bf16, which the CPU keeps in f32).
    let (cfg, fwd) = tiny();
    let opts = PipelineOptions { precision: Precision::Bf16, ..PipelineOptions::default() };
    let run = programs(&fwd, &opts);
    let step = run.step().unwrap();
    let (want_loss, want) = loss_and_grads(&mut RefExecutor::new(&run, Rounding::F32), &fwd, step, &cfg);
    for isa in product_paths() {
        let (loss, got) = loss_and_grads(&mut cpu(&run, 2, isa), &fwd, step, &cfg);
        assert!((loss - want_loss).abs() <= 1e-3 * want_loss.abs(), "{isa:?}: loss {loss} vs {want_loss}");
        let mut worst = (0.0f64, String::new());
        for ((name, g), (_, w)) in got.iter().zip(&want) {
            let err = fusec_ir::testkit::rel_l2(g, w);
            assert!(err <= 2e-2, "{isa:?}: gradient of {name}: relative L2 {err:e}");
            if err > worst.0 {
                worst = (err, name.clone());
            }
        }
        eprintln!("{isa:?}: loss {loss} vs {want_loss}; worst gradient relative L2 {:e} ({})", worst.0, worst.1);
    }
}

#[test]
fn fp32_training_gives_the_same_bits_at_every_isa_level() {
    let (cfg, fwd) = tiny();
    let run = programs(&fwd, &PipelineOptions::default());
    let levels: Vec<Isa> = Isa::ALL.into_iter().filter(|i| i.supported()).collect();
    let want = losses(&mut cpu(&run, 2, Isa::Scalar), run.step().unwrap(), &cfg, &fwd);
    for &isa in &levels[1..] {
        let mut ex = cpu(&run, 2, isa);
        let got = losses(&mut ex, run.step().unwrap(), &cfg, &fwd);
        assert_eq!(got, want, "{isa:?} vs scalar");
    }
    if levels.len() == 1 {
        fusec_ir::testkit::skip("fp32 at every ISA level", "this host has only the scalar level");
    }
}
