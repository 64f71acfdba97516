"""Predicted against measured step time, on the accelerator at hand.

For each workload the step is predicted first (:func:`xlafit.check.local_prediction.predict_here`: the
run's train step compiled here and priced by the step model, :mod:`xlafit.predict`, at the
device's rates: a calibration file's or the built-in row), then the recipe's run is built as
``xlafit train`` does (:class:`xlafit.Trainer`) and its train step timed with the trainer's
own dispatch loop (as ``xlafit bench``: warm-up steps, then timed steps between two device
syncs, the input wait apart), and the program it ran predicted again. The error is
``predicted / measured - 1``; the roofline bound is recorded beside it.

Workloads (``--size full``, an H100 or H200; ``--size tiny`` rehearses the same code on a
CPU with small presets, given ``--peak`` and ``--bandwidth``, since a CPU has no table row):

  bert    BERT-base MLM, seq 128, batch 256, bf16 compute (the recipe, synthetic tokens)
  resnet  ResNet-50, 224 px, batch 256, bf16 compute (synthetic images)
  llm     the llm recipe's llama-3.2-1b preset, seq 1024, batch 8, bf16 compute (the demo text)

Commands:
  PYTHONPATH=src python3 benchmarks/gpu/measured.py --json OUT.json                  # GPU
  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/gpu/measured.py --size tiny \\
      --peak 1e11 --bandwidth 2e10 --json /tmp/predict.json                              # rehearsal
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

WORKLOADS: dict[str, dict[str, list[str]]] = {
    "bert-b128": {  # a shape the step model's rates were not checked on: BERT-base at half the batch
        "recipe": ["bert"],
        "full": ["model.preset=base", "data.seq_len=128", "data.global_batch=128", "data.synthetic_examples=8192"],
        "tiny": ["model.preset=tiny", "data.seq_len=64", "data.global_batch=8", "data.synthetic_examples=512"],
        "common": ["data.source=synthetic", "model.compute_dtype=bfloat16"],
    },
    "llm-s2048": {  # and the 1B Llama at twice the sequence, half the batch
        "recipe": ["llm"],
        "full": ["model.preset=llama-3.2-1b", "data.seq_len=2048", "data.global_batch=4"],
        "tiny": ["model.preset=tiny", "data.seq_len=256", "data.global_batch=4"],
        "common": ["model.compute_dtype=bfloat16"],
    },
    "bert": {
        "full": ["model.preset=base", "data.seq_len=128", "data.global_batch=256", "data.synthetic_examples=8192"],
        "tiny": ["model.preset=tiny", "data.seq_len=64", "data.global_batch=16", "data.synthetic_examples=512"],
        "common": ["data.source=synthetic", "model.compute_dtype=bfloat16"],
    },
    "resnet": {
        "full": ["model.preset=resnet50", "data.global_batch=256", "data.synthetic_examples=4096"],
        "tiny": ["model.preset=demo", "data.global_batch=32", "data.synthetic_examples=512"],
        "common": ["data.source=synthetic", "model.compute_dtype=bfloat16"],
    },
    "llm": {
        "full": ["model.preset=llama-3.2-1b", "data.seq_len=1024", "data.global_batch=8"],
        "tiny": ["model.preset=tiny", "data.seq_len=128", "data.global_batch=8"],
        "common": ["model.compute_dtype=bfloat16"],
    },
}


def overrides_of(name: str, size: str) -> tuple[str, list[str]]:
    """A workload's recipe and overrides, one step per call (the timed loop counts calls,
    and the prediction is of one program)."""
    w = WORKLOADS[name]
    return w.get("recipe", [name])[0], [*w["common"], *w[size], "trainer.steps_per_call=1", "trainer.epochs=100"]


def build_trainer(recipe_name: str, overrides: list[str]) -> tuple[Any, Any, Any]:
    """``(trainer, train data, run)``: the recipe's run built as ``xlafit train`` builds it."""
    from xlafit.data.dataset import as_dataset
    from xlafit.parallel.cluster import connect
    from xlafit.parallel.sharding import parse_rules
    from xlafit.recipes import get_recipe, load_config
    from xlafit.run import recipe_trainer, resolve
    from xlafit.train.optim import make_optimizer

    cfg = load_config(recipe_name, overrides)
    recipe = get_recipe(recipe_name)
    recipe.validate(cfg)
    strategy = connect(cpu=cfg.cpu, mesh=cfg.mesh.sizes, rules=parse_rules(cfg.mesh.rules))
    train = as_dataset(recipe.load_data(cfg)[0])
    cfg, run = resolve(recipe.from_data(cfg, train), strategy, len(train))
    plan = make_optimizer(cfg.optimizer, run.global_batch)
    return recipe_trainer(recipe, cfg, run, strategy, train, plan, keep=False), train, run


