"""xlafit: data-parallel training on XLA devices (TPU cores, GPUs, CPUs) with JAX.

Example:
    >>> import xlafit
    >>> strategy = xlafit.connect()
    >>> strategy.num_replicas >= 1
    True
"""

from xlafit.config import Config, ConfigError
from xlafit.devices import Strategy, connect
from xlafit.recipes import load_config, train
from xlafit.train import FitResult, Trainer, TrainState

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "FitResult",
    "Strategy",
    "TrainState",
    "Trainer",
    "connect",
    "load_config",
    "train",
]
