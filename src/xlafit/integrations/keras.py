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

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xlafit.config import OptimizerConfig, TrainerConfig
from xlafit.data.dataset import Dataset, as_dataset
from xlafit.errors import ConfigError
from xlafit.parallel.mesh import Strategy
from xlafit.train.adapter import Adapted, require_data_parallel
from xlafit.train.optim import make_optimizer
from xlafit.train.trainer import FitResult, Trainer


# Keras' own layers broadcast a bias [C] against [B, C]; xlafit's tests (and careful users)
# run with jax_numpy_rank_promotion="raise", which Keras' code was not written for. Keras
# calls are traced under "allow"; the setting stays as the user chose everywhere else.
def _keras_numpy() -> Any:
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
        with _keras_numpy():
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


# --------------------------------------------------------------------------- loss and metrics


def _resolve_loss(keras: Any, loss: Any) -> Callable:
    """A Keras loss (object, name, or function of ``(y_true, y_pred)``) as an unreduced function."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        # Loss.call is the unreduced loss of Keras' convention; __call__ would reduce it.
        return loss.call
    if callable(loss):
        return loss
    raise ConfigError(
        f"loss must be a Keras loss, its name ('sparse_categorical_crossentropy') or a function "
        f"loss(y_true, y_pred) -> one value per example; got a {type(loss).__name__}."
    )


def _accuracy_for(keras: Any, y_true: Any, y_pred: Any) -> Callable:
    """Keras' choice for "accuracy": binary, sparse categorical or categorical, by the shapes."""
    binary = y_pred.shape[-1] == 1
    sparse = y_true.ndim < y_pred.ndim or (y_true.shape[-1] == 1 and y_pred.shape[-1] > 1)
    if binary:
        return keras.metrics.binary_accuracy
    return keras.metrics.sparse_categorical_accuracy if sparse else keras.metrics.categorical_accuracy


def _resolve_metric(keras: Any, metric: Any) -> tuple[str, Any]:
    """``(history name, function or "accuracy")`` of one Keras metric, as Keras names it."""
    if isinstance(metric, Mapping):  # a serialised metric, from model.get_compile_config()
        metric = keras.metrics.deserialize(metric)
    name: str | None = None
    if isinstance(metric, str):
        if metric.lower() in ("accuracy", "acc"):
            return metric, "accuracy"
        name, metric = metric, keras.metrics.get(metric)  # Keras keeps the name it was given
    if isinstance(metric, keras.metrics.MeanMetricWrapper):
        # A mean of a per-example function: the function is the metric.
        fn, kwargs = metric._fn, metric._fn_kwargs
        return str(name or metric.name), (lambda y_true, y_pred: fn(y_true, y_pred, **kwargs))
    if isinstance(metric, keras.metrics.Metric):
        raise ConfigError(
            f"the Keras metric {metric.name!r} ({type(metric).__name__}) keeps state across batches, so it is not "
            "a mean of per-example values, which xlafit's evaluation needs to count every example once; pass a "
            "function metric(y_true, y_pred) -> one value per example instead, or compute it after fit with "
            "model.predict."
        )
    if callable(metric):
        return str(name or getattr(metric, "__name__", type(metric).__name__)), metric
    raise ConfigError(f"a metric must be a Keras metric, its name or a function; got a {type(metric).__name__}.")


def _per_example(values: Any) -> jax.Array:
    """Keras' unreduced values ``[B, ...]`` -> ``[B]`` float32: the mean over the other axes,
    which is Keras' own "sum over batch size" once averaged over the batch."""
    values = jnp.asarray(values, jnp.float32)
    return values.mean(axis=tuple(range(1, values.ndim))) if values.ndim > 1 else values


