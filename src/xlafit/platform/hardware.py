"""The one hardware table (TPU generations, GPUs), and TPU slices described for the compiler.

Each TPU generation's row (:data:`GENERATIONS`) and each GPU's (:data:`GPUS`) cites the page
its figures come from; :func:`peak_flops` (the denominator of MFU), ``xlafit check --tpu``'s
roofline and HBM verdicts all read them here.

With the ``libtpu`` wheel installed (``pip install 'xlafit[tpu]'``, the version ``jax[tpu]``
pins), ``jax.experimental.topologies.get_topology_desc`` describes the devices of any TPU
slice on a machine that has none, and ``jax.jit(f).lower(abstract args).compile()`` runs
the TPU compiler for them: the program a TPU would run, its per-core memory, and the
compiler's refusal when it does not fit. MaxText's ``train_compile.py`` does this for its own
models; :mod:`xlafit.check` does it for any model (``xlafit check TARGET --tpu v3-8``).

Targets are named as Cloud TPU names its accelerator types: ``v2-8``, ``v3-8``, ``v4-8``,
``v5e-8``, ``v5p-8``, ``v6e-8``, ``tpu7x-8``, and slices such as ``v4-32`` or ``v5e-256``.
The number counts TensorCores on v2, v3, v4, v5p and tpu7x (two per chip) and chips on v5e
and v6e (one core each); v4 and v5p run a chip's two cores as one device (megacore).
``colab`` and ``kaggle`` name the slices those notebook services attach (v5e-1, v5e-8).

Example:
    >>> target = parse_targets("v3-8")[0]
    >>> target.chips, target.devices_per_chip, target.topology
    (4, 2, 'v3:2x2')
    >>> round(target.hbm_bytes / 2**30)  # per device: one TensorCore of a v3 chip
    16
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import os
import platform
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from xlafit.errors import ConfigError

INSTALL = "pip install 'xlafit[tpu]'"
LIBTPU_MODULE = "libtpu"  # the wheel's module: where the TPU compiler comes from


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

# Device files of the accelerators JAX would use instead of the CPU.
TPU_DEVICES = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")  # TPU v2/v3; v4 and later
ACCELERATOR_DEVICES = ("/dev/nvidia[0-9]*", *TPU_DEVICES, "/dev/kfd")


def accelerator_present() -> bool:
    """True if this host has a GPU or TPU device file, so JAX may not pick the CPU."""
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


# The usual names, for the error message and the docs; any power-of-two size parses.
KNOWN = (
    "v2-8 v2-32 v3-8 v3-32 v4-8 v4-32 v5e-1 v5e-4 v5e-8 v5e-16 v5e-256 v5p-8 v5p-32 "
    "v6e-1 v6e-4 v6e-8 v6e-16 v6e-256 tpu7x-8"
).split()
# The TPUs that notebook services attach: Colab's TPU runtime is one v5e chip, Kaggle's a v5e-8.
# A report names the slice beside the alias ("colab = v5e-1"), so nobody has to remember it.
ALIASES = {"colab": "v5e-1", "kaggle": "v5e-8"}


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice by its accelerator-type name, and what one of its JAX devices has."""

    name: str
    generation: Generation
    chips: int

    @property
    def devices_per_chip(self) -> int:
        return 1 if self.generation.megacore else self.generation.cores_per_chip

    @property
    def num_devices(self) -> int:
        return self.chips * self.devices_per_chip

    @property
    def topology(self) -> str:
        """The topology name ``get_topology_desc`` takes, e.g. ``v5e:2x4`` or ``v4:2x2x1``."""
        return f"{self.generation.name}:{'x'.join(map(str, _shape(self.chips, self.generation.dims)))}"

    @property
    def hbm_bytes(self) -> float:
        """HBM of one JAX device (a core, or a megacore chip), per the datasheet."""
        return self.generation.hbm_gib * 2**30 / self.devices_per_chip

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s of one JAX device."""
        return self.generation.bf16_tflops * 1e12 / self.devices_per_chip

    @property
    def hbm_bandwidth(self) -> float:
        """HBM bytes/s of one JAX device."""
        return self.generation.hbm_gbps * 1e9 / self.devices_per_chip

    @property
    def host_bandwidth(self) -> float:
        """Bytes/s one JAX device moves to or from its host's memory (a chip's cores share its link)."""
        return self.generation.host_gbps * 1e9 / self.devices_per_chip

    @property
    def source(self) -> str:
        return self.generation.source

    @property
    def shape(self) -> tuple[int, ...]:
        """The slice's chips as a grid (``2x4`` for v5e-8)."""
        return _shape(self.chips, self.generation.dims)

    def ici_bandwidth(self, group: int) -> float | None:
        """Bytes/s each chip moves in a ring collective over ``group`` chips of this slice.

        The group is taken to lie along as few torus axes as hold it (a mesh axis of
        ``make_mesh`` follows the slice's grid); along each axis the chip uses its two ports,
        both ways: ``axes x 2 x ICI / ports``. An axis shorter than the generation's
        ``wraparound`` length is a line, not a ring, and moves half that. None: the
        generation's page gives no ICI figure.
        """
        g = self.generation
        if g.ici_gbps is None or group <= 1:
            return None
        per_axis = 2 * g.ici_gbps * 1e9 / g.ici_ports
        total, held = 0.0, 1
        for length in sorted(self.shape, reverse=True):
            if held >= group or length == 1:
                break
            total += per_axis * (1.0 if length >= g.wraparound else 0.5)
            held *= length
        return total or None

    def price_per_hour(self, spot: bool = False, prices: dict[str, Price] | None = None) -> float | None:
        """USD per hour for the whole slice (its chips x the chip's price); None: not in the table."""
        row = (prices or PRICES).get(self.generation.name)
        if row is None:
            return None
        each = row.spot if spot else row.on_demand
        return None if each is None else each * self.chips


