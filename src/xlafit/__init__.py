"""xlafit: data-parallel training on XLA devices (TPU cores, GPUs, CPUs) with JAX.

``xlafit.train_and_evaluate(xlafit.load_config("mnist"))`` runs a recipe end to end;
:class:`Trainer` trains your own Flax NNX model, or a Keras 3 model (``xlafit.keras_models``,
``KERAS_BACKEND=jax``). The subpackages are ``xlafit.train``
(steps, optimizer, loop), ``xlafit.data``, ``xlafit.models`` and ``xlafit.recipes``.

Example:
    >>> import xlafit
    >>> strategy = xlafit.connect()
    >>> strategy.num_replicas >= 1
    True
"""

from xlafit import exitcodes, keras_models
from xlafit.config import Config, ConfigError
from xlafit.devices import Strategy, connect
from xlafit.recipes import load_config
from xlafit.run import train_and_evaluate
from xlafit.train import FitResult, NonFiniteError, Preempted, Trainer, TrainState

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
    "connect",
    "exitcodes",
    "keras_models",
    "load_config",
    "train_and_evaluate",
]
