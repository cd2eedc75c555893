#!/usr/bin/env bash
# GPU benchmark and parity check, for a machine with an NVIDIA GPU (the device tool's H100).
#
# Needs, inside the repository (ignored by git, carried to the device as `.dev`):
#   .dev/fusec                  the release binary built on the development machine
#   .dev/torch_gpt2_bench.py    ../shared/bench/torch_gpt2_bench.py
#   .dev/refs/llmc-odd/         ../shared/refs/llmc-odd (optional: the parity step is skipped without it)
#
# Runs:
#   1. llm.c parity on llmc-odd, 10 losses vs reference.json: plain fp32 products (--no-tf32,
#      score-matrix attention) within 1e-5, and TF32 products with flash attention within 1e-3
#   2. GPT-2 124M, fp32 (TF32 products), B=16 T=1024, 30 steps from random init, --profile
#   2c. the same with bf16 products (--precision bf16)
#   3. PyTorch on the same shape: eager-fp32 (TF32 allowed, as the bench sets it) and compile-bf16
# and prints fusec's tokens/s next to each PyTorch mode's, with the ratio.
#
# Output files go to $OUT (the device tool's result folder) or /tmp/fusec-gpu-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FUSEC_BIN:-.dev/fusec}
TORCH=${TORCH_BENCH:-.dev/torch_gpt2_bench.py}
REFS=${FUSEC_REFS:-.dev/refs/llmc-odd}
OUTDIR=${OUT:-/tmp/fusec-gpu-bench}
STEPS=${STEPS:-30}
mkdir -p "$OUTDIR"
export FUSEC_CACHE_DIR=${FUSEC_CACHE_DIR:-$OUTDIR/cache}
# CUDA's libraries (libnvrtc, libcublas) where the toolkit keeps them, if the loader does not know them.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

echo "== 1. llm.c parity (llmc-odd): fp32 (--no-tf32, limit 1e-5) and TF32 with flash attention (limit 1e-3)"
if [ -f "$REFS/reference.json" ]; then
  "$BIN" export gpt2 --like "$REFS/gpt2_odd_s4242.bin" -o "$OUTDIR/odd.graph"
  for mode in fp32 tf32; do
    flag=$([ $mode = fp32 ] && echo --no-tf32 || true)
    "$BIN" run "$OUTDIR/odd.graph" --target cuda $flag --init "$REFS/gpt2_odd_s4242.bin" \
      --data "$REFS/tokens_train_s11.bin" --val "$REFS/tokens_val_s12.bin" --val-every 100 \
      --batch 3 --seq 48 --steps 10 --lr 1e-3 --log-json "$OUTDIR/parity_$mode.jsonl" > "$OUTDIR/parity_$mode.txt"
    grep -E "attention" "$OUTDIR/parity_$mode.txt" | sed "s/^/$mode: /"
    python3 - "$REFS/reference.json" "$OUTDIR/parity_$mode.jsonl" $([ $mode = fp32 ] && echo 1e-5 || echo 1e-3) <<'EOF'
import json, sys
ref = json.load(open(sys.argv[1]))
got = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
limit = float(sys.argv[3])
worst = max(abs(g["loss"] - w) for g, w in zip(got, ref["losses"]))
print(f"parity: {len(got)} losses, worst difference from llm.c {worst:.3e} ({'PASS' if worst <= limit else 'FAIL'} at {limit:g})")
EOF
  done
else
  echo "skipped: no $REFS/reference.json"
fi

echo "== 1b. first step, cold vs warm kernel cache (GPT-2 124M, B=16 T=1024)"
rm -rf "$OUTDIR/cold"
for cache in cold warm; do
  FUSEC_CACHE_DIR="$OUTDIR/cold" "$BIN" run models/gpt2-124m.graph --target cuda --batch 16 --seq 1024 --steps 2 \
    --val-every 1000000 | grep -E "compile|gpu build|step time|first step|kernels" | sed "s/^/$cache: /"
done

echo "== 2. fusec: GPT-2 124M fp32 (TF32 products) B=16 T=1024, $STEPS steps"
"$BIN" run models/gpt2-124m.graph --target cuda --batch 16 --seq 1024 --steps "$STEPS" --val-every 1000000 \
  --profile --profile-json "$OUTDIR/profile.json" --log-json "$OUTDIR/fusec.jsonl" | tee "$OUTDIR/fusec.txt"

echo "== 2b. fusec without flash attention and cuBLASLt epilogues (score matrices, epilogue kernels), 10 steps"
"$BIN" run models/gpt2-124m.graph --target cuda --batch 16 --seq 1024 --steps 10 --val-every 1000000 \
  --no-flash-attention --no-cublaslt | grep -E "step time|throughput|peak memory"

echo "== 2c. fusec with bf16 products (--precision bf16), $STEPS steps"
"$BIN" run models/gpt2-124m.graph --target cuda --precision bf16 --batch 16 --seq 1024 --steps "$STEPS" --val-every 1000000 \
  --log-json "$OUTDIR/fusec_bf16.jsonl" | grep -E "loss  |step time|throughput|peak memory"

echo "== 3. PyTorch: eager-fp32, compile-bf16"
python3 "$TORCH" --layers 12 --heads 12 --channels 768 --batch 16 --seq 1024 \
  --modes eager-fp32,compile-bf16 | tee "$OUTDIR/torch.jsonl"

python3 - "$OUTDIR/fusec.jsonl" "$OUTDIR/fusec_bf16.jsonl" "$OUTDIR/torch.jsonl" <<'EOF'
import json, sys
def rate(path, what):
    steps = [json.loads(l) for l in open(path) if l.strip()]
    ms = sorted(s["ms"] for s in steps[1:]) or [steps[0]["ms"]]
    med = ms[len(ms) // 2]
    tps = 16 * 1024 / (med / 1000.0)
    print(f"fusec {what}: {med:.1f} ms/step (median of steps 1..), {tps:,.0f} tok/s, loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}")
    return tps
fusec, bf16 = rate(sys.argv[1], "cuda fp32/tf32"), rate(sys.argv[2], "cuda bf16 products")
for l in open(sys.argv[3]):
    l = l.strip()
    if not l.startswith("{"):
        continue
    t = json.loads(l)
    print(f"torch {t['mode']:>13}: {t['ms_per_step_median']:.1f} ms/step, {t['tokens_per_s']:,} tok/s, peak {t['peak_mem_mib']} MiB"
          f"  -> fusec fp32 / torch = {fusec / t['tokens_per_s']:.2f}x, fusec bf16 / torch = {bf16 / t['tokens_per_s']:.2f}x")
EOF
