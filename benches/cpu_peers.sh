#!/usr/bin/env bash
# fusec's CPU target next to its CPU peers on the same GPT-2 training shapes: llm.c's CPU
# trainer (train_gpt2.c, built here from a checkout you point to: it is not shipped) and
# PyTorch (when `python3 -c 'import torch'` works), alternating runs, printing each runner's
# median ms/step and its ratio to fusec's.
#
#   bash benches/cpu_peers.sh [--llmc PATH] [--shapes small,124m] [--rounds N] [--steps N]
#                             [--threads N] [--torch-bench PATH] [--precisions fp32,bf16]
#
# Every option has an environment variable (LLMC, SHAPES, ROUNDS, STEPS, THREADS, TORCH_BENCH,
# PRECISIONS; also PYTHON, TORCH_MODES, FUSEC: a fusec binary to use instead of building one).
#
# Shapes: `small` (fusec's preset: 4 layers, 4 heads, 256 channels, vocabulary 8192; B=8 T=256)
# and `124m` (GPT-2 124M: 12 layers, 12 heads, 768 channels, vocabulary 50257 padded to 50304;
# B=4 T=64, llm.c's default). Every runner trains the same initial weights (written by fusec as
# an llm.c checkpoint) on the same random tokens, AdamW, fp32 master weights.
#
# Runners, each run `--rounds` times, in turn (runner 1, runner 2, ..., then again), so that a
# busy host slows all of them alike:
#   fusec-PREC    `fusec run --target cpu --precision PREC` (the steps after the first two)
#   llmc          llm.c's train_gpt2.c: copied, its B, T and step count set, its validation and
#                 sampling turned off, compiled with `gcc -Ofast -march=native -fopenmp`; the
#                 "took X ms" of the steps after the first
#   torch-MODE    the PyTorch benchmark (`--device cpu`, modes from TORCH_MODES, default
#                 eager-fp32,eager-bf16), its median
# A runner's result is the median over the rounds of its per-run medians. Peers that are not
# available (no --llmc, no PyTorch) are skipped with a message.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LLMC=${LLMC:-}
SHAPES=${SHAPES:-small,124m}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-10}
THREADS=${THREADS:-$(nproc)}
TORCH_BENCH=${TORCH_BENCH:-$ROOT/../shared/bench/torch_gpt2_bench.py}
TORCH_MODES=${TORCH_MODES:-eager-fp32,eager-bf16}
PRECISIONS=${PRECISIONS:-fp32,bf16}
PYTHON=${PYTHON:-python3}
FUSEC=${FUSEC:-}

die() { echo "cpu_peers: $*" >&2; exit 2; }
note() { echo "cpu_peers: $*" >&2; }
positive() { [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"; }

while [ $# -gt 0 ]; do
  case $1 in
    --llmc) LLMC=${2:?--llmc needs a path}; shift 2 ;;
    --shapes) SHAPES=${2:?--shapes needs a list}; shift 2 ;;
    --rounds) ROUNDS=${2:?--rounds needs a count}; shift 2 ;;
    --steps) STEPS=${2:?--steps needs a count}; shift 2 ;;
    --threads) THREADS=${2:?--threads needs a count}; shift 2 ;;
    --torch-bench) TORCH_BENCH=${2:?--torch-bench needs a path}; shift 2 ;;
    --precisions) PRECISIONS=${2:?--precisions needs a list}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (try --help)" ;;
  esac
done
positive --rounds "$ROUNDS"
positive --steps "$STEPS"
positive --threads "$THREADS"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# fusec
if [ -z "$FUSEC" ]; then
  note "building fusec (cargo build --release)"
  (cd "$ROOT" && cargo build --release --quiet --bin fusec) || die "cargo build failed"
  FUSEC=$ROOT/target/release/fusec
fi
[ -x "$FUSEC" ] || die "no fusec binary at $FUSEC"

# Which peers can run.
HAVE_PY=0
command -v "$PYTHON" >/dev/null 2>&1 && HAVE_PY=1
[ $HAVE_PY = 1 ] || note "no $PYTHON: llm.c needs it to write its token file, PyTorch to run; only fusec runs"
HAVE_LLMC=0
if [ -z "$LLMC" ]; then
  note "skipping llm.c: give a checkout of it with --llmc PATH (or LLMC=PATH)"
