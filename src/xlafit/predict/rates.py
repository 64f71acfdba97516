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
import os
from pathlib import Path
from typing import Any

from xlafit.errors import ConfigError
from xlafit.io.cache import cache_dir

__all__ = ["BUILT_IN", "CALIBRATION_ENV", "Band", "Rates", "calibration_dir", "load_rates", "rates_for", "save_rates"]

BUILT_IN = Path(__file__).with_name("rates.json")
CALIBRATION_ENV = "XLAFIT_CALIBRATION"  # a calibration file to use first (xlafit check/plan --calibration)


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
    """

    median: float
    worst: float
    steps: int
    basis: str
    fitted: int = 0

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
