"""``xlafit check``: try a training step with XLA on the CPU before the TPU, automated.

The Hugging Face TPU guide's three XLA rules, checked up front instead of after a long
compile on the accelerator:

1. no data-dependent Python control flow (``if``/``while`` on an array's value);
2. no data-dependent shapes (boolean-mask indexing, ``jnp.unique``, ``jnp.nonzero``);
3. every new input shape compiles a new program: pad to a few fixed shapes.

The rules themselves: :mod:`xlafit.check.rules`; the TPU compiles: :mod:`xlafit.check.tpu`.
A user file defines ``model`` (an ``nnx.Module``, or a Keras 3 model with the JAX backend),
``loss_fn(model, batch)`` (per-example losses ``[B]``, or ``(losses, {metric: [B]})``;
optional for a compiled Keras model) and ``batch`` (a dict of arrays, a small real batch;
``{"x": ..., "y": ...}`` for Keras). Optional: ``dataset`` (an iterable of examples, dicts of arrays whose first
axis is the sequence) or ``lengths`` (one length per example) for rule 3.

The train step is traced abstractly (rules 1 and 2 fail at trace time; the failure is
mapped to the user's file and line), then run once on ``batch``, then compiled at the
per-device batch to read XLA's memory and cost analyses.
"""

from __future__ import annotations

__all__ = ["Finding", "Report", "check_file", "check_recipe", "check_step", "classify", "to_json"]

import contextlib
import dataclasses
import json
import os
import runpy
import shlex
import sys
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from xlafit.check.program import Program
from xlafit.check.report import Report
from xlafit.check.rules import Finding, classify
from xlafit.check.tpu import TRACE_FAILURE, check_targets
from xlafit.config import (
    MeshConfig,
    TrainerConfig,
    deep_merge,
    from_dict,
    load_yaml,
    merge_overrides,
    parse_overrides,
    validate_mesh,
)
from xlafit.data.dataset import as_dataset
from xlafit.data.shapes import compare_plans
from xlafit.errors import ConfigError
from xlafit.models.lora import ADAPTER
from xlafit.parallel.cluster import start_backends
from xlafit.parallel.sharding import parse_rules
from xlafit.platform.hardware import parse_targets
from xlafit.recipes import get_recipe, load_config
from xlafit.run import with_lora
from xlafit.train.adapter import adapt, framework_of
from xlafit.train.optim import make_optimizer
from xlafit.train.step import TrainState, build_train_step


def _train_step(model: nnx.Module, loss_fn: Any) -> tuple[Any, TrainState]:
    tx = optax.adamw(1e-3)
    model.train()
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]  # flax's overloads
    state = TrainState(jax.numpy.zeros((), jax.numpy.int32), params, tx.init(params), model_state)
    return build_train_step(graphdef, loss_fn, tx, unroll=True), state


def _stacked(batch: dict[str, Any], rows: int | None = None) -> dict[str, Any]:
    """``batch`` as one call's input ``[1, B, ...]``; with ``rows``, abstract arrays of that batch."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        v = np.asarray(v)
        if rows is None:
            out[k] = v[None]
        else:
            out[k] = jax.ShapeDtypeStruct((1, rows, *v.shape[1:]), v.dtype)
    return out


def _example_lengths(dataset: Any) -> np.ndarray:
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
) -> Report:
    """Checks one model + loss + batch; see the module docstring."""
    report = Report(target)
    if not isinstance(batch, dict) or not batch:
        raise ConfigError("`batch` must be a dict of arrays (one small real batch), e.g. {'x': ..., 'y': ...}.")
    step, state = _train_step(model, loss_fn)
    rows = len(np.asarray(next(iter(batch.values()))))
    try:
        jax.eval_shape(step, state, _stacked(batch))
        report.traced = True
        jax.block_until_ready(jax.jit(step)(state, _stacked(batch)))
        report.ran = True
    except Exception as e:  # every failure becomes a finding with a line
        report.findings.append(classify(e, user_file))

    _check_lengths(report, lengths, max_shapes)
    devices = devices or jax.device_count()
    per_device = per_device_batch or (global_batch // devices if global_batch else rows)
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


def _check_lengths(report: Report, lengths: np.ndarray | None, max_shapes: int) -> None:
    """Rule 3: the data's distinct lengths against ``max_shapes``, with the padding plans."""
    if lengths is None or not len(lengths):
        return
    distinct = int(len(np.unique(lengths)))
    report.shapes = {"examples": int(len(lengths)), "distinct": distinct, "max": int(np.max(lengths))}
    report.plans = compare_plans(lengths, min(max_shapes, distinct))
    if distinct > max_shapes:
        best = min((p for p in report.plans if p.shapes <= max_shapes), key=lambda p: p.padded_tokens)
        report.findings.append(
            Finding(
                3,
                f"the data holds {distinct} different lengths: fed as they are, {distinct} programs compile "
                f"(over --max-shapes {max_shapes}). Recommended: {best.name}, boundaries {best.boundaries} "
                f"({best.waste:.1%} of positions padding).",
            )
        )


