"""A user's Python file, as ``xlafit check``, ``xlafit plan`` and ``xlafit train`` read it.

The file defines ``model`` (an ``nnx.Module``, a ``torch.nn.Module`` or a compiled Keras 3
model), ``loss_fn(model, batch)`` and ``batch``; optionally ``optimizer`` (an optax
transformation), ``config`` (a :class:`~xlafit.config.TrainerConfig`) and ``mesh`` (a
:class:`~xlafit.config.MeshConfig`); for training also ``dataset``. :func:`load_file` runs it
and returns its names, a model of another framework adapted (:mod:`xlafit.train.adapter`);
:func:`file_overrides` reads the dotted overrides a file takes, :func:`file_sections` lays
them over the file's ``mesh`` and ``config``, and :func:`file_optimizer` finds its optimizer.

Example:
    >>> nested = file_overrides(["trainer.epochs=3", "data.global_batch=64"])
    >>> nested["trainer"], nested["data"]
    ({'epochs': 3}, {'global_batch': 64})
"""

from __future__ import annotations

import contextlib
import dataclasses
import runpy
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import optax
from flax import nnx

from xlafit.config import MeshConfig, OptimizerConfig, RunConfig, TrainerConfig, validate_mesh
from xlafit.errors import ConfigError
from xlafit.overrides import deep_merge, from_dict, load_yaml, parse_overrides
from xlafit.platform.cpu import CpuConfig
from xlafit.train.adapter import adapt, framework_of
from xlafit.train.traced import frame_in

__all__ = [
    "FILE_BATCH_KEYS",
    "FILE_SECTIONS",
    "FRAMEWORK",
    "SETTINGS_CHECK",
    "TRAIN_SECTIONS",
    "file_optimizer",
    "file_overrides",
    "file_sections",
    "load_file",
]

# Where load_file keeps a converted model's refusals (Adapted.check) in the file's names.
SETTINGS_CHECK = "__xlafit_settings_check__"
FRAMEWORK = "__xlafit_framework__"  # the model's framework when it is not Flax: "torch", "keras"

Command = Literal["check", "plan", "train"]


def _load_error(path: Path, e: BaseException, command: Command) -> ConfigError:
    """The one-line error for a user file that fails to load, at its line."""
    if isinstance(e, SyntaxError):  # raised by the compiler: the file has no frame in the traceback
        code = f" in `{e.text.strip()}`" if e.text and e.text.strip() else ""
        return ConfigError(
            f"{e.filename or path}, line {e.lineno}: {type(e).__name__}: {e.msg}{code}. "
            f"Fix that line and run xlafit {command} again."
        )
    frame = frame_in(e, path)
    where = f", at line {frame.lineno}" if frame is not None else ""
    return ConfigError(f"{path} failed while being loaded{where}: {type(e).__name__}: {e}")


def load_file(path: Path, command: Command = "check") -> dict[str, Any]:
    """The names the user's file defines; a Keras model or a torch module becomes an
    ``nnx.Module`` and its loss.

    The file runs with Flax's eager sharding off: a parameter annotated as Flax's guides show
    (``nnx.with_partitioning(init, ("embed", "mlp"))``) keeps its names as metadata, which
    the sharding rules lay over each layout's mesh, instead of asking for a mesh at import.
    What it prints goes to stderr: stdout is the command's (``--json``: JSON alone).
    ``command``: the command that runs it, named in its errors.

    Raises:
        ConfigError: a file that is not Python by its name (a data file would run as Python:
            JSON lines are Python dicts), or one that does not define the three names.
    """
    if path.suffix != ".py":
        raise ConfigError(
            f"{path} is not a Python file (.py): xlafit {command} runs a .py file that defines model, loss_fn and "
            f"batch, or takes a recipe by its name (xlafit {command} mnist); a data file is shown by xlafit data "
            f"show {path}."
        )
    try:
        with nnx.use_eager_sharding(False), contextlib.redirect_stdout(sys.stderr):
            namespace = runpy.run_path(str(path), run_name=f"__xlafit_{command}__")
    except Exception as e:
        raise _load_error(path, e, command) from None
    framework = framework_of(namespace.get("model"))
    if framework is not None:  # a Keras 3 model (its compiled loss unless loss_fn is given) or a torch module
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


