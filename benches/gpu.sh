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
#      score-matrix attention) within 1e-5, TF32 products with flash attention within 1e-3, and
#      --precision bf16 within 2e-2 relative
#   2. GPT-2 124M, fp32 (TF32 products), B=16 T=1024, 30 steps from random init, --profile
#   2c. the same in bf16: --precision bf16 / bf16+residual with each --recompute; one profiled
#   3. PyTorch on the same shape: eager-fp32 (TF32 allowed, as the bench sets it), eager-bf16
#      (autocast) and compile-bf16
#   4. with BIG=1: GPT-2 1.5B (d48) B=8, fusec bf16 and bf16+residual (each --recompute gelu, and
#      bf16+residual --recompute none), torch.compile bf16; BIG_STEPS steps each (default 20: the
#      step time moves +-5% from step to step with the clock under the GPU's power cap, so the
#      medians of 10 steps moved by about 1%)
# and prints fusec's ms/step, tokens/s and allocated memory next to each PyTorch mode's, with
# the ratios (PyTorch's peak is torch.cuda.max_memory_allocated; fusec's the one allocation).
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
source benches/device_env.sh

echo "== 1. llm.c parity (llmc-odd): fp32 (--no-tf32, limit 1e-5), TF32 with flash attention (limit 1e-3), bf16 (relative 2e-2)"
if [ -f "$REFS/reference.json" ]; then
  "$BIN" export gpt2 --like "$REFS/gpt2_odd_s4242.bin" -o "$OUTDIR/odd.graph"
  for mode in fp32 tf32 bf16; do
    flag=$(case $mode in fp32) echo --no-tf32;; bf16) echo --precision bf16;; esac)
    "$BIN" run "$OUTDIR/odd.graph" --target cuda $flag --init "$REFS/gpt2_odd_s4242.bin" \
      --data "$REFS/tokens_train_s11.bin" --val "$REFS/tokens_val_s12.bin" --val-every 100 \
      --batch 3 --seq 48 --steps 10 --lr 1e-3 --log-json "$OUTDIR/parity_$mode.jsonl" > "$OUTDIR/parity_$mode.txt"
    grep -E "attention" "$OUTDIR/parity_$mode.txt" | sed "s/^/$mode: /"
    python3 - "$REFS/reference.json" "$OUTDIR/parity_$mode.jsonl" $mode <<'EOF'
import json, sys
ref = json.load(open(sys.argv[1]))
got = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
mode = sys.argv[3]
# fp32: absolute 1e-5; TF32: absolute 1e-3; bf16: relative 2e-2 (issue 12's target).
rel = mode == "bf16"
limit = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 2e-2}[mode]
worst = max(abs(g["loss"] - w) / (abs(w) if rel else 1.0) for g, w in zip(got, ref["losses"]))
kind = "relative" if rel else "absolute"
print(f"parity {mode}: {len(got)} losses, worst {kind} difference from llm.c fp32 {worst:.3e} ({'PASS' if worst <= limit else 'FAIL'} at {limit:g})")
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

echo "== 2c. fusec bf16 (--precision bf16 / bf16+residual, each --recompute), $STEPS steps; the last one profiled"
for v in "bf16 none" "bf16 gelu" "bf16 gelu+layernorm" "bf16+residual gelu" "bf16+residual gelu+layernorm"; do
  set -- $v
  tag="$1_$2"
  "$BIN" run models/gpt2-124m.graph --target cuda --precision "$1" --recompute "$2" --batch 16 --seq 1024 --steps "$STEPS" \
    --val-every 1000000 --log-json "$OUTDIR/fusec_$tag.jsonl" > "$OUTDIR/fusec_$tag.txt"
  grep -E "peak memory" "$OUTDIR/fusec_$tag.txt" | sed "s/^/$tag: /"
  "$BIN" dump models/gpt2-124m.graph --pass memplan --precision "$1" --recompute "$2" --batch 16 --seq 1024 | grep "#   total" | sed "s/^/$tag plan: /"
done
for prec in bf16 bf16+residual; do
  tag=${prec/+/_}
  "$BIN" run models/gpt2-124m.graph --target cuda --precision $prec --recompute ${BF16_RECOMPUTE:-gelu} --batch 16 --seq 1024 \
    --steps 10 --val-every 1000000 --profile --profile-json "$OUTDIR/profile_$tag.json" > "$OUTDIR/fusec_${tag}_profile.txt"
  [ $prec = bf16 ] && sed -n '/profile/,$p' "$OUTDIR/fusec_${tag}_profile.txt" | head -60
  # Issue 12's target: every kernel but attention and the products within 6 ms a step.
  python3 - "$OUTDIR/profile_$tag.json" $prec <<'EOF2'