def _example(batch: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
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


def _positive(name: str, value: int | None) -> None:
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
    for t in report.tpu:
        # A rule violation, or any failure while tracing, fails every target alike: reported once.
        if t.error is not None and (t.error.rule in (1, 2) or t.error.kind == TRACE_FAILURE):
            if all((f.rule, f.kind) != (t.error.rule, t.error.kind) for f in report.findings):
                report.findings.append(t.error)
    report.traced = all(t.error is None or (t.error.rule == 0 and t.error.kind != TRACE_FAILURE) for t in report.tpu)
    return report


@contextlib.contextmanager
def importable(path: Path) -> Iterator[None]:
    """``path``'s directory and the working directory on ``sys.path``, as ``python path``
    (and ``python -m``) would have them, so the file can import its neighbours; restored after."""
    saved = list(sys.path)
    sys.path[:0] = [str(path.parent.resolve()), os.getcwd()]
    try:
        yield
    finally:
        sys.path[:] = saved


def _load_error(path: Path, e: BaseException) -> ConfigError:
    """The one-line error for a user file that fails to load, at its line."""
    if isinstance(e, SyntaxError):  # raised by the compiler: the file has no frame in the traceback
        code = f" in `{e.text.strip()}`" if e.text and e.text.strip() else ""
        return ConfigError(
            f"{e.filename or path}, line {e.lineno}: {type(e).__name__}: {e.msg}{code}. "
            "Fix that line and run xlafit check again."
        )
    line = classify(e, str(path)).line
    where = f", at line {line}" if line else ""
    return ConfigError(f"{path} failed while being loaded{where}: {type(e).__name__}: {e}")


def check_file(
    path: str | Path,
    overrides: Sequence[str] = (),
    tpu: str | None = None,
    max_batch: bool | int = False,
    preset: str | Path | None = None,
    **options: Any,
) -> Report:
    """Runs the user file and checks its ``model``, ``loss_fn`` and ``batch``.

    With ``tpu`` (``"v3-8,v5e-8"``), compiles the step for those TPU slices instead of
    running it here (:mod:`xlafit.check.tpu`). The file may then also define ``optimizer``
    (an optax transformation; default ``optax.adamw(1e-3)``), ``config`` (a
    :class:`~xlafit.config.TrainerConfig`: steps per call, accumulation, ``nan_policy``) and
    ``mesh`` (a :class:`~xlafit.config.MeshConfig`: FSDP, tensor parallelism), and build
    ``model`` with ``nnx.eval_shape`` and ``batch`` from ``jax.ShapeDtypeStruct``s: nothing is
    allocated. ``overrides`` (``["mesh.fsdp=-1", "trainer.accumulate_steps=4"]``) change the
    file's ``mesh`` and ``config`` as they change a recipe's, and ``data.per_device_batch``
    (or ``data.global_batch``) the rows a step takes where no batch flag is given;
    ``preset``, a YAML file with ``mesh:``, ``trainer:`` and ``data:`` sections (what
    ``xlafit plan --write`` writes), changes them first.

    Example:
        >>> check_file("big.py", ["mesh.fsdp=-1"], tpu="v5e-8")  # doctest: +SKIP
    """
    _positive("--per-device-batch", options.get("per_device_batch"))
    _positive("--global-batch", options.get("global_batch"))
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist.")
    nested = file_settings(overrides, tpu, preset)
    start_backends()  # quietly: libtpu's start-up errors on a machine without a TPU are no finding
    # The loss may import at trace time too: the file's imports stay possible until the end.
    with importable(path):
        namespace = load_file(path)
        lengths = namespace.get("lengths")
        if lengths is None and namespace.get("dataset") is not None:
            lengths = _example_lengths(namespace["dataset"])
        lengths = None if lengths is None else np.asarray(lengths)
        if tpu:
            program = file_program(path, namespace, nested, options)
            return check_tpu(
                str(path), program, tpu, lengths=lengths, max_shapes=options.get("max_shapes", 8), max_batch=max_batch
            )
        return check_step(
            str(path),
            namespace["model"],
            namespace["loss_fn"],
            namespace["batch"],
            user_file=str(path),
            lengths=lengths,
            **options,
        )


# What overrides of a user file may change: the file defines the model, its batch's layout and
# its optimizer itself; data.* sets how many rows a step takes (what a plan chose).
FILE_SECTIONS: dict[str, type] = {"mesh": MeshConfig, "trainer": TrainerConfig}
FILE_BATCH_KEYS = ("per_device_batch", "global_batch")


def file_settings(overrides: Sequence[str], tpu: str | None, preset: str | Path | None = None) -> dict[str, Any]:
    """``overrides`` (over ``preset``'s sections) as a nested dict of ``mesh`` and ``trainer``
    keys; anything else, or any setting without ``tpu`` (the plain check runs one unsharded
    step here), is refused."""
    nested = deep_merge(load_yaml(preset), parse_overrides(overrides)) if preset else parse_overrides(overrides)
    data = nested.get("data") or {}
    unknown = [f"{key}.*" for key in nested if key not in (*FILE_SECTIONS, "data")]
    unknown += [f"data.{key}" for key in data if key not in FILE_BATCH_KEYS] if isinstance(data, dict) else ["data"]
    if unknown:
        valid = ", ".join(f"{name}.{f.name}" for name, cls in FILE_SECTIONS.items() for f in dataclasses.fields(cls))
        raise ConfigError(
            f"unknown override {unknown[0]}: a file's check takes "
            "mesh.*, trainer.* and data.per_device_batch or data.global_batch overrides (the file defines its "
            f"model, batch layout and optimizer). Valid keys: {valid}, data.per_device_batch, data.global_batch."
        )
    for key, value in data.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"data.{key}={value}: give a positive whole number of examples.")
    if nested and not tpu:
        given = overrides[0] if overrides else f"--config {preset}"
        raise ConfigError(
            f"{given}: overrides apply to the compile for a TPU slice; add --tpu TARGET (e.g. --tpu v5e-8). "
            "Without it, xlafit check runs one plain step of the file's model on this machine."
        )
    return nested


