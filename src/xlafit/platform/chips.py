"""The one hardware table: TPU generations and GPUs, each row with the page its figures come from.

Each TPU generation's row (:data:`GENERATIONS`) and each GPU's (:data:`GPUS`, :data:`GPU_HBM`)
cites its source; :func:`peak_flops` (the denominator of MFU), ``xlafit check --tpu``'s
roofline and HBM verdicts, and the step model's host copies all read them here.
:data:`PRICES` gives a chip-hour's list price per generation.

Example:
    >>> GENERATIONS["v5e"].hbm_gib, GENERATIONS["v5e"].bf16_tflops
    (16, 197)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from xlafit.io.cache import cache_dir

# No Cloud TPU page (a generation's "system architecture") gives the rate of the link between
# a chip and its host. Every generation is given PCIe Gen4 x16's peak (PCI-SIG's PCIe 4.0 base
# specification: 16 GT/s per lane, 128b/130b encoding): an assumption, not a measurement, so a
# host copy priced at it is a lower bound on its time where the link is slower or shared.
HOST_LINK = "no published figure; PCIe Gen4 x16 assumed: 16 GT/s x 16 lanes x 128/130 / 8 bits = 31.5 GB/s each way"


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation's chip, from its Cloud TPU page (``source``).

    Attributes:
        name: the name in accelerator types (``v5e``) and topology names.
        cores_per_chip: TensorCores per chip.
        megacore: a chip's cores run as one JAX device (v4, v5p).
        name_counts: what the number of an accelerator type counts: ``cores`` or ``chips``.
        dims: dimensions of the slice's topology (2D torus or 3D).
        hbm_gib: HBM per chip, GiB.
        bf16_tflops: dense bf16 peak per chip.
        hbm_gbps: HBM bandwidth per chip, GB/s.
        device_kinds: what ``jax.Device.device_kind`` says on this generation.
        ici_gbps: bidirectional inter-chip interconnect (ICI) bandwidth per chip, GB/s, over
            all its ports; None where the generation's page does not give it.
        ici_ports: ICI ports per chip (one per torus neighbour: 4 in 2D, 6 in 3D).
        wraparound: the torus axis length from which a slice's axis closes into a ring; a
            shorter axis is a line (a bidirectional ring over a line moves half as much).
        host_chips: chips of the largest slice that is one VM (one JAX process): 8 for v5e
            and v6e (v5litepod-8 on ct5lp-hightpu-8t, v6e-8 on ct6e-standard-8t), 4 for the
            others (a v4-8 or v5p-8 is 4 chips on one host). Larger slices have 4 per host.
        pod_chips: chips of a whole pod, the largest slice (its page's system architecture):
            v2 256, v3 1,024, v4 4,096, v5e 256, v5p 8,960, v6e 256, TPU7x 9,216.
        host_gbps: bytes a chip moves between its HBM and its host's memory, GB/s each way
            (host offloading's copies); ``host_source`` says where the figure comes from.
    """

    name: str
    cores_per_chip: int
    megacore: bool
    name_counts: str
    dims: int
    hbm_gib: float
    bf16_tflops: float
    hbm_gbps: float
    source: str
    device_kinds: tuple[str, ...] = ()
    ici_gbps: float | None = None
    ici_ports: int = 4
    wraparound: int = 16
    host_chips: int = 4
    pod_chips: int = 256
    host_gbps: float = 31.5
    host_source: str = ""

    def __post_init__(self) -> None:
        if not self.host_source:
            object.__setattr__(self, "host_source", HOST_LINK)


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v2", 2, False, "cores", 2, 16, 45, 600, "cloud.google.com/tpu/docs/v2", ("TPU v2",)),
        Generation(
            "v3", 2, False, "cores", 2, 32, 123, 900, "cloud.google.com/tpu/docs/v3", ("TPU v3",), pod_chips=1024
        ),
        Generation(
            "v4",
            2,
            True,
            "cores",
            3,
            32,
            275,
            1200,
            "cloud.google.com/tpu/docs/v4",
            ("TPU v4",),
            None,
            6,
            4,
            pod_chips=4096,
        ),
        Generation(
            "v5e",
            1,
            False,
            "chips",
            2,
            16,
            197,
            819,
            "cloud.google.com/tpu/docs/v5e",
            ("TPU v5 lite", "TPU v5e"),
            400,
            host_chips=8,
        ),
        Generation(
            "v5p",
            2,
            True,
            "cores",
            3,
            95,
            459,
            2765,
            "cloud.google.com/tpu/docs/v5p",
            ("TPU v5p", "TPU v5"),
            1200,
            6,
            4,
            pod_chips=8960,
        ),
        Generation(
            "v6e",
            1,
            False,
            "chips",
            2,
            32,
            918,
            1638,
            "cloud.google.com/tpu/docs/v6e",
            ("TPU v6 lite", "TPU v6e"),
            800,
            host_chips=8,
        ),
        Generation(
            "tpu7x",
            2,
            False,
            "cores",
            3,
            192,
            2307,
            7380,
            "cloud.google.com/tpu/docs/tpu7x",
            ("TPU7x",),
            1200,
            6,
            4,
            pod_chips=9216,
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Price:
    """List price of one chip for an hour, USD (a slice costs its chips times this).

    ``spot`` is None where no Spot price was read. Prices differ by region (Spot prices by
    more than 2x between US regions) and change: ``xlafit plan --price v5e=0.9`` replaces a row
    for one plan.
    """

    on_demand: float
    spot: float | None
    source: str
    read: str  # when the row was read (YYYY-MM-DD)


# Prices per chip-hour, on-demand and Spot, in us-central1 (v4: us-central2, its only region),
# from Google's Cloud Billing Catalog API (the SKUs of usage type OnDemand and Preemptible) as
# SkyPilot's catalog machine-reads them every few hours (a slice's price over its chips):
# cloud.google.com/tpu/pricing itself could not be fetched where this table was written.
# The on-demand rows agree with the list prices that page publishes for its cheapest US regions.
_CATALOG = "Cloud Billing Catalog SKUs via github.com/skypilot-org/skypilot-catalog catalogs/v7/gcp/vms.csv @6f65ab5"
PRICES: dict[str, Price] = {
    "v4": Price(3.22, 0.9215, _CATALOG + ", us-central2-b: tpu-v4-8 (4 chips) 12.88, Spot 3.686", "2026-11-27"),
    "v5e": Price(1.20, 0.3468, _CATALOG + ", us-central1-a: tpu-v5litepod-8 9.6, Spot 2.7744", "2026-11-27"),
    "v5p": Price(4.20, 1.6422, _CATALOG + ", us-central1-a: tpu-v5p-8 (4 chips) 16.8, Spot 6.5688", "2026-11-27"),
    "v6e": Price(2.70, 0.7803, _CATALOG + ", us-central1-b: tpu-v6e-8 21.6, Spot 6.2424", "2026-11-27"),
}

# GPUs: dense bf16 TFLOP/s per device (sparsity excluded, as MaxText and nanoGPT count it).
GPUS: dict[str, tuple[float, str]] = {
    "A100": (312.0, "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense"),
    "H100 PCIe": (756.0, "NVIDIA H100 datasheet: PCIe 756 TFLOP/s bf16 dense (1513 sparse)"),
    "H100": (989.0, "NVIDIA H100 datasheet: SXM 989 TFLOP/s bf16 dense (1979 sparse)"),
    "H200": (989.0, "NVIDIA H200 datasheet: 989 TFLOP/s bf16 dense (1979 sparse)"),
}

# GPUs: HBM bandwidth per device, GB/s (the roofline's memory term on a GPU). The longest
# matching name wins, as for GPUS: JAX calls an H100 SXM "NVIDIA H100 80GB HBM3".
GPU_HBM: dict[str, tuple[float, str]] = {
    "A100-SXM4-40GB": (1555.0, "NVIDIA A100 datasheet: 40GB SXM 1,555 GB/s"),
    "A100-SXM4-80GB": (2039.0, "NVIDIA A100 datasheet: 80GB SXM 2,039 GB/s"),
    "A100-PCIE-40GB": (1555.0, "NVIDIA A100 datasheet: 40GB PCIe 1,555 GB/s"),
    "A100 80GB PCIe": (1935.0, "NVIDIA A100 datasheet: 80GB PCIe 1,935 GB/s"),
    "H100 PCIe": (2000.0, "NVIDIA H100 datasheet: PCIe 2 TB/s"),
    "H100": (3350.0, "NVIDIA H100 datasheet: SXM 3.35 TB/s"),
    "H200": (4800.0, "NVIDIA H200 datasheet: 4.8 TB/s"),
}

# MFU = model FLOPs per second achieved / peak FLOP/s (PaLM, Chowdhery et al. 2022, app. B). A
# float32 model is measured against the same bf16 peak, so its MFU reads low by design. CPUs have
# no honest datasheet number, so their peak is a float32 matrix product measured on the spot.


def device_peaks() -> dict[str, tuple[float, str]]:
    """``device_kind`` -> (dense bf16 TFLOP/s per JAX device, source), from both tables.

    TPU v2/v3 show each of a chip's two TensorCores as a device, so the chip's peak is halved;
    v4 and v5p (megacore) and the single-core v5e/v6e chips are one device per chip.
    """
    out = dict(GPUS)
    for g in GENERATIONS.values():
        per_device = g.bf16_tflops / (1 if g.megacore else g.cores_per_chip)
        for kind in g.device_kinds:
            out[kind] = (per_device, f"{g.source}: {g.bf16_tflops:g} TFLOP/s per chip, {g.cores_per_chip} core(s)")
    return out


def table_peak(device_kind: str) -> tuple[float, str] | None:
    """``(peak FLOP/s, source)`` of one device from :func:`device_peaks`, or None.

    The longest matching name wins, so "H100 PCIe" is not read as "H100".

    Example:
        >>> table_peak("NVIDIA H100 80GB HBM3")[0]
        989000000000000.0
        >>> table_peak("cpu") is None
        True
    """
    peaks = device_peaks()
    matches = [name for name in peaks if name.lower() in device_kind.lower()]
    if not matches:
        return None
    tflops, source = peaks[max(matches, key=len)]
    return tflops * 1e12, source


def table_bandwidth(device_kind: str) -> tuple[float, str] | None:
    """``(HBM bytes/s, source)`` of one JAX device, from :data:`GENERATIONS` and
    :data:`GPU_HBM`, or None (a CPU: no row).

    Example:
        >>> table_bandwidth("NVIDIA H100 80GB HBM3")[0]
        3350000000000.0
        >>> table_bandwidth("TPU v4")[0]  # a megacore chip: one device
        1200000000000.0
    """
    rows = dict(GPU_HBM)
    for g in GENERATIONS.values():
        per_device = g.hbm_gbps / (1 if g.megacore else g.cores_per_chip)
        for kind in g.device_kinds:
            rows[kind] = (per_device, f"{g.source}: {g.hbm_gbps:g} GB/s per chip, {g.cores_per_chip} core(s)")
    matches = [name for name in rows if name.lower() in device_kind.lower()]
    if not matches:
        return None
    gbps, source = rows[max(matches, key=len)]
    return gbps * 1e9, source


def table_host_bandwidth(device_kind: str) -> tuple[float, str] | None:
    """``(bytes/s each way between one JAX device and its host's memory, source)`` of a TPU
    generation in :data:`GENERATIONS` (:data:`HOST_LINK`), or None (another kind of device).

    Example:
        >>> table_host_bandwidth("TPU v6 lite")[0] / 1e9
        31.5
        >>> table_host_bandwidth("TPU v3")[0] / 1e9  # two cores share a chip's link
        15.75
    """
    rows = {}
    for g in GENERATIONS.values():
        per_device = g.host_gbps / (1 if g.megacore else g.cores_per_chip)
        for kind in g.device_kinds:
            rows[kind] = (per_device * 1e9, f"{g.host_source}, per chip, {g.cores_per_chip} core(s)")
    matches = [name for name in rows if name.lower() in device_kind.lower()]
    return rows[max(matches, key=len)] if matches else None


def table_memory(device_kind: str) -> float | None:
    """HBM bytes of one JAX device of a TPU generation in :data:`GENERATIONS` (a core, or a
    megacore chip), per its datasheet, or None (another kind of device).

    Example:
        >>> table_memory("TPU v5 lite") / 2**30
        16.0
    """
    for g in GENERATIONS.values():
        if any(kind.lower() == device_kind.lower() for kind in g.device_kinds):
            return g.hbm_gib * 2**30 / (1 if g.megacore else g.cores_per_chip)
    return None


PEAK_FILE = "cpu-peak.json"  # in the user cache: the measured peak of each CPU and jaxlib


def _cpu_name() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _measure_cpu_peak(n: int, repeats: int) -> float:
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), jnp.float32), cpu)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


