"""Finding the devices and laying the ``('data', 'fsdp', 'tensor')`` mesh over them.

The TensorFlow way is ``TPUClusterResolver`` -> ``initialize_tpu_system`` ->
``TPUStrategy``; the PyTorch/XLA way is ``xmp.spawn`` with one process per core. With JAX
one process drives every local device, so :func:`connect` only has to (1) pick the
platform, optionally simulating N CPU devices, and (2) build a ``Mesh`` over all devices of
all processes: ``data`` x ``fsdp`` x ``tensor`` (:func:`make_mesh`; the default is pure data
parallelism, every device on ``data``). Where each array lies on it: :mod:`xlafit.sharding`.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlafit.host_memory import TPU_DEVICES, accelerator_present, keep_freed_memory

SIMULATE_ENV = "XLAFIT_SIMULATE_DEVICES"
COORDINATOR_ENV = "XLAFIT_COORDINATOR"
NUM_PROCESSES_ENV = "XLAFIT_NUM_PROCESSES"
PROCESS_ID_ENV = "XLAFIT_PROCESS_ID"
INIT_TIMEOUT_ENV = "XLAFIT_INIT_TIMEOUT_S"  # how long to wait for every process to join
DISTRIBUTED_ENV = "XLAFIT_DISTRIBUTED"  # "1": join a job that JAX detects (TPU pod slice, ...)

# XLA:CPU library paths: which operations go to YNNPACK. dot,eltwise,reduce was measured
# fastest for the CNN/MLP workloads here, dot alone for BERT (BENCHMARKS.md). Only applied
# to CPU runs, and only when the user has not set the flag in XLA_FLAGS.
YNN_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
YNN_FUSION_TYPES = ("dot", "eltwise", "reduce", "individual_dot", "individual_convolution")
DEFAULT_YNN_FUSION = "dot,eltwise,reduce"


def is_prng_key(x: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``), which has no plain dtype."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class DeviceError(RuntimeError):
    """The requested devices cannot be had; the message says why and what to do."""


MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def make_mesh(devices: list[jax.Device], data: int = -1, fsdp: int = 1, tensor: int = 1) -> Mesh:
    """The ``('data', 'fsdp', 'tensor')`` mesh over ``devices`` (ordered by process, then id).

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
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    free = [k for k, v in sizes.items() if v == -1]
    bad = [k for k, v in sizes.items() if v == 0 or v < -1]
    if bad or len(free) > 1:
        raise DeviceError(
            f"mesh.{(bad or free)[0]}={sizes[(bad or free)[0]]}: mesh sizes are positive, and at most one of "
            "mesh.data, mesh.fsdp, mesh.tensor is -1 (the devices left)."
        )
    fixed = int(np.prod([v for v in sizes.values() if v != -1]))
    if free:
        if n % fixed:
            raise DeviceError(
                f"the mesh {_shape_text(sizes)} cannot cover {n} devices: {fixed} does not divide {n}. "
                f"Use sizes whose product divides {n} ({_divisors(n)})."
            )
        sizes[free[0]] = n // fixed
    if int(np.prod(list(sizes.values()))) != n:
        product = int(np.prod(list(sizes.values())))
        raise DeviceError(
            f"the mesh {_shape_text(sizes)} has {product} places for {n} devices: mesh.data x mesh.fsdp x "
            f"mesh.tensor must equal {n}. For example mesh.data=-1 mesh.fsdp={_largest_divisor(n, sizes['fsdp'])} "
            f"mesh.tensor={_largest_divisor(n, sizes['tensor'])} (sizes that divide {n}: {_divisors(n)})."
        )
    local = len([d for d in devices if d.process_index == devices[0].process_index])
    if local % sizes["tensor"]:
        raise DeviceError(
            f"mesh.tensor={sizes['tensor']} would spread a tensor-parallel group over several processes "
            f"({local} devices each); use a mesh.tensor that divides {local}: {_divisors(local)}."
        )
    return Mesh(np.array(devices).reshape(sizes["data"], sizes["fsdp"], sizes["tensor"]), MESH_AXES)


