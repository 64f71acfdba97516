"""``xlafit check FILE.py``: a user file's ``model``, ``loss_fn`` and ``batch`` (and, for a
TPU compile, its ``optimizer``, ``config`` and ``mesh``), loaded and checked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import optax

from xlafit.check.program import Program
from xlafit.check.report import Report
from xlafit.check.step import check_step, check_tpu, example_layout, example_lengths, positive, refuse_text
from xlafit.data.dataset import Dataset
from xlafit.errors import ConfigError
from xlafit.parallel.cluster import start_backends
from xlafit.parallel.sharding import parse_rules
from xlafit.train.optim import chain_of
from xlafit.train.rewards import importable
from xlafit.user_file import (
    FILE_BATCH_KEYS,
    FRAMEWORK,
    SETTINGS_CHECK,
    file_optimizer,
    file_overrides,
    file_sections,
    load_file,
)

__all__ = ["SETTINGS_CHECK", "check_file", "file_program", "file_settings", "importable", "load_file"]


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
        lengths = _lengths(namespace)
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


def _lengths(namespace: dict[str, Any]) -> np.ndarray | None:
    """The file's ``lengths``, or its ``dataset``'s where that is a list of examples; a
    training set (a dict of arrays or a Dataset, as ``xlafit train`` takes it) gives none: its
    batches take one shape."""
    lengths, dataset = namespace.get("lengths"), namespace.get("dataset")
    if lengths is None and dataset is not None and not isinstance(dataset, Mapping | Dataset):
        lengths = example_lengths(dataset)
    return None if lengths is None else np.asarray(lengths)


def file_settings(overrides: Sequence[str], tpu: str | None, preset: str | Path | None = None) -> dict[str, Any]:
    """``overrides`` (over ``preset``'s sections) as a nested dict of ``mesh`` and ``trainer``
    keys (:func:`~xlafit.user_file.file_overrides`); anything else, or any setting without
    ``tpu`` (the plain check runs one unsharded step here), is refused."""
    nested = file_overrides(overrides, preset)
    if nested and not tpu:
        given = overrides[0] if overrides else f"--config {preset}"
        raise ConfigError(
            f"{given}: overrides apply to the compile for a TPU slice; add --tpu TARGET (e.g. --tpu v5e-8). "
            "Without it, xlafit check runs one plain step of the file's model on this machine."
        )
    return nested


def file_program(path: Path, namespace: dict[str, Any], nested: dict[str, Any], options: dict[str, Any]) -> Program:
    """What to compile for a user file: its model, loss, optimizer, ``config`` and ``mesh``
    with the overrides applied, and the batch's layout."""
    batch = namespace["batch"]
    if not isinstance(batch, dict) or not batch:
        raise ConfigError(f"`batch` in {path} must be a dict of arrays or jax.ShapeDtypeStructs.")
    # An OptimizerConfig's chain: its state is what the compile needs, whatever the run's length.
    optimizer = chain_of(file_optimizer(path, namespace, default=optax.adamw(1e-3)), 1)
    mesh, config = file_sections(path, namespace, nested)
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
