"""xlafit: training on XLA devices (TPU cores, GPUs, CPUs) with JAX.

``xlafit.train_and_evaluate(xlafit.load_config("mnist"))`` runs a recipe end to end;
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

from xlafit import errors
from xlafit.config import Config
from xlafit.errors import ConfigError, NonFiniteError, Preempted, XlafitError
from xlafit.parallel.cluster import connect
from xlafit.parallel.mesh import Strategy
from xlafit.recipes import load_config
from xlafit.run import train_and_evaluate
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
    "load_config",
    "train_and_evaluate",
]
