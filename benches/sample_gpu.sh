#!/usr/bin/env bash
# Sampling on an NVIDIA GPU (issue 17): the key/value-cache decoder's CUDA test, then GPT-2
# 124M's decoding speed, `fusec sample --target cuda` next to PyTorch eager with a key/value
# cache (benches/torch_decode_bench.py), greedy, a 9-token prompt, 200 tokens.
#
# Needs, inside the repository (ignored by git, carried to the device as `.dev`):
#   .dev/fusec          the release binary built on the development machine
#   .dev/cuda_decoder   the test binary: `cargo test --release -p fusec-runtime --test cuda_decoder
#                       --no-run` prints its path (target/release/deps/cuda_decoder-HASH)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FUSEC_BIN:-.dev/fusec}
TEST=${DECODER_TEST:-.dev/cuda_decoder}
OUTDIR=${OUT:-/tmp/fusec-sample-bench}
WORK=${WORK:-/tmp/fusec-sample-work}
mkdir -p "$OUTDIR" "$WORK"
source benches/device_env.sh

echo "== 1. the cached decoder's logits = the interpreter's whole forward at every position (CUDA)"
"$TEST" --ignored --test-threads 1 2>&1 | tail -3

echo "== 2. GPT-2 124M: fusec sample --target cuda (a checkpoint after one step from random init)"
"$BIN" run models/gpt2-124m.graph --target cuda --steps 1 --save "$WORK/ck124" > "$OUTDIR/run124.txt" 2>&1
PROMPT="The quick brown fox jumps over the lazy dog"
for i in 1 2 3; do
  "$BIN" sample "$WORK/ck124" --target cuda --prompt "$PROMPT" --tokens 200 --temperature 0 2>&1 >/dev/null | tee -a "$OUTDIR/fusec_sample.txt"
done

echo "== 3. PyTorch eager with a key/value cache, same sizes (TF32 allowed, as fusec's default)"
python3 benches/torch_decode_bench.py --layers 12 --heads 12 --channels 768 --prompt 9 --tokens 200 | tee "$OUTDIR/torch_decode.jsonl"