class KerasLoss:
    """A Keras loss and metrics as xlafit's ``loss_fn(module, batch)``.

    Returns per-example losses (with the model's regularisation losses added to each, so
    their mean is Keras' total loss) and per-example metrics named as Keras names them.

    Args:
        loss: a Keras loss, its name, or ``loss(y_true, y_pred)`` returning one value per
            example (more axes are averaged).
        metrics: Keras metrics that are means of per-example values (``"accuracy"``,
            ``keras.metrics.SparseCategoricalAccuracy()``, ...) or functions
            ``metric(y_true, y_pred)``.
        x, y: the batch keys of the model's input and the target.

    Example:
        >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")  # doctest: +ELLIPSIS
        '...'
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> loss_fn = KerasLoss("sparse_categorical_crossentropy", ["accuracy"])
        >>> batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros(4, np.int32)}
        >>> losses, metrics = loss_fn(KerasModule(model), batch)
        >>> losses.shape, sorted(metrics)
        ((4,), ['accuracy'])
    """

    def __init__(
        self,
        loss: Any,
        metrics: Sequence[Any] | None = None,
        *,
        x: str = "x",
        y: str = "y",
        output_names: Sequence[str] | None = None,
        loss_weights: Any = None,
    ) -> None:
        keras = keras_backend()
        # One loss, or one per output (a list in output order, or a dict by output name).
        if isinstance(loss, Mapping):
            self._loss: Any = {k: _resolve_loss(keras, v) for k, v in loss.items()}
        elif isinstance(loss, list | tuple):
            self._loss = [_resolve_loss(keras, v) for v in loss]
        else:
            self._loss = _resolve_loss(keras, loss)
        self._loss_weights = loss_weights
        self.output_names = list(output_names or [])
        self._metrics = self._metric_table(keras, metrics)
        several = len(self.output_names) > 1  # Keras' names for several outputs: <output>_<metric>
        self.names = [
            f"{o}_{m}" if several else m
            for o in self.output_names or [""]
            for m in {**self._metrics.get("", {}), **self._metrics.get(o, {})}
        ]
        self.x, self.y = x, y

    def _metric_table(self, keras: Any, metrics: Any) -> dict[str, dict[str, Any]]:
        """``{output name: {metric name: metric}}``; ``""``: metrics of every output. Metrics
        come as Keras' compile takes them: a list, a list per output, or a dict by output."""
        resolve = lambda ms: dict(_resolve_metric(keras, m) for m in ([ms] if isinstance(ms, str) else ms or ()))  # noqa: E731
        if isinstance(metrics, Mapping):
            return {str(o): resolve(ms) for o, ms in metrics.items()}
        per_output = len(self.output_names) > 1 and bool(metrics)
        if per_output and all(m is None or isinstance(m, list | tuple) for m in metrics):
            return {o: resolve(ms) for o, ms in zip(self.output_names, metrics, strict=True)}
        return {"": resolve(metrics)}

    def __call__(self, module: KerasModule, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
        x, y_true = unflatten(batch, self.x), unflatten(batch, self.y)
        missing = [k for k, v in ((self.x, x), (self.y, y_true)) if v is None]
        if missing:
            raise ConfigError(
                f"a Keras model's batches need the keys {self.x!r} (the input) and {self.y!r} (the target); "
                f"{', '.join(map(repr, missing))} missing from {sorted(batch)}. Pass {{'x': x, 'y': y}}."
            )
        y_pred, reg = module.forward(x)
        # Keras' Loss.__call__ computes in float32 under mixed precision; Loss.call does not cast.
        y_pred = jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, y_pred)
        with _keras_numpy():
            pairs = self._outputs(y_true, y_pred)
            for output, loss, _, t, p in pairs:
                _check_labels(loss, t, p, output)
            losses = reg + sum(w * _per_example(loss(t, p)) for _, loss, w, t, p in pairs)
            metrics = {}
            for output, _, _, t, p in pairs:
                for name, fn in {**self._metrics.get("", {}), **self._metrics.get(output, {})}.items():
                    if fn == "accuracy":
                        fn = _accuracy_for(keras_backend(), t, p)
                    metrics[f"{output}_{name}" if len(pairs) > 1 else name] = _per_example(fn(t, p))
        return losses, metrics

    def _outputs(self, y_true: Any, y_pred: Any) -> list[tuple[str, Callable, float, Any, Any]]:
        """``(output name, its loss, its weight, target, prediction)`` per model output."""
        if not isinstance(y_pred, list | tuple | Mapping):
            return [("", self._loss, 1.0, y_true, y_pred)]
        names = self.output_names or [str(i) for i in range(len(y_pred))]
        preds = dict(y_pred) if isinstance(y_pred, Mapping) else dict(zip(names, y_pred, strict=True))
        if isinstance(y_true, Mapping):
            trues = dict(y_true)
        elif isinstance(y_true, list | tuple) and len(y_true) == len(preds):
            trues = dict(zip(preds, y_true, strict=True))
        else:
            raise ConfigError(
                f"the model has {len(preds)} outputs ({', '.join(preds)}): give y as a list of {len(preds)} arrays "
                "or a dict by output name, as Keras' fit takes it."
            )
        out = []
        for i, name in enumerate(preds):
            if name not in trues:
                raise ConfigError(f"y has no target for the output {name!r}; its keys: {', '.join(trues)}.")
            out.append(
                (
                    name,
                    self._per_output(self._loss, name, i),
                    self._per_output(self._loss_weights, name, i, 1.0),
                    trues[name],
                    preds[name],
                )
            )
        return out

    @staticmethod
    def _per_output(value: Any, name: str, index: int, default: Any = None) -> Any:
        """A list's ``index``-th item, a dict's ``name`` entry, or the value itself."""
        if isinstance(value, Mapping):
            return value.get(name, default)
        if isinstance(value, list | tuple):
            return value[index]
        return default if value is None else value


