"""The step model held against measured steps: the stored measurements of a folder
(``benchmarks/validation`` in the repository), predicted again with the rates of today's
model, side by side.

- ``gpu-<name>/``: a GPU's measured steps (``summary.json``), their compiled programs
  (``<workload>.hlo.txt.gz``), the per-kernel profile (``kernels.json.gz``) and the card's
  micro-benchmarks (``micro.json``, what its rates are fitted to);
- ``tpu/``: published MaxText runs (``runs.json``: step time, source) and the programs
  xlafit's llm recipe compiles for them (``<id>.json``, ``<id>.b<N>.hlo.txt.gz``).

:func:`fit_gpu` and :func:`fit_tpu` make the built-in rows from these measurements;
:func:`gpu_checks`, :func:`kernel_units` and :func:`tpu_checks` compare predictions with the
steps held out of those fits.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from xlafit.platform.hardware import GENERATIONS, parse_targets
from xlafit.predict.fit import fit_matmul, fit_peak_stream, fit_stream, held_out_band, informative
from xlafit.predict.model import StepPrediction, predict
from xlafit.predict.ops import Kernel, kernels
from xlafit.predict.rates import Rates, Validated

__all__ = [
    "Check",
    "KernelUnit",
    "fit_gpu",
    "fit_tpu",
    "gpu_checks",
    "kernel_units",
    "tpu_checks",
    "tpu_program_kernels",
    "tpu_rows",
]


@dataclasses.dataclass(frozen=True)
class Check:
    """One measured step and its prediction."""

    id: str
    device: str
    measured_s: float
    predicted_s: float
    role: str  # "held out" or "fitted"
    source: str
    note: str = ""

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


@dataclasses.dataclass(frozen=True)
class KernelUnit:
    """A kernel of a profile (or a group of library kernels) and the program's kernels it ran."""

    name: str
    measured_s: float  # per step
    predicted_s: float
    kinds: tuple[str, ...]
    launches: int

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1 if self.measured_s else math.inf


# ---------------------------------------------------------------------------- GPUs


@cache
def _hlo(path: Path) -> str:
    with gzip.open(path, "rt") as f:
        return f.read()


def fit_gpu(folder: Path, device_kind: str, units: int, vector_ops_per_s: float, vector_source: str) -> Rates:
    """A GPU's row from its micro-benchmarks (``micro.json``): the matrix rate and tile from
    the informative products, the bandwidth and fixed cost from the informative streams."""
    micro = json.loads((Path(folder) / "micro.json").read_text())
    everything = micro["matmul"] + micro["elementwise"]
    floor = min(r["s"] for r in everything)
    products = [r for r in informative(everything) if "m" in r]
    streams = [{"bytes": r["gbps_rw"] * 1e9 * r["s"], "s": r["s"]} for r in micro["elementwise"] if r["s"] >= 2 * floor]
    bandwidth, fixed = fit_stream(streams)
    where = f"benchmarks/validation/{Path(folder).name}/micro.json"
    # Wider streams (xlafit bench --calibrate's "wide_stream" rows), where the file has them.
    wide = micro.get("wide_stream", [])
    peak = fit_peak_stream(bandwidth, fixed, wide) if wide else None
    # bf16 products, their operands streamed as the model streams a product's (stream_rate)
    flops, tile = fit_matmul(products, units, bandwidth=peak or bandwidth)
    peak_source = (
        f"the fastest of the {len(wide)} wider streams of {where}"
        if peak
        else f"none: the {len(wide)} wider streams of {where} were no faster"
        if wide
        else f"not measured: {where} times bf16 streams only (4 bytes per element); xlafit bench --calibrate "
        "times wider ones"
    )
    return Rates(
        device_kind,
        flops,
        tile,
        units,
        bandwidth,
        vector_ops_per_s,
        0.0,
        stream_bytes_per_element=4 if peak else None,
        hbm_peak_bytes_per_s=peak,
        sources={
            "matmul_flops": f"fitted to the {len(products)} bf16 products of {where} timed above twice its dispatch "
            f"floor ({floor * 1e6:.0f} us)",
            "matmul_tile": "the wave model's best tile for those products",
            "units": "streaming multiprocessors (datasheet)",
            "hbm_bytes_per_s": f"fitted to the {len(streams)} element-wise streams of {where} above its dispatch floor",
            "vector_ops_per_s": vector_source,
            "kernel_s": f"not measured: the fit's fixed cost ({fixed * 1e6:.0f} us) is each timed call's, and every "
            "small row of micro.json is dispatch-bound; xlafit bench --calibrate measures it on the device",
            "hbm_peak_bytes_per_s": peak_source,
        },
    )