# Where load_file keeps a converted model's refusals (Adapted.check) in the file's names.
SETTINGS_CHECK = "__xlafit_settings_check__"


def load_file(path: Path) -> dict[str, Any]:
    """The names the user's file defines; a Keras model becomes an ``nnx.Module`` and its loss.

    The file runs with Flax's eager sharding off: a parameter annotated as Flax's guides show
    (``nnx.with_partitioning(init, ("embed", "mlp"))``) keeps its names as metadata, which
    the sharding rules lay over each layout's mesh, instead of asking for a mesh at import.
    """
    try:
        with nnx.use_eager_sharding(False):
            namespace = runpy.run_path(str(path), run_name="__xlafit_check__")
    except Exception as e:
        raise _load_error(path, e) from None
    if framework_of(namespace.get("model")) is not None:  # a Keras 3 model: its compiled loss unless loss_fn is given
        adapted = adapt(namespace["model"], namespace.get("loss_fn"))
        namespace["model"], namespace["loss_fn"] = adapted.module, adapted.loss_fn
        namespace[SETTINGS_CHECK] = adapted.check
    missing = [name for name in ("model", "loss_fn", "batch") if name not in namespace]
    if missing:
        raise ConfigError(
            f"{path} must define model (an nnx.Module, a torch.nn.Module or a compiled Keras 3 model), "
            "loss_fn(model, batch) "
            f"(optional for Keras) and batch (a dict of arrays; {{'x': ..., 'y': ...}} for Keras); "
            f"missing: {', '.join(missing)}."
        )
    if not isinstance(namespace["model"], nnx.Module):
        raise ConfigError(
            f"`model` in {path} is a {type(namespace['model']).__name__}, not an nnx.Module, a torch.nn.Module or a "
            "Keras 3 model."
        )
    return namespace