def _check_labels(loss: Callable, y_true: Any, y_pred: Any, output: str) -> None:
    """One-hot labels with a sparse loss, or class indices with a categorical one: named with
    the fix instead of Keras' own shape error from inside the loss."""
    owner = getattr(loss, "__self__", None)  # Loss.call, bound to the Keras loss object
    name = str(getattr(owner, "name", None) or getattr(loss, "__name__", ""))
    shape_t, shape_p = tuple(getattr(y_true, "shape", ())), tuple(getattr(y_pred, "shape", ()))
    if not shape_p or shape_p[-1] < 2:
        return
    one_hot = len(shape_t) == len(shape_p) and shape_t[-1] == shape_p[-1]
    of = f" of the output {output!r}" if output else ""
    if "sparse_categorical" in name and one_hot:
        raise ConfigError(
            f"the labels{of} are one-hot ({list(shape_t)}) but the loss {name} takes class indices "
            f"({list(shape_t[:-1])}); use categorical_crossentropy, or pass y.argmax(-1) as the labels."
        )
    if "sparse" not in name and "categorical" in name and len(shape_t) < len(shape_p):
        raise ConfigError(
            f"the labels{of} are class indices ({list(shape_t)}) but the loss {name} takes one-hot labels "
            f"({[*shape_t, shape_p[-1]]}); use sparse_categorical_crossentropy, or one-hot encode the labels."
        )


def compiled_loss(model: Any) -> KerasLoss:
    """The loss and metrics given to ``model.compile``, as a :class:`KerasLoss`.

    Raises:
        ConfigError: the model was not compiled with a loss.
    """
    keras_backend()
    if getattr(model, "loss", None) is None:
        raise ConfigError(
            "the Keras model was not compiled with a loss: pass loss= (a Keras loss, its name or "
            "loss(y_true, y_pred)), or call model.compile(loss=..., metrics=[...]) first."
        )
    config = model.get_compile_config() if model.compiled else {}
    return KerasLoss(model.loss, config.get("metrics") or (), **_outputs_of(model, config))