def gpu_checks(folder: Path, rates: Rates) -> list[Check]:
    """Each stored workload's measured step (wall time per step of the trainer's own loop)
    against the prediction for its stored program."""
    folder = Path(folder)
    summary = json.loads((folder / "summary.json").read_text())
    out = []
    for name, w in summary["workloads"].items():
        predicted = predict(_kernels(folder / f"{name}.hlo.txt.gz"), rates).seconds
        out.append(
            Check(
                name,
                summary["device"],
                w["step_s_wall"],
                predicted,
                "held out",
                f"benchmarks/validation/{folder.name}/summary.json",
                " ".join(w["overrides"]),
            )
        )
    return out


# Library kernels by the call that launches them: a profile names the cuBLAS / cuDNN kernel,
# not the program's instruction, so they are compared as a group per kind of call.
_LIBRARY_UNITS = (
    ("cuDNN attention (forward)", ("__cudnn$fmhaSoftmax",), re.compile(r"sdpa.*fprop")),
    (
        "cuDNN attention (backward)",
        ("__cudnn$fmhaSoftmaxBackward",),
        re.compile(r"sdpa.*bprop|compute_dot_do_o|convert_dq"),
    ),
    (
        "cuDNN convolutions",
        (
            "__cudnn$convForward",
            "__cudnn$convBiasActivationForward",
            "__cudnn$convBackwardInput",
            "__cudnn$convBackwardFilter",
        ),
        re.compile(r"xmma_(fprop|dgrad|wgrad)|cudnn|nhwc|Conv"),
    ),
    ("cuBLAS GEMMs", ("__cublas$lt$matmul", "__cublas$gemm"), re.compile(r"^nvjet|cublas|gemm|^sm\d+_xmma_gemm")),
)
_NOT_PROGRAM = re.compile(r"^(Memcpy|Memset|memcpy|memset)")


def _profile_name(kernel: Kernel) -> str:
    return kernel.name.replace(".", "_").replace("-", "_")


def _library_unit(name: str, calls: set[str]) -> str | None:
    """The group of a profile's library kernel: the first whose calls the program makes and
    whose pattern the name matches (a convolution program's nvjet kernels are cuDNN's)."""
    for unit, targets, pattern in _LIBRARY_UNITS:
        if calls & set(targets) and pattern.search(name):
            return unit
    conv = _LIBRARY_UNITS[2]
    if calls & set(conv[1]):
        return conv[0]
    return None


def kernel_units(folder: Path, workload: str, rates: Rates) -> list[KernelUnit]:
    """A stored profile's kernels beside the program's predicted kernels, largest first.

    A fusion kernel is matched by name with every fusion of the program that shares its
    code (:attr:`xlafit.predict.ops.Kernel.signature`); library kernels by group
    (:data:`_LIBRARY_UNITS`); copies and memsets the runtime adds are left out.
    """
    folder = Path(folder)
    measured: dict[str, list[float]] = json.loads(gzip.open(folder / "kernels.json.gz", "rt").read())[workload]
    prediction = predict(_kernels(folder / f"{workload}.hlo.txt.gz"), rates)
    by_signature: dict[str, list] = {}
    for t in prediction.kernels:
        if t.kernel.kind != "wait":
            by_signature.setdefault(t.kernel.signature or t.kernel.name, []).append(t)
    signature_of = {_profile_name(t.kernel): t.kernel.signature or t.kernel.name for t in prediction.kernels}
    calls = {t.kernel.target for t in prediction.kernels if t.kernel.target.startswith("__")}
    groups: dict[str, list[float]] = {}
    claimed: dict[str, str] = {}  # signature -> unit
    for name, (us, _) in measured.items():
        if _NOT_PROGRAM.match(name):
            continue
        if name in signature_of:
            unit = claimed.setdefault(signature_of[name], name)
        else:
            unit = _library_unit(name, calls) or "other library kernels"
        groups.setdefault(unit, [0.0])[0] += us * 1e-6
    predicted: dict[str, list] = {}
    for signature, times in by_signature.items():
        target = times[0].kernel.target
        unit = claimed.get(signature) or next(
            (u for u, targets, _ in _LIBRARY_UNITS if target in targets), "not in the profile"
        )
        predicted.setdefault(unit, []).extend(times)
    units = []
    for unit in set(groups) | set(predicted):
        times = predicted.get(unit, [])
        kinds = tuple(sorted({t.kernel.kind for t in times}))
        units.append(
            KernelUnit(
                unit,
                groups.get(unit, [0.0])[0],
                sum(t.total for t in times),
                kinds,
                sum(t.kernel.count for t in times),
            )
        )
    return sorted(units, key=lambda u: -u.measured_s)


