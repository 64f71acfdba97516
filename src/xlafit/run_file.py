"""One training run of a user's Python file, start to finish: :func:`train_file`, what
``xlafit train my_model.py`` runs.

The file is the one ``xlafit check`` and ``xlafit plan`` read (:mod:`xlafit.user_file`:
``model``, ``loss_fn(model, batch)`` and ``batch``; optionally ``config``, a
:class:`~xlafit.config.TrainerConfig`, and ``mesh``, a :class:`~xlafit.config.MeshConfig`).
To train, it also defines ``dataset`` (a dict of arrays with one row per example, or an
:class:`~xlafit.data.dataset.Dataset`) and ``optimizer`` (an optax transformation: there is no
default), and optionally ``eval_dataset``, ``global_batch`` or ``per_device_batch`` (the
overrides ``data.global_batch`` and ``data.per_device_batch`` come first), and
``learning_rate`` (the rate or schedule inside ``optimizer``, only to print and log it).

devices -> the file -> its settings with the overrides -> the run directory -> :class:`Trainer`
-> ``fit`` -> the final evaluation. The devices come first: building the file's model starts
JAX, after which ``--simulate N`` could no longer make its devices. The run directory holds
what the trainer writes (``metrics.jsonl``, TensorBoard's log, ``checkpoints/``); running the
same command again resumes from its newest checkpoint (the trainer refuses one of another
global batch or another model), and ``run.resume=false`` (``--restart``) moves an earlier run
aside first.

Example:
    >>> result = train_file("my_model.py", ["data.global_batch=64", "run.run_dir=runs/mine"])  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import optax
from etils import epath
from flax import nnx

from xlafit.checkpoint import check_directory
from xlafit.config import MeshConfig, OptimizerConfig, RunConfig, TrainerConfig
from xlafit.data.dataset import Dataset, as_dataset
from xlafit.data.loader import TrainOrder
from xlafit.errors import ConfigError, DataError, going_on_with
from xlafit.io.paths import as_path
from xlafit.overrides import from_dict
from xlafit.parallel.cluster import connect
from xlafit.parallel.mesh import Strategy
from xlafit.parallel.sharding import parse_rules
from xlafit.platform.cpu import CpuConfig
from xlafit.run import final_report, how_to_go_on
from xlafit.rundir import checkpoint_dir, log_to_file, make_run_dir, move_aside, refuse_foreign_dir
from xlafit.runlock import hold_run_dir
from xlafit.train.adapter import Adapted
from xlafit.train.arguments import check_batches, global_batch_of
from xlafit.train.loop import FitResult
from xlafit.train.rewards import importable
from xlafit.train.signals import handle_signals
from xlafit.train.trainer import Trainer
from xlafit.user_file import FILE_BATCH_KEYS, SETTINGS_CHECK, file_optimizer, file_overrides, file_sections, load_file

__all__ = ["FileRun", "read_file_run", "train_file"]


@dataclasses.dataclass
class FileRun:
    """What a user's file and the overrides make of a run, checked before anything is written."""

    model: Adapted  # the file's model as the trainer takes it (a torch or Keras model: converted, its refusals kept)
    optimizer: optax.GradientTransformation | OptimizerConfig
    train: Dataset
    eval: Dataset | None
    config: TrainerConfig
    mesh: MeshConfig
    batch: dict[str, int]  # {"global_batch": n} or {"per_device_batch": n}: the Trainer's argument
    learning_rate: optax.Schedule | float | None


