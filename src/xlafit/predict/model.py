"""The step-time model: every kernel of a compiled program priced at a device's achievable
rates, summed along the program's schedule.

Per kernel (:func:`kernel_seconds`), the larger of what it computes and what it moves, plus a
fixed cost:

- a matrix product or convolution: its FLOPs over the matrix rate, spread over the device's
  compute units tile by tile (a last partial wave of tiles leaves units idle: a product of
  120 output tiles on 132 SMs runs at 120/132 of the rate); fused attention is priced as the
  batched products it runs;
- every kernel: its HBM bytes (read + written) over the streaming bandwidth (an element-wise
  kernel moving more bytes per element than the measured stream, and a matrix product's
  pipelined loads, faster: :func:`stream_rate`),
  and its element-wise work over the vector rate;
- ``kernel_s`` per launch.

A collective costs ``collective_s`` plus its bytes over the link (a ring: ``(n - 1) / n`` of
the array per pass, two passes for an all-reduce). An asynchronous collective (``-start`` /
``-done``) overlaps the kernels the schedule puts between its start and its end; only what
they do not cover adds to the step. An asynchronous copy between memories (a TPU's prefetch
into on-chip memory) shares the HBM with those kernels: it overlaps only the part of each
that is not moving its own bytes. A copy between HBM and the host's memory (host
offloading: ``model.remat=offload``) moves its bytes over the host link (a TPU generation's
``host_gbps``, :func:`xlafit.platform.hardware.table_host_bandwidth`, unless the rates hold
``host_bytes_per_s``), beside the kernels up to its wait as an asynchronous collective does.
Kernels inside a loop count once per trip.

Example:
    >>> from xlafit.predict.ops import Kernel
    >>> from xlafit.predict.rates import Rates
    >>> rates = Rates("demo", 1e12, (128, 128), 4, 1e11, 1e12, 1e-6)
    >>> k = Kernel("dot", "matmul", 1, flops=2 * 512 * 512 * 512, shape=(1, 512, 512, 512))
    >>> round(kernel_seconds(k, rates) * 1e3, 3)  # 16 tiles on 4 units: 4 full waves
    0.269
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from xlafit.platform.hardware import table_host_bandwidth
from xlafit.predict.ops import Kernel, kernels
from xlafit.predict.rates import Rates

__all__ = [
    "SPLIT_K",
    "KernelTime",
    "StepPrediction",
    "host_rate",
    "kernel_seconds",
    "predict",
    "stream_rate",
    "wave_efficiency",
]

# The shortest piece of a product's contraction that a split-K library kernel gives one unit.
SPLIT_K = 512
# Passes over (n - 1) / n of the array that a ring collective makes.
_PASSES = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2, "all-to-all": 1}


@dataclasses.dataclass(frozen=True)
class KernelTime:
    """One kernel's predicted time per execution and what bounds it."""

    kernel: Kernel
    seconds: float
    bound: str  # "compute", "memory", "vector", "link", "host", "launch"

    @property
    def total(self) -> float:
        return self.seconds * self.kernel.count


@dataclasses.dataclass
class StepPrediction:
    """The predicted step and how it is made up.

    Attributes:
        seconds: one run of the program (one call: ``steps_per_call`` steps).
        kernels: every kernel's predicted time.
        exposed_collective_s: the time of the collectives and host copies not hidden behind
            other kernels.
        rates: the rates used.
    """

    seconds: float
    kernels: list[KernelTime]
    exposed_collective_s: float
    rates: Rates

    def by_kind(self) -> dict[str, float]:
        """Seconds per kernel kind (collectives at their full time, overlapped or not)."""
        out: dict[str, float] = {}
        for k in self.kernels:
            out[k.kernel.kind] = out.get(k.kernel.kind, 0.0) + k.total
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def top(self, n: int = 10) -> list[KernelTime]:
        return sorted(self.kernels, key=lambda k: -k.total)[:n]

    @property
    def launches(self) -> int:
        return sum(k.kernel.count for k in self.kernels if k.kernel.kind != "wait")


