"""A jitted function compiled ahead of time once per input signature, counted and timed.

:class:`CompiledStep` runs the train and eval steps (:mod:`xlafit.train.step` builds them):
every compile is logged with the input shapes that caused it, timed apart from the steps,
and refused past ``trainer.max_compiles`` before any time is spent compiling.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import jax

from xlafit.config import TrainerConfig
from xlafit.data.dataset import Dataset, num_shapes
from xlafit.errors import RecompileError
from xlafit.train.traced import at_users_line

log = logging.getLogger("xlafit")


def _signature(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten_with_path(tree)
    return (str(treedef), tuple((jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in leaves))


def _input_name(path: str) -> str:
    """``[0]['input_ids']`` (the first input's key) -> ``input_ids``; ``[1]`` -> ``input 1``."""
    parts = re.findall(r"\[['\"]?([^\]'\"]*)['\"]?\]", path)
    if parts and parts[0] == "0" and len(parts) > 1:
        parts = parts[1:]
    return "/".join(parts) if len(parts) != 1 or not parts[0].isdigit() else f"input {parts[0]}"


def signature_change(old: tuple | None, new: tuple) -> str:
    """What differs between two input signatures, e.g. ``input_ids [32, 128]:int32 -> [32, 96]:int32``."""
    if old is None:
        return "first inputs: " + ", ".join(f"{_input_name(p)} {list(s)}:{d}" for p, s, d in new[1])
    before = {p: (s, d) for p, s, d in old[1]}
    after = {p: (s, d) for p, s, d in new[1]}
    parts = []
    for path in sorted(set(before) | set(after)):
        if before.get(path) != after.get(path):
            fmt = lambda sd: "absent" if sd is None else f"{list(sd[0])}:{sd[1]}"  # noqa: E731
            parts.append(f"{_input_name(path)} {fmt(before.get(path))} -> {fmt(after.get(path))}")
    return "; ".join(parts) or "the input structure changed"


class CompiledStep:
    """Compiles a jitted function ahead of time, once per input signature, and counts it.

    Every compile is logged with the input shapes that caused it (and what changed since
    the previous one) and timed apart from the steps, so "did my step recompile?" has a
    direct answer: :attr:`compiles`. With ``max_compiles``, one compile more raises
    :class:`RecompileError` naming the changed input, before any time is spent compiling.
    """

    def __init__(self, name: str, fn: Callable, max_compiles: int | None = None, **jit_kwargs: Any) -> None:
        self.name = name
        self._jitted = jax.jit(fn, **jit_kwargs)
        self._cache: dict[tuple, Any] = {}
        self._last_key: tuple | None = None
        self.max_compiles = max_compiles
        self.compiles = 0
        self.compile_s = 0.0

    def __call__(self, *args: Any) -> Any:
        return self.precompile(*args)(*args)

    def precompile(self, *args: Any) -> Any:
        """The compiled program for inputs shaped like ``args`` (arrays or
        ``ShapeDtypeStruct``), compiling and counting it if it is new."""
        key = _signature(args[1:])  # the state's signature never changes
        compiled = self._cache.get(key)
        if compiled is None:
            change = signature_change(self._last_key, key)
            if self.max_compiles is not None and self.compiles >= self.max_compiles:
                raise RecompileError(
                    f"the {self.name} would compile program #{self.compiles + 1}, over trainer.max_compiles="
                    f"{self.max_compiles}: {change}. Every new input shape compiles a new XLA program (minutes "
                    "on a TPU). Give batches fixed shapes: pad to a multiple (xlafit.data.shapes.pad_batch), "
                    "bucket with plan_buckets/bucket_batches, keep the last batch full; or raise "
                    "trainer.max_compiles if the new shape is planned."
                )
            t0 = time.perf_counter()
            try:
                compiled = self._jitted.lower(*args).compile()
            except Exception as e:  # the user's code, traced: a line naming it, where it is that
                raise at_users_line(e, self.name) from e
            seconds = time.perf_counter() - t0
            self._cache[key] = compiled
            self._last_key = key
            self.compiles += 1
            self.compile_s += seconds
            log.info("compiled %s #%d in %.2fs (%s)", self.name, self.compiles, seconds, change)
        return compiled

    def flops_for(self, *args: Any) -> float | None:
        """FLOPs of one call on inputs shaped like ``args`` (arrays or ``ShapeDtypeStruct``),
        from XLA's cost analysis; compiles a program that is neither kept nor counted.

        Inside a ``lax.scan`` XLA counts the loop body once, so ask with a single step.
        """
        return _flops(self._jitted.lower(*args).compile())


def _flops(compiled: Any) -> float | None:
    """Total FLOPs of a compiled program per XLA's cost analysis (per device for SPMD), or None."""
    try:
        return float((compiled.cost_analysis() or {}).get("flops", 0.0)) or None
    except Exception:  # cost analysis is optional on some backends
        return None


def limit_compiles(
    train_step: CompiledStep,
    eval_step: CompiledStep,
    cfg: TrainerConfig,
    calls: int,
    train: Dataset,
    eval: Dataset | None,
) -> None:
    """Sets each step's ``max_compiles``: ``trainer.max_compiles``, or by default the
    programs a run plans: the distinct steps-per-call values of its ``calls`` times the
    dataset's shapes (1 for arrays; the bucket count for bucketed data). Any other compile
    is a shape nobody planned, and an error naming it."""
    if cfg.max_compiles is not None:
        train_step.max_compiles = eval_step.max_compiles = cfg.max_compiles
    elif cfg.nan_policy != "rollback":  # a rollback may restart calls at any checkpoint
        train_step.max_compiles = calls * num_shapes(train)
        eval_step.max_compiles = num_shapes(eval)