def train_file(path: str | Path, overrides: Sequence[str] = (), preset: str | Path | None = None) -> FitResult:
    """Trains the model of the user's file at ``path`` with :class:`~xlafit.train.trainer.Trainer`.

    Args:
        path: the Python file (see the module docstring for the names it defines).
        overrides: dotted ``key=value`` pairs: ``trainer.*`` and ``mesh.*`` over the file's
            ``config`` and ``mesh``, ``data.global_batch`` or ``data.per_device_batch``, and
            ``run.run_dir``, ``run.checkpoint_dir``, ``run.resume``, ``run.simulate_devices``
            (the command's flags), and ``cpu.*`` (the XLA:CPU settings, on a CPU). Any other
            key is refused with the valid ones.
        preset: a YAML file with ``mesh:``, ``trainer:`` and ``data:`` sections (what
            ``xlafit plan --write`` writes for a file), applied before ``overrides``.

    Returns:
        The trainer's :class:`~xlafit.train.loop.FitResult`.

    Raises:
        ConfigError: no such file, a file that lacks a name training needs, or a bad
            override; each before anything is written or trained.
        Preempted: SIGTERM or SIGINT; a checkpoint was written first, and the same call
            (the same command) resumes from it.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist: xlafit train takes a recipe's name or the path of a Python file that defines "
            "model, loss_fn, batch, dataset and optimizer (docs/guides/own-model.md)."
        )
    nested = file_overrides(overrides, preset, command="train")
    run = from_dict(RunConfig, nested.get("run") or {}, "run.")
    cpu = from_dict(CpuConfig, nested.get("cpu") or {}, "cpu.")
    named_dir = bool(run.run_dir)
    run = dataclasses.replace(run, run_dir=run.run_dir or _new_run_dir(path))
    # The loss may import the file's neighbours when it is traced, after the file has run.
    with handle_signals(), contextlib.ExitStack() as held, importable(path):
        connect(run.simulate_devices, cpu=cpu)  # the devices before the file's model starts JAX
        spec = read_file_run(path, load_file(path, command="train"), nested)
        strategy = connect(run.simulate_devices, mesh=spec.mesh.sizes, rules=parse_rules(spec.mesh.rules))
        global_batch = _global_batch(path, spec, strategy)
        if spec.model.check is not None:  # a torch or Keras model's refusals, before the run directory is made
            spec.model.check(strategy, spec.config)
        run_dir = _start_run_dir(run, strategy, held)
        trainer = Trainer(
            spec.model, spec.model.loss_fn, spec.optimizer, strategy=strategy, global_batch=global_batch,
            config=spec.config, learning_rate=spec.learning_rate, run_dir=run_dir,
            checkpoint_dir=run.checkpoint_dir, resume=run.resume,
        )  # fmt: skip
        # A stop says how to go on; the same command would start over in another new directory
        with going_on_with(None if named_dir else how_to_go_on(run_dir)):
            try:
                result = trainer.fit(spec.train, eval=spec.eval)
            finally:
                trainer.close()
    step = int(result.state.step)
    total = spec.config.epochs * TrainOrder.for_dataset(spec.train, global_batch, 0).steps_per_epoch
    if strategy.process_index == 0 and result.eval is not None:
        print(final_report(result.eval, result.eval_step, step), flush=True)
    if step < total and not named_dir and strategy.process_index == 0:  # stopped by trainer.stop_at_step
        print(how_to_go_on(run_dir), flush=True)
    return result


def read_file_run(path: Path, namespace: dict[str, Any], nested: dict[str, Any]) -> FileRun:
    """The run that a loaded file (:func:`~xlafit.user_file.load_file`) defines, with the
    overrides of ``nested`` applied.

    Raises:
        ConfigError: no ``dataset``, no ``optimizer``, no batch size, a model built as shapes
            only, or a name of the wrong kind; each in one line with the fix.
    """
    if namespace.get("dataset") is None:
        raise ConfigError(
            f"{path} defines no dataset, and training needs one: add `dataset = {{'x': x, 'y': y}}` (a dict of arrays "
            "with one row per example, the keys loss_fn reads) or an xlafit.data.Dataset; optionally eval_dataset too."
        )
    optimizer = file_optimizer(path, namespace)
    mesh, config = file_sections(path, namespace, nested)
    batch = _batch_size(path, namespace, nested)
    model = namespace["model"]
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model))):
        raise ConfigError(
            f"`model` in {path} is built as shapes only (nnx.eval_shape), as xlafit check --tpu and xlafit plan can "
            "take it; training needs its values: build it, e.g. model = MyModel(nnx.Rngs(0))."
        )
    eval_data = _data(path, namespace, "eval_dataset") if namespace.get("eval_dataset") is not None else None
    return FileRun(
        Adapted(model, namespace["loss_fn"], check=namespace.get(SETTINGS_CHECK)),
        optimizer,
        _data(path, namespace, "dataset"),
        eval_data,
        config,
        mesh,
        batch,
        namespace.get("learning_rate"),
    )


def _data(path: Path, namespace: dict[str, Any], name: str) -> Dataset:
    """The file's ``dataset`` or ``eval_dataset`` as a :class:`Dataset`; a one-line error naming it."""
    try:
        return as_dataset(namespace[name])
    except DataError as e:
        raise ConfigError(f"`{name}` in {path}: {e}") from None


