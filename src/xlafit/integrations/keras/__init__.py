"""Keras 3 models in xlafit: the Keras model as an ``nnx.Module``, its loss as a ``loss_fn``.

Keras 3 on the JAX backend already has a pure function of a model:
``model.stateless_call(trainable, non_trainable, x, training=...)`` returns the outputs,
the new non-trainable values (BatchNorm statistics, dropout seed state) and, with
``return_losses=True``, the regularisation losses. :class:`KerasModule` holds the trainable
values as ``nnx.Param`` and the others as :class:`KerasState`, so :class:`xlafit.Trainer`
trains a Keras model through the very code path of its NNX models: k steps per call,
prefetch, exact evaluation, checkpoints and exact resume, SIGTERM, the NaN policy,
multi-process jobs and the recompile guard are the same code, not a second loop.

``Trainer(keras_model, loss, optimizer, ...)`` wraps the model itself (:func:`adapt`) and
writes the trained values back into it at every checkpoint and at the end of ``fit``, so
``keras_model.predict`` and ``keras_model.save("x.keras")`` see them. :func:`fit` is the
``model.fit``-shaped entry point on top (``validation_data``, a ``History`` with Keras'
metric names); Keras features that do not carry over raise a :class:`ConfigError` that
names the xlafit equivalent. Batches are dicts with ``"x"`` (the model's input) and
``"y"`` (the target).

Keras is imported only when a Keras model is used; set ``KERAS_BACKEND=jax`` before it is
imported.
"""

from xlafit.integrations.keras.adapt import adapt, to_adapted
from xlafit.integrations.keras.batch import flatten, unflatten
from xlafit.integrations.keras.fitting import CALLBACKS, UNSUPPORTED, History, fit
from xlafit.integrations.keras.losses import KerasLoss, compiled_loss
from xlafit.integrations.keras.module import KerasModule, KerasState, is_keras_model, keras_backend
from xlafit.integrations.keras.optimizers import KerasAdamState, optax_from_keras, scale_by_keras_adam

__all__ = [
    "CALLBACKS",
    "UNSUPPORTED",
    "History",
    "KerasAdamState",
    "KerasLoss",
    "KerasModule",
    "KerasState",
    "adapt",
    "compiled_loss",
    "fit",
    "flatten",
    "is_keras_model",
    "keras_backend",
    "optax_from_keras",
    "scale_by_keras_adam",
    "to_adapted",
    "unflatten",
]