def covering(units: Sequence[KernelUnit], share: float = 0.8) -> list[KernelUnit]:
    """The largest measured units that together make up ``share`` of the measured time."""
    total = sum(u.measured_s for u in units)
    out, running = [], 0.0
    for u in units:
        if running >= share * total:
            break
        out.append(u)
        running += u.measured_s
    return out


# ---------------------------------------------------------------------------- TPUs


def tpu_runs(folder: Path) -> list[dict]:
    """The published runs with the programs compiled for them (``<id>.json``)."""
    folder = Path(folder)
    out = []
    for run in json.loads((folder / "runs.json").read_text())["runs"]:
        record = folder / f"{run['id']}.json"
        if record.exists():
            compiled = json.loads(record.read_text())
            if compiled.get("programs"):
                out.append({**run, "compiled": compiled})
    return out


@cache
def _kernels(path: Path) -> list[Kernel]:
    return kernels(_hlo(path), signatures=True)


def tpu_program_kernels(folder: Path, run: dict) -> list[tuple[int, list[Kernel]]]:
    """``(sequences per chip, kernels)`` of each program compiled for a run."""
    return [(p["batch"], _kernels(Path(folder) / p["file"])) for p in run["compiled"]["programs"]]


def tpu_step(folder: Path, run: dict, rates: Rates) -> float:
    """The predicted step of a published run: its own program's, or the line through the two
    programs at smaller batches, at its batch. Near the HBM's capacity the compiler
    rematerialises more (more FLOPs per sequence): then the program with fewer FLOPs per
    sequence alone, in proportion to the batch."""
    target = parse_targets(run["target"])[0]
    programs = tpu_program_kernels(folder, run)
    points = [(batch, predict(ks, rates, target.ici_bandwidth, target.num_devices).seconds) for batch, ks in programs]
    if len(points) == 1:
        batch, seconds = points[0]
        return seconds * run["batch"] / batch
    per_sequence = [sum(k.flops * k.count for k in ks) / batch for batch, ks in programs]
    if max(per_sequence) > 1.02 * min(per_sequence):
        batch, seconds = points[per_sequence.index(min(per_sequence))]
        return seconds * run["batch"] / batch
    (b1, s1), (b2, s2) = sorted(points)
    return s1 + (run["batch"] - b1) * (s2 - s1) / (b2 - b1)


def _generation(run: dict) -> str:
    return parse_targets(run["target"])[0].generation.name


def tpu_rates(generation: str, mxu: float, hbm: float, sources: dict[str, str]) -> Rates:
    """A TPU generation's row: its datasheet figures (per JAX device) scaled by the fitted
    efficiencies."""
    g = GENERATIONS[generation]
    per_device = 1 if g.megacore else g.cores_per_chip
    kind = g.device_kinds[0]
    return Rates(
        kind,
        mxu * g.bf16_tflops * 1e12 / per_device,
        (128, 128),
        1,
        hbm * g.hbm_gbps * 1e9 / per_device,
        None,
        0.0,
        sources=sources,
    )


def _fit_tpu_errors(folder: Path, runs: Sequence[dict], mxu: dict[str, float], hbm: float) -> list[float]:
    return [
        math.log(tpu_step(folder, run, tpu_rates(_generation(run), mxu[_generation(run)], hbm, {})) / run["step_s"])
        for run in runs
    ]


