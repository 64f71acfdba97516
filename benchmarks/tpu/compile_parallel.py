"""N BERT-base train-step compiles for v5e-8 (FSDP 8) at once, at BATCH per core: what one
compile costs on this machine, alone, side by side, or refused (RESOURCE_EXHAUSTED at a batch
that does not fit). Prints each compile's seconds and the wall time.

    JAX_PLATFORMS=cpu python benchmarks/tpu/compile_parallel.py N [BATCH]   # BATCH: 64 unless given
"""

import concurrent.futures as cf
import sys
import time

from xlafit.check import recipe_program
from xlafit.check.tpu import Steps, no_persistent_cache
from xlafit.platform.hardware import parse_targets

n = int(sys.argv[1])
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
target = parse_targets("v5e-8")[0]
progs = [
    recipe_program("bert", ["model.preset=base", "data.source=synthetic", "mesh.fsdp=8", "mesh.data=1"])[0]
    for _ in range(n)
]
steps = [Steps(target, p) for p in progs]
with no_persistent_cache():
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as pool:
        res = list(pool.map(lambda s: s.compile_train(batch)[1], steps))
    print(n, "compiles at once:", [round(r) for r in res], "wall", round(time.perf_counter() - t0), flush=True)