# What overrides of a user file may change: the file defines the model, its batch's layout and
# its optimizer itself; data.* sets how many rows a step takes (what a plan chose). A training
# run also takes run.* (where it writes and on what it runs: the train command's flags) and
# cpu.* (the XLA:CPU settings of a run on the CPU, as a recipe's).
FILE_SECTIONS: dict[str, type] = {"mesh": MeshConfig, "trainer": TrainerConfig}
TRAIN_SECTIONS: dict[str, type] = {"run": RunConfig, "cpu": CpuConfig}
FILE_BATCH_KEYS = ("per_device_batch", "global_batch")


def file_overrides(
    overrides: Sequence[str], preset: str | Path | None = None, command: Command = "check"
) -> dict[str, Any]:
    """``overrides`` (over ``preset``'s sections, a YAML file as ``xlafit plan --write``
    writes one) as a nested dict of ``mesh``, ``trainer`` and ``data`` batch keys, and
    ``run`` and ``cpu`` keys for ``command`` train; any other key is refused with the valid ones. The
    sections' own keys and types are checked where they are applied (:func:`file_sections`)."""
    nested = deep_merge(load_yaml(preset), parse_overrides(overrides)) if preset else parse_overrides(overrides)
    sections = {**FILE_SECTIONS, **(TRAIN_SECTIONS if command == "train" else {})}
    data = nested.get("data") or {}
    unknown = [f"{key}.*" for key in nested if key not in (*sections, "data")]
    unknown += [f"data.{key}" for key in data if key not in FILE_BATCH_KEYS] if isinstance(data, dict) else ["data"]
    if unknown:
        valid = ", ".join(f"{name}.{f.name}" for name, cls in sections.items() for f in dataclasses.fields(cls))
        takes, defines = "mesh.*, trainer.*", "model, batch layout and optimizer"
        if command == "train":
            takes, defines = "mesh.*, trainer.*, run.*, cpu.*", "model, data and optimizer"
        raise ConfigError(
            f"unknown override {unknown[0]}: a file's {'training' if command == 'train' else command} takes "
            f"{takes} and data.per_device_batch or data.global_batch overrides (the file defines its {defines}). "
            f"Valid keys: {valid}, data.per_device_batch, data.global_batch."
        )
    for key, value in data.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"data.{key}={value}: give a positive whole number of examples.")
    return nested


def file_sections(path: Path, namespace: dict[str, Any], nested: dict[str, Any]) -> tuple[MeshConfig, TrainerConfig]:
    """The file's ``mesh`` and ``config`` (their defaults where it defines none) with the
    ``mesh.*`` and ``trainer.*`` overrides of ``nested`` applied, checked together.

    Raises:
        ConfigError: a name that holds another type, an unknown key or a bad value.
    """
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
    return mesh, config


def file_optimizer(
    path: Path, namespace: dict[str, Any], default: optax.GradientTransformation | None = None
) -> optax.GradientTransformation | OptimizerConfig:
    """The file's ``optimizer`` (an optax transformation, or an
    :class:`~xlafit.config.OptimizerConfig`: its rate scaled with the global batch), or
    ``default``; without either, a one-line error with the line to add.

    Raises:
        ConfigError: no optimizer (and no default), or one that is neither.
    """
    optimizer = namespace.get("optimizer", default)
    keras = namespace.get(FRAMEWORK) == "keras"
    if optimizer is None:
        raise ConfigError(
            f"{path} defines no optimizer, and training needs one: add a line such as "
            "`optimizer = optax.adamw(1e-3)` (an optax transformation"
            + ("; a Keras optimizer converts with xlafit.integrations.keras.optax_from_keras)." if keras else ").")
        )
    if not isinstance(optimizer, optax.GradientTransformation | OptimizerConfig):
        raise ConfigError(
            f"`optimizer` in {path} must be an optax transformation, e.g. optax.adamw(1e-3), or an "
            "xlafit.config.OptimizerConfig."
        )
    return optimizer
