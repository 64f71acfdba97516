"""Llama 3.1 8B at MaxText's published shapes (sequence 8192, bf16 compute, FSDP over every
chip, splash attention) on a v6e-8, compiled by libtpu on this CPU: does it fit, and the
predicted tokens/s per chip and MFU beside MaxText's v6e-256 record.

    JAX_PLATFORMS=cpu python benchmarks/tpu/maxtext_predict.py OUT_DIR BATCH [REMAT]

BATCH: sequences per chip; REMAT: the remat policy (full unless given).

Memory and the verdict come from the whole 32-layer program with scanned layers (one layer
compiled, fast). XLA's cost analysis counts a scanned layer once, so FLOPs, HBM bytes and
collectives come from unscanned programs of 2 and 4 layers at the same shapes: the
difference is one layer's cost, and 32 layers cost the 2-layer program plus 30 such layers.
Compute time is the larger of those FLOPs and the model's own (6N + attention per token) at
peak, as `xlafit check` does. Writes OUT_DIR/v6e-8-8b-seq8192-b{BATCH}-{REMAT}.json.
"""

import json
import sys
import time
from pathlib import Path

from xlafit.check import recipe_program
from xlafit.check.tpu import OutOfMemory, Steps, memory_of, needed_bytes, no_persistent_cache, usable_hbm
from xlafit.platform.hardware import parse_targets
from xlafit.predict.collectives import collectives, summarize
from xlafit.predict.hlo import kernel_flops

here = Path(sys.argv[1])
batch = int(sys.argv[2])
remat = sys.argv[3] if len(sys.argv) > 3 else "full"
target = parse_targets("v6e-8")[0]
common = [
    "model.preset=llama-3.1-8b",
    "data.seq_len=8192",
    "model.compute_dtype=bfloat16",
    f"model.remat={remat}",
    "mesh.data=1",
    "mesh.fsdp=-1",
    f"data.per_device_batch={batch}",
    "data.global_batch=null",
    "data.eval_global_batch=8",
]


def compile_one(extra):
    program = recipe_program("llm", [*common, *extra])[0]
    steps = Steps(target, program)
    t0 = time.perf_counter()
    try:
        compiled, _ = steps.compile_train(batch)
    except OutOfMemory as e:
        return program, steps, None, time.perf_counter() - t0, needed_bytes(e.message)
    return program, steps, compiled, time.perf_counter() - t0, None


def cost(compiled):
    hlo = compiled.as_text()
    c = compiled.cost_analysis() or {}
    comm = summarize(collectives(hlo, target.num_devices), target)
    return {
        "flops": float(c.get("flops", 0.0)) + kernel_flops(hlo),
        "kernel_flops": kernel_flops(hlo),
        "bytes": float(c.get("bytes accessed", 0.0)),
        "comm_s": comm.seconds,
        "comm": comm.to_json(),
    }


out = {"target": target.name, "batch_per_chip": batch, "remat": remat, "overrides": common}
with no_persistent_cache():
    program, steps, compiled, seconds, needed = compile_one(["model.scan_layers=true"])
    out["full_program"] = {"scan_layers": True, "compile_s": seconds, "fits": compiled is not None}
    capacity = usable_hbm(target)[0]
    out["capacity_gib"] = capacity / 2**30
    if compiled is None:
        out["full_program"]["needs_gib"] = needed / 2**30 if needed else None
    else:
        memory = memory_of(compiled, steps.state_bytes, 0)
        out["full_program"]["memory_gib"] = {k: v / 2**30 for k, v in memory.items()}
        layers = {}
        for n in (2, 4):
            _, _, small, s, _ = compile_one(["model.scan_layers=false", f"model.num_layers={n}"])
            layers[n] = {**cost(small), "compile_s": s}
        out["layers"] = layers
        per_layer = {k: (layers[4][k] - layers[2][k]) / 2 for k in ("flops", "bytes", "comm_s")}
        total = {k: layers[2][k] + 30 * per_layer[k] for k in per_layer}
        model_flops = program.flops_per_example / program.tokens_per_example  # per token: 6N + attention
        # As `xlafit check`: compute never below the model's own FLOPs at peak.
        compute = max(total["flops"], model_flops * batch * 8192) / target.peak_flops
        memory_s, comm = total["bytes"] / target.hbm_bandwidth, total["comm_s"]
        step = max(compute, memory_s, comm)
        tokens = batch * 8192 / step
        out["prediction"] = {
            "per_layer": per_layer,
            "total": total,
            "compute_s": compute,
            "xla_flops_over_model_flops": total["flops"] / (model_flops * batch * 8192),
            "memory_s": memory_s,
            "comm_s": comm,
            "step_s": step,
            "step_no_overlap_s": max(compute, memory_s) + comm,
            "tokens_per_s_per_chip": tokens,
            "mfu": model_flops * tokens / target.peak_flops,
            "model_flops_per_token": model_flops,
            "peak_flops": target.peak_flops,
        }
name = here / f"v6e-8-8b-seq8192-b{batch}-{remat}.json"
name.write_text(json.dumps(out, indent=2, default=str))
print(json.dumps(out.get("prediction", out["full_program"]), indent=2, default=str))
