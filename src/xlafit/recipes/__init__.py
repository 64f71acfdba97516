"""Recipes: a preset, a model, a loss and data wiring per workload.

A recipe module provides ``ModelConfig`` (a dataclass), ``load_data(cfg) -> (train, eval)``,
``build_model(cfg, train)`` and ``loss_fn(model, batch)``, plus a YAML preset beside it with
the same name. Optional: ``DataConfig`` (a :class:`xlafit.config.DataConfig` subclass with
the recipe's data keys), ``throughput(cfg, train)`` (``tokens_per_example`` and
``flops_per_example`` for the logs) and ``save_artifacts(cfg, run_dir, train)`` (files a
run keeps beside its checkpoints, such as a tokenizer).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import yaml
from etils import epath

from xlafit.config import Config, ConfigError, DataConfig, build_config, load_yaml, parse_overrides, resolve_batch
from xlafit.data.loader import as_dataset
from xlafit.devices import connect
from xlafit.train.optim import make_optimizer
from xlafit.train.trainer import FitResult, Trainer, handle_signals

RECIPES = ("mnist", "bert")


def recipe_module(name: str) -> ModuleType:
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}.")
    return importlib.import_module(f"xlafit.recipes.{name}")


def load_config(name: str, overrides: Sequence[str] = (), preset: str | Path | None = None) -> Config:
    """The recipe's preset (or ``preset``, a YAML file) with dotted ``overrides`` applied.

    Example:
        >>> cfg = load_config("mnist", ["trainer.epochs=1"])
        >>> cfg.trainer.epochs
        1
    """
    module = recipe_module(name)
    path = Path(preset) if preset else Path(module.__file__).with_suffix(".yaml")
    return config_from_dict(name, load_yaml(path), parse_overrides(overrides))


def config_from_dict(name: str, preset: dict, overrides: dict | None = None) -> Config:
    """A recipe's :class:`Config` from a plain dict (a preset, or a run's ``config.yaml``)."""
    module = recipe_module(name)
    data_cls = getattr(module, "DataConfig", DataConfig)
    return build_config(name, preset, overrides or {}, module.ModelConfig, data_cls)


def _run_dir(cfg: Config) -> Path:
    if cfg.run.run_dir:
        return Path(cfg.run.run_dir)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.recipe}-{stamp}"


def _check_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create the run directory {run_dir}: {e.strerror}. Choose another --run-dir."
        ) from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"the run directory {run_dir} is not writable. Choose another --run-dir.")


# Config keys whose change makes a checkpoint's state or trajectory another run's: refused
# on resume. Everything else (epochs, logging, evaluation, checkpoint policy, devices with
# the same global batch) may change between segments of one run.
BREAKING = ("model", "optimizer", "data.global_batch", "data.seed", "trainer.invariant_chunks")


def _flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def checkpoint_dir(cfg: Config, run_dir: Path) -> epath.Path:
    """``run.checkpoint_dir`` (a path or URL), or the run directory's ``checkpoints/``."""
    return epath.Path(cfg.run.checkpoint_dir) if cfg.run.checkpoint_dir else epath.Path(run_dir / "checkpoints")


def _has_checkpoints(directory: epath.Path) -> bool:
    return directory.exists() and any(p.name.isdigit() for p in directory.iterdir())


def _shown(flat: dict[str, object], key: str) -> str:
    return repr(flat[key]) if key in flat else "(not set)"


def check_continuation(run_dir: Path, cfg: Config, announce: bool = True) -> None:
    """Refuses to resume a run whose checkpoint was made under an incompatible config.

    Raises:
        ConfigError: a :data:`BREAKING` key differs from the run's ``config.yaml``; the
            message names each difference and the fix.
    """
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists() or not _has_checkpoints(checkpoint_dir(cfg, run_dir)):
        return
    saved = _flatten(yaml.safe_load(saved_path.read_text()) or {})
    now = _flatten(cfg.to_dict())
    changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    # A key that only one side has comes from another xlafit version (a setting added or
    # removed since the run began): announced below, never a reason to refuse.
    breaking = [
        k for k in changed if k in saved and k in now and any(k == b or k.startswith(b + ".") for b in BREAKING)
    ]
    if breaking:
        diffs = "; ".join(f"{k}: {saved.get(k)!r} in the run, {now.get(k)!r} now" for k in breaking)
        raise ConfigError(
            f"cannot resume {run_dir}: {diffs}. This change breaks continuation from its checkpoints; "
            "use the run's values (see its config.yaml), or --restart / another --run-dir to start over."
        )
    safe = [k for k in changed if k != "run.resume"]
    if safe and announce:
        print(
            "resuming with changed settings: " + "; ".join(f"{k} {_shown(saved, k)} -> {_shown(now, k)}" for k in safe),
            flush=True,
        )


