"""Joining the job: platform options, simulated devices, the processes of a multi-host job.

:func:`connect` (1) sets the platform options before JAX starts its backends, optionally
simulating N CPU devices (:func:`configure`), (2) joins a multi-process job when the
environment names one (:class:`Cluster`: a coordinator, a rendezvous, a timeout), and
(3) builds the :class:`~xlafit.parallel.mesh.Strategy` over all devices of all processes.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping

import jax

from xlafit.errors import DeviceError, XlafitError
from xlafit.io.cache import enable_compilation_cache
from xlafit.parallel.env import (
    COORDINATOR_ENV,
    DISTRIBUTED_ENV,
    INIT_TIMEOUT_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    SIMULATE_ENV,
)
from xlafit.parallel.mesh import Strategy, make_mesh
from xlafit.platform import cpu as cpu_settings
from xlafit.platform.cpu import CpuConfig
from xlafit.platform.hardware import TPU_DEVICES, accelerator_present, quiet_stderr

log = logging.getLogger("xlafit")

# The XLA:CPU settings this process started with ("settings"), once configure applied them:
# they hold until the process ends, whatever a later run asks for.
_APPLIED: dict[str, CpuConfig] = {}
_WARNED: set[str] = set()  # the kernels a warning of _warn_if_not_applied named already


def _backend_started() -> bool:
    # jax initialises its backends lazily, on the first device query; after that the CPU
    # device count and XLA flags can no longer change in this process.
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def configure(simulate: int | None = None, *, cpu: CpuConfig | None = None) -> None:
    """Sets platform options; must run before JAX starts its backends.

    Args:
        simulate: run on this many CPU devices instead of the accelerators. ``None``
            reads the ``XLAFIT_SIMULATE_DEVICES`` environment variable.
        cpu: the XLA:CPU settings (:class:`~xlafit.platform.cpu.CpuConfig`), applied when the
            run is on the CPU (simulated devices, ``JAX_PLATFORMS=cpu``, or a host without
            GPU/TPU device files); default: ``CpuConfig()``.
    """
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
            fix = (
                f"import xlafit before anything else runs JAX ({SIMULATE_ENV} takes effect on import)"
                if os.environ.get(SIMULATE_ENV)
                else f"call xlafit.connect(simulate={simulate}) before any other JAX call, or set "
                f"{SIMULATE_ENV}={simulate} before starting Python"
            )
            raise DeviceError(
                f"JAX already started with {jax.device_count()} {jax.default_backend()} device(s), so "
                f"{simulate} simulated devices cannot be made in this process; {fix}."
            )
        if cpu is not None and jax.default_backend() == "cpu":
            _warn_if_not_applied(cpu)
        return
    enable_compilation_cache()
    platforms = jax.config.jax_platforms or ""  # type: ignore[attr-defined]
    on_cpu = simulate is not None or platforms.split(",")[0] == "cpu" or (not platforms and not accelerator_present())
    if on_cpu:
        _APPLIED["settings"] = cpu or CpuConfig()
        cpu_settings.apply(_APPLIED["settings"])
    if simulate is not None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", simulate)


def simulate_from_env() -> None:
    """Makes the devices ``XLAFIT_SIMULATE_DEVICES`` asks for (and the default XLA:CPU
    settings), as ``xlafit.connect()`` would; ``import xlafit`` calls it, so that the variable
    holds however JAX is first started afterwards (a model built before ``connect``, a bare
    ``jax.devices()``). Nothing where JAX already runs or the value is no count of devices:
    ``connect`` says so, with the fix."""
    value = os.environ.get(SIMULATE_ENV, "").strip()
    if value.isdigit() and int(value) >= 1 and not _backend_started():
        configure(int(value))


def _warn_if_not_applied(asked: CpuConfig) -> None:
    """Says so when a run asks for XLA:CPU kernels other than those this process started with
    (``cpu.fast_paths``, ``cpu.ynn_fusion``; an earlier ``xlafit.connect()`` applies the
    defaults): they cannot change once JAX runs, and they round differently, so the run's
    numbers can differ in their last bits from the same run started afresh. The memory and
    dispatch settings change no result and are not named."""
    applied = _APPLIED.get("settings")

    def kernels(settings: CpuConfig) -> str:
        fusion = f", cpu.ynn_fusion={','.join(settings.fusion_types)}" if settings.fast_paths else ""
        return f"cpu.fast_paths={str(settings.fast_paths).lower()}{fusion}"

    if applied is not None and kernels(applied) == kernels(asked):
        return
    if kernels(asked) in _WARNED:  # once a process: a notebook's every stage would say it again
        return
    _WARNED.add(kernels(asked))
    before = f"JAX started earlier in this process with {kernels(applied)}" if applied else "JAX started first"
    log.warning(
        "warning: this run's XLA:CPU kernels (%s) cannot apply: %s, and they hold until the process ends. The run "
        "goes on with those; its numbers can differ in their last bits from the same run in a new process "
        "(`xlafit train`). To have them, start with xlafit.connect(cpu=config.cpu), or call train_and_evaluate "
        "first.",
        kernels(asked),
        before,
    )


# What libtpu writes to stderr when JAX tries its TPU backend on a host with no TPU (libtpu
# is installed for `xlafit check --tpu`): it cannot find the VM's accelerator type and
# worker hostnames, then JAX goes on with the other backends.
_LIBTPU_NOISE = ("could not determine TPU", "Logging before InitGoogle", "Source Location Trace", "libtpu_init_utils")


def start_backends() -> list[jax.Device]:
    """``jax.devices()``, the first call (it starts the backends), without libtpu's five lines
    of start-up errors on a host that has libtpu but no TPU; everything else on stderr stays."""
    if importlib.util.find_spec("libtpu") is None or any(glob.glob(p) for p in TPU_DEVICES):
        return jax.devices()
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
                flags = dict(zip(names, ("--coordinator", "--num-processes", "--process-id"), strict=True))
                raise DeviceError(
                    f"a multi-process run needs all of {', '.join(f'{n} ({flags[n]})' for n in names)}; "
                    f"{', '.join(f'{n} ({flags[n]})' for n in missing)} {'is' if len(missing) == 1 else 'are'} "
                    "not set. Give the flags or the variables; `xlafit launch` sets them for you."
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


def _refuse_ports_in_use(coordinator: str) -> None:
    """Process 0 tries its two ports (JAX's coordinator, then the rendezvous) before it waits.

    Another program on the coordinator's port made process 0 wait out the whole timeout and
    then blame the other processes; one on the rendezvous port raised a bare OSError.
    """
    port = int(coordinator.rpartition(":")[2])
    for p, role in ((port, "the coordinator's"), (port + 1, "the rendezvous, the coordinator's + 1")):
        try:
            with socket.create_server(("", p)):
                pass
        except OSError as e:
            why = os.strerror(e.errno) if e.errno else str(e)  # "Address already in use"
            raise DeviceError(
                f"port {p} ({role}) on this host cannot be listened on ({why}), so process 0 of the job at "
                f"{coordinator} cannot serve it; choose another {COORDINATOR_ENV} port (--coordinator HOST:PORT) "
                "whose successor is free too (`xlafit launch` picks one)."
            ) from None


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
        _refuse_ports_in_use(cluster.coordinator)
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
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        if cluster.coordinator is None:  # JAX's own detection: which job, and who set it off, are the question
            raise DeviceError(_undetected(said)) from None
        raise DeviceError(
            f"process {cluster.process_id} of {cluster.num_processes} could not join the job at {where} "
            f"within {cluster.timeout_s}s ({said}). Check that "
            "every process was started, with the same coordinator address and process count, and that "
            "process 0 can be reached on that port."
        ) from None
    if cluster.num_processes is not None and jax.process_count() != cluster.num_processes:
        # JAX's service takes process 0's count: said, not refused (the job is whole; the other process would hang)
        log.warning(
            "warning: process %d was started with %s=%d, and the job it joined has %d processes (process 0's "
            "count); start every process with the same %s.",
            cluster.process_id, NUM_PROCESSES_ENV, cluster.num_processes, jax.process_count(), NUM_PROCESSES_ENV,
        )  # fmt: skip


def _undetected(said: str) -> str:
    """Why a process asked to join a job that JAX detects (a Cloud TPU pod slice, a SLURM job
    step) did not, what asked for it, and the fixes."""
    asked = [
        f"{name}={os.environ[name]}"
        for name in (DISTRIBUTED_ENV, "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES")
        if os.environ.get(name)
    ]
    return (
        f"{' and '.join(asked) or 'the environment'} asks to join a multi-process job, and JAX found none to join "
        f"here ({said}): it detects a Cloud TPU pod slice's workers and SLURM job steps. On one host, run without "
        f"{DISTRIBUTED_ENV}; to start the processes yourself, give each {COORDINATOR_ENV}, {NUM_PROCESSES_ENV} and "
        f"{PROCESS_ID_ENV}, or use `xlafit launch` (docs/guides/multihost.md)."
    )


def connect(
    simulate: int | None = None,
    *,
    cpu: CpuConfig | None = None,
    cluster: Cluster | None = None,
    mesh: tuple[int, ...] = (-1, 1, 1),
    rules: Mapping[str, str | None] | None = None,
) -> Strategy:
    """Finds every device of every process and returns the strategy over them.

    In a multi-process job (``xlafit launch``, a SLURM job step, every worker of a TPU pod
    slice) it first joins the job through ``jax.distributed``; see :meth:`Cluster.from_env`.

    Args:
        simulate: use this many simulated CPU devices (per process; rehearse an 8-core TPU
            with 8).
        cpu: the XLA:CPU settings, for a run on the CPU (:class:`~xlafit.platform.cpu.CpuConfig`).
        cluster: join this job; default: :meth:`Cluster.from_env`.
        mesh: sizes of ``(data, fsdp, tensor)`` or ``(data, fsdp, tensor, expert)``, one of
            them may be -1 (see :func:`make_mesh`);
            the default is pure data parallelism.
        rules: logical axis -> mesh axis (default :data:`xlafit.parallel.sharding.DEFAULT_RULES`).

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
    configure(simulate, cpu=cpu)
    cluster = cluster or Cluster.from_env()
    if cluster is not None and not started and not jax.distributed.is_initialized():
        _join(cluster)
    devices = start_backends() if not started else jax.devices()
    # Order by (process, id) so each process's devices are contiguous along the batch axes
    # and process p owns rows [p*L, (p+1)*L) of every global batch.
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Strategy(make_mesh(devices, *mesh), rules)


def connect_as_run(
    simulate: int | None,
    *,
    cpu: CpuConfig | None,
    mesh: tuple[int, ...],
    rules: Mapping[str, str | None] | None,
    same: str = "the answers are the same",
) -> Strategy:
    """The devices for a run's model read again (``xlafit generate``, ``xlafit eval``): the
    run's ``mesh`` where this host's devices make it, else every device, the model replicated
    over them (said on stderr, with ``same``: what does not change)."""
    try:  # first: the devices (simulated ones too) before anything else starts JAX
        return connect(simulate, cpu=cpu, mesh=mesh, rules=rules)
    except XlafitError:
        strategy = connect(simulate, cpu=cpu)
        axes = ("data", "fsdp", "tensor", "expert")
        shown = " ".join(f"mesh.{axis}={size}" for axis, size in zip(axes, mesh, strict=False) if size != 1)
        print(
            f"the run's mesh ({shown}) does not fit this host's {strategy.mesh.size} device(s): the model is "
            f"replicated over them ({same}; only the memory a device holds differs)",
            file=sys.stderr,
        )
        return strategy
