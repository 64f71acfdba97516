"""Every XLA:CPU setting of a run, each with its reason (:class:`CpuConfig`, the ``cpu:`` section).

The CPU is where a TPU run is rehearsed on simulated devices, where the tests run and where
the demos train; these settings keep such runs quick. They apply only when a run is on the
CPU (simulated devices, ``JAX_PLATFORMS=cpu``, or a host without an accelerator), before JAX
starts its backends (:func:`apply`, called by :func:`xlafit.parallel.cluster.configure`).

- YNNPACK (``fast_paths``, ``ynn_fusion``): XLA:CPU hands dots, elementwise operations and
  reductions to YNNPACK's kernels, faster than its own.
- Keeping freed host memory (``keep_memory``): XLA:CPU allocates a program's temporaries as
  one block per call and frees it when the call ends; glibc serves a block that large with a
  fresh ``mmap`` and returns it with ``munmap``, so every step would touch all of it as new
  pages (page faults, kernel time). :func:`keep_freed_memory` makes glibc serve every block
  from its heap (``M_MMAP_MAX=0``), keep what is freed (``M_TRIM_THRESHOLD=-1``) and use one
  heap from every thread (``M_ARENA_MAX=1``), so the next call reuses the pages. The cost is
  host memory: the process keeps what its heap once held, as JAX's and PyTorch's GPU
  allocators keep device memory. It changes no result. ``GLIBC_TUNABLES`` does the same for
  any process (``glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776``),
  and a user's own setting there wins.
- Inline dispatch (``async_dispatch=false``, the ResNet recipe's): each one-device call
  returns when it is done and its temporaries are freed, so the heap holds one block of them,
  not two while calls overlap. Programs over several devices stay asynchronous either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import os
import sys
from types import ModuleType

import jax

from xlafit.errors import ConfigError

resource: ModuleType | None
try:
    import resource
except ImportError:  # Windows
    resource = None

# XLA:CPU hands these operations of a CPU program to YNNPACK (cpu.ynn_fusion).
YNN_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
YNN_FUSION_TYPES = ("dot", "eltwise", "reduce", "individual_dot", "individual_convolution")
DEFAULT_YNN_FUSION = "dot,eltwise,reduce"

# mallopt parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
KEEP = {M_ARENA_MAX: 1, M_MMAP_MAX: 0, M_TRIM_THRESHOLD: -1}  # -1: never trim (man mallopt)


def page_faults() -> int | None:
    """This process's minor page faults so far (``getrusage``); None where there is no
    ``resource`` module (Windows). The bench counts them over its timed steps."""
    return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def page_faults_since(start: int | None) -> int | None:
    """Minor page faults since ``start``, a :func:`page_faults` reading (None if it was)."""
    now = page_faults()
    return None if start is None or now is None else now - start


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


_kept = False  # whether keep_freed_memory took in this process (mallopt is process-wide)


def keeping_freed_memory() -> bool:
    """True once :func:`keep_freed_memory` took in this process (the trainer says so at start)."""
    return _kept


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (None elsewhere), looked up once
    (``find_library`` runs ``ldconfig``): every TPU compile here trims through it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def keep_freed_memory() -> bool:
    """Makes glibc keep freed memory for reuse (see the module text).

    Returns whether the setting took: False off Linux, with a C library other than glibc
    (musl has no ``mallopt``), or when ``GLIBC_TUNABLES`` already sets malloc options (the
    user's choice wins).
    """
    if not sys.platform.startswith("linux") or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    global _kept
    _kept = all(mallopt(param, value) == 1 for param, value in KEEP.items())
    return _kept


def release_freed_memory() -> bool:
    """Hands the pages that glibc holds freed back to the system (``malloc_trim(0)``).

    A TPU compile here (``xlafit check --tpu``) allocates gigabytes of short-lived buffers; glibc
    keeps the freed ones in its heap, so the next compile's peak stands on the last one's
    leftovers (Gemma 3 1B's GRPO check held 5.3 GiB after its train step compiled, 0.7 GiB of an
    8-layer model's 2.6 GiB once trimmed). Returns whether it ran: not off glibc, nor where
    :func:`keep_freed_memory` took (the process chose to keep them).
    """
    if _kept or not sys.platform.startswith("linux"):
        return False
    trim = getattr(_glibc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


@dataclasses.dataclass
class CpuConfig:
    """The XLA:CPU settings of a run: they apply only when it runs on the CPU (simulated
    devices, ``JAX_PLATFORMS=cpu``, or a host without an accelerator), never on a TPU or GPU.

    The CPU is where a TPU run is rehearsed (simulated devices), tested and demonstrated; these
    settings keep those runs quick without touching what a TPU runs.
    """

    # YNNPACK kernels for the operations below (dots, elementwise, reductions): faster CPU steps.
    fast_paths: bool = True
    # What XLA:CPU hands to YNNPACK when fast_paths is on: a comma-separated subset of
    # dot, eltwise, reduce, individual_dot, individual_convolution.
    ynn_fusion: str = DEFAULT_YNN_FUSION
    # Keep freed host memory for reuse: each step's temporaries are not page-faulted in afresh.
    keep_memory: bool = True
    # false: one-device calls run inline, freeing their temporaries before the next call starts.
    async_dispatch: bool = True

    def __post_init__(self) -> None:
        unknown = [t for t in self.fusion_types if t not in YNN_FUSION_TYPES]
        if unknown:
            raise ConfigError(
                f"unknown YNNPACK fusion type {unknown[0]!r} (cpu.ynn_fusion); "
                f"choose from {', '.join(YNN_FUSION_TYPES)}, comma-separated."
            )

    @property
    def fusion_types(self) -> list[str]:
        return [t.strip() for t in self.ynn_fusion.split(",") if t.strip()]


# What apply() set (not the user's own): a later apply, before JAX starts, replaces it
# (``import xlafit`` with XLAFIT_SIMULATE_DEVICES applies the defaults, a run's own settings
# come after): the XLA_FLAGS entry it added, and whether it turned async dispatch off.
_added: list[str] = []
_inline: list[bool] = []


def apply(cfg: CpuConfig) -> None:
    """Applies ``cfg`` to this process; before JAX starts its backends, and only when the
    run is on the CPU (an accelerator's jaxlib may be another XLA build, one that rejects a
    flag it does not know)."""
    if cfg.keep_memory:
        keep_freed_memory()
    if not cfg.async_dispatch or _inline:
        jax.config.update("jax_cpu_enable_async_dispatch", cfg.async_dispatch)
        _inline[:] = [] if cfg.async_dispatch else [True]
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in _added]
    _added.clear()
    if cfg.fast_paths and not any(f.startswith(YNN_FUSION_FLAG) for f in flags):  # the user's own flag wins
        _added.append(f"{YNN_FUSION_FLAG}={','.join(cfg.fusion_types)}")
        flags.append(_added[0])
    if flags or "XLA_FLAGS" in os.environ:
        os.environ["XLA_FLAGS"] = " ".join(flags)
