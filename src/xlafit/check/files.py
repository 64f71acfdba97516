"""``xlafit check FILE.py``: a user file's ``model``, ``loss_fn`` and ``batch`` (and, for a
TPU compile, its ``optimizer``, ``config`` and ``mesh``), loaded and checked."""

from __future__ import annotations

import contextlib
import dataclasses
import runpy
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import optax
from flax import nnx

from xlafit.check.program import Program
from xlafit.check.report import Report
from xlafit.check.rules import classify
from xlafit.check.step import check_step, check_tpu, example_layout, example_lengths, positive, refuse_text
from xlafit.config import MeshConfig, TrainerConfig, validate_mesh
from xlafit.errors import ConfigError
from xlafit.overrides import deep_merge, from_dict, load_yaml, parse_overrides
from xlafit.parallel.cluster import start_backends
from xlafit.parallel.sharding import parse_rules
from xlafit.train.adapter import adapt, framework_of
from xlafit.train.rewards import importable

__all__ = ["SETTINGS_CHECK", "check_file", "file_program", "file_settings", "importable", "load_file"]


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
    positive("--per-device-batch", options.get("per_device_batch"))
    positive("--global-batch", options.get("global_batch"))
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
            lengths = example_lengths(namespace["dataset"])
        lengths = None if lengths is None else np.asarray(lengths)
        if tpu:
            program = file_program(path, namespace, nested, options)
            report = check_tpu(
                str(path), program, tpu, lengths=lengths, max_shapes=options.get("max_shapes", 8), max_batch=max_batch
            )
        else:
            for key, value in (namespace["batch"] if isinstance(namespace["batch"], dict) else {}).items():
                refuse_text(key, value)
            report = check_step(
                str(path),
                namespace["model"],
                namespace["loss_fn"],
                namespace["batch"],
                user_file=str(path),
                lengths=lengths,
                **options,
            )
    for finding in [*report.findings, *(t.error for t in report.tpu or [] if t.error is not None)]:
        finding.framework = namespace.get(FRAMEWORK)
    return report


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
FRAMEWORK = "__xlafit_framework__"  # the model's framework when it is not Flax: "torch", "keras"


def load_file(path: Path) -> dict[str, Any]:
    """The names the user's file defines; a Keras model becomes an ``nnx.Module`` and its loss.

    The file runs with Flax's eager sharding off: a parameter annotated as Flax's guides show
    (``nnx.with_partitioning(init, ("embed", "mlp"))``) keeps its names as metadata, which
    the sharding rules lay over each layout's mesh, instead of asking for a mesh at import.
    What it prints goes to stderr: stdout is the report's (``--json``: JSON alone).

    Raises:
        ConfigError: a file that is not Python by its name (a data file would run as Python:
            JSON lines are Python dicts), or one that does not define the three names.
    """
    if path.suffix != ".py":
        raise ConfigError(
            f"{path} is not a Python file (.py): xlafit check runs a .py file that defines model, loss_fn and batch, "
            f"or checks a recipe by its name (xlafit check mnist); a data file is shown by xlafit data show {path}."
        )
    try:
        with nnx.use_eager_sharding(False), contextlib.redirect_stdout(sys.stderr):
            namespace = runpy.run_path(str(path), run_name="__xlafit_check__")
    except Exception as e:
        raise _load_error(path, e) from None
    framework = framework_of(namespace.get("model"))
    if framework is not None:  # a Keras 3 model: its compiled loss unless loss_fn is given
        namespace[FRAMEWORK] = framework
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
    model = namespace["model"]
    if not isinstance(model, nnx.Module):
        built = isinstance(model, type) or callable(model)  # the class, or a function that builds the model
        raise ConfigError(
            f"`model` in {path} is a {type(model).__name__}, not an nnx.Module, a torch.nn.Module or a Keras 3 "
            "model"
            + (
                "; build it in the file: model = MyModel(nnx.Rngs(0)) (nnx.eval_shape(lambda: MyModel(nnx.Rngs(0))) "
                "builds it as shapes only, without memory for its parameters)."
                if built
                else "."
            )
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
    example = example_layout(batch)  # checks every entry first: a one-line error, not a traceback
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