def train(cfg: Config) -> FitResult:
    """Runs one recipe end to end: devices, data, model, optimizer, fit, final evaluation.

    SIGTERM/SIGINT at any point stop it cleanly: during training after a checkpoint
    (:class:`~xlafit.train.trainer.Preempted`), during start-up before anything is trained.
    """
    with handle_signals():
        return _train(cfg)


def _train(cfg: Config) -> FitResult:
    module = recipe_module(cfg.recipe)
    run = cfg.run
    strategy = connect(run.simulate_devices, cpu_fast_paths=run.xla_cpu_fast_paths, ynn_fusion=run.xla_cpu_ynn_fusion)
    _, global_batch = resolve_batch(cfg.data, strategy.num_replicas)
    eval_batch = cfg.data.eval_global_batch or global_batch
    if eval_batch % strategy.num_replicas:
        raise ConfigError(
            f"data.eval_global_batch={eval_batch} does not divide evenly over {strategy.num_replicas} devices; "
            f"use a multiple of {strategy.num_replicas}."
        )
    train_data, eval_data = module.load_data(cfg)
    steps_per_epoch = len(as_dataset(train_data)) // global_batch
    if steps_per_epoch == 0:
        raise ConfigError(
            f"the training set is smaller than one global batch ({global_batch}); lower data.global_batch."
        )
    plan = make_optimizer(cfg.optimizer, global_batch, cfg.trainer.epochs * steps_per_epoch)

    run_dir = _run_dir(cfg)
    # The resolved global batch is recorded, so a resume on another device count can keep it.
    resolved = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, global_batch=global_batch),
        run=dataclasses.replace(cfg.run, run_dir=str(run_dir)),
    )
    if cfg.run.resume:
        check_continuation(run_dir, resolved, announce=strategy.process_index == 0)
    if strategy.process_index == 0:
        _check_writable(run_dir)
        checkpoints = checkpoint_dir(cfg, run_dir)
        if not cfg.run.resume and checkpoints.exists():
            print(f"--restart: removing the checkpoints in {checkpoints} and the metrics of {run_dir}", flush=True)
            checkpoints.rmtree()
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved.to_dict(), sort_keys=False))
        if hasattr(module, "save_artifacts"):
            module.save_artifacts(cfg, run_dir, train_data)
        print(f"run directory: {run_dir}", flush=True)
        print(
            f"learning rate: {cfg.optimizer.learning_rate:g} at batch {cfg.optimizer.reference_batch} -> "
            f"peak {plan.peak_lr:.4g} at global batch {global_batch} ({cfg.optimizer.scaling} scaling), "
            f"{cfg.optimizer.warmup_steps} warmup steps, {cfg.optimizer.decay} decay",
            flush=True,
        )
    else:
        # Processes other than 0 print nothing; their own events go to their own file.
        run_dir.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(run_dir / f"process-{strategy.process_index}.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.getLogger("xlafit").addHandler(handler)
        logging.getLogger("xlafit").setLevel(logging.INFO)
    throughput = module.throughput(cfg, train_data) if hasattr(module, "throughput") else {}
    trainer = Trainer(
        module.build_model(cfg, train_data),
        module.loss_fn,
        plan.tx,
        strategy=strategy,
        global_batch=global_batch,
        config=cfg.trainer,
        learning_rate=plan.schedule,
        run_dir=run_dir,
        checkpoint_dir=cfg.run.checkpoint_dir,
        eval_global_batch=eval_batch,
        data_seed=cfg.data.seed,
        prefetch=cfg.data.prefetch,
        resume=cfg.run.resume,
        **throughput,
    )
    try:
        result = trainer.fit(train_data, eval=eval_data)
    finally:
        trainer.close()
    if strategy.process_index == 0 and result.eval is not None:
        metrics = "  ".join(f"{k}={v:.4f}" for k, v in result.eval.items() if k != "count")
        print(f"test: {metrics}  ({result.eval['count']} examples)", flush=True)
        if "accuracy" in result.eval:
            print(f"test accuracy: {result.eval['accuracy']:.4f}", flush=True)
        if "masked_accuracy" in result.eval:
            print(f"masked-token accuracy: {result.eval['masked_accuracy']:.4f}", flush=True)
    return result
