#!/usr/bin/env bash
# Issue 44 on a lent GPU, in one call (sized for one 10-minute call on an H100; part 3 optional).
#   1. BERT-base MLM, seq 128, bf16, batch 256: the recipe's step against Hugging Face
#      PyTorch + SDPA in the same run (fresh process per run, rows interleaved, median of 2);
#   2. predicted against measured step time of BERT-base, ResNet-50 and the llm recipe's 1B
#      preset (benchmarks/gpu/measured.py);
#   3. where BERT's step goes: a profile of 5 steps, its top kernels.
# From the repository root there (the machine's own jax, flax and optax):
#   OUT=$OUT PYTHONPATH=src bash benchmarks/gpu/mfu_predict.sh          # PARTS="1 2 3" by default
# Rehearsal on a CPU, small presets (a CPU has no table row: the predictor gets figures):
#   SIZE=tiny JAX_PLATFORMS=cpu OUT=/tmp/g44 PATH=.venv/bin:$PATH bash benchmarks/gpu/mfu_predict.sh
set -euo pipefail
OUT=${OUT:-runs/gpu-mfu-predict}
PARTS=${PARTS:-1 2 3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${SIZE:-full}" = tiny ]; then
  bert=(--preset mini --batch 32 --dtype float32 --steps 4 --warmup 2)
  predict=(--size tiny --warmup 2 --steps 4 --peak 1e11 --bandwidth 2e10)
else
  bert=(--preset base --batch 256 --dtype bfloat16 --steps 20 --warmup 3)
  predict=()
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; python3 -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/machine.txt" 2>&1
# Each part has its own time limit (seconds), so that one slow part cannot take the call's
# whole limit: what the others found still comes back (predict.json is written per workload).
limit() { timeout "$1" "${@:2}" || echo "part stopped (exit $?): over its ${1} s or failed" >&2; }
for part in $PARTS; do
  case $part in
    1) limit "${LIMIT1:-270}" python3 benchmarks/speed/bert_speed.py "${bert[@]}" --repeats 2 --rows xlafit,hf \
         --json "$OUT/bert_table.json" 2>&1 | tee "$OUT/bert_table.txt" ;;
    2) limit "${LIMIT2:-240}" python3 benchmarks/gpu/measured.py "${predict[@]}" --json "$OUT/predict.json" 2>&1 \
         | tee "$OUT/predict.txt" ;;
    3) # the trace's folder is deeper than what comes back from $OUT: kept aside, summarised
      limit "${LIMIT3:-60}" python3 benchmarks/speed/bert_speed.py "${bert[@]}" --repeats 1 --rows xlafit \
        --profile /tmp/bert-profile > /dev/null
      limit 30 python3 benchmarks/speed/perfetto_top.py /tmp/bert-profile 2>&1 | tee "$OUT/profile_top.txt" ;;
  esac
done
