"""Achievable rates per device kind: what the step model (:mod:`xlafit.predict.model`) prices
kernels with, one row per device, each figure with where it comes from.

A datasheet peak is what a device cannot exceed; a training step's kernels run well below it
(an H200's large bf16 products at 87 % of its 989 TFLOP/s, its streaming kernels at 70 % of
its 4.8 TB/s). The rows hold what was *measured* on the device (its micro-benchmarks: a GPU
row, or a calibration file ``xlafit bench --calibrate`` wrote) or *fitted* to published
measured steps (the TPU rows, no TPU being at hand), and each row says which, with the error
its predictions showed against measured steps (:class:`Band`).

The built-in rows live in ``rates.json`` beside this module. A calibration file has the same
format, one row; :func:`rates_for` prefers a calibration of the device kind in the user
cache (``<cache>/calibration/``) over the built-in row, and says which it used.

Example:
    >>> row = rates_for("NVIDIA H200")
    >>> row.origin, round(row.matmul_flops / 1e12)
    ('built-in', 830)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from xlafit.errors import ConfigError
from xlafit.io.cache import cache_dir

__all__ = [
    "BUILT_IN",
    "CALIBRATION_ENV",
    "LIKE_DEVICES",
    "LIKE_PARAMS",
    "LIKE_STEP",
    "Band",
    "Kind",
    "Rates",
    "Validated",
    "calibration_dir",
    "load_rates",
    "parameter_count",
    "rates_for",
    "save_rates",
]

BUILT_IN = Path(__file__).with_name("rates.json")
CALIBRATION_ENV = "XLAFIT_CALIBRATION"  # a calibration file to use first (xlafit check/plan --calibration)


# When a program is like the steps a band was measured on (Band.unlike): its step time and
# parameter count within the validated range widened by these factors either way, and its
# devices within LIKE_DEVICES of it (the same order of magnitude); the same device kind (the
# band is its row's), a model family and a kind of training (full, LoRA) that were measured.
LIKE_STEP = 2.0
LIKE_PARAMS = 2.0
LIKE_DEVICES = 4.0


@dataclasses.dataclass(frozen=True)
class Validated:
    """One measured step a band comes from: what program it was.

    Attributes:
        id: the step's name in the validation data (``benchmarks/validation``).
        family: the recipe (``llm``, ``bert``, ``resnet``): the kind of model.
        params: the model's parameter count.
        devices: the JAX devices the step ran on.
        step_s: the measured step.
        training: ``full`` or ``lora``.

    Every step a band records is a train step: a program a run compiles beside it (a rollout's
    generation) is never like them.
    """

    id: str
    family: str
    params: int
    devices: int
    step_s: float
    training: str = "full"


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a prediction is for, to hold against a band's population (:meth:`Band.unlike`):
    the model family (None: a user's own model), its parameter count, the devices, the
    predicted step, the kind of training and the program (a train step, or a program a run
    compiles beside it: a rollout's generation)."""

    family: str | None
    params: int | None
    devices: int
    step_s: float
    training: str = "full"
    program: str = "train step"


def parameter_count(model: Any) -> int:
    """The parameters of an ``nnx.Module``, concrete or abstract (``nnx.Param``: a LoRA
    run's frozen base and its adapters included), for a :class:`Kind`. A quantized layer
    (``qvalue`` codes, ``scale`` per block, ``qtype``) counts the weights it stands for, not
    its storage: two 4-bit codes a byte, scales no parameter."""
    stored = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and hasattr(node, "qtype") and hasattr(node, "qvalue"):
            codes, scales = (int(math.prod(getattr(node, k).get_value().shape)) for k in ("qvalue", "scale"))
            stored += codes * (1 if node.qtype == "int8" else 2) - codes - scales
    return stored


def _params(n: float) -> str:
    """``n`` parameters in three digits, in billions from what rounds to 1,000 millions.

    Example:
        >>> _params(999.9e6), _params(999.4e6), _params(32.9e9)
        ('1B', '999M', '32.9B')
    """
    return f"{n / 1e9:.3g}B" if n >= 999.5e6 else f"{n / 1e6:.3g}M"