def run_workload(name: str, size: str, warmup: int, steps: int, peak: float | None, bandwidth: float | None) -> dict:
    import jax

    from xlafit.bench.worker import _timed_calls
    from xlafit.check import recipe_program
    from xlafit.check.local_prediction import predict_here

    recipe_name, overrides = overrides_of(name, size)
    # Predicted before it runs: the run's step compiled here and priced.
    program, _, _ = recipe_program(recipe_name, overrides)
    before = predict_here(program, peak, bandwidth).report
    trainer, train, run = build_trainer(recipe_name, overrides)
    t0 = time.perf_counter()
    timed = _timed_calls(trainer, train, warmup, warmup + steps)
    measured = statistics.median(timed["call_s"])
    # The program just timed (the trainer compiled one, for one step per call), read again.
    compiled = next(iter(trainer.train_step._cache.values()))
    program, _, _ = recipe_program(recipe_name, overrides, global_batch=run.global_batch)
    here = predict_here(program, peak, bandwidth, compiled=compiled)
    report = here.report
    device = jax.devices()[0]
    return {
        "workload": name,
        "size": size,
        "overrides": overrides,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "global_batch": run.global_batch,
        "measured_step_s": measured,
        "measured_p10_p90_s": [float(x) for x in _quantiles(timed["call_s"])],
        "input_wait_s": timed["wait_s"],
        "timed_steps": timed["steps"],
        "compile_s": trainer.train_step.compile_s,
        "predicted_before_run_s": before.step_s if before.predicted else None,
        "predicted_step_s": report.step_s,
        "predicted_by": "step model" if report.predicted else "roofline bound (no rates for this device)",
        "band": report.band,
        "rates": report.rates,
        "bound_s": report.bound_s,
        "predicted_compute_s": report.compute_s,
        "predicted_memory_s": report.memory_s,
        "bound": report.bound,
        "flops_per_step": report.flops_per_step,
        "analytic_flops_per_step": report.analytic_flops_per_step,
        "bytes_per_step": report.bytes_per_step,
        "peak_flops": here.peak_flops,
        "peak_source": here.peak_source,
        "hbm_bandwidth": here.hbm_bandwidth,
        "bandwidth_source": here.bandwidth_source,
        "error": report.step_s / measured - 1 if report.step_s else None,
        "mfu_measured": (report.analytic_flops_per_step or 0) / measured / here.peak_flops or None,
        "wall_s": time.perf_counter() - t0,
        "versions": {"jax": jax.__version__, "python": sys.version.split()[0]},
    }


def _quantiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=10)
    return q[0], q[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="bert,resnet,llm")
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peak", type=float, help="one device's FLOP/s, instead of the hardware table's")
    p.add_argument("--bandwidth", type=float, help="one device's HBM bytes/s, instead of the table's")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    results = []
    for name in args.workloads.split(","):
        r = run_workload(name, args.size, args.warmup, args.steps, args.peak, args.bandwidth)
        results.append(r)
        err = f"{r['error']:+.0%}" if r["error"] is not None else "-"
        print(
            f"{name}: measured {r['measured_step_s'] * 1e3:.1f} ms, predicted {r['predicted_step_s'] * 1e3:.1f} ms "
            f"by the {r['predicted_by']}, error {err}; roofline bound {r['bound_s'] * 1e3:.1f} ms ({r['bound']}); "
            f"MFU {r['mfu_measured'] or 0:.1%}",
            flush=True,
        )
        if args.json:  # after every workload: a run cut short keeps what it finished
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
