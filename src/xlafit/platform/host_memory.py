"""Whether a model's state can be held in this machine's memory, asked before it is built.

On a CPU the devices are the host: a state larger than the memory the machine has free does
not fail with an error but gets the process killed by the kernel's out-of-memory killer
(a notebook's kernel dies, "session crashed"), after minutes of loading. :func:`refuse_beyond`
refuses such a state first, in one line naming its size, the memory free and the fix (the
TPU compiler answers for a TPU without one: ``xlafit check --tpu``). Only a state that cannot
fit is refused: the activations of a step come on top of it, and are not guessed at.

Example:
    >>> import jax, jax.numpy as jnp
    >>> state_bytes({"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)})
    4194304
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax

from xlafit.errors import ConfigError

MEMINFO = Path("/proc/meminfo")


def available_bytes() -> int | None:
    """The memory this machine can give a process now (Linux's ``MemAvailable``: free memory
    and the caches it can drop), or None where the kernel does not say (macOS, Windows)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def state_bytes(tree: Any) -> int:
    """The bytes the leaves of ``tree`` (arrays or ``ShapeDtypeStruct``s) take on this
    process's devices: a leaf laid out over several devices counts each device's shard, so
    that a replicated leaf counts once per device, as XLA:CPU's simulated devices each hold
    their copy; a leaf with no layout counts once."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            continue
        itemsize = dtype.itemsize  # a PRNG key's too (its extended dtype says its bytes)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            total += math.prod(shape) * itemsize
            continue
        total += len(sharding.addressable_devices) * math.prod(sharding.shard_shape(tuple(shape))) * itemsize
    return total


def materialized_on_cpu() -> bool:
    """Whether arrays made here now are real ones in the host's memory: JAX's devices are
    the CPU, and no ``jit`` or ``eval_shape`` is tracing (where every array is a shape, and
    nothing is allocated)."""
    return jax.devices()[0].platform == "cpu" and not isinstance(jax.numpy.zeros(()), jax.core.Tracer)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def refuse_beyond(nbytes: int, what: str, fix: str) -> None:
    """Raises :class:`~xlafit.errors.ConfigError` when ``nbytes`` (``what``: "the train
    state (parameters and optimizer state)") is more than this machine has free, with
    ``fix``; does nothing where the free memory is unknown."""
    free = available_bytes()
    if free is not None and nbytes > free:
        raise ConfigError(
            f"{what} takes {_gib(nbytes)}, more than the {_gib(free)} of memory this machine has free: on its CPU "
            f"the process would be killed for memory. {fix}"
        )


def check_train_state(state: Any, platform: str) -> None:
    """Refuses a train state (``ShapeDtypeStruct`` leaves with their layouts) that a CPU's
    memory cannot hold, before it is made; nothing on an accelerator, whose memory the
    compiler answers for."""
    if platform == "cpu":  # the devices are the host
        refuse_beyond(
            state_bytes(state),
            "the train state (parameters, optimizer state and model state, on every device that holds them)",
            "Ask whether a TPU holds it with `xlafit check --tpu` (the TPU compiler runs here, no TPU needed); on this "
            "machine, train a smaller model, or on fewer simulated devices where the state is replicated.",
        )
