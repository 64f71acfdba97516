#!/usr/bin/env bash
# The README's "Will it fit on the TPU?" tables: `xlafit check --tpu` for the recipes on six
# TPU generations, compiled by libtpu on this machine (no TPU). Writes runs/tpu-fit/*.txt.
# Usage: benchmarks/tpu/fit.sh            (about an hour on 2 CPU cores)
set -euo pipefail
out=runs/tpu-fit
mkdir -p "$out"
x=".venv/bin/xlafit"
targets=v2-8,v3-8,v4-8,v5e-8,v5p-8,v6e-8
run() {  # name, then the check's arguments
  local name=$1; shift
  echo "== $name: xlafit check $*"
  local t0=$SECONDS
  $x check "$@" > "$out/$name.txt" 2>&1 || true  # exit 1 when a target does not fit
  echo "wall $((SECONDS - t0)) s" >> "$out/$name.txt"
}
# The MNIST CNN at the recipe's batch (16 per core).
run mnist mnist --tpu "$targets"
# BERT with its real vocabulary (30522) on synthetic token ids, AdamW, float32.
run bert-tiny-128 bert --tpu "$targets" data.source=synthetic model.preset=tiny data.per_device_batch=32 data.global_batch=null
run bert-base-128 bert --tpu v3-8,v5e-8 data.source=synthetic model.preset=base data.per_device_batch=32 data.global_batch=null
run bert-large-512 bert --tpu v3-8,v5e-8,v5p-8 data.source=synthetic model.preset=large data.seq_len=512 \
  data.max_predictions=80 data.per_device_batch=8 data.global_batch=null
# Seed 002's question, "how big a batch per core?", for BERT-base at seq 128 (one step per call).
run bert-base-128-maxbatch bert --tpu v3-8,v5e-8 --max-batch data.source=synthetic model.preset=base \
  data.per_device_batch=128 data.global_batch=null trainer.steps_per_call=1

# The largest per-core batch for every row (2026-11-24 tables; each search is 4-13 compiles,
# minutes to 20 minutes per target here). Run with FULL=1; one target per process, so two can
# run side by side (the compiles of one process mostly keep one core busy).
if [[ "${FULL:-0}" == 1 ]]; then
  S="data.source=synthetic data.global_batch=null --max-batch"
  L512="data.seq_len=512 data.max_predictions=80"
  for t in ${targets//,/ }; do
    run 16-mnist-$t mnist --tpu $t --max-batch
    for m in tiny base; do
      run 16-$m-128-$t bert --tpu $t $S model.preset=$m data.per_device_batch=32
      run 16-$m-512-$t bert --tpu $t $S $L512 model.preset=$m data.per_device_batch=32
    done
    run 16-large-128-$t bert --tpu $t $S model.preset=large data.per_device_batch=32
    run 16-large-512-$t bert --tpu $t $S $L512 model.preset=large data.per_device_batch=8
  done
  # README "Beyond data parallelism": DP / FSDP / FSDP + remat for BERT-base, -large and 24 x 2048.
  BIG="model.preset=custom model.num_layers=24 model.hidden_size=2048 model.num_heads=16 model.intermediate_size=8192"
  for t in v3-8 v5e-8; do
    for m in "model.preset=base data.per_device_batch=32" "model.preset=large data.per_device_batch=32" \
      "$BIG data.per_device_batch=8"; do
      name=$(echo "$m" | grep -o 'preset=[a-z]*' | cut -d= -f2)
      run 17-$name-dp-$t bert --tpu $t $S $m
      run 17-$name-fsdp-$t bert --tpu $t $S $m mesh.fsdp=8
      run 17-$name-fsdp-remat-$t bert --tpu $t $S $m mesh.fsdp=8 model.remat=full
    done
  done
fi
