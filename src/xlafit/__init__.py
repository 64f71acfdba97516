"""xlafit: training on XLA devices (TPU cores, GPUs, CPUs) with JAX.

``xlafit.train_and_evaluate(xlafit.load_config("mnist"))`` runs a recipe end to end, and
``xlafit.evaluate_run("runs/...", data=...)`` scores its checkpoints;
:class:`Trainer` trains your own Flax NNX model, or a Keras 3 model (``xlafit.integrations.keras``,
``KERAS_BACKEND=jax``). The subpackages are ``xlafit.train`` (steps, optimizer, loop),
``xlafit.data``, ``xlafit.models``, ``xlafit.recipes``, ``xlafit.parallel`` (mesh,
sharding, multi-process jobs), ``xlafit.check`` (the XLA rules and TPU compiles) and
``xlafit.hf`` (Hugging Face weights).

Example:
    >>> import xlafit
    >>> strategy = xlafit.connect()
    >>> strategy.num_replicas >= 1
    True
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Any

from xlafit import errors
from xlafit.errors import ConfigError, NonFiniteError, Preempted, XlafitError
from xlafit.parallel.env import SIMULATE_ENV

if os.environ.get(SIMULATE_ENV):
    # XLAFIT_SIMULATE_DEVICES=N makes N CPU devices however JAX is first started after this
    # import (a notebook's model before xlafit.connect()), not only through connect(). It
    # loads JAX, which the variable says will run.
    from xlafit.parallel.cluster import simulate_from_env

    simulate_from_env()

if TYPE_CHECKING:
    from xlafit.config import Config
    from xlafit.parallel.cluster import connect
    from xlafit.parallel.mesh import Strategy
    from xlafit.recipes import load_config
    from xlafit.run import train_and_evaluate
    from xlafit.run_eval import evaluate_run
    from xlafit.train import FitResult, Trainer, TrainState

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "FitResult",
    "NonFiniteError",
    "Preempted",
    "Strategy",
    "TrainState",
    "Trainer",
    "XlafitError",
    "connect",
    "errors",
    "evaluate_run",
    "load_config",
    "train_and_evaluate",
]

# The public names that need JAX are loaded on first use (PEP 562): `import xlafit` and the
# `xlafit` command's --help stay fast, and the command's modules load the library when they run.
_LAZY = {
    "Config": "xlafit.config",
    "connect": "xlafit.parallel.cluster",
    "Strategy": "xlafit.parallel.mesh",
    "load_config": "xlafit.recipes",
    "train_and_evaluate": "xlafit.run",
    "evaluate_run": "xlafit.run_eval",
    "FitResult": "xlafit.train",
    "Trainer": "xlafit.train",
    "TrainState": "xlafit.train",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # the next access finds it directly
        return value
    if importlib.util.find_spec(f"xlafit.{name}") is not None:  # a subpackage: xlafit.train.losses, ...
        return importlib.import_module(f"xlafit.{name}")
    raise AttributeError(f"module 'xlafit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
