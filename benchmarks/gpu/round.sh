#!/usr/bin/env bash
# What a lent GPU runs next, in one call of about 9 minutes (a session has 15 minutes of
# device time, a machine start included):
#   1. benchmarks/gpu/kernel_micro.py: the kernels the step model prices worst, alone, timed,
#      profiled and predicted (to price them from measurements, kernel by kernel);
#   2. benchmarks/gpu/levers.py: the 1B Llama with cuDNN's flash attention (checked against
#      XLA's on one batch first) at batch 8 and 16, and BERT with its vocabulary padded to a
#      multiple of 128, each beside the recipe as it is.
# The llm recipe's demo data reads the Korean corpus of the konlpy wheel, which GPU images
# lack: make runs/site here first and carry it (the run tool's carry=["runs/site"]):
#   mkdir -p runs/site/konlpy/data/corpus && cp .venv/lib/python3.*/site-packages/konlpy/__init__.py runs/site/konlpy/ \
#     && cp -r .venv/lib/python3.*/site-packages/konlpy/data/corpus/{kolaw,kobill} runs/site/konlpy/data/corpus/
# There, from the repository root (the machine's own jax, flax and optax):
#   OUT=$OUT PYTHONPATH=src bash benchmarks/gpu/round.sh
# Rehearsal on a CPU, small sizes:
#   SIZE=tiny JAX_PLATFORMS=cpu OUT=/tmp/round PYTHONPATH=src PATH=.venv/bin:$PATH bash benchmarks/gpu/round.sh
set -euo pipefail
OUT=${OUT:-runs/gpu-round}
SIZE=${SIZE:-full}
LEVERS=${LEVERS:-llm,llm-cudnn,llm-cudnn-b16,bert,bert-vocab-30592}
mkdir -p "$OUT"
[ -d runs/site ] && export PYTHONPATH="${PYTHONPATH:-src}:runs/site"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true; python3 -c 'import jax; print(jax.__version__, jax.devices())'; } > "$OUT/machine.txt" 2>&1
limit() { timeout "$1" "${@:2}" || echo "stopped (exit $?): over its ${1} s or failed" >&2; }
extra=(); [ "$SIZE" = tiny ] && extra=(--size tiny)
limit "${LIMIT1:-150}" python3 benchmarks/gpu/kernel_micro.py "${extra[@]}" --json "$OUT/kernel-micro.json"
limit "${LIMIT2:-390}" python3 benchmarks/gpu/levers.py "${extra[@]}" --variants "$LEVERS" --limit 120 --json "$OUT/levers.json"
ls -la "$OUT"