def _outputs_of(model: Any, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The model's output names and its compiled loss weights, for a :class:`KerasLoss`."""
    weights = (config or {}).get("loss_weights")
    return {"output_names": list(getattr(model, "output_names", None) or []), "loss_weights": weights}


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
        return module, (compiled if metrics is None else KerasLoss(model.loss, metrics, **_outputs_of(model, config)))
    if metrics is None:
        metrics = config.get("metrics")
    return module, KerasLoss(loss, metrics, **_outputs_of(model))


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


# --------------------------------------------------------------------------- optimizers


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


def optax_from_keras(optimizer: Any) -> optax.GradientTransformation:
    """The optax equivalent of a Keras ``Adam``, ``AdamW`` or ``SGD`` with a constant rate.

    Same hyperparameters (Keras' defaults included: Adam's epsilon is 1e-7) and, for Adam
    and AdamW, Keras' own arithmetic (:func:`scale_by_keras_adam`), so a model trains as
    Keras' ``fit`` would train it.

    Raises:
        ConfigError: another optimizer, a schedule, or a setting optax has no twin for.
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
        # Keras decays every variable (lr x weight_decay x value) unless excluded by name.
        decay = [optax.add_decayed_weights(cfg["weight_decay"])] if cfg.get("weight_decay") else []
        opt = optax.chain(adam, *decay, optax.scale_by_learning_rate(lr))
    elif isinstance(optimizer, keras.optimizers.SGD) and not cfg.get("weight_decay"):
        opt = optax.sgd(lr, momentum=cfg["momentum"] or None, nesterov=cfg["nesterov"])
    else:
        raise ConfigError(f"xlafit translates Keras Adam, AdamW and SGD, not {name} with {cfg}; {how}.")
    clip = cfg.get("global_clipnorm")
    return optax.chain(optax.clip_by_global_norm(clip), opt) if clip else opt


# --------------------------------------------------------------------------- fit


# Keras fit arguments and callbacks that do not carry over, and what xlafit has instead.
UNSUPPORTED = {
    "validation_split": "pass validation_data=(x_val, y_val)",
    "shuffle": "xlafit reshuffles every epoch by (seed, step), which makes resume exact; seed= picks the order",
    "class_weight": "weight the per-example losses inside loss(y_true, y_pred)",
    "sample_weight": "weight the per-example losses inside loss(y_true, y_pred)",
    "initial_epoch": "give run_dir=: fit resumes from its newest checkpoint",
    "steps_per_epoch": "xlafit trains whole epochs of the arrays; stop early with config=TrainerConfig(stop_at_step=N)",
    "validation_steps": "validation covers every example of validation_data, each once",
    "validation_batch_size": "set config via xlafit.Trainer(eval_global_batch=...)",
    "validation_freq": "config=TrainerConfig(eval_every_epochs=N)",
}
CALLBACKS = {
    "ModelCheckpoint": "run_dir= (a checkpoint every epoch; TrainerConfig(checkpoint_every_steps=N) for more)",
    "BackupAndRestore": "run_dir=: fit resumes bit-exact from the newest checkpoint there",
    "EarlyStopping": "epochs= or TrainerConfig(stop_at_step=N)",
    "LearningRateScheduler": "an optax schedule in the optimizer, or an OptimizerConfig (warmup, decay)",
    "ReduceLROnPlateau": "an optax schedule in the optimizer, or an OptimizerConfig (warmup, decay)",
    "TensorBoard": "run_dir=: TensorBoard logs go to run_dir/tensorboard",
    "CSVLogger": "run_dir=: every record goes to run_dir/metrics.jsonl",
    "TerminateOnNaN": "TrainerConfig(nan_policy='stop') (the default; or 'skip', 'rollback')",
    "ProgbarLogger": "progress lines are printed anyway",
    "History": "fit returns a History",
}


@dataclasses.dataclass
class History:
    """What :func:`fit` returns, shaped like Keras' ``History``.

    Attributes:
        history: per-epoch means of training loss and metrics, and ``val_``-prefixed
            evaluations, under Keras' names (``loss``, ``accuracy``, ``val_loss``, ...).
        epoch: the epochs this call trained (0-based, as Keras counts).
        result: the trainer's :class:`~xlafit.FitResult` (compile counts and times, ...).
    """

    history: dict[str, list[float]]
    epoch: list[int]
    result: FitResult


def _as_data(x: Any, y: Any, what: str) -> Dataset | Mapping[str, np.ndarray]:
    """``x`` and ``y`` as Keras' ``fit`` takes them (an array, a list of arrays, or a dict of
    arrays by input or output name) as one flat dict of arrays (:func:`flatten`)."""
    if y is None and (isinstance(x, Dataset) or isinstance(x, Mapping) and "y" in x):
        return x
    if y is None:
        raise ConfigError(f"{what}: give x and y (NumPy arrays), or a dict {{'x': ..., 'y': ...}}.")
    batch = {**flatten("x", x, what), **flatten("y", y, what)}
    rows = {k: len(v) for k, v in batch.items()}
    if len(set(rows.values())) > 1:
        sizes = ", ".join(f"{k} {n}" for k, n in rows.items())
        raise ConfigError(f"{what}: every array needs one row per example, and these disagree: {sizes}.")
    return batch


def flatten(key: str, value: Any, what: str) -> dict[str, np.ndarray]:
    """One of Keras' ``x`` / ``y`` as batch entries: an array as ``key``, a list's items as
    ``key/0``, ``key/1``, ..., a dict's as ``key/<name>`` (:func:`unflatten` undoes it).

    Example:
        >>> import numpy as np
        >>> sorted(flatten("x", {"image": np.zeros(2), "tags": np.ones(2)}, "data"))
        ['x/image', 'x/tags']
    """
    if isinstance(value, Mapping):
        parts = {f"{key}/{name}": v for name, v in value.items()}
    elif isinstance(value, list | tuple):
        parts = {f"{key}/{i}": v for i, v in enumerate(value)}
    else:
        parts = {key: value}
    bad = [k for k, v in parts.items() if not hasattr(v, "shape")]
    if bad or not parts:
        kind = type(parts[bad[0]]).__name__ if bad else "an empty " + type(value).__name__
        raise ConfigError(
            f"{what}: {key} must be an array, a list of arrays or a dict of arrays (NumPy), as Keras' fit takes "
            f"it; {bad[0] if bad else key} is {kind}. tf.data pipelines and generators do not carry over: xlafit "
            "draws batches by index, so resume and evaluation are exact."
        )
    return {k: np.asarray(v) for k, v in parts.items()}


def unflatten(batch: Mapping[str, Any], key: str) -> Any:
    """What :func:`flatten` made of ``key``: the array, the list, or the dict; None if absent."""
    if key in batch:
        return batch[key]
    parts = {k[len(key) + 1 :]: v for k, v in batch.items() if k.startswith(key + "/")}
    if not parts:
        return None
    if all(name.isdigit() for name in parts):
        return [parts[name] for name in sorted(parts, key=int)]
    return parts


def _optimizer(model: Any, optimizer: Any, global_batch: int, total_steps: int) -> tuple[Any, Any]:
    """``(optax transformation, its learning-rate schedule or None)``."""
    if isinstance(optimizer, OptimizerConfig):
        plan = make_optimizer(optimizer, global_batch, total_steps)
        return plan.tx, plan.schedule
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            raise ConfigError(
                "no optimizer: pass optimizer= (optax, an xlafit.config.OptimizerConfig, or a Keras Adam/AdamW/SGD), "
                "or model.compile(optimizer=...) first."
            )
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer, None
    keras = keras_backend()
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return optax_from_keras(optimizer), optimizer.get_config()["learning_rate"]
    raise ConfigError(f"optimizer must be optax, an OptimizerConfig or a Keras optimizer; got {type(optimizer)}.")


def fit(
    model: Any,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: int = 32,
    epochs: int = 1,
    optimizer: Any = None,
    loss: Any = None,
    metrics: Sequence[Any] | None = None,
    validation_data: Any = None,
    callbacks: Sequence[Any] | None = None,
    verbose: Any = "auto",
    steps_per_execution: int = 1,
    strategy: Strategy | None = None,
    config: TrainerConfig | None = None,
    run_dir: str | Path | None = None,
    seed: int = 0,
    **keras_only: Any,
) -> History:
    """``model.fit`` for a Keras 3 model, trained by :class:`xlafit.Trainer` on every device.

    The arguments are Keras' (``batch_size`` is the global batch, as under ``TPUStrategy``:
    ``16 * strategy.num_replicas``); the trained values are in ``model`` afterwards.

    Args:
        model: a built Keras 3 model; ``loss``, ``metrics`` and ``optimizer`` default to
            those of ``model.compile``.
        x, y: NumPy arrays, or ``x`` a dict ``{"x": ..., "y": ...}`` or an xlafit Dataset.
        optimizer: optax, an :class:`xlafit.config.OptimizerConfig` (its rate scaled from
            ``reference_batch`` to ``batch_size``), or a Keras Adam/AdamW/SGD (translated).
        validation_data: ``(x_val, y_val)``, evaluated at every epoch's end, each example
            once (the last batch padded and masked).
        callbacks: not supported; the error names the xlafit equivalent of each.
        verbose: accepted for Keras compatibility; progress lines are always printed.
        steps_per_execution: optimizer steps per compiled call (Keras' own name for it).
        strategy: from :func:`xlafit.connect`; default: every device.
        config: further loop settings (checkpoints, NaN policy, ...); ``epochs`` and
            ``steps_per_execution`` fill its fields.
        run_dir: metrics, TensorBoard logs and checkpoints; ``fit`` resumes from there.
        seed: the data order's seed.

    Returns:
        A :class:`History`: ``history["loss"]``, ``history["val_accuracy"]``, ...

    Raises:
        ConfigError: a Keras feature that does not carry over, named with its equivalent.

    Example:
        >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")  # doctest: +ELLIPSIS
        '...'
        >>> import keras, numpy as np, xlafit
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, activation="softmax")])
        >>> model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
        ...               metrics=["accuracy"])
        >>> x, y = np.eye(4, dtype=np.float32).repeat(16, 0), np.arange(64) // 16
        >>> history = fit(model, x, y, batch_size=32, epochs=20, validation_data=(x, y))  # doctest: +ELLIPSIS
        devices: 8 x cpu (1 process(es))   per-device batch: 4   global batch: 32
        ...
        >>> sorted(history.history), history.history["val_accuracy"][-1]
        (['accuracy', 'loss', 'val_accuracy', 'val_loss'], 1.0)
        >>> kernel, bias = model.get_weights()  # the trained values are the Keras model's
        >>> bool(((x @ kernel + bias).argmax(-1) == y).all())
        True
    """
    if keras_only:
        name = next(iter(keras_only))
        hint = UNSUPPORTED.get(name)
        raise ConfigError(
            f"fit(..., {name}=) is Keras-only: {hint}." if hint else f"fit() got an unknown argument {name!r}."
        )
    if callbacks:
        names = [type(c).__name__ for c in callbacks]
        hints = "; ".join(f"{n} -> {CALLBACKS[n]}" for n in names if n in CALLBACKS)
        raise ConfigError(
            f"Keras callbacks ({', '.join(names)}) do not run in xlafit: its steps are compiled ahead, several per "
            f"call, with no Python between them. {hints or 'Use the xlafit settings instead'}"
            + (
                "."
                if hints
                else ": run_dir (checkpoints, TensorBoard), TrainerConfig (stops, NaN policy, "
                "evaluation), an optax schedule (learning rate)."
            )
        )
    del verbose
    train = _as_data(x, y, "training data")
    val = None
    if validation_data is not None:
        if not isinstance(validation_data, tuple | list) or len(validation_data) != 2:
            raise ConfigError("validation_data must be (x_val, y_val); xlafit does not take sample weights there.")
        val = _as_data(validation_data[0], validation_data[1], "validation_data")
    config = dataclasses.replace(config or TrainerConfig(), epochs=epochs, steps_per_call=steps_per_execution)
    adapted = to_adapted(model, loss, metrics)
    rows = len(as_dataset(train))
    total = epochs * max(rows // batch_size, 1)
    tx, lr = _optimizer(model, optimizer, batch_size, total)
    trainer = Trainer(
        adapted,
        adapted.loss_fn,
        tx,
        strategy=strategy,
        global_batch=batch_size,
        config=config,
        learning_rate=lr,
        run_dir=run_dir,
        data_seed=seed,
    )
    try:
        result = trainer.fit(train, eval=val)
    finally:
        trainer.close()
    return _history(result, rows // batch_size, ["loss", *adapted.loss_fn.names])


def _history(result: FitResult, steps_per_epoch: int, names: list[str]) -> History:
    """Per-epoch means of the logged records (each weighted by its steps), under Keras' names;
    the whole run's, what was logged before a resume included."""
    sums: dict[int, dict[str, float]] = {}
    steps: dict[int, int] = {}
    previous = None
    for record in result.history:
        step = record["step"]
        epoch = (step - 1) // steps_per_epoch
        # The first record of a resumed run starts at the checkpoint, not at the previous record.
        n = step - previous if previous is not None else step - epoch * steps_per_epoch
        previous = step
        steps[epoch] = steps.get(epoch, 0) + n
        for name in names:
            if name in record:
                sums.setdefault(epoch, {})[name] = sums.get(epoch, {}).get(name, 0.0) + record[name] * n
    epochs = sorted(steps)
    history = {name: [sums[e][name] / steps[e] for e in epochs if name in sums.get(e, {})] for name in names}
    by_epoch = {(e["step"] - 1) // steps_per_epoch: e for e in result.evaluations}
    for name in names:
        values = [by_epoch[e][name] for e in epochs if e in by_epoch and name in by_epoch[e]]
        if values:
            history[f"val_{name}"] = values
    return History(history, epochs, result)
