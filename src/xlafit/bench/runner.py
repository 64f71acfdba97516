"""Runs ``xlafit bench``'s configurations, each in its own process, interleaved round by round."""

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

from xlafit.bench.summary import summarize
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
    _check_rows(devices, compare, base.batch)
    for d in devices:
        n = available if d == "all" else int(d)
        if not cpu and n > available:
            raise ConfigError(f"--devices {d}: this machine has {available} {probe['platform']} device(s).")
        _check_split(base.batch, n, d)  # "all" is a count only now
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
    _check_rows(devices, compare, batch)
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


def _check_rows(devices: Sequence[str], compare: Sequence[str], batch: int) -> None:
    """Refuses device counts and peers that no machine could run, before the probe's worker
    starts (seconds): what depends on the machine is checked in :func:`plan_configs`."""
    for d in devices:
        if d == "all":
            continue
        try:
            n = int(d)
        except ValueError:
            raise ConfigError(f"--devices {d}: expected device counts or 'all', e.g. --devices 1,all.") from None
        if n < 1:
            raise ConfigError(f"--devices {d}: a device count is at least 1.")
        _check_split(batch, n, d)
    for peer in compare:
        if peer not in PEERS:
            raise ConfigError(f"--compare {peer}: known peers are {', '.join(PEERS)}.")


def _check_split(batch: int, n: int, asked: str) -> None:
    # Each device takes an equal share of the global batch (the Trainer refuses otherwise).
    if batch % n:
        raise ConfigError(
            f"--batch {batch} does not divide over {n} devices (--devices {asked}): "
            f"use a batch that is a multiple of {n}, or other --devices."
        )


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
