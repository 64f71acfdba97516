#!/usr/bin/env bash
# ResNet-50 v1.5 training on one GPU (issue 18): 224 px, bf16, images/s and MFU (24.3 GFLOP
# per training image: train_flops_per_example), against Hugging Face's
# ResNetForImageClassification in PyTorch eager (channels-last, bf16 autocast) and
# torch.compile, the same batch, optimizer (Nesterov SGD) and synthetic images.
#   OUT=results bash benchmarks/gpu/resnet.sh          # all four parts below (about 9 minutes on an H200)
#   TINY=1 bash benchmarks/gpu/resnet.sh               # the rehearsal on a CPU (ResNet-18, width 8, 32 px)
#   PARTS="2 3" OUT=results bash benchmarks/gpu/resnet.sh   # only some of the parts
# On the lent GPU machine (its image has JAX with the CUDA plugin, flax, optax, orbax, torch
# and transformers; grain, simplejpeg and tensorboardX are not needed for synthetic images,
# which a CPU rehearsal with those three imports blocked confirmed), from the repository root
# (results of 2026-11-26 on an H100 and an H200: BENCHMARKS.md, benchmarks/results/gpu-2026-11-26):
#   PYTHONPATH=src XLAFIT="python3 -m xlafit" OUT=$OUT bash benchmarks/gpu/resnet.sh
# One device call runs at most 10 minutes, and a session may have 15 minutes of device time
# in all: run part 1 (issue 18's numbers) in a call of its own first (PARTS=1), then "2 3 4".
# Each part writes its own JSON, so a call cut short keeps the parts it finished.
set -euo pipefail
OUT=${OUT:-runs/gpu-resnet}
mkdir -p "$OUT"
XLAFIT=${XLAFIT:-xlafit}
if [[ "${TINY:-0}" == 1 ]]; then
    size=(--depth 18 --width 8 --image-size 32 --batch 8 --steps 3 --warmup 2 --repeats 1)
else
    size=(--depth 50 --image-size 224 --batch 256 --steps 30 --warmup 5 --repeats 3)
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null | tee "$OUT/gpu.txt" || true

PARTS=${PARTS:-1 2 3 4}
for p in $PARTS; do
    [[ $p == [1234] ]] || { echo "PARTS=\"$PARTS\": the parts are 1, 2, 3 and 4, e.g. PARTS=\"2 3\"" >&2; exit 2; }
done
part() { [[ " $PARTS " == *" $1 "* ]]; }

# 1. Issue 18's numbers: xlafit bf16 against PyTorch eager under bf16 autocast, nothing that
#    waits on torch.compile's compiles.
part 1 && $XLAFIT bench resnet "${size[@]}" --dtype bfloat16 --devices 1 --compare torch \
    --json "$OUT/resnet50_bf16.json" 2>&1 | tee "$OUT/resnet50_bf16.txt"
# 2. torch.compile, and xlafit with 2 steps per call.
part 2 && $XLAFIT bench resnet "${size[@]}" --dtype bfloat16 --devices 1 --steps-per-call 1,2 \
    --compare torch-compile --json "$OUT/resnet50_bf16_compile.json" 2>&1 | tee "$OUT/resnet50_bf16_compile.txt"
# 3. float32 (TF32 matmuls where XLA picks them) against PyTorch eager, same batch.
part 3 && $XLAFIT bench resnet "${size[@]}" --dtype float32 --devices 1 --compare torch \
    --json "$OUT/resnet50_f32.json" 2>&1 | tee "$OUT/resnet50_f32.txt"
# 4. Where the time goes: a profile of 5 steps of the bf16 row, summarised by kernel.
if part 4; then
    $XLAFIT bench resnet "${size[@]}" --dtype bfloat16 --devices 1 --repeats 1 --profile 5 \
        --profile-dir "${PROFILE_DIR:-$OUT/profile}" > /dev/null
    ${PYTHON:-python3} "$(dirname "$0")/../speed/perfetto_top.py" "${PROFILE_DIR:-$OUT/profile}" 5 2>&1 | tee "$OUT/profile_top.txt"
fi
