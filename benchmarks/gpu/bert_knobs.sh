#!/usr/bin/env bash
# Issue 4's MFU gap on a GPU: the recipe row of BERT-base (seq 128, bf16, batch 256) under
# XLA settings that target the non-matmul half of the step (BENCHMARKS.md, profile), each
# in fresh processes, median of 3. Run after bert.sh; about 6 minutes on an H100.
#   OUT=results bash benchmarks/gpu/bert_knobs.sh
# PRESET=mini BATCH=32 DTYPE=float32 rehearse it on a CPU (the GPU flags are then ignored).
set -euo pipefail
OUT=${OUT:-runs/gpu-bert}
mkdir -p "$OUT"
knob() {  # knob NAME "XLA FLAGS" [bert_speed.py arguments]
  local name=$1 flags=$2
  shift 2
  echo "== $name: XLA_FLAGS='$flags' $*"
  local all
  all=$(echo "${XLA_FLAGS:-} $flags" | xargs)  # XLA takes a blank XLA_FLAGS for a file name
  XLA_FLAGS="$all" python3 benchmarks/speed/bert_speed.py --preset "${PRESET:-base}" \
    --batch "${BATCH:-256}" --dtype "${DTYPE:-bfloat16}" --steps 20 --warmup 3 --repeats 3 --rows xlafit \
    --json "$OUT/knob_$name.json" "$@" 2>&1 | tail -n 4
}
{
  knob baseline ""
  # LayerNorm forward and backward as cuDNN kernels (7% of the step was LayerNorm backward).
  knob cudnn_layer_norm "--xla_gpu_enable_cudnn_layer_norm=true"
  # GEMMs through cuBLAS only (+6% in one earlier run, not repeated).
  knob no_triton_gemm "--xla_gpu_enable_triton_gemm=false"
  knob both "--xla_gpu_enable_cudnn_layer_norm=true --xla_gpu_enable_triton_gemm=false"
  # What dropout costs at most: none at all (not a setting to adopt; a bound).
  knob no_dropout "" --dropout 0
} | tee "$OUT/knobs.txt"
