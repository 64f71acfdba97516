"""Orbax checkpoints of the whole :class:`~xlafit.train.step.TrainState`.

Saves are asynchronous (training continues while the arrays are written) and atomic
(Orbax writes to a temporary directory and renames it when complete), so an interrupted
save never shadows the previous checkpoint. Typed PRNG keys are stored as their raw
``uint32`` key data.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger("xlafit")


def is_prng_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_saveable(tree: Any) -> Any:
    """Replaces typed PRNG key arrays by their ``uint32`` key data."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_prng_key(x) else x, tree)


def from_saveable(raw: Any, like: Any) -> Any:
    """Inverse of :func:`to_saveable`, using ``like`` to know which leaves were keys."""
    return jax.tree.map(
        lambda r, ref: jax.random.wrap_key_data(r, impl=jax.random.key_impl(ref)) if is_prng_key(ref) else r, raw, like
    )


def _abstract(tree: Any) -> Any:
    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        data = jax.random.key_data(x) if is_prng_key(x) else x
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


class Checkpointer:
    """Keeps the last ``keep`` checkpoints of a run under ``directory``.

    Example:
        >>> ckpt = Checkpointer("/tmp/run/checkpoints", keep=3)  # doctest: +SKIP
        >>> ckpt.save(100, state); ckpt.wait()  # doctest: +SKIP
        >>> state = ckpt.restore(state)  # doctest: +SKIP
    """

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True) -> None:
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any) -> None:
        """Starts writing ``state`` as checkpoint ``step`` (returns before it is on disk)."""
        self._manager.save(step, args=ocp.args.StandardSave(to_saveable(state)), force=True)

    def restore(self, like: Any, step: int | None = None) -> Any:
        """Restores checkpoint ``step`` (default: the newest) with the shardings of ``like``."""
        step = self.latest_step() if step is None else step
        raw = self._manager.restore(step, args=ocp.args.StandardRestore(_abstract(like)))
        return from_saveable(raw, like)

    def wait(self) -> None:
        """Blocks until every save started so far is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
