"""``xlafit bench``: a table of configurations you can trust.

A benchmark that mixes compile time, input stalls and device time into one number, with
spreads larger than the means, answers nothing. Here every
configuration runs in its own process (:mod:`xlafit.bench.worker`) for a fixed number of
steps after a warm-up, configurations interleaved round by round so that machine noise
hits all alike, and the parts are reported apart:

- compile time: XLA compiles, counted and timed by the train step itself;
- step time: calls are dispatched asynchronously, as in training, with one sync before
  and one after the timed steps; a call's time is the interval since the previous call
  returned, less its input wait (in steady state, the devices' time per call), per step:
  median and p10-p90 spread;
- input wait: time the loop waited for the next batch (share of wall time);
- wall time = step time + input wait, so time per epoch = steps per epoch x wall time per
  step, and examples/s = batch / wall time per step;
- MFU: FLOPs per step (XLA's cost analysis, checked against the analytic count) / step
  wall time / peak FLOP/s (:mod:`xlafit.platform.hardware`).

Example:
    >>> result = run_bench("mnist", devices=["1"], steps=4, warmup=2, repeats=1)  # doctest: +SKIP
    >>> print(format_table(result))                                                 # doctest: +SKIP
"""

from xlafit.bench.report import format_table, plot, whiskers
from xlafit.bench.runner import BENCH_RECIPES, PEERS, Row, plan_configs, run_bench, run_worker
from xlafit.bench.summary import model_flops, summarize

__all__ = [
    "BENCH_RECIPES",
    "PEERS",
    "Row",
    "format_table",
    "model_flops",
    "plan_configs",
    "plot",
    "run_bench",
    "run_worker",
    "summarize",
    "whiskers",
]
