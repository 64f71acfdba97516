#!/usr/bin/env bash
# The BERT-base numbers of BENCHMARKS.md on a GPU (issue 4): seq 128, bf16, batch 256.
#   OUT=results bash benchmarks/gpu/bert.sh          # about 8 minutes on an H100
set -euo pipefail
OUT=${OUT:-runs/gpu-bert}
mkdir -p "$OUT"
bench() { python3 benchmarks/speed/bert_speed.py --preset base --batch 256 --dtype bfloat16 --steps 20 --warmup 3 "$@"; }

# 1. The table: the recipe, the head at every position, Hugging Face PyTorch + SDPA.
bench --repeats 3 --rows xlafit,xlafit-full-head,hf --json "$OUT/bert_base_b256.json" 2>&1 | tee "$OUT/bert_base_b256.txt"
# 2. Dropout with 16 random bits per decision (the default) against nnx.Dropout's 32, both
#    compiled in one process and timed in alternating blocks.
python3 benchmarks/speed/dropout_bits.py --preset base --batch 256 --dtype bfloat16 2>&1 | tee "$OUT/dropout_bits.txt"
# 3. Where the time goes: a profile of 5 steps, summarised by kernel.
bench --repeats 1 --rows xlafit --profile "$OUT/profile" > /dev/null
python3 benchmarks/speed/perfetto_top.py "$OUT/profile" 2>&1 | tee "$OUT/profile_top.txt"