def _seconds(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _range(values: Iterable[float], show: Callable[[float], str]) -> str:
    """``34.1B-69B``: the smallest and the largest, each as ``show`` writes it."""
    lo, hi = show(min(values := list(values))), show(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


@dataclasses.dataclass(frozen=True)
class Band:
    """How far predictions with a row's rates were from measured steps.

    Attributes:
        median: the median of |predicted / measured - 1| over the steps held out of the fit.
        worst: the largest of them.
        steps: how many measured steps the figures come from.
        basis: what they were: ``measured`` (steps timed on this device kind, none used in the
            fit) or ``published`` (steps others measured and published, held out of the fit).
        fitted: how many further published steps the row's rates were fitted to (0: the rates
            come from micro-benchmarks alone).
        population: what the steps held out were (:class:`Validated`); empty: not recorded
            (a calibration file's), and the band is quoted for every program.
    """

    median: float
    worst: float
    steps: int
    basis: str
    fitted: int = 0
    population: tuple[Validated, ...] = ()

    def validated_on(self) -> str:
        """What the band was measured on, in a line: ``2 published steps: llm (full
        training), 34.1B-69B parameters, 256 devices, steps of 12.5-15.1 s``."""
        p = self.population
        if not p:
            return f"{self.steps} {self.basis} steps (not described)"
        families = ", ".join(dict.fromkeys(v.family for v in p))
        training = " and ".join(dict.fromkeys(v.training for v in p))
        return (
            f"{len(p)} {self.basis} steps: {families} ({training} training), "
            f"{_range((v.params for v in p), _params)} parameters, {_range((v.devices for v in p), str)} "
            f"device{'s' if max(v.devices for v in p) > 1 else ''}, "
            f"steps of {_range((v.step_s for v in p), _seconds)}"
        )

    def unlike(self, kind: Kind) -> list[str]:
        """How ``kind`` differs from the programs the band was measured on, by the rule of
        :data:`LIKE_STEP`, :data:`LIKE_PARAMS`, :data:`LIKE_DEVICES`; empty: like them (or
        no population is recorded)."""
        p = self.population
        if not p:
            return []
        out = []
        if kind.program != "train step":  # the population's are all train steps (Validated)
            out.append(f"the {kind.program}, not a train step")
        if kind.family not in {v.family for v in p}:
            out.append(f"a {kind.family} model" if kind.family else "a model of your own")
        if kind.training not in {v.training for v in p}:
            out.append(f"{kind.training.replace('lora', 'LoRA')} training")
        params = [v.params for v in p]
        if kind.params is not None and not min(params) / LIKE_PARAMS <= kind.params <= max(params) * LIKE_PARAMS:
            out.append(f"{_params(kind.params)} parameters")
        devices = [v.devices for v in p]
        if not min(devices) / LIKE_DEVICES <= kind.devices <= max(devices) * LIKE_DEVICES:
            out.append(f"{kind.devices} device{'s' if kind.devices != 1 else ''}")
        steps = [v.step_s for v in p]
        if not min(steps) / LIKE_STEP <= kind.step_s <= max(steps) * LIKE_STEP:
            out.append(f"a step of {_seconds(kind.step_s)}")
        return out

    def describe(self, kind: str) -> str:
        """``±9 % (worst 14 %) over 3 measured steps on NVIDIA H200``."""
        where = "measured steps" if self.basis == "measured" else "published steps held out of the fit"
        fitted = f"; rates fitted to {self.fitted} other published steps" if self.fitted else ""
        return f"±{self.median:.0%} (worst {self.worst:.0%}) over {self.steps} {where} on {kind}{fitted}"


@dataclasses.dataclass(frozen=True)
class Rates:
    """What one device achieves, for :func:`xlafit.predict.model.predict`.

    Attributes:
        device_kind: the name ``jax.Device.device_kind`` reports (matched as a substring,
            the longest match winning: "TPU v5 lite", "NVIDIA H200").
        matmul_flops: FLOP/s of large bf16 matrix products (all units busy).
        matmul_tile: the output tile one compute unit works on at a time; a product's tiles
            spread over ``units`` in waves, and a last partial wave leaves units idle.
        units: compute units the tiles spread over (a GPU's SMs; a TPU core's MXUs count as one).
        hbm_bytes_per_s: bytes/s a kernel streaming large arrays reads plus writes.
        vector_ops_per_s: element-wise float adds per second (:data:`xlafit.predict.ops.VECTOR_COST`);
            None: element-wise kernels are priced by their bytes alone.
        kernel_s: fixed time per kernel: its launch and the ramp of its first and last wave.
        collective_s: fixed time per collective (latency of the link).
        link_bytes_per_s: bytes/s per device over the link collectives use; None: the hardware
            table's ICI figure for the slice.
        stream_bytes_per_element: the bytes per element of the streams ``hbm_bytes_per_s``
            was measured on (4: a bf16 read and written); with ``hbm_peak_bytes_per_s``, wider
            element-wise kernels stream faster (:func:`xlafit.predict.model.stream_rate`).
        hbm_peak_bytes_per_s: the fastest measured stream of the wider ones; None: not
            measured, every kernel streams at ``hbm_bytes_per_s``.
        host_bytes_per_s: bytes/s a copy between HBM and the host's memory moves (host
            offloading); None: the hardware table's host link for the device kind.
        sources: for each field above, where its value comes from.
        band: the measured error of predictions made with this row, None if never held
            against a measured step.
        origin: ``built-in`` or the calibration file's path.
    """

    device_kind: str
    matmul_flops: float
    matmul_tile: tuple[int, int]
    units: int
    hbm_bytes_per_s: float
    vector_ops_per_s: float | None
    kernel_s: float
    collective_s: float = 0.0
    link_bytes_per_s: float | None = None
    stream_bytes_per_element: float | None = None
    hbm_peak_bytes_per_s: float | None = None
    host_bytes_per_s: float | None = None
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    band: Band | None = None
    origin: str = "built-in"

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("origin")
        out["matmul_tile"] = list(self.matmul_tile)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], origin: str) -> Rates:
        known = {f.name for f in dataclasses.fields(cls)} - {"origin"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}; a rates row has {sorted(known)}")
        band = data.get("band")
        if band:
            band = {**band, "population": tuple(Validated(**v) for v in band.get("population", ()))}
        return cls(
            **{
                **data,
                "matmul_tile": tuple(data["matmul_tile"]),
                "band": Band(**band) if band else None,
                "origin": origin,
            }
        )

    def describe_band(self) -> str:
        """The error band as the output prints it, or what is missing."""
        if self.band is None:
            return f"error unknown: {self.device_kind}'s rates were never held against a measured step"
        return self.band.describe(self.device_kind)

    def band_for(self, kind: Kind) -> tuple[str, float | None]:
        """The error band as quoted for a prediction of ``kind``, and its median: the band
        where ``kind`` is like the programs it was measured on (:meth:`Band.unlike`), else
        "not validated for this kind of program" with what differs and what it was measured
        on, and no median."""
        if self.band is None:
            return self.describe_band(), None
        reasons = self.band.unlike(kind)
        if reasons:
            return (
                f"not validated for this kind of program ({', '.join(reasons)}); validated on: "
                f"{self.band.validated_on()} on {self.device_kind}",
                None,
            )
        measured = f"; validated on: {self.band.validated_on()}" if self.band.population else ""
        return self.describe_band() + measured, self.band.median


