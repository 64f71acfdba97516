"""``model.fit`` for a Keras 3 model (:func:`fit`), trained by :class:`xlafit.Trainer`: Keras'
arguments and ``History``, and a clear error for each Keras feature that does not carry over."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import optax

from xlafit.config import OptimizerConfig, TrainerConfig
from xlafit.data.dataset import Dataset, as_dataset
from xlafit.errors import ConfigError
from xlafit.integrations.keras.adapt import to_adapted
from xlafit.integrations.keras.batch import flatten
from xlafit.integrations.keras.module import keras_backend
from xlafit.integrations.keras.optimizers import optax_from_keras
from xlafit.parallel.mesh import Strategy
from xlafit.train.loop import FitResult
from xlafit.train.trainer import Trainer

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


def _optimizer(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """``(optax transformation or OptimizerConfig, its learning-rate schedule or None)``: an
    OptimizerConfig goes to the trainer as it is, which plans its schedule over the run (its
    warmup in epochs too), says it, and keeps its length in the checkpoints."""
    if isinstance(optimizer, OptimizerConfig):
        return optimizer, None
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
        return optax_from_keras(optimizer, model), optimizer.get_config()["learning_rate"]
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
    steps_per_execution: int | None = None,
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
        steps_per_execution: optimizer steps per compiled call (Keras' own name for it);
            None: the value given to ``model.compile`` (1 if none).
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
    if steps_per_execution is None:  # as Keras' fit: model.compile's (1 where it set none)
        steps_per_execution = int(getattr(model, "steps_per_execution", 1) or 1) if model.compiled else 1
    config = dataclasses.replace(config or TrainerConfig(), epochs=epochs, steps_per_call=steps_per_execution)
    adapted = to_adapted(model, loss, metrics)
    rows = len(as_dataset(train))
    tx, lr = _optimizer(model, optimizer)
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
