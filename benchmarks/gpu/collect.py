"""On a lent GPU: for each workload of ``benchmarks/gpu/measured.py``, the trainer's step
timed (wall / steps), its optimised HLO, XLA's cost analysis and a per-kernel profile; the
step model's validation data (``benchmarks/validation/gpu-<card>/``).

    PYTHONPATH=src OUT=DIR python3 benchmarks/gpu/collect.py [bert,resnet,llm]
    SIZE=tiny JAX_PLATFORMS=cpu OUT=/tmp/x python benchmarks/gpu/collect.py    # rehearsal on a CPU

Writes ``<name>.hlo.txt.gz``, ``kernels.json.gz`` (``{workload: {kernel: [us per step,
launches per step]}}``), ``kernels_by_op.json.gz`` (the same by the HLO instruction the
profiler names in each kernel's ``hlo_op``, where it does: library kernels then map to their
calls one by one) and ``summary.json``. The card's rates come from ``xlafit bench
--calibrate``, run beside it.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

OUT = os.environ.get("OUT", "/tmp/gpu-dataset")
SIZE = os.environ.get("SIZE", "full")


def kernels_of(trace_dir: str) -> tuple[dict, dict]:
    """Per kernel name and per HLO instruction (``hlo_op``): total microseconds and launches."""
    path = glob.glob(trace_dir + "/**/perfetto_trace.json.gz", recursive=True)[0]
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = any("gpu" in n.lower() for n in names.values())
    by_name, by_op = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") != "X" or (gpu and "gpu" not in names.get(e["pid"], "").lower()):
            continue
        by_name[e["name"]][0] += e.get("dur", 0)
        by_name[e["name"]][1] += 1
        op = (e.get("args") or {}).get("hlo_op")
        if op:
            by_op[op][0] += e.get("dur", 0)
            by_op[op][1] += 1
    return dict(by_name), dict(by_op)


def workload(name: str, summary: dict) -> tuple[dict, dict]:
    import measured as pm

    from xlafit.bench.worker import _timed_calls

    recipe_name, overrides = pm.overrides_of(name, SIZE)
    trainer, train, run = pm.build_trainer(recipe_name, overrides)
    warm, timed = 3, (20 if SIZE == "full" else 4)
    t = _timed_calls(trainer, train, warm, warm + timed)
    compiled = next(iter(trainer.train_step._cache.values()))
    with gzip.open(f"{OUT}/{name}.hlo.txt.gz", "wt") as f:
        f.write(compiled.as_text())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    profiled = 6 if SIZE == "full" else 2
    trace = tempfile.mkdtemp()
    with jax.profiler.trace(trace, create_perfetto_trace=True):
        t2 = _timed_calls(trainer, train, 1, 1 + profiled)
    by_name, by_op = kernels_of(trace)
    steps = 1 + profiled
    summary["workloads"][name] = {
        "overrides": overrides,
        "global_batch": run.global_batch,
        "step_s_wall": t["wall_s"] / t["steps"],
        "step_s_median_call": float(np.median(t["call_s"])),
        "timed_steps": t["steps"],
        "compile_s": trainer.train_step.compile_s,
        "cost_analysis": {k: float(v) for k, v in cost.items() if k in ("flops", "bytes accessed", "transcendentals")},
        "profiled_steps_in_trace": steps,
        "profiled_wall_s": t2["wall_s"],
        "kernel_us_per_step_sum": sum(v[0] for v in by_name.values()) / steps,
    }
    per_step = lambda d: {k: [v[0] / steps, v[1] / steps] for k, v in d.items()}  # noqa: E731
    return per_step(by_name), per_step(by_op)


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    summary: dict = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "workloads": {}}
    kernels: dict = {}
    by_op: dict = {}
    t0 = time.time()
    for name in (sys.argv[1] if len(sys.argv) > 1 else "bert,resnet,llm").split(","):
        try:
            kernels[name], by_op[name] = workload(name, summary)
            print(name, "done", round(time.time() - t0), json.dumps(summary["workloads"][name])[:300], flush=True)
        except Exception as e:  # keep the others
            print(name, "failed", repr(e)[:500], flush=True)
        with open(f"{OUT}/summary.json", "w") as f:
            json.dump(summary, f, indent=1, default=str)
        with gzip.open(f"{OUT}/kernels.json.gz", "wt") as f:
            json.dump(kernels, f)
        with gzip.open(f"{OUT}/kernels_by_op.json.gz", "wt") as f:
            json.dump(by_op, f)
    print("all done", round(time.time() - t0))


if __name__ == "__main__":
    main()
