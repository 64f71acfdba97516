"""The step model's time of a compiled decode loop, by kernel: `python loop_breakdown.py PROGRAM.hlo [TRIPS]`
(a v5e-8's rates; the loop of TRIPS iterations, 255 by default)."""

import collections
import sys

from xlafit.platform.slices import parse_target
from xlafit.predict.model import predict
from xlafit.predict.ops import loop_kernels
from xlafit.predict.rates import rates_for

hlo = open(sys.argv[1]).read()
trips = int(sys.argv[2]) if len(sys.argv) > 2 else 255
target = parse_target("v5e-8")
prediction = predict(loop_kernels(hlo, trips), rates_for(target.generation.device_kinds[0]), target.ici_bandwidth, 8)
print(f"loop {prediction.seconds * 1e3:.1f} ms, exposed collectives {prediction.exposed_collective_s * 1e3:.1f} ms")
by_bound: dict[str, float] = collections.defaultdict(float)
rows = []
for kt in prediction.kernels:
    k = kt.kernel
    by_bound[kt.bound] += kt.seconds * k.count
    moved = (k.bytes_read + k.bytes_written + k.moved) / 1e6
    rows.append((kt.seconds * k.count * 1e3, kt.bound, k.count, k.kind, k.name, moved, k.shape))
for bound, seconds in sorted(by_bound.items(), key=lambda x: -x[1]):
    print(f"{bound}: {seconds * 1e3:.2f} ms")
for ms, bound, count, kind, name, moved, shape in sorted(rows, reverse=True)[:12]:
    print(f"{ms:8.2f} ms {bound:8s} x{count:4d} {kind:12s} {name[:40]:40s} {moved:8.2f} MB {shape}")