elif [ ! -f "$LLMC/train_gpt2.c" ]; then
  die "--llmc $LLMC: no train_gpt2.c there"
elif ! command -v gcc >/dev/null 2>&1; then
  note "skipping llm.c: no gcc"
elif [ $HAVE_PY = 0 ]; then
  note "skipping llm.c: no $PYTHON to write its token file"
else
  HAVE_LLMC=1
fi
HAVE_TORCH=0
if [ $HAVE_PY = 1 ] && "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
  if [ -f "$TORCH_BENCH" ]; then HAVE_TORCH=1; else note "skipping PyTorch: no benchmark script at $TORCH_BENCH (--torch-bench PATH)"; fi
else
  note "skipping PyTorch: '$PYTHON -c \"import torch\"' fails (PyTorch is not installed)"
fi

median() { sort -g | awk '{v[NR] = $1} END { if (NR == 0) exit 1; print v[int((NR + 1) / 2)] }'; }

# Writes N random tokens below V in llm.c's token-file layout (header of 256 int32: magic
# 20240520, version 1, count; then uint16 ids).
write_tokens() { # out n vocab seed
  "$PYTHON" - "$@" <<'PY'
import random, struct, sys
out, n, vocab, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
header = [20240520, 1, n] + [0] * 253
with open(out, "wb") as f:
    f.write(struct.pack("<256i", *header))
    f.write(struct.pack("<%dH" % n, *(rng.randrange(vocab) for _ in range(n))))
PY
}

# Builds llm.c's trainer for B x T and STEPS + 1 steps, without validation or sampling, in $1.
build_llmc() { # dir B T
  local dir=$1 src=$1/train_gpt2.c
  cp "$LLMC/train_gpt2.c" "$src"
  # (what the source says, what it becomes): each must be there.
  local -a from=("int B = 4;" "int T = 64;" "step <= 40;" "if (step % 10 == 0) {" "if (step > 0 && step % 20 == 0) {")
  local -a to=("int B = $2;" "int T = $3;" "step <= $STEPS;" "if (0) {" "if (0) {")
  local i text
  text=$(<"$src")
  for i in "${!from[@]}"; do
    [[ $text == *"${from[$i]}"* ]] || die "llm.c's train_gpt2.c has no '${from[$i]}' to change (another version?)"
    text=${text/"${from[$i]}"/"${to[$i]}"}
  done
  printf '%s\n' "$text" >"$src"
  gcc -Ofast -march=native -fopenmp -DOMP -Wno-unused-result -I"$LLMC" -o "$dir/train_gpt2" "$src" -lm \
    || die "compiling llm.c's train_gpt2.c failed"
}

# One run of a runner: prints its median ms/step.
run_fusec() { # precision graph tokens B T
  local log=$WORK/fusec.jsonl
  rm -f "$log"
  "$FUSEC" run "$2" --target cpu --precision "$1" --batch "$4" --seq "$5" --steps $((STEPS + 2)) \
    --data "$3" --threads "$THREADS" --log-json "$log" >/dev/null 2>"$WORK/fusec.err" \
    || { cat "$WORK/fusec.err" >&2; die "fusec run failed"; }
  tail -n +3 "$log" | sed -n 's/.*"ms":\([0-9.]*\).*/\1/p' | median
}
run_llmc() { # dir
  (cd "$1" && OMP_NUM_THREADS=$THREADS ./train_gpt2 >"$WORK/llmc.out" 2>&1) || { tail "$WORK/llmc.out" >&2; die "llm.c failed"; }
  sed -n 's/^step \([0-9]*\): .*took \([0-9.]*\) ms.*/\1 \2/p' "$WORK/llmc.out" | awk '$1 > 0 {print $2}' | median
}
run_torch() { # mode L H C Vp B T
  OMP_NUM_THREADS=$THREADS "$PYTHON" "$TORCH_BENCH" --device cpu --modes "$1" --layers "$2" --heads "$3" --channels "$4" \
    --vocab "$5" --batch "$6" --seq "$7" --steps "$STEPS" --warmup 2 2>"$WORK/torch.err" \
    | sed -n 's/.*"ms_per_step_median": *\([0-9.]*\).*/\1/p' | tail -1 | grep . \
    || { tail "$WORK/torch.err" >&2; die "the PyTorch benchmark failed"; }
}

