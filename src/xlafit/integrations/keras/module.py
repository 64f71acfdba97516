"""A Keras 3 model as an ``nnx.Module`` (:class:`KerasModule`), and the checks that Keras runs on JAX."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlafit.errors import ConfigError


# Keras' own layers broadcast a bias [C] against [B, C]; xlafit's tests (and careful users)
# run with jax_numpy_rank_promotion="raise", which Keras' code was not written for. Keras
# calls are traced under "allow"; the setting stays as the user chose everywhere else.
def keras_numpy() -> Any:
    return jax.numpy_rank_promotion("allow")


def keras_backend() -> Any:
    """The ``keras`` module, after checking that it runs on JAX.

    Raises:
        ConfigError: keras is not installed, or it was imported with another backend.
    """
    try:
        import keras
    except ImportError:
        raise ConfigError("training a Keras model needs keras 3: pip install 'xlafit[keras]'.") from None
    if keras.backend.backend() != "jax":
        raise ConfigError(
            f"keras runs on its {keras.backend.backend()!r} backend; xlafit trains Keras models on JAX: set "
            "KERAS_BACKEND=jax before keras is imported (os.environ['KERAS_BACKEND'] = 'jax' at the top of the script)."
        )
    return keras


def is_keras_model(obj: Any) -> bool:
    """True for a Keras 3 model (without importing keras: an unimported keras made none)."""
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(obj, getattr(keras, "Model", ()))


class KerasState(nnx.Variable):
    """A non-trainable Keras variable: BatchNorm statistics, a dropout seed generator's state."""


class KerasModule(nnx.Module):
    """A Keras 3 model as an ``nnx.Module``: what :class:`xlafit.Trainer` trains.

    Trainable variables become ``nnx.Param`` (in ``model.trainable_variables`` order), the
    others :class:`KerasState`; the Keras model itself is static structure. Built in eval
    mode, as xlafit's models: ``train()`` / ``eval()`` select Keras' ``training=True/False``.

    Args:
        model: a built Keras 3 model (``KERAS_BACKEND=jax``).

    Example:
        >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")  # doctest: +ELLIPSIS
        '...'
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> module = KerasModule(model)
        >>> x = np.ones((4, 3), np.float32)
        >>> kernel, bias = model.get_weights()
        >>> bool(np.allclose(module(x), x @ kernel + bias))
        True
    """

    def __init__(self, model: Any) -> None:
        keras_backend()
        if not model.built:
            raise ConfigError(
                f"the Keras model {model.name!r} is not built, so it has no variables yet; start it with "
                "keras.Input(shape) or call it once on a batch before handing it to xlafit."
            )
        self.keras_model = model
        self.deterministic = True  # nnx's train()/eval() flag: training=not deterministic
        self.params = nnx.List([nnx.Param(jnp.asarray(v.value)) for v in model.trainable_variables])
        self.state = nnx.List([KerasState(jnp.asarray(v.value)) for v in model.non_trainable_variables])

    def forward(self, x: Any) -> tuple[Any, jax.Array]:
        """``(outputs, regularisation loss)``; updates the non-trainable state (in training)."""
        with keras_numpy():
            y, state, losses = self.keras_model.stateless_call(
                [p[...] for p in self.params],
                [s[...] for s in self.state],
                x,
                training=not self.deterministic,
                return_losses=True,
            )
        for variable, value in zip(self.state, state, strict=True):
            variable[...] = value
        reg = sum((jnp.asarray(v, jnp.float32) for v in losses), jnp.zeros((), jnp.float32))
        return y, reg

    def __call__(self, x: Any) -> Any:
        return self.forward(x)[0]

    def write_back(self, params: nnx.State, model_state: nnx.State) -> None:
        """Puts trained values into this module and into the Keras model's variables.

        Each value is copied from its first local shard: the trainer donates its state to
        the next step, and a multi-process job's replicated arrays span other hosts.
        Costs one on-device copy of the parameters per call (checkpoints and the end).
        """

        def local(x: jax.Array) -> jax.Array:
            return x.addressable_data(0).copy()

        nnx.update(self, jax.tree.map(local, params), jax.tree.map(local, model_state))
        model = self.keras_model
        ours: list[nnx.Variable] = [*self.params, *self.state]
        for keras_var, var in zip(model.trainable_variables + model.non_trainable_variables, ours, strict=True):
            keras_var.assign(var[...])