def load_rates(path: Path | str) -> list[Rates]:
    """The rows of a rates file: the built-in table (a list) or a calibration file (one row)."""
    path = Path(path)
    data = json.loads(path.read_text())
    rows = data if isinstance(data, list) else [data]
    origin = "built-in" if path == BUILT_IN else str(path)
    try:
        return [Rates.from_json(row, origin) for row in rows]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a rates file: {e}") from e


def save_rates(rates: Rates, path: Path | str) -> Path:
    """Writes one row as a calibration file (JSON, a few hundred bytes: shareable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rates.to_json(), indent=1) + "\n")
    return path


def calibration_dir() -> Path:
    """Where ``xlafit bench --calibrate`` writes, and where :func:`rates_for` looks first."""
    return cache_dir() / "calibration"


def _match(rows: list[Rates], device_kind: str) -> Rates | None:
    hits = [r for r in rows if r.device_kind.lower() in device_kind.lower()]
    return max(hits, key=lambda r: len(r.device_kind)) if hits else None


def rates_for(device_kind: str, calibration: Path | str | None = None) -> Rates | None:
    """The rates for ``device_kind``: a given calibration file (or ``$XLAFIT_CALIBRATION``)
    if it holds that kind, else one in :func:`calibration_dir`, else the built-in row; None if
    there is none."""
    calibration = calibration or os.environ.get(CALIBRATION_ENV)
    if calibration:
        try:
            given = load_rates(calibration)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"calibration {calibration} ({CALIBRATION_ENV} or --calibration): {e}; give a file xlafit bench "
                "--calibrate wrote, or unset it."
            ) from None
        found = _match(given, device_kind)
        if found is not None:
            return found
    folder = calibration_dir()
    if folder.is_dir():
        for path in sorted(folder.glob("*.json")):
            try:
                found = _match(load_rates(path), device_kind)
            except (OSError, ValueError):
                continue  # a broken file in the cache is not this device's calibration
            if found is not None:
                return found
    return _match(load_rates(BUILT_IN), device_kind)
