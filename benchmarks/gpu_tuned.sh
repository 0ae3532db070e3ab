#!/usr/bin/env bash
# One method's row of the Fashion-MNIST CNN tuned table on a GPU, at the full budget (20 trials, 5 seeds), timed:
# what the whole CNN table costs on a device.  The layout of .gpu/ is gpu_run.sh's (tree, site, cache, whl).
#   OUT=$OUT METHODS=fedavg LIMIT=300 bash benchmarks/gpu_tuned.sh
# Everything, the table so far and its summary.json included, is appended to $OUT/log.txt: after gpu_run.sh, whose 8
# files are all a device call brings back.  A study cut short by LIMIT is lost with the machine (the log keeps its
# printed lines so far).
set -u -o pipefail
ROOT=$(pwd)
G=$ROOT/.gpu
OUT=${OUT:?OUT must name the results folder}
DEV=${GPU_RUN_DEVICE:-cuda}
METHODS=${METHODS:-fedavg}
LIMIT=${LIMIT:-300}
PY=${PY:-python3}
. "$ROOT/benchmarks/gpu_env.sh"
{
  nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  t0=$SECONDS
  timeout "$LIMIT" $PY -m fedmtl reproduce tuned --out /tmp/tuned --federations fmnist_cnn --methods "$METHODS" \
    --device "$DEV" --no-progress
  echo "=== reproduce tuned: exit $? after $((SECONDS - t0))s"
  for f in /tmp/tuned/tuned.md /tmp/tuned/summary.json /tmp/tuned/studies/fmnist_cnn/*/trials.csv; do
    [ -f "$f" ] && { echo "=== $f"; cat "$f"; echo; }
  done
} 2>&1 | tee -a "$OUT/log.txt"
