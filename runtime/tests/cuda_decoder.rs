//! The cached decoder on the CUDA target (`cargo test -p fusec-runtime --test cuda_decoder --
//! --ignored` on a GPU): its logits equal the interpreter's whole forward at every position, for
//! random small GPT-2s, with exact fp32 products (no TF32) and with TF32 at a looser tolerance.

mod decoder_common;

use decoder_common::*;
use fusec_ir::rng::Rng;
use fusec_passes::pipeline::PipelineOptions;
use fusec_runtime::cuda::{CudaExecutor, CudaOptions};
use fusec_runtime::programs::RunPrograms;

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on the device"]
fn cached_logits_equal_the_full_forward_at_every_position_on_cuda() {
    let mut rng = Rng::new(29);
    for case in 0..3 {
        let Case { cfg, params, tokens, full } = random_case(&mut rng, 300 + case);
        for p in [1, 3, cfg.max_seq] {
            let run = RunPrograms::decoder(&cfg, p, &PipelineOptions::default()).unwrap();
            let opts = CudaOptions { tf32: false, ..CudaOptions::default() };
            let (ex, _) = CudaExecutor::new(&run, &opts).unwrap();
            let mut d = decoder(Box::new(ex), &cfg, p, &params);
            check_positions(&format!("cuda {cfg}"), &mut d, &cfg, &tokens, p, &full);
            check_positions(&format!("cuda {cfg}, second prompt"), &mut d, &cfg, &tokens, p, &full);
        }
    }
}
