#!/bin/bash
# The resnet demo from a fresh clone, workers=2 against workers=0, interleaved, each run under
# the exclusive CPU lock with an empty XLAFIT_CACHE (BENCHMARKS.md, "Images").
#   bash benchmarks/speed/resnet_demo.sh /path/to/fresh/clone [rounds]
set -u
CLONE=$1
ROUNDS=${2:-2}
OUT=${OUT:-/tmp/resnet-demo}
mkdir -p "$OUT"
for i in $(seq 1 "$ROUNDS"); do
  for w in 2 0; do
    rm -rf "$OUT/cache-$i-$w" "$OUT/run-$i-$w"
    flock -x /tmp/xlafit-cpu.lock bash -c "
      START=\$(date +%s.%N)
      XLAFIT_CACHE=$OUT/cache-$i-$w JAX_PLATFORMS=cpu PYTHONPATH=$CLONE/src \
        xlafit train resnet --simulate 8 --run-dir $OUT/run-$i-$w data.workers=$w > $OUT/log-$i-$w.txt 2>&1
      echo run=$i workers=$w rc=\$? wall=\$(echo \"\$(date +%s.%N) - \$START\" | bc) \$(grep 'test accuracy' $OUT/log-$i-$w.txt)"
  done
done
