#!/usr/bin/env bash
# The step model on a lent GPU, in one call (sized for a 10-minute call on an H100 or H200):
#   1. xlafit bench --calibrate: the card's rates measured (calibration.json, calibrate.json);
#   2. predicted, then measured: BERT-base at batch 128 and the 1B Llama at seq 2048 (shapes
#      the rates were never checked on), then the three stored workloads
#      (benchmarks/gpu/measured.py; predicted before each runs, with the built-in row
#      where the card has one, else with part 1's calibration);
#   3. the new shapes' programs and per-kernel profiles, each kernel named by its HLO
#      instruction where the profiler says (benchmarks/gpu/collect.py).
# From the repository root there (the machine's own jax, flax and optax; the llm workloads
# read the Korean demo corpus from the konlpy wheel: put its files on PYTHONPATH if the
# machine lacks it; WORKLOADS and KERNELS pick a subset):
#   OUT=$OUT PYTHONPATH=src bash benchmarks/gpu/predict.sh
# Rehearsal on a CPU, small sizes:
#   SIZE=tiny JAX_PLATFORMS=cpu OUT=/tmp/gp PYTHONPATH=src PATH=.venv/bin:$PATH bash benchmarks/gpu/predict.sh
set -euo pipefail
OUT=${OUT:-runs/gpu-predict}
PARTS=${PARTS:-1 2 3}
SIZE=${SIZE:-full}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SIZE
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; python3 -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/machine.txt" 2>&1
limit() { timeout "$1" "${@:2}" || echo "part stopped (exit $?): over its ${1} s or failed" >&2; }
for part in $PARTS; do
  case $part in
    1) limit "${LIMIT1:-150}" python3 -m xlafit bench --calibrate --calibrate-sizes "$SIZE" --out "$OUT/calibration.json" \
         --json "$OUT/calibrate.json" ;;
    2) if [ -f "$OUT/calibration.json" ] && ! python3 -c 'import jax, sys; from xlafit.predict.rates import rates_for; sys.exit(rates_for(jax.devices()[0].device_kind) is None)'; then
         export XLAFIT_CALIBRATION="$OUT/calibration.json"  # no built-in row for this card
       fi
       extra=(); [ "$SIZE" = tiny ] && extra=(--size tiny --warmup 2 --steps 4 --peak 1e11 --bandwidth 2e10)
       limit "${LIMIT2:-330}" python3 benchmarks/gpu/measured.py --workloads "${WORKLOADS:-bert-b128,llm-s2048,bert,resnet,llm}" \
         "${extra[@]}" --json "$OUT/predict.json" ;;
    3) limit "${LIMIT3:-120}" env OUT="$OUT/kernels" python3 benchmarks/gpu/collect.py "${KERNELS:-bert-b128,llm-s2048}" ;;
  esac
done
ls -la "$OUT"