def fit_tpu(folder: Path, fitted: Iterable[str]) -> dict[str, Rates]:
    """TPU rows fitted to the published runs named in ``fitted``: per generation the matrix
    units' share of peak, and shared by all generations the share of HBM bandwidth, searched
    on a grid for the least squared log error of the predicted steps."""
    chosen = [r for r in tpu_runs(folder) if r["id"] in set(fitted)]
    if not chosen:
        raise ValueError("no compiled published runs to fit")
    generations = sorted({_generation(r) for r in chosen})
    best: tuple[float, dict[str, float], float] | None = None
    for hbm in (0.5, 0.6, 0.7, 0.8, 0.9):
        mxu = {}
        for g in generations:
            mine = [r for r in chosen if _generation(r) == g]
            # The step is nearly proportional to 1 / mxu where products dominate: solve per
            # generation by bisection on the mean log error.
            lo, hi = 0.2, 1.0
            for _ in range(30):
                mid = (lo + hi) / 2
                mean = statistics.fmean(_fit_tpu_errors(folder, mine, {g: mid}, hbm))
                lo, hi = (mid, hi) if mean > 0 else (lo, mid)
            mxu[g] = (lo + hi) / 2
        error = sum(e * e for e in _fit_tpu_errors(folder, chosen, mxu, hbm))
        if best is None or error < best[0]:
            best = (error, mxu, hbm)
    assert best is not None
    _, mxu, hbm = best
    ids = ", ".join(sorted(r["id"] for r in chosen))
    return {
        g: tpu_rates(
            g,
            mxu[g],
            hbm,
            {
                "matmul_flops": f"{mxu[g]:.3f} x the datasheet's bf16 peak, fitted to published MaxText runs ({ids})",
                "hbm_bytes_per_s": f"{hbm:.2f} x the datasheet's HBM bandwidth, fitted to the same runs",
                "matmul_tile": "the MXU's 128 x 128",
                "vector_ops_per_s": "not modelled on TPUs: element-wise kernels are priced by their bytes",
                "kernel_s": "not modelled on TPUs",
                "collectives": "the slice's ICI from the hardware table (Target.ici_bandwidth)",
            },
        )
        for g in generations
    }


def tpu_rows(rows: Iterable[Rates]) -> dict[str, Rates]:
    """The TPU rows of a rates table by generation name (``v5e``), read from their device kinds."""
    out = {}
    for row in rows:
        for g in GENERATIONS.values():
            if row.device_kind in g.device_kinds:
                out[g.name] = row
    return out


def tpu_checks(folder: Path, rows: dict[str, Rates], fitted: Iterable[str]) -> list[Check]:
    """Every compiled published run against its prediction with ``rows`` (by generation)."""
    fitted = set(fitted)
    out = []
    for run in tpu_runs(folder):
        g = _generation(run)
        if g not in rows:
            continue
        predicted = tpu_step(folder, run, rows[g])
        extrapolated = len(run["compiled"]["programs"]) > 1 or run["compiled"]["programs"][0]["batch"] != run["batch"]
        note = run.get("approximation", "")
        if extrapolated:
            batches = ", ".join(str(p["batch"]) for p in run["compiled"]["programs"])
            note = "; ".join(x for x in (note, f"extrapolated from {batches} per chip (xlafit's does not fit)") if x)
        out.append(
            Check(
                run["id"],
                run["target"],
                run["step_s"],
                predicted,
                "fitted" if run["id"] in fitted else "held out",
                run["source"],
                note,
            )
        )
    return out


def band_of(
    checks: Sequence[Check], basis: str, fitted: int = 0, kinds: Mapping[str, Mapping[str, Any]] | None = None
) -> dict:
    """The held-out checks' band as ``rates.json`` stores it; with ``kinds`` (each check's
    family, params, devices and training, by id), the programs it was measured on, which a
    prediction must be like for the band to be quoted (:meth:`xlafit.predict.rates.Band.unlike`)."""
    held = [c for c in checks if c.role == "held out"]
    band = held_out_band([c.error for c in held], basis, fitted)
    if kinds is not None:
        population = tuple(Validated(c.id, step_s=c.measured_s, **kinds[c.id]) for c in held)
        band = dataclasses.replace(band, population=population)
    return dataclasses.asdict(band)


def predictions(folder: Path, workload: str, rates: Rates) -> StepPrediction:
    """The prediction of one stored GPU workload (for a report of its kernels)."""
    return predict(_kernels(Path(folder) / f"{workload}.hlo.txt.gz"), rates)
