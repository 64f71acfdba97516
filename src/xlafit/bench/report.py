"""``xlafit bench``'s result as a table and as a plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xlafit.errors import ConfigError


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table of :func:`run_bench`'s result."""
    s, m = result["settings"], result["machine"]
    lines = [
        f"{result['recipe']}: global batch {s['batch']}, {s['steps']} timed steps after {s['warmup']} warm-up, "
        f"median of {s['repeats']} runs; epoch = {s['train_examples']} examples ({s['data']}) = "
        f"{s['steps_per_epoch']} steps",
        f"machine: {m['device_kind']} x{m['device_count']} ({m['platform']}), {m['processor']}, {m['cpus']} CPUs; "
        f"MFU peak: {result['peak']['source']}",
        "step ms: each timed call's time per step, median and p10-p90; epoch s, examples/s and MFU: the whole "
        "timed span per step (input waits in, compiles out)",
        "",
        f"{'configuration':<30} {'compile s':>9} {'step ms':>8} {'p10-p90 ms':>13} {'epoch s':>8} "
        f"{'examples/s':>10} {'wait %':>6} {'MFU %':>6} {'speedup':>7}",
    ]
    for row in result["rows"]:
        spread = f"{row['step_ms_p10']:.2f}-{row['step_ms_p90']:.2f}"
        lines.append(
            f"{row['configuration']:<30} {_fmt(row['compile_s'], '.2f'):>9} {row['step_ms_median']:>8.2f} "
            f"{spread:>13} {row['epoch_s']:>8.2f} {row['examples_per_s']:>10.0f} "
            f"{100 * row['input_wait_frac']:>6.1f} {100 * row['mfu']:>6.1f} {row['speedup']:>6.2f}x"
        )
    lines.append("")
    for r in result["rows"]:
        xla = r["flops_per_step_xla"]
        lines.append(
            f"FLOPs/step {r['configuration']}: XLA {_fmt(xla and xla / 1e9, '.2f')} G, analytic "
            f"{r['flops_per_step_analytic'] / 1e9:.2f} G; MFU from {r['mfu_flops_source']}"
        )
    for r in result["rows"]:
        if r.get("step_ms_predicted"):
            error = r["step_ms_predicted"] / r["step_ms_median"] - 1
            lines.append(
                f"predicted step {r['configuration']}: {r['step_ms_predicted']:.2f} ms ({error:+.0%} against the "
                f"measured median); the step model's error: {r['prediction_band']}"
            )
        elif r.get("prediction_band"):
            lines.append(f"predicted step {r['configuration']}: {r['prediction_band']}")
    for r in result["rows"]:
        if r.get("page_faults_per_step") is not None:
            runs = ", ".join(f"{f:,.0f}" for f in r["page_faults_per_step_runs"])
            peak = _fmt(r["peak_rss_bytes"] and r["peak_rss_bytes"] / 2**30, ".2f")
            lines.append(f"host memory {r['configuration']}: peak {peak} GiB; page faults/timed step {runs}")
    return "\n".join(lines)


def whiskers(rows: Sequence[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Error-bar lengths below and above each row's median examples/s: to the slowest and
    the fastest run, never negative.

    The median comes from the median run's wall time per step, so with one or two runs it
    can land an ulp outside ``[min, max]`` of the runs' own rates (matplotlib refuses a
    negative ``xerr``).

    Example:
        >>> lo, hi = whiskers([{"examples_per_s": 100.0, "examples_per_s_runs": [90.0, 100.0, 120.0]}])
        >>> lo.tolist(), hi.tolist()
        ([10.0], [20.0])
    """
    med = np.array([r["examples_per_s"] for r in rows], dtype=float)
    lo = med - np.array([min(r["examples_per_s_runs"]) for r in rows], dtype=float)
    hi = np.array([max(r["examples_per_s_runs"]) for r in rows], dtype=float) - med
    return np.maximum(lo, 0.0), np.maximum(hi, 0.0)


def plot(result: dict[str, Any], path: str | Path) -> None:
    """A PNG: examples/s per configuration (bars: median, whiskers: min-max over runs) and
    time per epoch split into step time and input wait."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    rows = result["rows"]
    names = [r["configuration"] for r in rows]
    y = np.arange(len(rows))
    # Constrained layout makes room for the legend outside the axes, beside the bars.
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.6 * len(rows)), sharey=True, layout="constrained")
    left.barh(y, [r["examples_per_s"] for r in rows], xerr=whiskers(rows), color="tab:blue")
    left.set_yticks(y, names)
    left.invert_yaxis()
    left.set_xlabel("examples/s (median; whiskers: min-max)")
    spe = result["settings"]["steps_per_epoch"]
    runs = result["runs"]
    parts: dict[str, list[float]] = {"step": [], "input wait": []}
    for r in rows:
        first = runs[r["configuration"]]
        wait = np.median([x["wait_s"] / x["steps"] for x in first])
        step = np.median([sum(x["call_s"]) / x["steps"] for x in first])
        parts["step"].append(spe * step)
        parts["input wait"].append(spe * wait)
    left_edge = np.zeros(len(rows))
    for label, values in parts.items():
        right.barh(y, values, left=left_edge, label=label)
        left_edge += np.array(values)
    right.set_xlabel(f"seconds per epoch ({spe} steps); compile time apart")
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.suptitle(f"xlafit bench {result['recipe']}: {result['machine']['device_kind']} ({result['date']})")
    fig.savefig(path, dpi=120)
    plt.close(fig)
