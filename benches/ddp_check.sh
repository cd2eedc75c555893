#!/usr/bin/env bash
# Data-parallel correctness on several NVIDIA GPUs (issue 15), for the device tool's
# nvidia-h100-x2 / nvidia-h200-x2 (or more GPUs): N ranks of batch B against one GPU of batch
# N·B, the same global batches, loss by loss.
#
# Needs, inside the repository (ignored by git, carried to the device as `.dev`):
#   .dev/fusec                  the release binary built on the development machine
#   .dev/refs/llmc-odd/         ../shared/refs/llmc-odd (optional: those rows are skipped without it)
#
# Rows: llmc-odd (fp32 products with --no-tf32, TF32, bf16) and GPT-2 124M (bf16, TF32), each
# as one GPU of the global batch against N ranks (overlapped buckets, --no-comm-overlap,
# --zero 1); and one rank against a plain run (bit for bit). Prints the worst relative loss
# difference of each row against its one-GPU run.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FUSEC_BIN:-.dev/fusec}
REFS=${FUSEC_REFS:-.dev/refs/llmc-odd}
OUTDIR=${OUT:-/tmp/fusec-ddp-check}
STEPS=${STEPS:-10}
mkdir -p "$OUTDIR"
source benches/device_env.sh
N=${RANKS:-$(nvidia-smi -L | wc -l)}

# run NAME GRAPH ARGS...: one fusec run logging to $OUTDIR/NAME.jsonl (stdout in NAME.txt).
run() {
  local name=$1 graph=$2; shift 2
  "$BIN" run "$graph" --target cuda --steps "$STEPS" --val-every 5 --val-batches 2 \
    --no-divergence-check --log-json "$OUTDIR/$name.jsonl" "$@" > "$OUTDIR/$name.txt" 2> "$OUTDIR/$name.err" \
    || { echo "FAILED: $name"; tail -3 "$OUTDIR/$name.err"; }
}
compare() {
  [ -s "$OUTDIR/$1.jsonl" ] && [ -s "$OUTDIR/$2.jsonl" ] || { echo "$2: no log to compare"; return 0; }
  python3 - "$OUTDIR/$1.jsonl" "$OUTDIR/$2.jsonl" "$2" <<'EOF'
import json, sys
def losses(p):
    return [(k, v[k]) for v in map(json.loads, open(p)) for k in ("loss", "val_loss") if k in v]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert len(a) == len(b) and len(a) > 0, (len(a), len(b))
worst = max(abs(x - y) / abs(x) for (_, x), (_, y) in zip(a, b))
same = all(x == y for (_, x), (_, y) in zip(a, b))
print(f"{sys.argv[3]:<34} {len(a):>3} losses  worst relative difference {worst:.2e}{'  (bit-identical)' if same else ''}")
EOF
}

echo "== GPUs: $N ranks"
"$BIN" nccl-check --mib 256 --iters 20 || true

if [ -f "$REFS/reference.json" ]; then
  "$BIN" export gpt2 --like "$REFS/gpt2_odd_s4242.bin" -o "$OUTDIR/odd.graph"
  odd=(--init "$REFS/gpt2_odd_s4242.bin" --data "$REFS/tokens_train_s11.bin" --val "$REFS/tokens_val_s12.bin" --seq 48 --lr 1e-3)
  for mode in fp32 tf32 bf16; do
    flag=$(case $mode in fp32) echo --no-tf32;; bf16) echo --precision bf16;; esac)
    run "odd_${mode}_1gpu" "$OUTDIR/odd.graph" "${odd[@]}" $flag --batch $((2 * N))
    run "odd_${mode}_${N}ranks" "$OUTDIR/odd.graph" "${odd[@]}" $flag --batch 2 --ranks "$N"
    compare "odd_${mode}_1gpu" "odd_${mode}_${N}ranks"
    run "odd_${mode}_${N}ranks_zero1" "$OUTDIR/odd.graph" "${odd[@]}" $flag --batch 2 --ranks "$N" --zero 1
    compare "odd_${mode}_${N}ranks" "odd_${mode}_${N}ranks_zero1"
  done
else
  echo "skipped llmc-odd: no $REFS/reference.json"
fi

"$BIN" export gpt2 --preset d12 -o "$OUTDIR/d12.graph"
for mode in bf16 tf32; do
  flag=$([ $mode = bf16 ] && echo "--precision bf16" || true)
  # A learning rate at which 10 steps from random init stay smooth (at 1e-3 the loss jumps at
  # step 5, and bf16's rounding differences grow from 1e-6 to 6e-3 after it).
  flag="$flag --lr 1e-4"
  run "d12_${mode}_plain" "$OUTDIR/d12.graph" $flag --batch 16 --seq 1024
  run "d12_${mode}_1rank" "$OUTDIR/d12.graph" $flag --batch 16 --seq 1024 --ranks 1
  compare "d12_${mode}_plain" "d12_${mode}_1rank"
  run "d12_${mode}_1gpu" "$OUTDIR/d12.graph" $flag --batch $((16 * N)) --seq 1024
  for variant in overlap no-overlap zero1; do
    extra=$(case $variant in no-overlap) echo --no-comm-overlap;; zero1) echo "--zero 1";; esac)
    run "d12_${mode}_${N}ranks_$variant" "$OUTDIR/d12.graph" $flag --batch 16 --seq 1024 --ranks "$N" $extra
    compare "d12_${mode}_1gpu" "d12_${mode}_${N}ranks_$variant"
    grep -E "^(step time|ranks|per rank|comm|memory) " "$OUTDIR/d12_${mode}_${N}ranks_$variant.txt" | sed 's/^/    /'
  done
done
