"""Cost arithmetic of the plan's search: a compiled program's FLOPs and HBM bytes per step
(:func:`program_cost`), and how much a larger batch could still gain (:func:`reachable_gain`)."""

from __future__ import annotations

import math
from typing import Any

from xlafit.check.speed import steps_in_cost
from xlafit.plan.candidates import Candidate
from xlafit.predict.collectives import loop_trips
from xlafit.predict.hlo import kernel_flops, loop_flops


def program_cost(compiled: Any, c: Candidate, k: int, hlo: str) -> tuple[float, float]:
    """FLOPs and HBM bytes per step of one compiled call of ``k`` steps of ``c`` (``hlo``: its text)."""
    cost = compiled.cost_analysis() or {}
    counted = steps_in_cost(hlo, k)
    # XLA's cost analysis counts a loop's body once: a scanned accumulation's micro-batches too.
    micro = c.accumulate if c.accumulate > 1 and c.accumulate in loop_trips(hlo) else 1
    # The products of other loops (a model's own scan over its layers), counted once there too.
    inner = loop_flops(hlo, {n for n in (k, micro) if n > 1})
    # The Pallas kernels' FLOPs (splash attention), which the cost analysis cannot see, per step.
    flops = (float(cost.get("flops", 0.0)) + inner) * micro / counted + kernel_flops(hlo) / k
    return flops, float(cost.get("bytes accessed", 0.0)) * micro / counted


def reachable_gain(points: list[tuple[int, float]], refused: int | None) -> float | None:
    """How much faster than the newest of two fits ``points`` (per-core batch, examples/s)
    the largest batch below the smallest ``refused`` one could run; None: none refused yet.

    The step time is taken to grow linearly in the batch through the two fits (a fixed part,
    the parameters' traffic, and a part per example), so throughput climbs toward a ceiling.
    Only a refusal bounds the batch: near the HBM's capacity the compiler rematerialises on
    its own and the memory stops growing as a line (the 1.28B BERT on a v5e-8: 13.7 GiB at
    32 per core, 15.3 at 64, where the line through 8 and 32 meets the capacity at 39).
    """
    (b0, s0), (b1, s1) = points
    if refused is None:
        return None
    cap = refused - 1
    if cap <= b1:
        return 0.0
    t0, t1 = b0 / s0, b1 / s1  # seconds per step, up to the number of batch shards
    per_example = (t1 - t0) / (b1 - b0)
    step = t1 + per_example * (cap - b1)
    return math.inf if step <= 0 else (cap / step) / s1 - 1
