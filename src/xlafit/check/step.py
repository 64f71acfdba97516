"""The check of one training step on this machine (XLA's rules 1 and 2 while tracing and
running it, rule 3 on the data's lengths, memory and FLOPs at the run's batch) and its
compile for TPU slices: what :func:`xlafit.check.check_file` and
:func:`xlafit.check.check_recipe` run on a user file's or a recipe's model."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from xlafit.check.broadcast import row_against_every_label
from xlafit.check.lever_fits import fit_levers
from xlafit.check.program import Program
from xlafit.check.report import Report
from xlafit.check.rules import Finding, classify
from xlafit.check.tpu import TRACE_FAILURE, check_targets
from xlafit.data.shapes import compare_plans
from xlafit.errors import ConfigError
from xlafit.platform.hardware import parse_targets
from xlafit.train.state import TrainState
from xlafit.train.step import build_train_step

__all__ = ["check_step", "check_tpu", "example_layout", "example_lengths", "positive", "to_json"]


SCALAR_LOSS_NOTE = (
    "loss_fn returns {names} as a scalar (a mean over the batch): training takes it, but evaluation "
    "(fit(eval=...)) needs one value per example, so that a padded last batch's padding rows count zero; "
    "return the unreduced values (optax's losses without .mean(), torch's with reduction='none') to evaluate too."
)


def _train_step(
    model: nnx.Module, loss_fn: Any, seen: dict[str, Any] | None = None, trainable: Any = nnx.Param
) -> tuple[Any, TrainState]:
    """The check's train step and state, training the ``trainable`` variables (LoRA: the
    adapters); ``seen`` gets the names of the loss's outputs that are scalars (``loss``, a
    metric's name) when it is traced."""
    tx = optax.adamw(1e-3)
    model.train()
    graphdef, params, model_state = nnx.split(model, trainable, ...)  # type: ignore[misc]  # flax's overloads
    state = TrainState(jax.numpy.zeros((), jax.numpy.int32), params, tx.init(params), model_state)

    def recorded(module: Any, batch: Any) -> Any:
        out = loss_fn(module, batch)
        if seen is not None:
            losses, metrics = out if isinstance(out, tuple) else (out, {})
            values = {"loss": losses, **(metrics if isinstance(metrics, dict) else {})}
            seen["scalars"] = [name for name, value in values.items() if getattr(value, "ndim", None) == 0]
        return out

    return build_train_step(graphdef, recorded, tx, unroll=True, trainable=trainable), state