def _batch_size(path: Path, namespace: dict[str, Any], nested: dict[str, Any]) -> dict[str, int]:
    """The batch the run trains with: ``data.global_batch`` or ``data.per_device_batch`` of
    the overrides, else the file's ``global_batch`` or ``per_device_batch``."""
    given = {k: v for k, v in (nested.get("data") or {}).items() if v is not None}
    if not given:
        given = {key: namespace[key] for key in FILE_BATCH_KEYS if namespace.get(key) is not None}
    if not given:
        raise ConfigError(
            f"no batch size: give data.global_batch=N (the examples of one optimizer step over all devices) or "
            f"data.per_device_batch=N on the command line, or define global_batch = N in {path}."
        )
    return given


def _global_batch(path: Path, spec: FileRun, strategy: Strategy) -> int:
    """The global batch on ``strategy``'s devices, refused unless it splits over them and the
    dataset holds at least one."""
    per_device = spec.batch.get("per_device_batch")
    global_batch = global_batch_of(spec.batch.get("global_batch"), per_device, strategy.num_replicas)
    check_batches(global_batch, None, strategy.num_replicas)
    if len(spec.train) < global_batch:
        raise ConfigError(
            f"`dataset` in {path} holds {len(spec.train)} examples, fewer than one global batch of {global_batch}; "
            "give a smaller data.global_batch (or data.per_device_batch)."
        )
    return int(global_batch)


def _new_run_dir(path: Path) -> str:
    """A run directory of its own, named after the file and the time: ``runs/my_model-20260101-120000``."""
    return str(Path("runs") / f"{path.stem}-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}")


def _start_run_dir(run: RunConfig, strategy: Strategy, held: contextlib.ExitStack) -> epath.Path:
    """The run directory, made and held by process 0 (another training there is refused),
    an earlier run moved aside for ``run.resume=false``; a recipe's run is not resumed."""
    refuse_foreign_dir(run)
    if run.checkpoint_dir:
        check_directory(run.checkpoint_dir)
    run_dir = as_path(run.run_dir or "")
    if strategy.process_index != 0:
        log_to_file(run_dir / f"process-{strategy.process_index}.log")
        return run_dir
    make_run_dir(run_dir, run)
    for line in held.enter_context(hold_run_dir(run_dir)):
        print(line, flush=True)
    if not run.resume:
        for line in move_aside(run_dir, checkpoint_dir(run)):
            print(line, flush=True)
    elif (run_dir / "config.yaml").exists():  # a recipe's run writes it; a file's run does not
        raise ConfigError(
            f"{run_dir} holds a recipe's run (its config.yaml), not this file's: give another --run-dir, or start "
            "over there with --restart (the earlier run is moved aside)."
        )
    print(f"run directory: {run_dir}", flush=True)
    return run_dir
