"""A Keras loss and its metrics as the trainer's ``loss_fn`` (:class:`KerasLoss`): per-example
values, per output, under Keras' names."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from xlafit.errors import ConfigError
from xlafit.integrations.keras.batch import unflatten
from xlafit.integrations.keras.module import KerasModule, keras_backend, keras_numpy


def _resolve_loss(keras: Any, loss: Any) -> Callable:
    """A Keras loss (object, name, or function of ``(y_true, y_pred)``) as an unreduced function."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        # xlafit averages the per-example values over the global batch: Keras' default
        # reduction, and "mean"-like ones without sample weights. None ("none") is the
        # per-example values themselves (Keras' own fit refuses a loss that is not one value).
        if loss.reduction == "sum":
            raise ConfigError(
                f"the Keras loss {loss.name!r} has reduction='sum', which xlafit does not translate (it averages over "
                "the batch); use the default reduction, with the learning rate scaled as wanted (the sum's gradient "
                "is the mean's times the batch size)."
            )
        # Loss.call is the unreduced loss of Keras' convention; __call__ would reduce it.
        return loss.call
    if callable(loss):
        if _parameters(loss)[:2] == ["model", "batch"]:
            raise ConfigError(
                "with a Keras model, the loss is a Keras loss, its name, loss(y_true, y_pred) or a KerasLoss (batches "
                "are {'x': inputs, 'y': targets}); this one takes (model, batch), the form of an nnx.Module's loss_fn."
            )
        return loss
    raise ConfigError(
        f"loss must be a Keras loss, its name ('sparse_categorical_crossentropy') or a function "
        f"loss(y_true, y_pred) -> one value per example; got a {type(loss).__name__}."
    )


def _parameters(fn: Callable) -> list[str]:
    """The names of ``fn``'s parameters, or none where Python cannot say (a builtin)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


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
            example (more axes are averaged); averaged over the batch as Keras' default
            reduction (``reduction="sum"`` is refused).
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
        with keras_numpy():
            pairs = self._outputs(y_true, y_pred)
            for output, loss, _, t, p in pairs:
                _check_labels(loss, t, p, output)
            evaluating = module.deterministic
            values = [(output, w, _per_example(loss(t, p))) for output, loss, w, t, p in pairs]
            for output, _, value in values:
                _check_per_example(value, "loss", output, evaluating)
            losses = reg + sum(w * value for _, w, value in values)
            metrics = {}
            for output, _, _, t, p in pairs:
                for name, fn in {**self._metrics.get("", {}), **self._metrics.get(output, {})}.items():
                    if fn == "accuracy":
                        fn = _accuracy_for(keras_backend(), t, p)
                    key = f"{output}_{name}" if len(pairs) > 1 else name
                    metrics[key] = _check_per_example(_per_example(fn(t, p)), f"metric {name!r}", output, evaluating)
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


def _check_per_example(value: jax.Array, what: str, output: str, evaluating: bool) -> jax.Array:
    """``value``, refused where evaluation meets a scalar (a mean over the batch): the padded
    last batch's rows could not count zero. Training takes a scalar (xlafit's train step does)."""
    if evaluating and value.ndim == 0:
        of = f" of the output {output!r}" if output else ""
        raise ConfigError(
            f"evaluation needs the {what}{of} to return one value per example, got a scalar (a mean over the batch), "
            "which cannot count a padded last batch's rows as zero; use a loss(y_true, y_pred) that returns one "
            "value per example, e.g. keras.losses.MeanSquaredError(reduction=None) or a function without the mean."
        )
    return value


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
    return KerasLoss(model.loss, config.get("metrics") or (), **outputs_of(model, config))


def outputs_of(model: Any, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The model's output names and its compiled loss weights, for a :class:`KerasLoss`."""
    weights = (config or {}).get("loss_weights")
    return {"output_names": list(getattr(model, "output_names", None) or []), "loss_weights": weights}
