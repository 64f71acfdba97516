"""A table row from a configuration's repeated runs: medians, spreads, MFU and where its FLOPs came from."""

from __future__ import annotations

from typing import Any

import numpy as np


def model_flops(xla: float | None, analytic: float) -> tuple[float, str]:
    """FLOPs per step for MFU, and where they came from.

    XLA's cost analysis of the compiled step is preferred; where it is missing, or off the
    analytic count by more than 25%, the analytic count is used. (On GPUs XLA hands
    convolutions to cuDNN as custom calls that its cost analysis counts as zero FLOPs.)

    Example:
        >>> model_flops(1.14e9, 9.16e9)
        (9160000000.0, 'analytic (XLA cost analysis: 1.14 GFLOP, 0.12x)')
    """
    if xla is None:
        return analytic, "analytic (no XLA cost analysis)"
    ratio = xla / analytic
    if 0.75 <= ratio <= 1.25:
        return xla, "XLA cost analysis"
    return analytic, f"analytic (XLA cost analysis: {xla / 1e9:.2f} GFLOP, {ratio:.2f}x)"


def summarize(name: str, runs: list[dict[str, Any]], steps_per_epoch: int, batch: int, peak: float) -> dict[str, Any]:
    """One table row from the repeated runs of a configuration (medians over runs)."""
    step_s = np.concatenate([np.array(r["call_s"]) / np.array(r["call_steps"]) for r in runs])
    first = runs[0]
    flops, flops_source = model_flops(first.get("flops_per_step"), first["flops_per_step_analytic"])
    # One wall time per step (the median run's) drives the columns derived from it, so
    # that they add up: epoch s = steps/epoch x it, examples/s = batch / it.
    wall_per_step = float(np.median([r["wall_s"] / r["steps"] for r in runs]))
    median = {
        "wall_ms_per_step": 1e3 * wall_per_step,
        "examples_per_s": batch / wall_per_step,
        "epoch_s": steps_per_epoch * wall_per_step,
        "input_wait_frac": float(np.median([r["wait_s"] / r["wall_s"] for r in runs])),
        "mfu": flops / wall_per_step / peak,
    }
    # The same expression as the median's, so that one run's whisker is exactly zero.
    per_run = [{"examples_per_s": batch / (r["wall_s"] / r["steps"])} for r in runs]
    compile_s = [r["compile_s"] for r in runs if r["compile_s"] is not None]
    # Page faults in the timed steps: a run far above the others grew its heap there (for
    # XLA:CPU, by a whole block of temporaries: xlafit.platform.cpu) and is slower for it.
    faults = [r["page_faults"] / r["steps"] for r in runs if r.get("page_faults") is not None]
    peak_rss = [r["peak_rss_bytes"] for r in runs if r.get("peak_rss_bytes") is not None]
    return {
        "configuration": name,
        "compile_s": float(np.median(compile_s)) if compile_s else None,
        "compiles": first["compiles"],
        "step_ms_median": 1e3 * float(np.median(step_s)),
        "step_ms_p10": 1e3 * float(np.percentile(step_s, 10)),
        "step_ms_p90": 1e3 * float(np.percentile(step_s, 90)),
        **median,
        "examples_per_s_runs": [p["examples_per_s"] for p in per_run],
        "page_faults_per_step": float(np.median(faults)) if faults else None,
        "page_faults_per_step_runs": faults,
        "peak_rss_bytes": max(peak_rss) if peak_rss else None,
        "flops_per_step_xla": first.get("flops_per_step"),
        "flops_per_step_analytic": first["flops_per_step_analytic"],
        "mfu_flops_source": flops_source,
        "devices": first["devices"],
        "device_kind": first["device_kind"],
        # the step model's prediction of this configuration's program (not a measurement)
        "step_ms_predicted": 1e3 * first["predicted_step_s"] if first.get("predicted_step_s") else None,
        "prediction_band": first.get("prediction_band"),
    }