@functools.cache
def measured_cpu_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` float32 matrix product on this machine's CPU, all cores.

    The median of ``repeats`` timed products after one warm-up. Simulated CPU devices share
    these cores, so this is the peak of the whole machine, not of one simulated device.
    Measured once a machine (its six products take about a second of CPU): the peak is kept
    in the user cache (``cpu-peak.json``, by processor, the cores this process may use and
    jaxlib's version), so every later run, in this process or another, reports MFU against
    the same peak. Delete the file to measure again.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{_cpu_name()}, {cores} cores, jaxlib {jax.lib.__version__}, {n}^3 x {repeats}"
    path = cache_dir() / PEAK_FILE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), float) and known[key] > 0:
        return known[key]
    known[key] = peak = _measure_cpu_peak(n, repeats)
    with contextlib.suppress(OSError):  # a read-only cache: measured again by the next process
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{PEAK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)  # whole, for a process that reads it meanwhile
    return peak


def peak_flops(devices: list[jax.Device]) -> tuple[float, str]:
    """``(peak FLOP/s, how it was found)`` of ``devices`` together.

    Raises:
        LookupError: an accelerator missing from :data:`GENERATIONS` and :data:`GPUS`.
    """
    if devices[0].platform == "cpu":
        return measured_cpu_peak(), "float32 2048^3 matmul measured on this CPU (all cores)"
    found = table_peak(devices[0].device_kind)
    if found is None:
        raise LookupError(
            f"no peak FLOP/s known for {devices[0].device_kind!r}; add it to xlafit.platform.hardware.GPUS "
            "(or to a TPU generation's device_kinds)."
        )
    per_device, source = found
    return per_device * len(devices), f"{len(devices)} x {source}"
