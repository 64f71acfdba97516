#!/bin/bash
# The "will it fit" table of the llm recipe: Llama 3.2 1B and Llama 3.1 8B shapes, full
# fine-tuning and LoRA (rank 16 on q/k/v/o, base in bf16), at 2,048 and 8,192 tokens, on
# Colab's v5e-1 and Kaggle's v5e-8, with the largest per-core batch (libtpu's compiler).
# bf16 compute, remat full, scanned layers, every core on fsdp. Run from the repository root.
out=benchmarks/results/2026-11-27/llm-fit
common="model.compute_dtype=bfloat16 model.remat=full model.scan_layers=true mesh.data=1 mesh.fsdp=-1 data.per_device_batch=1 data.global_batch=null data.eval_global_batch=8"
for model in llama-3.2-1b llama-3.1-8b; do
  for mode in full lora; do
    lora=""; [ $mode = lora ] && lora="lora.rank=16 lora.base_dtype=bfloat16"
    for seq in 2048 8192; do
      name=$model-$mode-$seq
      .venv/bin/xlafit check llm --tpu colab,kaggle --max-batch --json model.preset=$model data.seq_len=$seq $common $lora > $out/$name.json 2> $out/$name.log
      echo "$name: $?"
    done
  done
done