echo "fusec CPU peers: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $THREADS thread(s), $ROUNDS rounds of $STEPS steps"
IFS=, read -r -a shape_list <<<"$SHAPES"
IFS=, read -r -a precisions <<<"$PRECISIONS"
IFS=, read -r -a torch_modes <<<"$TORCH_MODES"
for shape in "${shape_list[@]}"; do
  case $shape in
    small) preset=small L=4 H=4 C=256 V=8192 Vp=8192 B=8 T=256 ;;
    124m) preset=d12 L=12 H=12 C=768 V=50257 Vp=50304 B=4 T=64 ;;
    *) die "unknown shape '$shape' (small, 124m)" ;;
  esac
  dir=$WORK/$shape
  mkdir -p "$dir"
  "$FUSEC" export gpt2 --preset "$preset" -o "$dir/model.graph" >/dev/null
  # The initial weights every runner loads: fusec's GPT-2 initialization after one step at
  # learning rate 0 (which changes nothing), as an llm.c checkpoint.
  "$FUSEC" run "$dir/model.graph" --target cpu --steps 1 --lr 0 --batch 1 --seq 8 --save "$dir/init.bin" >/dev/null 2>&1 \
    || die "could not write the initial checkpoint"
  tokens=$dir/tokens.bin
  if [ $HAVE_PY = 1 ]; then
    write_tokens "$tokens" $((B * T * (STEPS + 4) + 1)) "$V" 7
  fi
  runners=()
  for p in "${precisions[@]}"; do runners+=("fusec-$p"); done
  if [ $HAVE_LLMC = 1 ]; then
    mkdir -p "$dir/llmc/dev/data/tinyshakespeare"
    build_llmc "$dir/llmc" "$B" "$T"
    ln -s "$dir/init.bin" "$dir/llmc/gpt2_124M.bin"
    ln -s "$tokens" "$dir/llmc/dev/data/tinyshakespeare/tiny_shakespeare_train.bin"
    ln -s "$tokens" "$dir/llmc/dev/data/tinyshakespeare/tiny_shakespeare_val.bin"
    runners+=(llmc)
  fi
  if [ $HAVE_TORCH = 1 ]; then
    for m in "${torch_modes[@]}"; do runners+=("torch-$m"); done
  fi
  [ $HAVE_PY = 1 ] || tokens=""
  echo
  echo "== $shape: L=$L H=$H C=$C V=$V (padded $Vp), B=$B T=$T"
  for ((r = 1; r <= ROUNDS; r++)); do
    for name in "${runners[@]}"; do
      case $name in
        fusec-*)
          if [ -n "$tokens" ]; then ms=$(run_fusec "${name#fusec-}" "$dir/model.graph" "$tokens" "$B" "$T")
          else
            # No token file: fusec's embedded corpus.
            ms=$("$FUSEC" run "$dir/model.graph" --target cpu --precision "${name#fusec-}" --batch "$B" --seq "$T" \
              --steps $((STEPS + 2)) --threads "$THREADS" --log-json "$WORK/f.jsonl" >/dev/null 2>&1 \
              && tail -n +3 "$WORK/f.jsonl" | sed -n 's/.*"ms":\([0-9.]*\).*/\1/p' | median)
          fi ;;
        llmc) ms=$(run_llmc "$dir/llmc") ;;
        torch-*) ms=$(run_torch "${name#torch-}" "$L" "$H" "$C" "$Vp" "$B" "$T") ;;
      esac
      echo "$ms" >>"$dir/$name.ms"
      printf '  round %d %-18s %10.1f ms/step\n' "$r" "$name" "$ms"
    done
  done
  echo "  --"
  base=$(median <"$dir/${runners[0]}.ms")
  printf '  %-18s %12s %10s %14s\n' runner "ms/step" "tok/s" "vs ${runners[0]}"
  for name in "${runners[@]}"; do
    m=$(median <"$dir/$name.ms")
    awk -v n="$name" -v m="$m" -v b="$base" -v tok=$((B * T)) \
      'BEGIN { printf "  %-18s %12.1f %10.0f %13.2fx\n", n, m, tok / m * 1000, m / b }'
  done
done
