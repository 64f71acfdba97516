#!/bin/bash
# The LLM guide's fit rows for Gemma 3 1B (unscanned: its sliding-window and global layers differ)
# and Qwen3 1.7B (scanned), full and LoRA, at 2,048 tokens, one sequence per core, on Colab's
# v5e-1 and Kaggle's v5e-8 (libtpu's compiler; the step model's prediction). Run from the repository root.
out=benchmarks/results/2026-11-27/llm-fit-families
common="model.compute_dtype=bfloat16 model.remat=full mesh.data=1 mesh.fsdp=-1 data.per_device_batch=1 data.global_batch=null data.eval_global_batch=8 data.seq_len=2048"
for model in qwen3-1.7b gemma-3-1b; do
  scan="model.scan_layers=true"; [ $model = gemma-3-1b ] && scan="model.scan_layers=false"
  for mode in lora full; do
    lora=""; [ $mode = lora ] && lora="lora.rank=16 lora.base_dtype=bfloat16"
    name=$model-$mode-2048
    echo "xlafit check llm --tpu colab,kaggle --json model.preset=$model $common $scan $lora" > $out/$name.cmd
    JAX_PLATFORMS=cpu .venv/bin/xlafit check llm --tpu colab,kaggle --json model.preset=$model $common $scan $lora > $out/$name.json 2> $out/$name.log
    echo "$name: $?"
  done
done
