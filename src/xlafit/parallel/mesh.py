"""Finding the devices and laying the ``('data', 'fsdp', 'tensor')`` mesh over them.

The TensorFlow way is ``TPUClusterResolver`` -> ``initialize_tpu_system`` ->
``TPUStrategy``; the PyTorch/XLA way is ``xmp.spawn`` with one process per core. With JAX
one process drives every local device, so :func:`connect` only has to (1) pick the
platform, optionally simulating N CPU devices, and (2) build a ``Mesh`` over all devices of
all processes: ``data`` x ``fsdp`` x ``tensor`` (:func:`make_mesh`; the default is pure data
parallelism, every device on ``data``). Where each array lies on it: :mod:`xlafit.parallel.sharding`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlafit.errors import DeviceError
from xlafit.parallel.sharding import BATCH_AXES, DEFAULT_RULES, MESH_AXES, divisors, tree_shardings


def is_prng_key(x: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``), which has no plain dtype."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def make_mesh(devices: list[jax.Device], data: int = -1, fsdp: int = 1, tensor: int = 1, expert: int = 1) -> Mesh:
    """The ``('data', 'fsdp', 'tensor')`` mesh over ``devices`` (ordered by process, then id),
    ``('data', 'fsdp', 'expert', 'tensor')`` with ``expert`` above 1 (expert parallelism: a
    mixture of experts' experts split over it, the batch too).

    One size may be -1: the devices left. ``tensor`` is the fastest-varying axis, so a
    tensor-parallel group is made of neighbouring devices of one process, and each process
    owns a contiguous block of every batch (the batch is split over ``data`` x ``fsdp``).

    Why not ``mesh_utils.create_device_mesh``'s physical (ICI ring) order on TPUs: for a
    v5e/v6e 4x4 slice it interleaves the hosts along the batch (processes 0,0,1,1,1,1,0,...
    on a 16 x 1 x 1 mesh, 0,0,1,1,0,0,... on 4 x 2 x 2), which breaks the contiguous blocks
    above; process order already puts a host's 2x2 chips (v5e) or 2x2x1 (v4/v5p) on the inner
    axes, so a tensor group of 2 or 4 is ICI neighbours (device coordinates read from
    libtpu's topologies), and pure data parallelism all-reduces over every device, whose
    order does not matter.

    Example:
        >>> dict(make_mesh(jax.devices(), fsdp=4, tensor=2).shape)
        {'data': 1, 'fsdp': 4, 'tensor': 2}

    Raises:
        DeviceError: the sizes do not multiply to the device count (the message lists sizes
            that would), or a tensor group would span processes.
    """
    n = len(devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor, **({"expert": expert} if expert != 1 else {})}
    free = [k for k, v in sizes.items() if v == -1]
    bad = [k for k, v in sizes.items() if v == 0 or v < -1]
    if bad or len(free) > 1:
        raise DeviceError(
            f"mesh.{(bad or free)[0]}={sizes[(bad or free)[0]]}: mesh sizes are positive, and at most one of "
            "mesh.data, mesh.fsdp, mesh.tensor, mesh.expert is -1 (the devices left)."
        )
    fixed = int(np.prod([v for v in sizes.values() if v != -1]))
    if free:
        if n % fixed:
            raise DeviceError(
                f"the mesh {_shape_text(sizes)} cannot cover {n} devices: {fixed} does not divide {n}. "
                f"Use sizes whose product divides {n} ({divisors(n)})."
            )
        sizes[free[0]] = n // fixed
    if int(np.prod(list(sizes.values()))) != n:
        product = int(np.prod(list(sizes.values())))
        # A layout for a TPU slice (a plan's) rehearses here on as many simulated CPU devices.
        rehearse = (
            f" To run this layout on this machine, add --simulate {product} (run.simulate_devices={product}: "
            f"{product} simulated CPU devices, the same global batch)."
            if product > n and devices[0].platform == "cpu"
            else ""
        )
        raise DeviceError(
            f"the mesh {_shape_text(sizes)} has {product} places for {n} devices: mesh.data x mesh.fsdp x "
            f"mesh.tensor must equal {n}. For example mesh.data=-1 mesh.fsdp={_largest_divisor(n, sizes['fsdp'])} "
            f"mesh.tensor={_largest_divisor(n, sizes['tensor'])} (sizes that divide {n}: {divisors(n)}).{rehearse}"
        )
    local = len([d for d in devices if d.process_index == devices[0].process_index])
    if local % sizes["tensor"]:
        raise DeviceError(
            f"mesh.tensor={sizes['tensor']} would spread a tensor-parallel group over several processes "
            f"({local} devices each); use a mesh.tensor that divides {local}: {divisors(local)}."
        )
    axes = tuple(a for a in MESH_AXES if a in sizes)  # tensor innermost: a group of neighbours
    return Mesh(np.array(devices).reshape(*(sizes[a] for a in axes)), axes)


def _shape_text(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in sizes.items())


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in divisors(n) if d <= max(at_most, 1))


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The devices a run uses and how arrays are laid over them.

    Batches are split along their leading axis over ``data`` x ``fsdp`` (``batch``);
    parameters and optimizer state lie as :mod:`xlafit.parallel.sharding` says (``shardings``):
    replicated on a pure data-parallel mesh, split over ``fsdp`` and ``tensor`` otherwise.
    A mesh with only a ``data`` axis (older code) is pure data parallelism.

    Example:
        >>> from xlafit.parallel.cluster import connect
        >>> strategy = connect()
        >>> strategy.num_replicas >= 1
        True
    """

    mesh: Mesh
    # logical axis name -> mesh axis (xlafit.parallel.sharding.DEFAULT_RULES, mesh.rules)
    rules: Mapping[str, str | None] | None = None

    def axis_size(self, name: str) -> int:
        """The size of mesh axis ``name`` (1 when the mesh has no such axis)."""
        return int(dict(self.mesh.shape).get(name, 1))

    @property
    def num_replicas(self) -> int:
        """Batch shards: ``data`` x ``fsdp`` x ``expert``, the devices (or tensor-parallel
        groups) that each take their own rows of every batch; all devices, in pure data
        parallelism."""
        return self.axis_size("data") * self.axis_size("fsdp") * self.axis_size("expert")

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def data_parallel_only(self) -> bool:
        """True when every device holds the whole model (``fsdp`` = ``tensor`` = ``expert`` = 1)."""
        return self.axis_size("fsdp") == 1 and self.axis_size("tensor") == 1 and self.axis_size("expert") == 1

    @property
    def _batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in BATCH_AXES if a in self.mesh.axis_names)

    def shardings(self, tree: Any) -> Any:
        """``NamedSharding``s for a tree of variables (parameters, optimizer state, model
        state; arrays or ``ShapeDtypeStruct``s): see :func:`xlafit.parallel.sharding.tree_shardings`."""
        return tree_shardings(tree, self.mesh, self.rules if self.rules is not None else DEFAULT_RULES)

    def put(self, tree: Any, shardings: Any) -> Any:
        """Places host values (identical in every process) on the devices with ``shardings``:
        each device receives only its own slice."""

        def one(x: Any, sharding: NamedSharding) -> jax.Array:
            if is_prng_key(x):
                return jax.random.wrap_key_data(one(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

        return jax.tree.map(one, tree, shardings)

    @property
    def platform(self) -> str:
        return self.mesh.devices.flat[0].platform

    @property
    def memory_kinds(self) -> frozenset[str]:
        """The memories the mesh's devices address: ``device``, and on TPUs, GPUs and CPUs
        ``pinned_host`` and ``unpinned_host`` too (none known: an empty set)."""
        try:
            return frozenset(m.kind for m in self.mesh.devices.flat[0].addressable_memories())
        except (AttributeError, NotImplementedError, RuntimeError):  # a backend without memory spaces
            return frozenset()

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def process_count(self) -> int:
        return jax.process_count()

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def batch(self) -> NamedSharding:
        return self.batch_sharding()

    def batch_sharding(self, leading_axes: int = 0) -> NamedSharding:
        """Sharding of a batch whose example axis comes after ``leading_axes`` axes.

        ``leading_axes=1`` is the layout of k stacked batches for ``steps_per_call``.
        """
        return NamedSharding(self.mesh, PartitionSpec(*([None] * leading_axes), self._batch_axes))

    def replicate(self, tree: Any) -> Any:
        """Copies host or single-device values to every device, in every process.

        ``jax.device_put`` cannot target devices of other processes; each process instead
        contributes its (identical) copy through ``make_array_from_process_local_data``.
        """

        def put(x: Any) -> jax.Array:
            if is_prng_key(x):
                return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
            x = np.asarray(x)
            return jax.make_array_from_process_local_data(self.replicated, x, x.shape)

        return jax.tree.map(put, tree)

    def describe(self) -> str:
        """A human-readable table of the platform, processes, devices and mesh."""
        lines = [
            f"platform: {self.platform}   process {self.process_index} of {self.process_count}",
            f"{'id':>4}  {'kind':<24} {'process':>7}  {'memory':>12}",
        ]
        for d in self.mesh.devices.flat:
            lines.append(f"{d.id:>4}  {d.device_kind:<24} {d.process_index:>7}  {_memory(d):>12}")
        lines.append(self.layout())
        return "\n".join(lines)

    def layout(self) -> str:
        """One line: the mesh and what it does with parameters and batches."""
        shape = " ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        if self.data_parallel_only:
            return (
                f"mesh: {shape} -> parameters replicated on {self.num_devices} devices, "
                f"batches split over {' x '.join(self._batch_axes)}"
            )
        parts = []
        if self.axis_size("fsdp") > 1:
            parts.append("parameters and optimizer state split over fsdp")
        if self.axis_size("tensor") > 1:
            parts.append("tensor-parallel over tensor")
        if self.axis_size("expert") > 1:
            parts.append("experts split over expert")
        over = " x ".join(self._batch_axes)
        shards = f"{self.num_replicas} shard{'' if self.num_replicas == 1 else 's'}"
        return f"mesh: {shape} -> {', '.join(parts)}; batches split over {over} ({shards})"


def _memory(device: jax.Device) -> str:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends do not implement memory_stats
        stats = {}
    limit = stats.get("bytes_limit")
    return f"{limit / 2**30:.1f} GiB" if limit else "n/a"