def file_program(path: Path, namespace: dict[str, Any], nested: dict[str, Any], options: dict[str, Any]) -> Program:
    """What to compile for a user file: its model, loss, optimizer, ``config`` and ``mesh``
    with the overrides applied, and the batch's layout."""
    batch = namespace["batch"]
    if not isinstance(batch, dict) or not batch:
        raise ConfigError(f"`batch` in {path} must be a dict of arrays or jax.ShapeDtypeStructs.")
    optimizer = namespace.get("optimizer", optax.adamw(1e-3))
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ConfigError(f"`optimizer` in {path} must be an optax transformation, e.g. optax.adamw(1e-3).")
    settings = {}
    for name, cls in FILE_SECTIONS.items():
        defined = namespace.get("config" if name == "trainer" else name, cls())
        if not isinstance(defined, cls):
            raise ConfigError(
                f"`{'config' if name == 'trainer' else name}` in {path} must be an xlafit.config.{cls.__name__}, "
                f"e.g. {cls.__name__}(); it is a {type(defined).__name__}."
            )
        settings[name] = from_dict(
            cls, deep_merge(dataclasses.asdict(typing.cast(Any, defined)), nested.get(name, {})), f"{name}."
        )
    mesh, config = settings["mesh"], settings["trainer"]
    validate_mesh(mesh, config)
    example = _example(batch)  # checks every entry first: a one-line error, not a traceback
    rows = np.shape(next(iter(batch.values())))[0]
    per_device, global_batch = options.get("per_device_batch"), options.get("global_batch")
    if per_device is None and global_batch is None:  # the flags win over data.* (a plan's batch)
        per_device, global_batch = ((nested.get("data") or {}).get(key) for key in FILE_BATCH_KEYS)
    return Program(
        namespace["model"],
        namespace["loss_fn"],
        optimizer,
        config,
        example,
        per_device_batch=per_device or (None if global_batch else rows),
        global_batch=global_batch,
        eval_global_batch=None,
        user_file=str(path),
        mesh=mesh.sizes,
        rules=parse_rules(mesh.rules),
        batch_syntax="--per-device-batch {n}",
        settings_check=namespace.get(SETTINGS_CHECK),
    )


def recipe_program(
    name: str,
    overrides: Sequence[str] = (),
    preset: str | Path | None = None,
    per_device_batch: int | None = None,
    global_batch: int | None = None,
) -> tuple[Program, Any, int]:
    """What ``check --tpu`` compiles for a recipe: ``(program, config, train examples)``.

    The model is built abstractly (``nnx.eval_shape``) from the recipe's config with
    ``overrides`` (``preset``: a YAML file instead of the recipe's own), with the run's own
    optimizer, batch sizes and loop settings, and with ``lora.rank`` set its adapters, the
    only trainable variables (the base frozen, as a run trains it); a given
    ``per_device_batch`` or ``global_batch`` replaces the config's.
    """
    cfg = load_config(name, list(overrides), preset=preset)
    recipe = get_recipe(name)
    recipe.validate(cfg)
    train = as_dataset(recipe.load_data(cfg)[0])
    cfg = recipe.from_data(cfg, train)
    per_device = per_device_batch or (None if cfg.data.global_batch else cfg.data.per_device_batch)
    global_batch = global_batch or cfg.data.global_batch
    reference = global_batch or (per_device or 1) * 8
    optimizer = make_optimizer(cfg.optimizer, reference, total_steps=cfg.optimizer.decay_steps or 1000).tx
    work = recipe.throughput(cfg, train)
    program = Program(
        nnx.eval_shape(lambda: with_lora(recipe.build_model(cfg, train), cfg.lora, cfg.trainer.seed)),
        recipe.loss_fn,
        optimizer,
        cfg.trainer,
        _example(train.take(np.arange(1))),
        per_device_batch=per_device,
        global_batch=None if per_device else global_batch,
        eval_global_batch=cfg.data.eval_global_batch or global_batch or (per_device or 1) * 8,
        flops_per_example=work.get("flops_per_example"),
        tokens_per_example=work.get("tokens_per_example"),
        mesh=cfg.mesh.sizes,
        rules=parse_rules(cfg.mesh.rules),
        model_levers=_model_levers(cfg.model),
        trainable=ADAPTER if cfg.lora.rank else nnx.Param,
    )
    return program, cfg, len(train)


