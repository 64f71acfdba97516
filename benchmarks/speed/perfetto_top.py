"""Top GPU kernels of a Perfetto trace written by jax.profiler (create_perfetto_trace=True);
for a CPU-only trace, the top XLA:CPU operations (its worker threads, summed over threads).

python benchmarks/speed/perfetto_top.py DIR_OR_FILE [STEPS]
"""

import collections
import glob
import gzip
import json
import os
import sys

path = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
f = path if os.path.isfile(path) else glob.glob(path + "/**/perfetto_trace.json.gz", recursive=True)[0]
d = json.load(gzip.open(f))
ev = d["traceEvents"] if isinstance(d, dict) else d
pids = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
tids = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"}
gpu = any("gpu" in name.lower() for name in pids.values())


def counted(e: dict) -> bool:
    if gpu:
        return "gpu" in pids.get(e["pid"], "").lower()
    # XLA:CPU runs a program's operations on its Eigen threads; skip the executor's own spans
    return tids.get((e["pid"], e["tid"]), "").startswith("tf_XLAEigen") and not e["name"].startswith(
        ("ThunkExecutor", "SlinkyThreadPool")
    )


tot: collections.Counter = collections.Counter()
cnt: collections.Counter = collections.Counter()
for e in ev:
    if e.get("ph") == "X" and counted(e):
        tot[e["name"]] += e.get("dur", 0)
        cnt[e["name"]] += 1
all_us = sum(tot.values())
print(f"{'GPU' if gpu else 'XLA:CPU threads'} busy: {all_us / steps / 1000:.2f} ms/step over {steps} steps")
for name, us in tot.most_common(45):
    print(f"{us / steps / 1000:8.2f} ms/step {100 * us / all_us:5.1f}% x{cnt[name] // steps:4d} {name[:100]}")
