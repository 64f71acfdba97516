"""A Keras model as the trainer takes it: its :class:`~xlafit.integrations.keras.module.KerasModule`,
its loss, the trained values written back, and the settings Keras models cannot take refused."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xlafit.config import TrainerConfig
from xlafit.errors import ConfigError
from xlafit.integrations.keras.losses import KerasLoss, compiled_loss, outputs_of
from xlafit.integrations.keras.module import KerasModule
from xlafit.parallel.mesh import Strategy
from xlafit.train.adapter import Adapted, require_data_parallel


def adapt(model: Any, loss: Any = None, metrics: Sequence[Any] | None = None) -> tuple[KerasModule, Any]:
    """What :class:`xlafit.Trainer` and ``xlafit check`` train for a Keras model.

    Args:
        model: a built Keras 3 model.
        loss: a :class:`KerasLoss`, a Keras loss or its name, ``loss(y_true, y_pred)``, or
            None for the loss of ``model.compile``.
        metrics: with a plain loss: the metrics (default: those of ``model.compile``).

    Returns:
        ``(module, loss_fn)``: a :class:`KerasModule` and ``loss_fn(module, batch)`` on
        batches ``{"x": inputs, "y": targets}``.

    Example:
        >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")  # doctest: +ELLIPSIS
        '...'
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> module, loss_fn = adapt(model, "sparse_categorical_crossentropy", ["accuracy"])
        >>> type(module).__name__, loss_fn.names
        ('KerasModule', ['accuracy'])
    """
    module = KerasModule(model)
    if isinstance(loss, KerasLoss):
        return module, loss
    config = model.get_compile_config() if model.compiled else {}
    if loss is None:
        compiled = compiled_loss(model)
        return module, (compiled if metrics is None else KerasLoss(model.loss, metrics, **outputs_of(model, config)))
    if metrics is None:
        metrics = config.get("metrics")
    return module, KerasLoss(loss, metrics, **outputs_of(model))


def to_adapted(model: Any, loss: Any = None, metrics: Sequence[Any] | None = None) -> Adapted:
    """A Keras model as the trainer takes it (:mod:`xlafit.train.adapter`): the module and loss
    of :func:`adapt`, its trained values written back into ``model``, and the settings Keras
    models cannot take refused."""
    module, loss_fn = adapt(model, loss, metrics)
    return Adapted(module, loss_fn, write_back=module.write_back, check=_check_settings)


def _check_settings(strategy: Strategy, config: TrainerConfig) -> None:
    require_data_parallel(strategy, "Keras models")
    if config.invariant_chunks is not None:
        # Keras' dropout seed is plain uint32 state, not a JAX key: every chunk would draw
        # the same masks, a different training from the one the setting promises.
        raise ConfigError(
            "trainer.invariant_chunks does not carry over to Keras models (their dropout seed state "
            "cannot be split per chunk); set trainer.invariant_chunks=null."
        )
