"""What :class:`~xlafit.train.trainer.Trainer` takes, checked before anything is built,
compiled or written.

A wrong argument from Python (``global_batch="32"``, an optimizer's name instead of the optax
transformation, a dict for ``config``) is refused here, by name, before any compile or run
directory; unchecked, it fails deep inside JAX, or trains nothing (a negative batch). Each check
raises :class:`~xlafit.errors.ConfigError` naming the argument, what it got and what it takes. Numbers
follow the config's own rules (:func:`xlafit.config.check_type`,
:func:`xlafit.config.check_positive`), so the command and Python refuse a batch in the same words.

Example:
    >>> check_batches(-4, None, num_replicas=8)
    Traceback (most recent call last):
    ...
    xlafit.errors.ConfigError: global_batch=-4 must be a positive number.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

import optax
from flax import nnx

from xlafit.config import (
    DataConfig,
    OptimizerConfig,
    TrainerConfig,
    check_non_negative,
    check_positive,
    check_type,
    resolve_batch,
)
from xlafit.errors import ConfigError
from xlafit.parallel.mesh import Strategy
from xlafit.train.adapter import Adapted, framework_of

MODEL_KINDS = (
    "an nnx.Module, a function that builds one (lambda: MLP(nnx.Rngs(0))), a Keras 3 model or a torch.nn.Module"
)


def check_arguments(
    model: Any,
    loss_fn: Any,
    optimizer: Any,
    *,
    strategy: Any,
    config: Any,
    learning_rate: Any,
    run_dir: Any,
    checkpoint_dir: Any,
    data_seed: Any,
    prefetch: Any,
    resume: Any,
    tokens_per_example: Any,
    flops_per_example: Any,
) -> None:
    """Refuses the first argument of ``Trainer(...)`` it cannot train with (the batches:
    :func:`check_batches`, once the strategy says how many shards they split into).

    Raises:
        ConfigError: names the argument, the type or value it got, and what it takes.
    """
    check_model(model, loss_fn)
    if isinstance(optimizer, OptimizerConfig) and learning_rate is not None:
        raise ConfigError(
            "learning_rate (only logged) is for an optax optimizer: an OptimizerConfig's schedule is logged as it is. "
            "Leave learning_rate out."
        )
    if not isinstance(optimizer, optax.GradientTransformation | OptimizerConfig):
        keras = framework_of(optimizer) == "keras"
        convert = "xlafit.integrations.keras.optax_from_keras(optimizer, model)"
        hint = f"; a Keras optimizer converts with {convert}" if keras else ""
        raise ConfigError(
            "optimizer must be an optax.GradientTransformation (e.g. optax.adamw(1e-3)) or an "
            f"xlafit.config.OptimizerConfig (its rate scaled with the global batch), got {_kind(optimizer)}{hint}."
        )
    if strategy is not None and not isinstance(strategy, Strategy):
        raise ConfigError(
            f"strategy must be what xlafit.connect() returns (a Strategy), or None for every device; "
            f"got {_kind(strategy)}."
        )
    if config is not None and not isinstance(config, TrainerConfig):
        hint = f": TrainerConfig(**{dict(config)!r}) builds one" if isinstance(config, Mapping) else ""
        raise ConfigError(f"config must be an xlafit.config.TrainerConfig, got {_kind(config)}{hint}.")
    if not (learning_rate is None or callable(learning_rate) or _is_real(learning_rate)):
        raise ConfigError(
            "learning_rate (only logged) must be the optax schedule inside the optimizer (step -> rate), a number "
            f"or None; got {_kind(learning_rate)}."
        )
    for name, path in (("run_dir", run_dir), ("checkpoint_dir", checkpoint_dir)):
        if path is not None and not isinstance(path, str | os.PathLike):
            raise ConfigError(f"{name} must be a str or os.PathLike (a directory or gs:// URL), got {_kind(path)}.")
    check_type(data_seed, int, "data_seed")
    check_type(prefetch, int, "prefetch")
    check_non_negative(prefetch, "prefetch")
    check_type(resume, bool, "resume")
    for name, value in (("tokens_per_example", tokens_per_example), ("flops_per_example", flops_per_example)):
        check_type(value, float | None, name)
        check_positive(value, name)


def check_model(model: Any, loss_fn: Any) -> None:
    """Refuses a model of no kind the trainer takes, and a loss that is no function of an
    ``nnx.Module``'s (a foreign model's adapter checks its own: Keras takes a loss's name)."""
    foreign = isinstance(model, Adapted) or framework_of(model) is not None
    if not (foreign or isinstance(model, nnx.Module) or callable(model)):
        raise ConfigError(f"model must be {MODEL_KINDS}; got {_kind(model)}.")
    if not foreign and not callable(loss_fn):
        raise ConfigError(
            "loss_fn must be a callable (model, batch) -> per-example losses [B] (or (losses, {metric: values})); "
            f"got {_kind(loss_fn)}."
        )


def global_batch_of(global_batch: Any, per_device_batch: Any, num_replicas: int) -> Any:
    """The global batch ``Trainer`` was given, or ``per_device_batch`` x ``num_replicas`` (the
    strategy's batch shards), as a recipe's ``data.per_device_batch`` resolves.

    Example:
        >>> global_batch_of(None, 16, num_replicas=8)
        128

    Raises:
        ConfigError: both given, or neither, or a per-device batch that is no positive int.
    """
    if global_batch is not None and per_device_batch is not None:
        raise ConfigError(
            f"give global_batch={global_batch} or per_device_batch={per_device_batch}, not both "
            f"(the global batch is per_device_batch x the strategy's {num_replicas} replicas)."
        )
    if per_device_batch is None:
        if global_batch is None:
            raise ConfigError(
                "Trainer needs global_batch= (the examples per optimizer step over all devices) or "
                f"per_device_batch= (the examples per device, times the strategy's {num_replicas} replicas)."
            )
        return global_batch
    check_type(per_device_batch, int, "per_device_batch")
    check_positive(per_device_batch, "per_device_batch")
    return resolve_batch(DataConfig(per_device_batch=per_device_batch), num_replicas)[1]


def check_batches(global_batch: Any, eval_global_batch: Any, num_replicas: int) -> None:
    """Refuses a train or eval batch that is no positive int, or that does not divide evenly
    over the ``num_replicas`` batch shards of the strategy."""
    for name, batch in (("global_batch", global_batch), ("eval_global_batch", eval_global_batch)):
        check_type(batch, int if name == "global_batch" else int | None, name)
        check_positive(batch, name)
        if batch is not None and batch % num_replicas:
            raise ConfigError(
                f"{name}={batch} does not divide over {num_replicas} devices; "
                f"use a multiple of {num_replicas} (e.g. {max(batch // num_replicas * num_replicas, num_replicas)})."
            )


def built(builder: Callable[[], nnx.Module]) -> Callable[[], nnx.Module]:
    """``builder`` run with Flax's eager sharding off: an ``nnx.with_partitioning`` annotation
    stays a name for the sharding rules (xlafit.parallel.sharding) instead of asking for a
    mesh whose axes carry the model's own names. What it returns must be an ``nnx.Module``."""

    def build() -> nnx.Module:
        with nnx.use_eager_sharding(False):
            model = builder()
        if not isinstance(model, nnx.Module):
            raise ConfigError(
                f"the model function returned {_kind(model)}, not an nnx.Module; it must build the model "
                "(lambda: MLP(nnx.Rngs(0))), or pass the model itself (a Keras 3 model or torch.nn.Module)."
            )
        return model

    return build


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """``value``'s type as a message names it: ``str``, ``NoneType``, ``dict``."""
    return type(value).__name__