def wave_efficiency(shape: Sequence[int], tile: tuple[int, int], units: int) -> float:
    """The share of ``units`` busy over a product's waves of output tiles: ``(batch, m, n,
    k)`` makes ``batch * ceil(m / tm) * ceil(n / tn)`` tiles (padding a partial tile counts
    as work), run ``units`` at a time. A product with fewer tiles than units splits its
    contraction into chunks of at least :data:`SPLIT_K` (as cuBLAS, cuDNN and XLA's Triton
    GEMMs do), each chunk a tile of its own.

    Example:
        >>> round(wave_efficiency((1, 4096, 4096, 4096), (128, 256), 132), 3)  # 512 tiles, 4 waves
        0.97
        >>> round(wave_efficiency((1, 64, 147, 3211264), (128, 256), 132), 3)  # split 132 ways
        0.287
    """
    if len(shape) != 4:
        return 1.0
    batch, m, n, k = shape
    tm, tn = tile
    tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
    if tiles == 0:
        return 1.0
    split = max(1, min(units // tiles, k // SPLIT_K))
    waves = math.ceil(tiles * split / units)
    return (batch * m * n * split) / (waves * units * tm * tn)


Link = Callable[[int], float | None] | float | None


def kernel_seconds(kernel: Kernel, rates: Rates, link: Link = None, devices: int = 1) -> float:
    """One execution of ``kernel`` at ``rates`` (see the module docstring)."""
    return _price(kernel, rates, link, devices)[0]


def host_rate(rates: Rates) -> float:
    """Bytes/s between a device and its host's memory: the rates' own figure, else the
    hardware table's for the device kind, else the HBM's (no figure: a GPU, a CPU).

    Example:
        >>> host_rate(Rates("TPU v5 lite", 1e14, (128, 128), 1, 5e11, None, 0.0)) / 1e9
        31.5
    """
    found = table_host_bandwidth(rates.device_kind)
    return rates.host_bytes_per_s or (found[0] if found else rates.hbm_bytes_per_s)


def _price(kernel: Kernel, rates: Rates, link: Link, devices: int) -> tuple[float, str]:
    if kernel.kind == "wait":
        return 0.0, "launch"
    if kernel.kind == "host":
        return kernel.bytes / host_rate(rates), "host"
    if kernel.kind == "transfer":
        return kernel.bytes / rates.hbm_bytes_per_s, "memory"
    if kernel.kind == "collective":
        group = kernel.group or devices  # no replica groups: all devices
        if group == 1:
            return 0.0, "link"
        bandwidth = (link(group) if callable(link) else link) or rates.link_bytes_per_s
        if not bandwidth:
            return rates.collective_s, "link"
        share = 1.0 if kernel.target == "collective-permute" else _PASSES.get(kernel.target, 1) * (group - 1) / group
        return rates.collective_s + share * kernel.moved / bandwidth, "link"
    parts = {"memory": kernel.bytes / stream_rate(kernel, rates)}
    if rates.vector_ops_per_s:
        parts["vector"] = kernel.vector / rates.vector_ops_per_s
    if kernel.flops:
        efficiency = wave_efficiency(kernel.shape, rates.matmul_tile, rates.units)
        parts["compute"] = kernel.flops / (rates.matmul_flops * efficiency)
    bound = max(parts, key=lambda p: parts[p])
    return parts[bound] + rates.kernel_s, bound if parts[bound] > rates.kernel_s else "launch"


def stream_rate(kernel: Kernel, rates: Rates) -> float:
    """The bandwidth ``kernel`` streams HBM at.

    A loop kernel keeps as many loads in flight as each thread touches bytes per element
    (every operand and output of the element), and a memory system gives bandwidth in
    proportion to the bytes in flight up to its peak (Little's law): on an H200, an
    element-wise kernel moving 4 bytes per element (a bf16 in, a bf16 out) streams about
    two-thirds as fast as one moving 8 or more. Where a row has measured streams of several
    widths (``stream_bytes_per_element``, ``hbm_peak_bytes_per_s``), an element-wise kernel
    wider than the reference stream gets ``hbm_bytes_per_s`` scaled by its width, up to the
    peak. A matrix product loads its operands tile by tile through a pipeline of several
    stages (cuBLAS's, cuDNN's and XLA's Triton GEMMs: ``num_stages`` in a fusion's config),
    tens of kilobytes in flight per unit: one bound by its bytes (a float32 operand read for
    a short contraction) streams at the peak. Every other kernel, and every kernel of a row
    without the wider streams, ``hbm_bytes_per_s``.

    Example:
        >>> row = Rates("GPU", 1e15, (128, 128), 100, 3e12, None, 0.0, stream_bytes_per_element=4,
        ...             hbm_peak_bytes_per_s=4.5e12)
        >>> wide = Kernel("convert", "elementwise", 1, bytes_read=4e6, bytes_written=2e6, elements=10**6)
        >>> stream_rate(wide, row) / 1e12  # 6 bytes per element: 1.5 x the 4-byte stream's rate
        4.5
        >>> stream_rate(Kernel("dot", "matmul", 1, bytes_read=1e9), row) / 1e12
        4.5
    """
    if kernel.kind == "matmul" and rates.hbm_peak_bytes_per_s:
        return rates.hbm_peak_bytes_per_s
    if kernel.kind != "elementwise" or not kernel.elements or not rates.stream_bytes_per_element:
        return rates.hbm_bytes_per_s
    width = kernel.bytes / kernel.elements
    rate = rates.hbm_bytes_per_s * max(1.0, width / rates.stream_bytes_per_element)
    return min(rate, rates.hbm_peak_bytes_per_s or rate)


def _advance(running: dict[str, float], copies: set[str], seconds: float, spare: float) -> None:
    """What one kernel of ``seconds`` leaves of the asynchronous work beside it: each
    collective and host copy runs ``seconds`` on (the link is its own); the copies take the HBM time the
    kernel leaves ``spare`` one after another, oldest first (they share the one HBM)."""
    for name in running:
        if name in copies:
            step = min(running[name], spare)
            running[name] -= step
            spare -= step
        else:
            running[name] = max(0.0, running[name] - seconds)


def predict(program: str | list[Kernel], rates: Rates, link: Link = None, devices: int = 1) -> StepPrediction:
    """The predicted time of one run of a compiled program.

    Args:
        program: the optimised HLO text (``compiled.as_text()``), or its kernels.
        rates: the device's achievable rates (:func:`xlafit.predict.rates.rates_for`).
        link: the collectives' bandwidth per device when the rates hold none: bytes/s, or a
            function of the group's size (a TPU slice's ICI:
            :meth:`xlafit.platform.hardware.Target.ici_bandwidth`).
        devices: the program's devices (the group of a collective that names none).
    """
    found = kernels(program) if isinstance(program, str) else program
    times = [KernelTime(k, *_price(k, rates, link, devices)) for k in found]

    # Along the schedule: an asynchronous collective or copy runs beside the kernels until
    # its wait; a copy only beside the time a kernel is not streaming HBM itself. A loop's
    # body may wait first and start after (a prefetch for the next trip): what is left of
    # such a one at the body's end runs on beside the body's first kernels, up to its wait.
    def spare(t: KernelTime) -> float:  # the time a kernel leaves the HBM to the copies beside it
        return t.seconds - min(t.seconds, t.kernel.bytes / stream_rate(t.kernel, rates))

    running: dict[str, float] = {}
    counts: dict[str, int] = {}
    copies: set[str] = set()
    early: dict[str, int] = {}  # waits met before their start, at their place in the listing
    exposed = 0.0
    busy = 0.0
    for at, t in enumerate(times):
        k = t.kernel
        if k.asynchronous:
            running[k.name], counts[k.name] = t.seconds, k.count
            if k.kind == "transfer":
                copies.add(k.name)
            continue
        if k.kind == "wait":
            if k.target in running:
                exposed += running.pop(k.target) * k.count
            else:
                early[k.target] = at
            continue
        if k.kind == "collective":
            exposed += t.total
            continue
        busy += t.total
        _advance(running, copies, t.seconds, spare(t))
    for name, left in running.items():
        if name in early:  # into the next trip: the same loop's kernels before its wait
            for t in times[: early[name]]:
                if t.kernel.count == counts[name] and not t.kernel.asynchronous and t.kernel.kind != "wait":
                    left = max(0.0, left - (spare(t) if name in copies else t.seconds))
        exposed += left * counts[name]  # started and never waited for in the listing: once per start
    return StepPrediction(busy + exposed, times, exposed, rates)