def _shape_text(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in sizes.items())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in _divisors(n) if d <= max(at_most, 1))


@dataclasses.dataclass(frozen=True)
class Strategy:
    """The devices a run uses and how arrays are laid over them.

    Batches are split along their leading axis over ``data`` x ``fsdp`` (``batch``);
    parameters and optimizer state lie as :mod:`xlafit.sharding` says (``shardings``):
    replicated on a pure data-parallel mesh, split over ``fsdp`` and ``tensor`` otherwise.
    A mesh with only a ``data`` axis (older code) is pure data parallelism.

    Example:
        >>> strategy = connect()
        >>> strategy.num_replicas >= 1
        True
    """

    mesh: Mesh
    # logical axis name -> mesh axis (xlafit.sharding.DEFAULT_RULES, mesh.rules)
    rules: Mapping[str, str | None] | None = None

    def axis_size(self, name: str) -> int:
        """The size of mesh axis ``name`` (1 when the mesh has no such axis)."""
        return int(dict(self.mesh.shape).get(name, 1))

    @property
    def num_replicas(self) -> int:
        """Batch shards: ``data`` x ``fsdp``, the devices (or tensor-parallel groups) that
        each take their own rows of every batch; all devices, in pure data parallelism."""
        return self.axis_size("data") * self.axis_size("fsdp")

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def data_parallel_only(self) -> bool:
        """True when every device holds the whole model (``fsdp`` = ``tensor`` = 1)."""
        return self.axis_size("fsdp") == 1 and self.axis_size("tensor") == 1

    @property
    def _batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in BATCH_AXES if a in self.mesh.axis_names)

    def shardings(self, tree: Any) -> Any:
        """``NamedSharding``s for a tree of variables (parameters, optimizer state, model
        state; arrays or ``ShapeDtypeStruct``s): see :func:`xlafit.sharding.tree_shardings`."""
        from xlafit.sharding import DEFAULT_RULES, tree_shardings

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
        return f"mesh: {shape} -> {', '.join(parts)}; batches split over data x fsdp ({self.num_replicas} shards)"


def _memory(device: jax.Device) -> str:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends do not implement memory_stats
        stats = {}
    limit = stats.get("bytes_limit")
    return f"{limit / 2**30:.1f} GiB" if limit else "n/a"


