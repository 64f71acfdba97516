#!/bin/bash
# Llama 3.1 8B pretraining shapes on a v6e-8, as MaxText's published v6e-256 run (seq 8192,
# bf16, FSDP over every chip), compiled by libtpu here: predicted tokens/s per chip and MFU.
# Unscanned layers (XLA's cost analysis counts a scanned layer once), remat full (XLA's
# attention keeps each layer's scores; MaxText runs a flash kernel).
out=benchmarks/results/2026-11-26/llm-maxtext
B=${B:-1}  # sequences per chip (2 did not fit: 54.0 GiB of 31.25)
.venv/bin/xlafit check llm --tpu v6e-8 --json model.preset=llama-3.1-8b data.seq_len=8192 \
  model.compute_dtype=bfloat16 model.remat=full mesh.data=1 mesh.fsdp=-1 \
  data.per_device_batch=$B data.global_batch=null data.eval_global_batch=8 > $out/v6e-8-8b-seq8192-b$B.json 2> $out/v6e-8-8b-seq8192-b$B.log
echo "rc $?"
