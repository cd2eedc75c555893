#!/usr/bin/env bash
# Data-parallel scaling (issue 15), for a machine with several NVIDIA GPUs (the device tool's
# nvidia-h200-x2 / -x4): fusec `--ranks N` and PyTorch DDP on the same GPUs in one call.
#
# Needs, inside the repository (ignored by git, carried to the device as `.dev`):
#   .dev/fusec                  the release binary built on the development machine
#   .dev/torch_gpt2_bench.py    ../shared/bench/torch_gpt2_bench.py (for torch_ddp_bench.py)
#
# For N in 1 and every count up to the GPUs visible (1, 2, 4, 8): GPT-2 124M bf16, B=16 T=1024
# a GPU, STEPS steps from random init: fusec's median step and global tokens/s (from
# --log-json, the steps after the first 3), then torchrun DDP eager and torch.compile; prints
# one table with each one's scaling over its own 1-GPU run and fusec's ratio to DDP compile.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FUSEC_BIN:-.dev/fusec}
TORCH=${TORCH_BENCH:-.dev/torch_gpt2_bench.py}
OUTDIR=${OUT:-/tmp/fusec-ddp-bench}
STEPS=${STEPS:-20}
PRESET=${PRESET:-d12}
mkdir -p "$OUTDIR"
source benches/device_env.sh
GPUS=$(nvidia-smi -L | wc -l)
"$BIN" export gpt2 --preset "$PRESET" -o "$OUTDIR/model.graph"
COUNTS=""
for n in 1 2 4 8; do [ "$n" -le "$GPUS" ] && COUNTS="$COUNTS $n"; done

for n in $COUNTS; do
  echo "== fusec --ranks $n"
  "$BIN" run "$OUTDIR/model.graph" --target cuda --precision bf16 --batch 16 --seq 1024 \
    --steps "$STEPS" --val-every 100000 --no-divergence-check --ranks "$n" \
    --log-json "$OUTDIR/fusec_$n.jsonl" > "$OUTDIR/fusec_$n.txt"
  grep -E "^(step time|throughput|ranks|memory) " "$OUTDIR/fusec_$n.txt" || true
  for mode in eager compile; do
    echo "== torchrun DDP $mode, $n GPU(s)"
    flag=$([ $mode = compile ] && echo --compile || true)
    torchrun --standalone --nproc_per_node "$n" benches/torch_ddp_bench.py --bench "$TORCH" \
      --steps "$STEPS" $flag | tail -1 | tee "$OUTDIR/ddp_${mode}_$n.json"
  done
done

python3 - "$OUTDIR" $COUNTS <<'EOF'
import json, statistics, sys
out, counts = sys.argv[1], [int(c) for c in sys.argv[2:]]
def fusec(n):
    steps = [json.loads(l) for l in open(f"{out}/fusec_{n}.jsonl") if '"loss"' in l]
    ms = statistics.median(s["ms"] for s in steps[3:])
    return ms, n * 16 * 1024 / ms * 1e3
def ddp(mode, n):
    r = json.loads(open(f"{out}/ddp_{mode}_{n}.json").read())
    return r["ms_per_step_median"], r["tokens_per_s"]
rows = {n: (fusec(n), ddp("eager", n), ddp("compile", n)) for n in counts}
base = rows[counts[0]]
print(f"{'GPUs':>4} | {'fusec ms':>8} {'tok/s':>9} {'scale':>5} | {'DDP eager tok/s':>15} {'scale':>5} | {'DDP compile tok/s':>17} {'scale':>5} | fusec/compile")
for n, (f, e, c) in rows.items():
    print(f"{n:>4} | {f[0]:8.1f} {f[1]:9.0f} {f[1]/base[0][1]:5.2f} | {e[1]:15.0f} {e[1]/base[1][1]:5.2f} | {c[1]:17.0f} {c[1]/base[2][1]:5.2f} | {f[1]/c[1]:.2f}x")
EOF
