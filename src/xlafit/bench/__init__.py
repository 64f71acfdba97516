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

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xlafit.bench.worker import Spec
from xlafit.data import mnist
from xlafit.errors import BenchError, ConfigError
from xlafit.models.resnet import DEPTHS

BENCH_RECIPES = ("mnist", "resnet")
PEERS = ("torch", "torch-compile", "xlafit-torch")  # xlafit-torch: the PyTorch module trained by xlafit


def _worker_env(simulate: int | None) -> dict[str, str]:
    env = dict(os.environ)
    # The device count is the worker's to choose (XLAFIT_SIMULATE_DEVICES), not XLA_FLAGS'.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env.pop("XLAFIT_SIMULATE_DEVICES", None)
    if simulate:
        env["XLAFIT_SIMULATE_DEVICES"] = str(simulate)
    return env


def run_worker(spec: Spec, simulate: int | None = None) -> dict[str, Any]:
    """Runs one configuration in a fresh Python process and returns its measurements."""
    out = subprocess.run(
        [sys.executable, "-m", "xlafit.bench.worker", json.dumps(dataclasses.asdict(spec))],
        capture_output=True,
        text=True,
        env=_worker_env(simulate),
        check=False,
    )
    if out.returncode:
        raise BenchError(f"the {spec.framework} configuration failed:\n{(out.stderr or out.stdout)[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclasses.dataclass
class Row:
    """One row of the table: a name, what its worker runs, and its simulated CPU devices."""

    name: str
    spec: Spec
    simulate: int | None = None


def plan_configs(
    devices: Sequence[str],
    steps_per_call: Sequence[int],
    compare: Sequence[str],
    probe: dict[str, Any],
    base: Spec,
    simulate: int | None,
) -> list[Row]:
    """The rows: one xlafit row per device count ("all" = every device) and steps per call,
    then the peers.

    On a CPU, N devices are N simulated devices (one process, like a TPU host's cores);
    ``simulate`` is what "all" means there.
    """
    cpu = probe["platform"] == "cpu"
    available = (simulate or 1) if cpu else probe["device_count"]
    counts: list[int] = []
    for d in devices:
        try:
            n = available if d == "all" else int(d)
        except ValueError:
            raise ConfigError(f"--devices {d}: expected device counts or 'all', e.g. --devices 1,all.") from None
        if n < 1 or (not cpu and n > available):
            raise ConfigError(f"--devices {d}: this machine has {available} {probe['platform']} device(s).")
        if base.batch % n:
            # Each device takes an equal share of the global batch (the Trainer refuses otherwise).
            raise ConfigError(
                f"--batch {base.batch} does not divide over {n} devices (--devices {d}): "
                f"use a batch that is a multiple of {n}, or other --devices."
            )
        if n not in counts:
            counts.append(n)
    configs = []
    for n in counts:
        for k in steps_per_call:
            name = f"xlafit {n} {probe['platform']}" + (" (simulated)" if cpu and n > 1 else "")
            name += f" k={k}" if k > 1 else ""
            spec = dataclasses.replace(base, framework="xlafit", devices=n, steps_per_call=k)
            configs.append(Row(name, spec, simulate=n if cpu else None))
    for peer in compare:
        if peer not in PEERS:
            raise ConfigError(f"--compare {peer}: known peers are {', '.join(PEERS)}.")
        if peer == "xlafit-torch":  # PyTorch's own module, trained by xlafit on the most devices asked for
            if base.recipe != "mnist":
                raise ConfigError("--compare xlafit-torch: the PyTorch module through xlafit is benchmarked for mnist.")
            n = counts[-1]
            spec = dataclasses.replace(base, framework=peer, devices=n, profile_steps=0)
            configs.append(Row(f"the PyTorch module through xlafit, {n} device(s)", spec, simulate=n if cpu else None))
            continue
        name = "PyTorch eager" if peer == "torch" else "PyTorch torch.compile"
        configs.append(Row(name, dataclasses.replace(base, framework=peer, profile_steps=0)))
    return configs


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


def run_bench(
    recipe: str = "mnist",
    *,
    devices: Sequence[str] = ("1", "all"),
    compare: Sequence[str] = (),
    steps: int = 60,
    warmup: int = 10,
    repeats: int = 3,
    batch: int = 128,
    steps_per_call: Sequence[int] = (1,),
    dtype: str = "float32",
    data: str = "embedded",
    examples: int | None = None,
    simulate: int | None = None,
    depth: int = 50,
    width: int = 64,
    image_size: int = 224,
    epochs: float | None = None,
    profile: int = 0,
    profile_dir: str | Path = "runs/bench-profile",
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Benchmarks ``recipe`` in each configuration; returns the table's rows and every run.

    Args:
        recipe: the workload: "mnist" (the CNN), or "resnet" (ResNet-``depth`` v1.5 of stem
            width ``width`` on synthetic ``image_size`` images; its peers are Hugging Face's
            ``ResNetForImageClassification`` of the same sizes, channels-last).
        devices: device counts for xlafit rows, or "all".
        compare: peers: "torch" (eager), "torch-compile".
        steps: timed steps per run (``epochs`` instead: that many epochs' worth).
        warmup: untimed steps first (compiles happen here).
        repeats: runs per configuration; the table shows medians.
        batch: global batch, the same for every configuration.
        steps_per_call: xlafit train steps per compiled call (a row for each).
        dtype: xlafit compute dtype.
        data: "embedded", "synthetic" (``examples`` random digits) or an IDX directory;
            resnet: always synthetic images.
        examples: synthetic examples (default: 60,000 digits; 8 batches of images).
        simulate: simulated CPU devices that "all" means on a CPU.
        profile: trace this many extra steps of each xlafit row with ``jax.profiler``.
        profile_dir: where the traces go (one folder per row).
        progress: receives a line per finished run.
    """
    _check_options(recipe, steps, warmup, repeats, batch, steps_per_call, epochs, profile, simulate, examples)
    if recipe == "resnet":
        _check_resnet(depth, width, image_size)
        data = "synthetic"  # same-shape random images: the benchmark times the step, not a decoder
        examples = examples or 8 * batch
    examples = examples or 60_000
    n_train = _train_size(data, examples)
    steps_per_epoch = n_train // batch
    if steps_per_epoch < 1:
        raise ConfigError(f"--batch {batch} is larger than the {n_train} training examples.")
    probe = run_worker(Spec("probe"))
    base = Spec("xlafit", recipe, 1, data, examples, batch, warmup, steps, 1, dtype, profile)
    base.depth, base.width, base.image_size = depth, width, image_size
    if epochs is not None:
        base.steps = max(1, round(epochs * steps_per_epoch))
    configs = plan_configs(devices, steps_per_call, compare, probe, base, simulate)
    runs = _run_rounds(configs, repeats, batch, Path(profile_dir), progress)
    settings = {
        "batch": batch,
        "warmup": warmup,
        "steps": base.steps,
        "repeats": repeats,
        "steps_per_call": list(steps_per_call),
        "dtype": dtype,
        "data": data,
        "train_examples": n_train,
        "steps_per_epoch": steps_per_epoch,
        **({"depth": depth, "width": width, "image_size": image_size} if recipe == "resnet" else {}),
    }
    return {
        "recipe": recipe,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "xlafit " + " ".join(sys.argv[1:])
        if sys.argv[0].endswith(("xlafit", "xlafit/__main__.py"))
        else None,
        "machine": {
            "platform": probe["platform"],
            "device_kind": probe["device_kind"],
            "device_count": probe["device_count"],
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "peak": {"flops_per_device": probe["peak_flops_per_device"], "source": probe["peak_source"]},
        "settings": settings,
        "versions": _versions(runs),
        "rows": _rows(configs, runs, probe, steps_per_epoch, batch),
        "runs": runs,
    }


def _check_options(
    recipe: str,
    steps: int,
    warmup: int,
    repeats: int,
    batch: int,
    steps_per_call: Sequence[int],
    epochs: float | None,
    profile: int,
    simulate: int | None,
    examples: int | None,
) -> None:
    """Refuses impossible settings before any worker starts, naming the flag."""
    if recipe not in BENCH_RECIPES:
        raise ConfigError(f"unknown benchmark recipe {recipe!r}; available: {', '.join(BENCH_RECIPES)}.")
    at_least_one = [("steps", steps), ("repeats", repeats), ("batch", batch)]
    at_least_one += [("steps-per-call", k) for k in steps_per_call]
    at_least_one += [("simulate", simulate or 1), ("examples", 1 if examples is None else examples)]
    for name, value in at_least_one:
        if value < 1:
            raise ConfigError(f"--{name} must be at least 1, got {value}.")
    if warmup < 0:
        raise ConfigError(f"--warmup must be 0 or more, got {warmup}.")
    if profile < 0:
        raise ConfigError(f"--profile must be 0 (no trace) or more steps, got {profile}.")
    if epochs is not None and epochs <= 0:
        raise ConfigError(f"--epochs must be more than 0, got {epochs}.")


def _check_resnet(depth: int, width: int, image_size: int) -> None:
    if depth not in DEPTHS:
        raise ConfigError(f"--depth {depth}: ResNet depths are {', '.join(map(str, sorted(DEPTHS)))}.")
    if width < 1 or image_size < 32:
        raise ConfigError(f"--width must be at least 1 and --image-size at least 32, got {width}, {image_size}.")


def _run_rounds(
    configs: list[Any], repeats: int, batch: int, profile_dir: Path, progress: Callable[[str], None]
) -> dict[str, list[dict[str, Any]]]:
    """Every configuration once per round, interleaved, so machine noise hits all alike."""
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    for r in range(repeats):
        for c in configs:
            spec = c.spec
            if spec.profile_steps:
                folder = c.name.replace(" ", "-").replace("(", "").replace(")", "")
                spec = dataclasses.replace(spec, profile_dir=str(profile_dir / folder))
                if r:  # one trace per configuration is enough
                    spec.profile_steps = 0
            last = run_worker(spec, c.simulate)
            runs[c.name].append(last)
            faults = last.get("page_faults")
            faults_text = "" if faults is None else f", page faults/step {faults / last['steps']:,.0f}"
            progress(
                f"round {r + 1}/{repeats}  {c.name}: {batch * last['steps'] / last['wall_s']:.0f} examples/s, "
                f"input wait {100 * last['wait_s'] / last['wall_s']:.1f}%{faults_text}"
            )
    return runs


def _rows(
    configs: list[Any], runs: dict[str, list[dict[str, Any]]], probe: dict[str, Any], steps_per_epoch: int, batch: int
) -> list[dict[str, Any]]:
    """The table: one row per configuration, medians, speed-up against the first row."""
    rows = []
    for c in configs:
        n = runs[c.name][0]["devices"]
        # simulated CPU devices share the machine's cores: its peak is the whole machine's
        peak = probe["peak_flops_per_device"] * (1 if probe["platform"] == "cpu" else n)
        rows.append(summarize(c.name, runs[c.name], steps_per_epoch, batch, peak))
        rows[-1]["peak_flops"] = peak
    for row in rows:
        row["speedup"] = row["examples_per_s"] / rows[0]["examples_per_s"]
    return rows


def _versions(runs: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Library versions reported by the configurations' first runs (jax, flax, torch, ...)."""
    versions: dict[str, str] = {}
    for config_runs in runs.values():
        versions.update(config_runs[0].get("versions", {}))
    return versions


def _train_size(data: str, examples: int) -> int:
    if data == "synthetic":
        return examples
    splits = mnist.load_embedded() if data == "embedded" else mnist.load_idx_dir(data)
    return len(splits["train"]["label"])


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