def _backend_started() -> bool:
    # jax initialises its backends lazily, on the first device query; after that the CPU
    # device count and XLA flags can no longer change in this process.
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def configure(
    simulate: int | None = None,
    *,
    cpu_fast_paths: bool = True,
    ynn_fusion: str = DEFAULT_YNN_FUSION,
    cpu_keep_memory: bool = True,
    cpu_async_dispatch: bool = True,
) -> None:
    """Sets platform options; must run before JAX starts its backends.

    Args:
        simulate: run on this many CPU devices instead of the accelerators. ``None``
            reads the ``XLAFIT_SIMULATE_DEVICES`` environment variable.
        cpu_fast_paths: hand the ``ynn_fusion`` operations of CPU programs to YNNPACK (adds
            :data:`YNN_FUSION_FLAG` to ``XLA_FLAGS`` when the run is on the CPU, unless it
            is set there already).
        ynn_fusion: a comma-separated subset of :data:`YNN_FUSION_TYPES`.
        cpu_keep_memory: when the run is on the CPU (simulated devices, ``JAX_PLATFORMS=cpu``,
            or a host without GPU/TPU device files), keep freed host memory for reuse
            instead of page-faulting every call's temporaries in afresh
            (:mod:`xlafit.host_memory`).
        cpu_async_dispatch: when the run is on the CPU, ``False`` runs each one-device call
            inline (``jax_cpu_enable_async_dispatch``): the call returns when it is done and its
            temporaries are freed, so the next call reuses them instead of the heap growing by
            another block while two calls overlap. Programs over several devices stay
            asynchronous either way.
    """
    types = [t.strip() for t in ynn_fusion.split(",") if t.strip()]
    unknown = [t for t in types if t not in YNN_FUSION_TYPES]
    if unknown:
        raise DeviceError(
            f"unknown YNNPACK fusion type {unknown[0]!r} (run.xla_cpu_ynn_fusion); "
            f"choose from {', '.join(YNN_FUSION_TYPES)}, comma-separated."
        )
    if simulate is None and os.environ.get(SIMULATE_ENV):
        try:
            simulate = int(os.environ[SIMULATE_ENV])
        except ValueError:
            raise DeviceError(
                f"{SIMULATE_ENV}={os.environ[SIMULATE_ENV]!r} must be a whole number of devices."
            ) from None
    if simulate is not None and simulate < 1:
        raise DeviceError(f"cannot simulate {simulate} devices; use --simulate 1 or more.")
    if _backend_started():
        if simulate is not None and (jax.default_backend() != "cpu" or jax.device_count() != simulate):
            raise DeviceError(
                f"JAX already started with {jax.device_count()} {jax.default_backend()} device(s), so "
                f"{simulate} simulated devices cannot be made in this process. Call xlafit.connect("
                f"simulate={simulate}) before any other JAX call, or set {SIMULATE_ENV}={simulate}."
            )
        return
    from xlafit.cache import enable_compilation_cache

    enable_compilation_cache()
    platforms = jax.config.jax_platforms or ""  # type: ignore[attr-defined]
    on_cpu = simulate is not None or platforms.split(",")[0] == "cpu" or (not platforms and not accelerator_present())
    if cpu_keep_memory and on_cpu:
        keep_freed_memory()
    if on_cpu and not cpu_async_dispatch:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if simulate is not None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", simulate)
    flags = os.environ.get("XLA_FLAGS", "")
    if cpu_fast_paths and on_cpu and YNN_FUSION_FLAG not in flags:
        # Only where the run is on the CPU: an accelerator's jaxlib may be another XLA
        # build, one that rejects a flag it does not know.
        os.environ["XLA_FLAGS"] = f"{flags} {YNN_FUSION_FLAG}={','.join(types)}".strip()


# What libtpu writes to stderr when JAX tries its TPU backend on a host with no TPU (libtpu
# is installed for `xlafit check --tpu`): it cannot find the VM's accelerator type and
# worker hostnames, then JAX goes on with the other backends.
_LIBTPU_NOISE = ("could not determine TPU", "Logging before InitGoogle", "Source Location Trace", "libtpu_init_utils")


def start_backends() -> list[jax.Device]:
    """``jax.devices()``, the first call (it starts the backends), without libtpu's five lines
    of start-up errors on a host that has libtpu but no TPU; everything else on stderr stays."""
    if importlib.util.find_spec("libtpu") is None or any(glob.glob(p) for p in TPU_DEVICES):
        return jax.devices()
    from xlafit.tpu import quiet_stderr

    sys.stderr.flush()
    kept: list[str] = []
    try:
        with quiet_stderr() as kept:
            return jax.devices()
    finally:
        lines = "".join(kept).splitlines(keepends=True)
        sys.stderr.write("".join(line for line in lines if not any(n in line for n in _LIBTPU_NOISE)))
        sys.stderr.flush()