def check_recipe(
    name: str,
    overrides: list[str] | None = None,
    tpu: str | None = None,
    max_batch: bool | int = False,
    preset: str | Path | None = None,
    **options: Any,
) -> Report:
    """Checks a recipe's model, loss and a batch of its data (and, for bert, the lengths
    of its tokenized corpus against the padding plans).

    With ``tpu``, compiles the recipe's train and eval steps for those TPU slices, with the
    run's own optimizer, batch sizes (``data.per_device_batch`` or ``data.global_batch``
    over each target's cores) and loop settings (:func:`recipe_program`); the model is built
    abstractly. ``preset``: a YAML file in place of the recipe's own (a ``plan.yaml``).
    """
    _positive("--per-device-batch", options.get("per_device_batch"))
    _positive("--global-batch", options.get("global_batch"))
    start_backends()  # quietly, as for a file
    if tpu:  # the recipes feed fixed shapes (bert packs its sequences): rule 3 has nothing to say
        parse_targets(tpu)  # an unknown name fails before the model is built
        program, cfg, _ = recipe_program(
            name, overrides or [], preset, options.get("per_device_batch"), options.get("global_batch")
        )
        report = check_tpu(name, program, tpu, max_batch=max_batch)
        report.assumed = assumed_settings(cfg, program, overrides or [])
        # A per-core batch compiled over a config's global one: the command clears the global one.
        cleared = ["data.global_batch=null"] if program.per_device_batch and cfg.data.global_batch else []
        report.command = check_command(name, tpu, [*(overrides or []), *cleared], report.assumed, preset)
        return report
    cfg = load_config(name, overrides or [], preset=preset)
    recipe = get_recipe(name)
    recipe.validate(cfg)
    train = as_dataset(recipe.load_data(cfg)[0])
    cfg = recipe.from_data(cfg, train)
    lengths = recipe.sequence_lengths(cfg)
    rows = options.get("per_device_batch") or 8  # the example batch run here: small
    batch = train.take(np.arange(min(rows, len(train))))
    if not options.get("per_device_batch") and not options.get("global_batch"):
        # Memory and FLOPs at the run's own batch, as --tpu compiles it, not the example's rows.
        if cfg.data.global_batch:
            options = {**options, "global_batch": cfg.data.global_batch}
        elif cfg.data.per_device_batch:
            options = {**options, "per_device_batch": cfg.data.per_device_batch}
    return check_step(name, recipe.build_model(cfg, train), recipe.loss_fn, batch, lengths=lengths, **options)


# The settings that shape a recipe's compiled step, printed with every answer (when present).
SHAPING = (
    "model.preset", "data.seq_len", "data.image_size", "lora.rank", "lora.base_dtype", "model.compute_dtype",
    "model.remat", "model.scan_layers", "model.attention", "mesh.data", "mesh.fsdp", "mesh.tensor",
    "trainer.steps_per_call", "trainer.accumulate_steps",
)  # fmt: skip


def assumed_settings(cfg: Any, program: Program, overrides: Sequence[str]) -> list[str]:
    """The settings an answer is for, as overrides to copy: the batch the program compiles
    and each of :data:`SHAPING` the config has, the recipe's defaults included (a run that
    meant 2,048 tokens sees that the answer is for the default's 128)."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    batch = (
        f"data.per_device_batch={program.per_device_batch}"
        if program.per_device_batch
        else f"data.global_batch={program.global_batch}"
    )
    out = [batch]
    for key in SHAPING:
        section, _, field = key.partition(".")
        holder = getattr(cfg, section, None)
        if holder is None or not hasattr(holder, field):
            continue
        value = getattr(holder, field)
        if value is None or key not in given and key.startswith(("mesh.", "trainer.")) and value in (1, -1):
            continue  # an unset preset, a mesh axis or loop setting at its default: nothing assumed
        if key.startswith("lora.") and not getattr(cfg.lora, "rank", 0):
            continue  # no adapters
        if key == "model.preset" and getattr(cfg.model, "init_from_hf", None):
            key, value = "model.init_from_hf", cfg.model.init_from_hf  # the checkpoint's sizes, not the preset's
        out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def check_command(
    name: str, tpu: str, overrides: Sequence[str], assumed: Sequence[str], preset: str | Path | None = None
) -> str:
    """The command that checks the same run again: every override given and every setting
    assumed, each key once (the assumed value, which the config resolved, wins)."""
    config = ["--config", str(preset)] if preset else []
    return shlex.join(["xlafit", "check", name, "--tpu", tpu, *config, *merge_overrides(overrides, assumed)])


def _model_levers(model: Any) -> tuple[tuple[str, str], ...]:
    """The memory levers a recipe's model settings offer, for a run that does not fit."""
    found = []
    if getattr(model, "remat", None) == "none":
        found.append(("activations", "rematerialisation: model.remat=full or dots_saveable (activations recomputed)"))
    if getattr(model, "compute_dtype", None) == "float32":
        found.append(("activations", "bf16 compute: model.compute_dtype=bfloat16 (parameters stay float32)"))
    if getattr(model, "logits_chunk", None) == 0:
        found.append(("activations", "the loss's logits a chunk at a time: model.logits_chunk=1024 (recomputed)"))
    return tuple(found)


def to_json(report: Report) -> str:
    return json.dumps(report.to_json(), indent=2, default=str)
