"""TPU slices by name, and their devices for the TPU compiler on a machine that has none.

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
What a slice's chips are (HBM, FLOP/s, bandwidths) is the hardware table's
(:mod:`xlafit.platform.chips`).

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
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from xlafit.errors import ConfigError
from xlafit.platform.chips import GENERATIONS, PRICES, Generation, Price

INSTALL = "pip install 'xlafit[tpu]'"
LIBTPU_MODULE = "libtpu"  # the wheel's module: where the TPU compiler comes from


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
    def hosts(self) -> int:
        """The slice's TPU VMs, one JAX process each: one up to the generation's one-VM slice
        (``host_chips``), else 4 chips a host (a v5e-16 is 4 hosts)."""
        return 1 if self.chips <= self.generation.host_chips else self.chips // 4

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
            f"TPU target {name!r}: the number in a {gen.name} name counts {unit} and must be a power of two"
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