@dataclasses.dataclass(frozen=True)
class Cluster:
    """How this process joins a multi-process job (``jax.distributed``)."""

    coordinator: str | None = None  # host:port of process 0; None: detected by JAX
    num_processes: int | None = None
    process_id: int | None = None
    timeout_s: int = 300

    @classmethod
    def from_env(cls) -> Cluster | None:
        """The job this process belongs to, or None for a single-process run.

        Explicit ``XLAFIT_COORDINATOR`` / ``XLAFIT_NUM_PROCESSES`` / ``XLAFIT_PROCESS_ID``
        (what ``xlafit launch`` sets) win; otherwise a SLURM job step with several tasks or
        a multi-worker Cloud TPU slice is left to JAX's own cluster detection.
        """
        names = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV)
        given = {n: os.environ[n] for n in names if os.environ.get(n)}
        if given:
            missing = [n for n in names if n not in given]
            if missing:
                raise DeviceError(
                    f"a multi-process run needs all of {', '.join(names)}; {', '.join(missing)} "
                    "is not set. `xlafit launch` sets them for you."
                )
            try:
                num, pid = int(given[NUM_PROCESSES_ENV]), int(given[PROCESS_ID_ENV])
            except ValueError:
                raise DeviceError(f"{NUM_PROCESSES_ENV} and {PROCESS_ID_ENV} must be whole numbers.") from None
            if not 0 <= pid < num:
                raise DeviceError(f"{PROCESS_ID_ENV}={pid} must lie in [0, {NUM_PROCESSES_ENV}={num}).")
            return cls(given[COORDINATOR_ENV], num, pid, _timeout())
        detected = (
            os.environ.get(DISTRIBUTED_ENV, "") in ("1", "true", "auto")
            or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1
            or "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
        )
        if detected:
            return cls(timeout_s=_timeout())
        return None


def _timeout() -> int:
    try:
        return int(os.environ.get(INIT_TIMEOUT_ENV, "300"))
    except ValueError:
        raise DeviceError(f"{INIT_TIMEOUT_ENV} must be a whole number of seconds.") from None


def _rendezvous(cluster: Cluster) -> None:
    """Meets every process on the port after the coordinator's before JAX does.

    JAX aborts the whole process (a C++ fatal error, not an exception) when a process does
    not arrive in time, and names no one. This handshake fails first, with names: process 0
    says which processes never came, the others say that process 0 cannot be reached.
    """
    if cluster.coordinator is None:
        raise ValueError("_rendezvous needs the coordinator's address; without one JAX finds it.")
    host, _, port = cluster.coordinator.rpartition(":")
    address = (host, int(port) + 1)
    deadline = time.monotonic() + cluster.timeout_s
    hint = f"set {INIT_TIMEOUT_ENV} to wait longer than {cluster.timeout_s}s"
    if cluster.process_id == 0:
        if cluster.num_processes is None:
            raise DeviceError(
                f"process 0 of the job at {cluster.coordinator} cannot tell how many processes to wait for: "
                f"set {NUM_PROCESSES_ENV} (`xlafit launch` sets it)."
            )
        with socket.create_server(("", address[1]), reuse_port=False) as server:
            server.settimeout(0.5)
            arrived: dict[int, socket.socket] = {}
            while len(arrived) < cluster.num_processes - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, cluster.num_processes)) - set(arrived))
                    for conn in arrived.values():
                        conn.close()
                    raise DeviceError(
                        f"process(es) {', '.join(map(str, missing))} of {cluster.num_processes} did not join the "
                        f"job at {cluster.coordinator} within {cluster.timeout_s}s. Start them with the same "
                        f"coordinator address and process count, or {hint}."
                    )
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                conn.settimeout(5)
                arrived[int(conn.recv(16).decode() or -1)] = conn
            for conn in arrived.values():
                conn.sendall(b"ok")
                conn.close()
        return
    while True:
        try:
            with socket.create_connection(address, timeout=1) as conn:
                conn.sendall(str(cluster.process_id).encode())
                conn.settimeout(max(deadline - time.monotonic(), 1) + 5)
                if conn.recv(2) == b"ok":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise DeviceError(
                f"process {cluster.process_id} of {cluster.num_processes} could not join the job at "
                f"{cluster.coordinator} within {cluster.timeout_s}s: process 0 cannot be reached, or did "
                f"not see every process. Check that process 0 was started with the same coordinator address "
                f"and that this host can reach ports {port} and {int(port) + 1}; or {hint}."
            )
        time.sleep(0.5)