import json, sys
rows = json.load(open(sys.argv[1]))
steps = next(r["calls"] for r in rows if r["kernel"] == "adamw")
rest = sum(r["total_ms"] for r in rows if not r["kernel"].startswith(("matmul", "gemm", "flash_attention")))
print(f"{sys.argv[2]}: kernels other than products and attention {rest / steps:.2f} ms a step (target 6)")
EOF2
done

echo "== 3. PyTorch: eager-fp32, eager-bf16, compile-bf16"
python3 "$TORCH" --layers 12 --heads 12 --channels 768 --batch 16 --seq 1024 \
  --modes eager-fp32,eager-bf16,compile-bf16 | tee "$OUTDIR/torch.jsonl"

python3 - "$OUTDIR" "$OUTDIR/torch.jsonl" <<'EOF2'
import glob, json, os, re, sys
out = sys.argv[1]
def rate(path):
    # Step records only (a run's log ends with a validation-only line).
    steps = [s for s in (json.loads(l) for l in open(path) if l.strip()) if "ms" in s]
    ms = sorted(s["ms"] for s in steps[1:]) or [steps[0]["ms"]]
    med = ms[len(ms) // 2]
    return med, 16 * 1024 / (med / 1000.0), steps[0]["loss"], steps[-1]["loss"]
def alloc(txt):
    m = re.search(r"peak memory\s+([\d.]+) MiB allocated", open(txt).read()) if os.path.exists(txt) else None
    return float(m.group(1)) if m else float("nan")
fusec = {"fp32/tf32": (rate(f"{out}/fusec.jsonl"), alloc(f"{out}/fusec.txt"))}
for j in sorted(glob.glob(f"{out}/fusec_bf16*.jsonl")):
    tag = os.path.basename(j)[6:-6]
    fusec[tag] = (rate(j), alloc(j[:-6] + ".txt"))
torch = [json.loads(l) for l in open(sys.argv[2]) if l.strip().startswith("{")]
for name, ((med, tps, l0, l1), mib) in fusec.items():
    print(f"fusec {name:>29}: {med:6.1f} ms/step, {tps:>9,.0f} tok/s, loss {l0:.4f} -> {l1:.4f}, {mib:,.0f} MiB allocated")
    for t in torch:
        print(f"    vs torch {t['mode']:>13} ({t['ms_per_step_median']:.1f} ms, {t['peak_mem_mib']:,} MiB): "
              f"speed {tps / t['tokens_per_s']:.2f}x, memory {mib / t['peak_mem_mib']:.2f}x")
EOF2

if [ -n "${BIG:-}" ]; then
  echo "== 4. GPT-2 1.5B (d48) B=8 T=1024: fusec bf16 and bf16+residual (and bf16+residual --recompute none) vs torch.compile bf16, ${BIG_STEPS:-20} steps each (medians)"
  "$BIN" export gpt2 --preset d48 -o "$OUTDIR/d48.graph"
  for cfg in bf16:${BF16_RECOMPUTE:-gelu}:d48 bf16+residual:${BF16_RECOMPUTE:-gelu}:d48_residual bf16+residual:none:d48_residual_none; do
    IFS=: read -r prec rec tag <<< "$cfg"
    "$BIN" run "$OUTDIR/d48.graph" --target cuda --precision $prec --recompute $rec --batch 8 --seq 1024 \
      --steps "${BIG_STEPS:-20}" --val-every 1000000 --log-json "$OUTDIR/fusec_$tag.jsonl" | tee "$OUTDIR/fusec_$tag.txt" | grep -E "step time|throughput|peak memory|compile"
  done
  python3 "$TORCH" --layers 48 --heads 25 --channels 1600 --batch 8 --seq 1024 --steps "${BIG_STEPS:-20}" --modes compile-bf16 | tee "$OUTDIR/torch_d48.jsonl"
  python3 - "$OUTDIR" <<'EOF3'
import json, re, sys
out = sys.argv[1]
t = [json.loads(l) for l in open(f"{out}/torch_d48.jsonl") if l.strip().startswith("{")][0]
for tag, prec in [("d48", "bf16"), ("d48_residual", "bf16+residual"), ("d48_residual_none", "bf16+residual --recompute none")]:
    steps = [s for s in (json.loads(l) for l in open(f"{out}/fusec_{tag}.jsonl") if l.strip()) if "ms" in s][1:]
    ms = sorted(s["ms"] for s in steps)[len(steps) // 2]
    mib = float(re.search(r"peak memory\s+([\d.]+) MiB allocated", open(f"{out}/fusec_{tag}.txt").read()).group(1))
    tps = 8 * 1024 / (ms / 1000.0)
    print(f"fusec 1.5B {prec}: {ms:.1f} ms/step, {tps:,.0f} tok/s, {mib:,.0f} MiB allocated")
    print(f"    vs torch {t['mode']} ({t['ms_per_step_median']:.1f} ms, {t['peak_mem_mib']:,} MiB): "
          f"speed {tps / t['tokens_per_s']:.2f}x, memory {mib / t['peak_mem_mib']:.2f}x")
EOF3
fi
