"""Rates from measurements: the least-squares fits behind every row of ``rates.json`` and
every calibration file.

- :func:`fit_matmul`: the matrix rate and the tile of the wave model
  (:func:`xlafit.predict.model.wave_efficiency`) from timed products of several shapes;
- :func:`fit_stream`: the streaming bandwidth and the fixed cost per kernel from element-wise
  kernels of several sizes (time = fixed + bytes / bandwidth);
- :func:`fit_peak_stream`: the bandwidth of element-wise kernels that move more bytes per
  element than those (:func:`xlafit.predict.model.stream_rate`);
- :func:`held_out_band`: the error band of a row's predictions against measured steps.

Timings too close to a run's dispatch floor say nothing about the kernel (a product of
1024^3 timed from Python takes as long as one of 512^3): :func:`informative` keeps the rows
that took at least twice the fastest row of their file.

Example:
    >>> rows = [{"m": 4096, "n": 4096, "k": 4096, "s": 1.4e-4}, {"m": 8192, "n": 8192, "k": 8192, "s": 1.1e-3}]
    >>> flops, tile = fit_matmul(rows, units=8, tiles=((128, 128),))
    >>> round(flops / 1e12)
    991
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from xlafit.predict.model import wave_efficiency
from xlafit.predict.rates import Band

__all__ = ["TILES", "fit_matmul", "fit_peak_stream", "fit_stream", "held_out_band", "informative"]

# Output tiles the fit chooses among: the shapes GPU GEMM libraries and TPU MXUs work in.
TILES = ((128, 128), (128, 256), (256, 128), (256, 256), (64, 128))


def informative(rows: Sequence[dict], floor_factor: float = 2.0) -> list[dict]:
    """The rows whose time ``s`` is at least ``floor_factor`` x the fastest row's."""
    if not rows:
        return []
    floor = min(r["s"] for r in rows)
    return [r for r in rows if r["s"] >= floor_factor * floor]


def fit_matmul(
    rows: Iterable[dict],
    units: int,
    tiles: Sequence[tuple[int, int]] = TILES,
    bandwidth: float | None = None,
    itemsize: int = 2,
) -> tuple[float, tuple[int, int]]:
    """``(FLOP/s, tile)`` that best predict timed products ``{"m", "n", "k", "s"}`` (batch 1):
    for each tile, the rate that minimises the squared log error of
    ``2 m n k / (rate * wave_efficiency)``; the tile with the least error wins.

    With ``bandwidth`` (bytes/s, and the operands' ``itemsize``), each product is predicted
    as the step model prices it, the larger of that and its operands and result over the
    bandwidth: a product with a short contraction that streams its operands then says nothing
    about the matrix rate and does not pull it down."""
    rows = list(rows)
    if not rows:
        raise ValueError("no timed matrix products to fit")
    # Each product's time can be no less than its bytes over the bandwidth (0 without one).
    moved = [(r["m"] * r["k"] + r["k"] * r["n"] + r["m"] * r["n"]) * itemsize / (bandwidth or math.inf) for r in rows]
    best: tuple[float, float, tuple[int, int]] | None = None
    for tile in tiles:
        work = [
            2.0 * r["m"] * r["n"] * r["k"] / wave_efficiency((1, r["m"], r["n"], r["k"]), tile, units) for r in rows
        ]
        # Without a bandwidth, log(s) = log(work) - log(rate): the rate is the geometric mean.
        log_rate = statistics.fmean(math.log(w) - math.log(r["s"]) for w, r in zip(work, rows, strict=True))
        seconds = [r["s"] for r in rows]
        if bandwidth:
            log_rate = _fit_bounded(work, moved, seconds, log_rate)
        error = _squared_log_error(work, moved, seconds, log_rate)
        if best is None or error < best[0] - 1e-12:
            best = (error, math.exp(log_rate), tile)
    assert best is not None
    return best[1], best[2]


def _squared_log_error(
    work: Sequence[float], moved: Sequence[float], seconds: Sequence[float], log_rate: float
) -> float:
    """The squared log error of ``max(work / rate, moved)`` against the timed ``seconds``."""
    return sum(
        (math.log(max(w / math.exp(log_rate), t)) - math.log(s)) ** 2
        for w, t, s in zip(work, moved, seconds, strict=True)
    )


def _fit_bounded(work: Sequence[float], moved: Sequence[float], seconds: Sequence[float], start: float) -> float:
    """The log rate minimising the squared log error of ``max(work / rate, moved)`` against
    ``seconds``: a grid over a factor of 20 either side of ``start``, then a golden-section
    search between the best point's neighbours (each term is unimodal, the sum need not be)."""

    def error(log_rate: float) -> float:
        return _squared_log_error(work, moved, seconds, log_rate)

    step = 0.01
    grid = [start + step * i for i in range(-300, 301)]
    best = min(grid, key=error)
    low, high = best - step, best + step
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(40):
        x, y = high - ratio * (high - low), low + ratio * (high - low)
        if error(x) <= error(y):
            high = y
        else:
            low = x
    return (low + high) / 2


def fit_stream(rows: Iterable[dict]) -> tuple[float, float]:
    """``(bytes/s, fixed seconds)`` of ``time = fixed + bytes / bandwidth`` fitted by least
    squares to streaming kernels ``{"bytes", "s"}``; the fixed part is never negative."""
    points = [(float(r["bytes"]), float(r["s"])) for r in rows]
    if not points:
        raise ValueError("no timed streaming kernels to fit")
    if len(points) == 1:
        return points[0][0] / points[0][1], 0.0
    mean_b = statistics.fmean(b for b, _ in points)
    mean_s = statistics.fmean(s for _, s in points)
    spread = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (s - mean_s) for b, s in points) / spread if spread else 0.0
    fixed = mean_s - slope * mean_b
    if slope <= 0 or fixed < 0:  # through the origin instead
        slope = sum(b * s for b, s in points) / sum(b * b for b, _ in points)
        fixed = 0.0
    return 1.0 / slope, fixed


def fit_peak_stream(bandwidth: float, fixed: float, wide: Iterable[dict], gain: float = 1.05) -> float | None:
    """The fastest of the wider streams ``{"bytes", "s"}`` (after the ``fixed`` cost per
    kernel :func:`fit_stream` found), or None when none beats ``bandwidth`` by ``gain``: the
    device streams wide elements no faster, and the model keeps one bandwidth."""
    rates = [float(r["bytes"]) / max(float(r["s"]) - fixed, float(r["s"]) / 2) for r in wide]
    fastest = max(rates, default=0.0)
    return fastest if fastest > gain * bandwidth else None


def held_out_band(errors: Sequence[float], basis: str, fitted: int = 0) -> Band:
    """The band of relative errors ``predicted / measured - 1`` of held-out steps."""
    if not errors:
        raise ValueError("no held-out steps")
    magnitudes = sorted(abs(e) for e in errors)
    return Band(round(statistics.median(magnitudes), 4), round(magnitudes[-1], 4), len(errors), basis, fitted)
