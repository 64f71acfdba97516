"""Compiles the published MaxText runs of ``benchmarks/validation/tpu/runs.json`` for their TPU
slices with the TPU compiler on this machine (libtpu, no TPU), as ``xlafit check --tpu``
does, and keeps each train step's optimised program for the step model's validation.

    JAX_PLATFORMS=cpu python benchmarks/predict/tpu_published.py [ID ...]   # default: every run not yet compiled

Writes ``benchmarks/validation/tpu/<id>.b<N>.hlo.txt.gz`` (the program at N sequences per
chip, metadata stripped) and ``<id>.json`` (compile time, per-core memory, the overrides).
xlafit's program does not always fit at the published batch (it keeps float32 logits and has
no host offloading): then the two largest batches below it that fit are compiled, and the
validation extrapolates the step along the line through them.

    JAX_PLATFORMS=cpu python benchmarks/predict/tpu_published.py --levers OUT_DIR [ID ...]

compiles each run at its published batch with the recipe's memory levers instead (the logits
in blocks, ``model.logits_chunk=auto``; with tensor parallelism, the residual stream split over
the tensor group, ``mesh.rules=activation_embed=tensor``, then full remat; last, layer inputs in
host memory, ``model.remat=offload``: the first that fits, :func:`levers_for`), and writes
``OUT_DIR/<id>.json``: whether it fits, its memory, the step model's predicted step and
tokens/s per chip beside MaxText's published figure (a prediction against a measurement). The
validation set is left as it is.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import time
from pathlib import Path

from xlafit.check import recipe_program
from xlafit.check.tpu import OutOfMemory, Steps, memory_of, needed_bytes, no_persistent_cache
from xlafit.platform.hardware import parse_targets
from xlafit.predict.model import predict
from xlafit.predict.rates import rates_for

HERE = Path(__file__).resolve().parents[1] / "validation" / "tpu"


def overrides(run: dict, batch: int) -> list[str]:
    """The llm recipe's settings for a published run: its model, sequence and batch, bf16
    compute, its remat (full unless the run names another), scanned layers, FSDP over the
    slice (and its tensor axis), the whole logits."""
    target = parse_targets(run["target"])[0]
    tensor = run.get("mesh", {}).get("tensor", 1)
    out = [f"model.{k}={v}" for k, v in run["model"].items()]
    out += [
        f"data.seq_len={run['seq']}",
        "model.compute_dtype=bfloat16",
        f"model.remat={run.get('remat', 'full')}",
        "model.scan_layers=true",
        "mesh.data=1",
        "mesh.fsdp=-1",
        f"mesh.tensor={tensor}",
        f"data.global_batch={batch * target.num_devices}",
        "data.eval_global_batch=null",
        "model.logits_chunk=0",  # the whole float32 logits, as the recorded programs were compiled
    ]
    if run["model"].get("preset") == "custom":
        out.append(f"model.max_position_embeddings={run['seq']}")
    return out


def compile_at(run: dict, batch: int, levers: list[str] | None = None) -> tuple[dict, str | None]:
    """One program of ``run`` at ``batch`` sequences per chip (``levers``: settings over the
    recorded ones): its record and HLO (None: it does not fit)."""
    target = parse_targets(run["target"])[0]
    settings = overrides(run, batch) + (levers or [])
    program = recipe_program("llm", settings)[0]
    program.eval_global_batch = None
    out: dict = {"batch": batch, "overrides": settings, "xla_options": run.get("xla_options")}
    with no_persistent_cache():
        steps = Steps(target, program)
        per_device = batch * target.num_devices // steps.strategy.num_replicas
        t0 = time.perf_counter()
        try:
            compiled, _ = steps.compile_train(per_device, options=run.get("xla_options"))
        except OutOfMemory as e:
            out.update(fits=False, compile_s=time.perf_counter() - t0, needs=needed_bytes(e.message))
            return out, None
        out.update(fits=True, compile_s=time.perf_counter() - t0, per_device_batch=per_device)
        out["memory"] = memory_of(compiled, steps.state_bytes, 0)
        return out, re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())


def compile_run(run: dict) -> dict:
    """The run at its batch, or the two largest smaller batches that fit."""
    out: dict = {"id": run["id"], "target": run["target"], "programs": [], "refused": []}
    for batch in range(run["batch"], 0, -1):
        print(f"  {batch} per chip ...", file=sys.stderr, flush=True)
        record, hlo = compile_at(run, batch)
        if hlo is None:
            out["refused"].append(record)
            continue
        record["file"] = f"{run['id']}.b{batch}.hlo.txt.gz"
        with gzip.open(HERE / record["file"], "wt") as f:
            f.write(hlo)
        out["programs"].append(record)
        if batch == run["batch"] or len(out["programs"]) == 2:
            break
    return out


def levers_for(run: dict) -> list[list[str]]:
    """The levers tried at a published batch, in order: the logits in blocks with the run's own
    remat; with tensor parallelism, the residual stream split over the tensor group as well
    (MaxText's activation_embed), then with full remat; last, each layer's input in host memory."""
    blocks = ["model.logits_chunk=auto"]
    out = [blocks]
    if run.get("mesh", {}).get("tensor", 1) > 1:
        split = [*blocks, "mesh.rules=activation_embed=tensor"]
        out.append(split)
        if run.get("remat", "full") != "full":
            out.append([*split, "model.remat=full"])
    return [*out, [*blocks, "model.remat=offload"]]


def with_levers(run: dict, out: Path) -> dict:
    """The run at its published batch with :func:`levers_for`'s levers (the first that fits): its
    memory, and the step model's step and tokens/s per chip against MaxText's."""
    target = parse_targets(run["target"])[0]
    result: dict = {"id": run["id"], "target": run["target"], "batch": run["batch"], "tried": []}
    for levers in levers_for(run):
        print(f"  {run['batch']} per chip with {' '.join(levers)} ...", file=sys.stderr, flush=True)
        record, hlo = compile_at(run, run["batch"], levers)
        result["tried"].append(record)
        if hlo is None:
            continue
        rates = rates_for(target.generation.device_kinds[0])
        assert rates is not None, target.generation.name
        step = predict(hlo, rates, target.ici_bandwidth, target.num_devices).seconds
        tokens = run["batch"] * run["seq"] / step
        published = run.get("tokens_per_s_chip") or run["batch"] * run["seq"] / run["step_s"]
        result.update(
            fits=True,
            levers=levers,
            predicted_step_s=step,
            predicted_tokens_per_s_chip=tokens,
            published_step_s=run["step_s"],
            published_tokens_per_s_chip=published,
            ratio=tokens / published,
        )
        break
    else:
        result["fits"] = False
    (out / f"{run['id']}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*")
    parser.add_argument("--levers", type=Path, metavar="OUT_DIR", help="compile at the published batch with the levers")
    args = parser.parse_args()
    runs = json.loads((HERE / "runs.json").read_text())["runs"]
    if args.levers:
        args.levers.mkdir(parents=True, exist_ok=True)
        for run in [r for r in runs if not args.ids or r["id"] in args.ids]:
            if (args.levers / f"{run['id']}.json").exists():
                continue
            print(f"{run['id']}: compiling for {run['target']} ...", file=sys.stderr, flush=True)
            r = with_levers(run, args.levers)
            print(json.dumps({k: r.get(k) for k in ("id", "fits", "levers", "ratio")}), flush=True)
        return
    chosen = (
        [r for r in runs if r["id"] in args.ids]
        if args.ids
        else [r for r in runs if not (HERE / f"{r['id']}.json").exists()]
    )
    for run in chosen:
        print(f"{run['id']}: compiling for {run['target']} ...", file=sys.stderr, flush=True)
        try:
            result = compile_run(run)
        except Exception as e:  # a run the recipe cannot build: said, and the others go on
            print(f"{run['id']}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        (HERE / f"{run['id']}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(json.dumps({"id": result["id"], "batches": [p["batch"] for p in result["programs"]]}), flush=True)


if __name__ == "__main__":
    main()