def _stacked(batch: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
    """``batch`` as one call's input ``[1, B, ...]``; with ``rows``, abstract arrays of that batch."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        v = np.asarray(v)
        if rows is None:
            out[k] = v[None]
        else:
            out[k] = jax.ShapeDtypeStruct((1, rows, *v.shape[1:]), jax.dtypes.canonicalize_dtype(v.dtype))
    return out


def example_lengths(dataset: Any) -> np.ndarray:
    lengths = []
    for example in dataset:
        arrays = [np.asarray(v) for v in (example.values() if isinstance(example, dict) else [example])]
        with_axis = [a for a in arrays if a.ndim >= 1]
        lengths.append(with_axis[0].shape[0] if with_axis else 1)
    return np.array(lengths)


def check_step(
    target: str,
    model: nnx.Module,
    loss_fn: Any,
    batch: dict[str, Any],
    *,
    user_file: str | None = None,
    lengths: np.ndarray | None = None,
    per_device_batch: int | None = None,
    global_batch: int | None = None,
    devices: int | None = None,
    max_shapes: int = 8,
    one_shape: bool = False,
    trainable: Any = nnx.Param,
    users_loss: bool = True,
) -> Report:
    """Checks one model + loss + batch; see the module docstring. ``one_shape``: the data
    reaches the step in one shape whatever ``lengths`` are (a recipe packs or pads its
    examples to rows of one length), so the lengths' plans are information, not rule 3.
    ``trainable``: the variables the step trains (a LoRA run's adapters). ``users_loss``:
    ``loss_fn`` is the user's to change (False: a recipe's own; no advice on its outputs)."""
    report = Report(target)
    if not isinstance(batch, dict) or not batch:
        raise ConfigError("`batch` must be a dict of arrays (one small real batch), e.g. {'x': ..., 'y': ...}.")
    seen: dict[str, Any] = {}
    step, state = _train_step(model, loss_fn, seen, trainable)
    rows = len(np.asarray(next(iter(batch.values()))))
    try:
        broadcasts = row_against_every_label(lambda: jax.eval_shape(step, state, _stacked(batch)), user_file)
        report.traced = True
        report.findings += broadcasts
        if seen.get("scalars") and users_loss:
            report.notes.append(SCALAR_LOSS_NOTE.format(names=", ".join(seen["scalars"])))
        jax.block_until_ready(jax.jit(step)(state, _stacked(batch)))
        report.ran = True
    except Exception as e:  # every failure becomes a finding with a line
        report.findings.append(classify(e, user_file))

    _check_lengths(report, lengths, max_shapes, one_shape)
    devices = devices or jax.device_count()
    per_device = per_device_batch or (max(1, global_batch // devices) if global_batch else rows)
    report.batch = {"per_device": per_device, "devices": devices, "global": global_batch or per_device * devices}
    if global_batch is not None and global_batch % devices:
        report.findings.append(
            Finding(
                0,
                f"global batch {global_batch} does not divide over {devices} devices; use a multiple of {devices} "
                f"(e.g. {max(devices, global_batch // devices * devices)}).",
                kind="batch",
            )
        )
    if report.ran:
        compiled = jax.jit(step).lower(state, _stacked(batch, per_device)).compile()
        mem = compiled.memory_analysis()
        if mem is not None:
            report.memory = {
                "arguments": int(mem.argument_size_in_bytes),
                "outputs": int(mem.output_size_in_bytes),
                "temporaries": int(mem.temp_size_in_bytes),
                "generated code": int(mem.generated_code_size_in_bytes),
            }
        cost = compiled.cost_analysis() or {}
        report.flops_per_step = float(cost.get("flops", 0.0)) or None
    return report


def _check_lengths(report: Report, lengths: np.ndarray | None, max_shapes: int, one_shape: bool = False) -> None:
    """Rule 3: the data's distinct lengths against ``max_shapes``, with the padding plans."""
    if lengths is None or not len(lengths):
        return
    distinct = int(len(np.unique(lengths)))
    report.shapes = {"examples": int(len(lengths)), "distinct": distinct, "max": int(np.max(lengths))}
    report.shapes["one_shape"] = one_shape
    report.plans = compare_plans(lengths, min(max_shapes, distinct))
    if distinct > max_shapes and not one_shape:
        best = min((p for p in report.plans if p.shapes <= max_shapes), key=lambda p: p.padded_tokens)
        report.findings.append(
            Finding(
                3,
                f"the data holds {distinct} different lengths: fed as they are, {distinct} programs compile "
                f"(over --max-shapes {max_shapes}). Recommended: {best.name}, boundaries {best.boundaries} "
                f"({best.waste:.1%} of positions padding).",
            )
        )


def refuse_text(key: str, value: Any) -> None:
    """Refuses a batch entry of text (a step takes numbers only), before JAX does with a page
    about abstract arrays, or a TPU compile that never sees the entry says it fits."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        try:
            dtype = np.asarray(value).dtype
        except ValueError:  # ragged: example_layout names it
            return
    if dtype.kind in "US":
        raise ConfigError(
            f"batch[{key!r}] holds text ({dtype}): a step takes numbers only; encode it (token ids, class indices) "
            "or leave it out of `batch`."
        )


def example_layout(batch: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """One example's layout (shape without the batch axis, dtype as a TPU step gets it) from a
    batch of arrays or ``ShapeDtypeStruct``s; a one-line ``ConfigError`` for an entry that is
    no array, has no batch axis, or whose batch axis disagrees with the others'."""
    out, rows = {}, {}
    for k, v in batch.items():
        if isinstance(v, dict):
            raise ConfigError(
                f"batch[{k!r}] is a dict; `batch` must be a flat dict of arrays: give its entries keys of their "
                f"own, e.g. batch[{k + '_' + str(next(iter(v), 'x'))!r}]."
            )
        if not isinstance(v, jax.ShapeDtypeStruct):
            try:
                v = np.asarray(v)
            except ValueError as e:  # a ragged list
                raise ConfigError(f"batch[{k!r}] is not an array ({e}); pad its rows to one shape.") from None
            refuse_text(k, v)
            if v.dtype == object:
                raise ConfigError(
                    f"batch[{k!r}] is a {type(batch[k]).__name__} that is not an array of numbers; every entry of "
                    "`batch` must be an array or a jax.ShapeDtypeStruct."
                )
        if not v.shape:
            raise ConfigError(f"batch[{k!r}] is a scalar; every entry of `batch` needs a leading batch axis.")
        rows[k] = v.shape[0]
        # As jit takes it: float64 and int64 become float32 and int32 unless jax_enable_x64 is on.
        out[k] = jax.ShapeDtypeStruct(tuple(v.shape[1:]), jax.dtypes.canonicalize_dtype(v.dtype))
    if len(set(rows.values())) > 1:
        sizes = ", ".join(f"{k} {n}" for k, n in rows.items())
        raise ConfigError(
            f"the entries of `batch` disagree on the batch (first) axis: {sizes} rows; give every entry the same "
            "number of rows."
        )
    return out


def positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{name} must be a positive whole number, got {value}.")


def check_tpu(
    target: str,
    program: Program,
    targets: str,
    *,
    lengths: np.ndarray | None = None,
    max_shapes: int = 8,
    max_batch: bool | int = False,
) -> Report:
    """Compiles ``program`` for each TPU target of ``targets`` (``"v3-8,v5e-8"``); see
    :mod:`xlafit.check.tpu`. Rules 1 and 2 surface while tracing for the TPU, at the
    user's line; rule 3 is checked on ``lengths`` as without ``--tpu``."""
    report = Report(target)
    parsed = parse_targets(targets)  # an unknown name fails before any compile
    _check_lengths(report, lengths, max_shapes)
    report.tpu = check_targets(parsed, program, max_batch)
    for t, each in zip(report.tpu, parsed, strict=True):  # what would make it fit, compiled
        fit_levers(t, each, program, max_batch)
    for t in report.tpu:
        # A rule violation, or any failure while tracing, fails every target alike: reported once.
        if t.error is not None and (t.error.rule in (1, 2) or t.error.kind == TRACE_FAILURE):
            if all((f.rule, f.kind) != (t.error.rule, t.error.kind) for f in report.findings):
                report.findings.append(t.error)
    report.traced = all(t.error is None or (t.error.rule == 0 and t.error.kind != TRACE_FAILURE) for t in report.tpu)
    return report


def to_json(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2, default=str)
