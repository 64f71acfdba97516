"""Keras optimizers as optax transformations, with Keras' own Adam arithmetic."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from xlafit.errors import ConfigError
from xlafit.integrations.keras.module import keras_backend


class KerasAdamState(NamedTuple):
    steps: jax.Array  # the number of updates so far (Keras' iterations)
    mu: optax.Updates  # Keras' m
    nu: optax.Updates  # Keras' v


def scale_by_keras_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-7) -> optax.GradientTransformation:
    """Adam as Keras computes it: ``m += (g - m)(1 - b1)``, ``v += (g^2 - v)(1 - b2)``,
    ``m * sqrt(1 - b2^t) / (1 - b1^t) / (sqrt(v) + eps)``.

    The same update as ``optax.scale_by_adam`` in exact arithmetic, except that Keras adds
    epsilon before the bias correction (optax after). Written the way Keras writes it, the
    moments round as Keras' do, and XLA:CPU fuses the update into fewer passes over the
    parameters than optax's ``(1 - b1) g + b1 m``, which keeps xlafit as fast as Keras' own
    ``fit`` on simulated devices.
    """

    def init(params: optax.Params) -> KerasAdamState:
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return KerasAdamState(jnp.zeros([], jnp.int32), zeros(), zeros())

    def update(updates: optax.Updates, state: KerasAdamState, params: optax.Params | None = None):
        del params
        steps = state.steps + 1
        mu = jax.tree.map(lambda m, g: m + (g - m) * (1 - b1), state.mu, updates)
        nu = jax.tree.map(lambda v, g: v + (g * g - v) * (1 - b2), state.nu, updates)
        t = steps.astype(jnp.float32)
        correction = jnp.sqrt(1 - b2**t) / (1 - b1**t)
        updates = jax.tree.map(lambda m, v: m * correction / (jnp.sqrt(v) + eps), mu, nu)
        return updates, KerasAdamState(steps, mu, nu)

    return optax.GradientTransformation(init, update)


def optax_from_keras(optimizer: Any, model: Any = None) -> optax.GradientTransformation:
    """The optax equivalent of a Keras ``Adam``, ``AdamW`` or ``SGD`` with a constant rate.

    Same hyperparameters (Keras' defaults included: Adam's epsilon is 1e-7) and, for Adam
    and AdamW, Keras' own arithmetic (:func:`scale_by_keras_adam`), so a model trains as
    Keras' ``fit`` would train it.

    Args:
        optimizer: a Keras optimizer.
        model: the Keras model it trains; needed where the optimizer excludes variables
            from weight decay (``exclude_from_weight_decay``): the decay then skips the
            parameters Keras would skip.

    Returns:
        An optax transformation of the parameters :class:`xlafit.Trainer` trains for the model.

    Raises:
        ConfigError: another optimizer, a schedule, a setting optax has no twin for, or
            weight-decay exclusions without the model.

    Example:
        >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")  # doctest: +ELLIPSIS
        '...'
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> adamw = keras.optimizers.AdamW(1e-3, weight_decay=0.01)
        >>> adamw.exclude_from_weight_decay(var_names=["bias"])
        >>> tx = optax_from_keras(adamw, model)  # decays the kernel only, as Keras does
    """
    keras = keras_backend()
    name = type(optimizer).__name__
    cfg = optimizer.get_config()
    lr = cfg.get("learning_rate")
    how = "pass an optax transformation instead (optax.adam(1e-3), optax.sgd(0.1, momentum=0.9), ...)"
    if not isinstance(lr, float):
        raise ConfigError(
            f"the Keras {name} has a learning-rate schedule, which xlafit does not translate; {how} with an optax "
            "schedule, or an xlafit.config.OptimizerConfig (warmup, decay, scaling with the batch)."
        )
    for key, default in (("clipnorm", None), ("clipvalue", None), ("use_ema", False), ("amsgrad", False)):
        if cfg.get(key, default) != default:
            raise ConfigError(f"the Keras {name} sets {key}={cfg[key]}, which xlafit does not translate; {how}.")
    if cfg.get("gradient_accumulation_steps"):
        raise ConfigError(
            f"the Keras {name} accumulates gradients; set TrainerConfig(accumulate_steps=...) instead, and {how}."
        )
    if isinstance(optimizer, keras.optimizers.Adam):  # AdamW is an Adam with weight_decay set
        adam = scale_by_keras_adam(cfg["beta_1"], cfg["beta_2"], cfg["epsilon"])
        # Keras decays every variable (lr x weight_decay x value) unless excluded.
        wd = cfg.get("weight_decay")
        decay = [optax.add_decayed_weights(wd, mask=_decay_mask(optimizer, model, name))] if wd else []
        opt = optax.chain(adam, *decay, optax.scale_by_learning_rate(lr))
    elif isinstance(optimizer, keras.optimizers.SGD) and not cfg.get("weight_decay"):
        opt = optax.sgd(lr, momentum=cfg["momentum"] or None, nesterov=cfg["nesterov"])
    else:
        raise ConfigError(f"xlafit translates Keras Adam, AdamW and SGD, not {name} with {cfg}; {how}.")
    clip = cfg.get("global_clipnorm")
    return optax.chain(optax.clip_by_global_norm(clip), opt) if clip else opt


def _decay_mask(optimizer: Any, model: Any, name: str) -> Any:
    """Which parameters the Keras optimizer decays, as optax's ``mask``: None for all of them,
    or a function of the parameters' tree (Keras' own ``_use_weight_decay`` per variable)."""
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
        optimizer, "_exclude_from_weight_decay_pattern", None
    )
    if not excluded:
        return None
    decides = getattr(optimizer, "_use_weight_decay", None)
    if decides is None:
        raise ConfigError(
            f"the Keras {name} excludes variables from weight decay, and this Keras does not say which "
            "(no _use_weight_decay); pass optax.adamw(..., mask=...) instead."
        )
    if model is None:
        raise ConfigError(
            f"the Keras {name} excludes variables from weight decay (exclude_from_weight_decay), which xlafit maps "
            "onto the parameters it trains through the model: pass the model too: optax_from_keras(optimizer, model)."
        )
    flags = [bool(decides(v)) for v in model.trainable_variables]
    names = [v.path for v in model.trainable_variables]

    def mask(params: Any) -> Any:
        # KerasModule keeps the trainable variables as params[i], in model.trainable_variables order.
        def decayed(path: tuple, _: Any) -> bool:
            index = next((k.key for k in path if isinstance(getattr(k, "key", None), int)), None)
            if index is None or not 0 <= index < len(flags):
                raise ConfigError(
                    f"the Keras {name} excludes variables from weight decay, and the parameter "
                    f"{jax.tree_util.keystr(path)} is not one of the model's {len(flags)} trainable variables "
                    f"({', '.join(names[:4])}, ...); train the Keras model itself, or use optax.adamw(..., mask=...)."
                )
            return flags[index]

        tree = jax.tree_util.tree_map_with_path(decayed, params)
        if len(jax.tree.leaves(tree)) != len(flags):
            raise ConfigError(
                f"the Keras {name} excludes variables from weight decay, but the parameters trained "
                f"({len(jax.tree.leaves(tree))}) are not the model's {len(flags)} trainable variables; train the "
                "Keras model with the default trainable filter, or use optax.adamw(..., mask=...)."
            )
        return tree

    return mask
