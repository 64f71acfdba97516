#!/usr/bin/env bash
# The MNIST numbers of BENCHMARKS.md on a GPU: 60,000 same-shape synthetic digits (no real
# IDX files on that machine), 10 epochs, global batch 128.
#   OUT=results bash benchmarks/gpu/mnist.sh
set -euo pipefail
OUT=${OUT:-runs/gpu-bench}
mkdir -p "$OUT"
xlafit() { python3 -m xlafit "$@"; }

# 1. The table: xlafit one step per call and a whole epoch per call, PyTorch eager.
xlafit bench mnist --data synthetic --examples 60000 --epochs 10 --steps-per-call 1,468 \
  --compare torch --repeats 3 --json "$OUT/mnist.json" --plot "$OUT/mnist.png" 2>&1 | tee "$OUT/mnist.txt"
# 2. bfloat16 compute (float32 parameters).
xlafit bench mnist --data synthetic --examples 60000 --epochs 10 --steps-per-call 468 --dtype bfloat16 \
  --repeats 3 --json "$OUT/mnist_bf16.json" 2>&1 | tee "$OUT/mnist_bf16.txt"
# 3. The real trainer end to end (fit loop, evaluation, checkpoints) on the same data as IDX files.
mkdir -p "$OUT/idx"
python3 - "$OUT/idx" <<'PY'
import sys
import numpy as np
from xlafit.data.mnist import write_idx
rng = np.random.default_rng(0)
for name, n in (("train", 60000), ("t10k", 10000)):
    write_idx(f"{sys.argv[1]}/{name}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
    write_idx(f"{sys.argv[1]}/{name}-labels-idx1-ubyte", rng.integers(0, 10, n, dtype=np.uint8))
PY
/usr/bin/time -f "wall %e s" python3 -m xlafit train mnist --data-dir "$OUT/idx" --run-dir /tmp/mnist-gpu --restart \
  trainer.epochs=10 trainer.steps_per_call=468 trainer.invariant_chunks=null trainer.log_every_steps=468 \
  2>&1 | tee "$OUT/train.txt"
cp /tmp/mnist-gpu/metrics.jsonl "$OUT/train_metrics.jsonl"