def _shape(chips: int, dims: int) -> tuple[int, ...]:
    """A slice's chips as a 2D or 3D grid, as Cloud TPU lays them out: ``8 -> 2x4`` in 2D;
    ``4 -> 2x2x1`` (one host), ``16 -> 2x2x4`` in 3D."""
    if dims == 2:
        if chips == 1:
            return (1, 1)
        side = 1 << ((chips.bit_length() - 1) // 2)
        return (side, chips // side)
    if chips <= 4:
        return (1, chips, 1) if chips < 4 else (2, 2, 1)  # one host
    shape, axis = [2, 2, 2], 2  # then 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...
    while shape[0] * shape[1] * shape[2] < chips:
        shape[axis] *= 2
        axis = (axis - 1) % 3
    return tuple(shape)


def command_name(name: str) -> str:
    """A target's name as ``--tpu`` takes it: a report's ``"colab = v5e-1"`` is ``"colab"``."""
    return name.partition(" = ")[0].strip()


def parse_target(name: str) -> Target:
    """``"v5e-8"`` -> its :class:`Target`; an unknown name is a ``ConfigError`` listing the known ones.

    ``colab`` and ``kaggle`` (:data:`ALIASES`) stand for the slices those services attach; the
    target's name then says both.

    Example:
        >>> parse_target("kaggle").name, parse_target("colab").num_devices
        ('kaggle = v5e-8', 1)
    """
    key = name.strip().lower()
    for alias, slice_name in ALIASES.items():
        if key in (alias, f"{alias} = {slice_name}"):  # the second: a report's name, read back
            return dataclasses.replace(parse_target(slice_name), name=f"{alias} = {slice_name}")
    match = re.fullmatch(r"(v2|v3|v4|v5e|v5litepod|v5p|v6e|tpu7x)-(\d+)", key)
    aliases = ", ".join(f"{a} (= {t})" for a, t in ALIASES.items())
    known = f"known TPU targets: {', '.join(KNOWN)}, {aliases} (any power-of-two size of these generations)."
    if match is None:
        raise ConfigError(f"unknown TPU target {name!r}; {known}")
    gen = GENERATIONS["v5e" if match.group(1) == "v5litepod" else match.group(1)]
    count = int(match.group(2))
    chips = count // gen.cores_per_chip if gen.name_counts == "cores" else count
    if chips < 1 or chips & (chips - 1) or (gen.name_counts == "cores" and count % gen.cores_per_chip):
        unit = "TensorCores (2 per chip)" if gen.name_counts == "cores" else "chips"
        raise ConfigError(
            f"TPU target {name!r}: the number counts {unit} and must be a power of two"
            f"{' and at least 2' if gen.name_counts == 'cores' else ''}; {known}"
        )
    if chips > gen.pod_chips:
        largest = 1 << (gen.pod_chips.bit_length() - 1)  # the largest power-of-two slice
        size = largest * (gen.cores_per_chip if gen.name_counts == "cores" else 1)
        raise ConfigError(
            f"TPU target {name!r} has {chips:,} chips; a whole {gen.name} pod has {gen.pod_chips:,} "
            f"({gen.source}): the largest slice named here is {gen.name}-{size}."
        )
    return Target(f"{gen.name}-{count}", gen, chips)


def parse_targets(names: str) -> list[Target]:
    """``"v3-8,v5e-8"`` -> targets, in order; naming none is an error."""
    targets = [parse_target(n) for n in names.split(",") if n.strip()]
    if not targets:
        raise ConfigError(f"--tpu {names!r} names no TPU target; give one or more, e.g. --tpu v5e-8 or --tpu colab.")
    return targets


def require_libtpu() -> None:
    """Raises a one-line ``ConfigError`` with the install command when the TPU compiler
    cannot be loaded here."""
    if importlib.util.find_spec(LIBTPU_MODULE) is None:
        where = ""
        if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
            where = f" (libtpu ships for x86-64 Linux only; this is {platform.system()} {platform.machine()})"
        raise ConfigError(f"--tpu needs the TPU compiler, the libtpu wheel, which is not installed{where}: {INSTALL}")


_STDERR_LOCK = threading.RLock()


@contextlib.contextmanager
def quiet_stderr() -> Iterator[list[str]]:
    """Sends what C++ code writes to file descriptor 2 to a buffer instead of the terminal.

    libtpu, loaded on a machine that is no TPU VM, logs that it cannot find the VM's
    accelerator type and worker hostnames; none of it concerns a compile-only use. The
    text is kept (the yielded list) for an error report.
    """
    kept: list[str] = []
    # File descriptor 2 belongs to the process: two threads redirecting it at once would
    # restore each other's sink, and stderr would stay in a deleted file.
    with _STDERR_LOCK, tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield kept
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept.append(sink.read().decode(errors="replace"))


def devices(target: Target) -> list[Any]:
    """The JAX devices of ``target``'s slice, for compiling only (nothing runs on them)."""
    require_libtpu()
    from jax.experimental import topologies

    # libtpu takes a lock file (/tmp/libtpu_lockfile) so that two processes do not drive one
    # TPU; here nothing runs on a TPU, and a second `xlafit check --tpu` must not be refused.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    options: dict[str, Any] = {"chip_config_name": "megacore"} if target.generation.megacore else {}
    if target.chips <= target.generation.host_chips:  # one VM (libtpu's default host is 2x2 chips)
        options["chips_per_host_bounds"] = (*target.shape, 1, 1)[:3]
    with quiet_stderr():
        topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology, **options)
    found = list(topology.devices)
    if len(found) != target.num_devices:  # the table and libtpu disagree: say so rather than guess
        raise ConfigError(
            f"libtpu describes {target.topology} as {len(found)} devices, xlafit expected {target.num_devices}."
        )
    return found


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


def measured_cpu_peak(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` float32 matrix product on this machine's CPU, all cores.

    The median of ``repeats`` timed products after one warm-up. Simulated CPU devices share
    these cores, so this is the peak of the whole machine, not of one simulated device.
    """
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