def _join(cluster: Cluster) -> None:
    # jax.config creates its options as attributes at run time; its type declares none of them.
    if jax.config.jax_platforms == "cpu":  # type: ignore[attr-defined]
        # CPU devices of different processes talk through gloo over TCP.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = cluster.coordinator or "the address JAX detects"
    if cluster.coordinator:
        _rendezvous(cluster)
    try:
        jax.distributed.initialize(
            cluster.coordinator,
            cluster.num_processes,
            cluster.process_id,
            initialization_timeout=cluster.timeout_s,
        )
    except Exception as e:  # jax raises RuntimeError/XlaRuntimeError/ValueError here
        raise DeviceError(
            f"process {cluster.process_id} of {cluster.num_processes} could not join the job at {where} "
            f"within {cluster.timeout_s}s ({str(e).splitlines()[0] if str(e) else type(e).__name__}). Check that "
            "every process was started, with the same coordinator address and process count, and that "
            "process 0 can be reached on that port."
        ) from None


def connect(
    simulate: int | None = None,
    *,
    cpu_fast_paths: bool = True,
    ynn_fusion: str = DEFAULT_YNN_FUSION,
    cpu_keep_memory: bool = True,
    cpu_async_dispatch: bool = True,
    cluster: Cluster | None = None,
    mesh: tuple[int, int, int] = (-1, 1, 1),
    rules: Mapping[str, str | None] | None = None,
) -> Strategy:
    """Finds every device of every process and returns the strategy over them.

    In a multi-process job (``xlafit launch``, a SLURM job step, every worker of a TPU pod
    slice) it first joins the job through ``jax.distributed``; see :meth:`Cluster.from_env`.

    Args:
        simulate: use this many simulated CPU devices (per process; rehearse an 8-core TPU
            with 8).
        cpu_fast_paths, ynn_fusion, cpu_keep_memory, cpu_async_dispatch: see :func:`configure`.
        cluster: join this job; default: :meth:`Cluster.from_env`.
        mesh: sizes of ``(data, fsdp, tensor)``, one of them may be -1 (see :func:`make_mesh`);
            the default is pure data parallelism.
        rules: logical axis -> mesh axis (default :data:`xlafit.sharding.DEFAULT_RULES`).

    Returns:
        A :class:`Strategy` whose mesh lays ``data`` x ``fsdp`` x ``tensor`` over all devices.

    Example:
        >>> import xlafit
        >>> strategy = xlafit.connect()
        >>> print(strategy.describe())  # doctest: +ELLIPSIS
        platform: cpu   process 0 of 1
        ...
        mesh: data=8 fsdp=1 tensor=1 -> parameters replicated on 8 devices, batches split over data x fsdp
        >>> print(xlafit.connect(mesh=(1, 4, 2)).layout())  # doctest: +ELLIPSIS
        mesh: data=1 fsdp=4 tensor=2 -> parameters and optimizer state split over fsdp, tensor-parallel ... (4 shards)
    """
    started = _backend_started()
    configure(
        simulate,
        cpu_fast_paths=cpu_fast_paths,
        ynn_fusion=ynn_fusion,
        cpu_keep_memory=cpu_keep_memory,
        cpu_async_dispatch=cpu_async_dispatch,
    )
    cluster = cluster or Cluster.from_env()
    if cluster is not None and not started and not jax.distributed.is_initialized():
        _join(cluster)
    devices = start_backends() if not started else jax.devices()
    # Order by (process, id) so each process's devices are contiguous along the batch axes
    # and process p owns rows [p*L, (p+1)*L) of every global batch.
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Strategy(make_mesh(devices, *mesh), rules)
