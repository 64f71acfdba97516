"""One training run of a recipe, start to finish: :func:`train_and_evaluate`.

config -> devices -> data -> model -> optimizer -> run directory -> :class:`Trainer` -> report.
The command ``xlafit train`` parses its arguments into a :class:`~xlafit.config.Config` and
calls this; the training loop itself is :meth:`xlafit.Trainer.fit`.

A run directory holds ``config.yaml`` (the config as resolved: batch sizes, schedule length,
what the data decided), ``metrics.jsonl``, ``tensorboard/``, ``checkpoints/`` and the
recipe's artifacts (a tokenizer). Running the same command again resumes from the newest
intact checkpoint, after checking that the new config continues the same run.

Example:
    >>> import xlafit
    >>> cfg = xlafit.load_config("mnist", ["trainer.epochs=1", "run.run_dir=/tmp/xlafit-doc-run"])
    >>> result = xlafit.train_and_evaluate(cfg)                       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from etils import epath

from xlafit.config import Config, ConfigError, resolve_batch
from xlafit.data.dataset import as_dataset
from xlafit.devices import Strategy, connect
from xlafit.recipes import get_recipe
from xlafit.train.optim import OptimizerPlan, highest_rate, make_optimizer
from xlafit.train.signals import handle_signals
from xlafit.train.trainer import FitResult, Trainer

# Config keys whose change makes a checkpoint's state or trajectory another run's: refused
# on resume. Everything else (logging, evaluation, checkpoint policy, devices with the same
# global batch, epochs with the same schedule) may change between segments of one run.
BREAKING = ("recipe", "model", "optimizer", "data.global_batch", "data.seed", "trainer.invariant_chunks")


def train_and_evaluate(cfg: Config) -> FitResult:
    """Runs one recipe end to end: devices, data, model, optimizer, fit, final evaluation.

    SIGTERM/SIGINT at any point stop it cleanly: during training after a checkpoint
    (:class:`~xlafit.train.signals.Preempted`, which the ``xlafit`` command turns into exit
    status 75), during start-up before anything is trained. ``run.resume=false`` is the
    command's ``--restart``.
    """
    with handle_signals():
        recipe = get_recipe(cfg.recipe)
        strategy = connect(
            cfg.run.simulate_devices, cpu_fast_paths=cfg.run.xla_cpu_fast_paths, ynn_fusion=cfg.run.xla_cpu_ynn_fusion
        )
        train_data, eval_data = recipe.load_data(cfg)
        train_data = as_dataset(train_data)
        cfg, run = resolve(recipe.from_data(cfg, train_data), strategy, len(train_data))
        plan = make_optimizer(cfg.optimizer, run.global_batch)
        run_dir = run.run_dir
        if cfg.run.resume:
            check_continuation(run_dir, cfg, announce=strategy.process_index == 0)
        if strategy.process_index == 0:
            start_run_dir(run_dir, cfg)
            recipe.save_artifacts(cfg, run_dir, train_data)
            print(f"run directory: {run_dir}", flush=True)
            print(describe_schedule(cfg, plan), flush=True)
        else:
            log_to_file(run_dir / f"process-{strategy.process_index}.log")
        trainer = Trainer(
            recipe.build_model(cfg, train_data),
            recipe.loss_fn,
            plan.tx,
            strategy=strategy,
            global_batch=run.global_batch,
            config=cfg.trainer,
            learning_rate=plan.schedule,
            run_dir=run_dir,
            checkpoint_dir=cfg.run.checkpoint_dir,
            eval_global_batch=run.eval_batch,
            data_seed=cfg.data.seed,
            prefetch=cfg.data.prefetch,
            resume=cfg.run.resume,
            **recipe.throughput(cfg, train_data),
        )
        try:
            result = trainer.fit(train_data, eval=eval_data)
        finally:
            trainer.close()
    if strategy.process_index == 0 and result.eval is not None:
        print(final_report(result.eval), flush=True)
    return result


class Resolved(NamedTuple):
    """What :func:`resolve` decided, typed: the config records the same values."""

    run_dir: Path
    global_batch: int
    eval_batch: int


def resolve(cfg: Config, strategy: Strategy, num_examples: int) -> tuple[Config, Resolved]:
    """``cfg`` with what this run decides filled in: batch sizes for these devices, the
    schedule's length and the run directory, so that ``config.yaml`` records what was used
    and a resume on another device count keeps the global batch."""
    per_device, global_batch = resolve_batch(cfg.data, strategy.num_replicas)
    eval_batch = cfg.data.eval_global_batch or global_batch
    if eval_batch % strategy.num_replicas:
        raise ConfigError(
            f"data.eval_global_batch={eval_batch} does not divide evenly over {strategy.num_replicas} devices; "
            f"use a multiple of {strategy.num_replicas}."
        )
    steps_per_epoch = num_examples // global_batch
    if steps_per_epoch == 0:
        raise ConfigError(
            f"the training set ({num_examples} examples) is smaller than one global batch ({global_batch}); "
            "lower data.global_batch."
        )
    if cfg.run.run_dir:
        run_dir = cfg.run.run_dir
    else:
        run_dir = str(Path("runs") / f"{cfg.recipe}-{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}")
    resolved = dataclasses.replace(
        cfg,
        data=dataclasses.replace(
            cfg.data, per_device_batch=per_device, global_batch=global_batch, eval_global_batch=eval_batch
        ),
        optimizer=dataclasses.replace(
            cfg.optimizer, decay_steps=cfg.optimizer.decay_steps or cfg.trainer.epochs * steps_per_epoch
        ),
        run=dataclasses.replace(cfg.run, run_dir=run_dir),
    )
    return resolved, Resolved(Path(run_dir), global_batch, eval_batch)


def describe_schedule(cfg: Config, plan: OptimizerPlan) -> str:
    """The learning-rate line of the start-up: scaled peak, warmup and decay, as the run will do them."""
    o = cfg.optimizer
    line = (
        f"learning rate: {o.learning_rate:g} at batch {o.reference_batch} -> peak {plan.peak_lr:.4g} at global "
        f"batch {cfg.data.global_batch} ({o.scaling} scaling), "
    )
    if o.warmup_steps >= plan.decay_steps:
        reached = highest_rate(plan.schedule, plan.decay_steps)
        return line + (
            f"{o.warmup_steps} warmup steps, more than the schedule's {plan.decay_steps}: the rate rises to "
            f"{reached:.4g} and the run ends before the peak and before any decay"
        )
    return line + f"{o.warmup_steps} warmup steps, {o.decay} decay over {plan.decay_steps - o.warmup_steps} steps"


def final_report(metrics: dict[str, float]) -> str:
    """The last lines of a run: the final evaluation, and its headline metric alone."""
    shown = "  ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k != "count")
    lines = [f"test: {shown}  ({metrics['count']} examples)"]
    if "accuracy" in metrics:
        lines.append(f"test accuracy: {metrics['accuracy']:.4f}")
    if "masked_accuracy" in metrics:
        lines.append(f"masked-token accuracy: {metrics['masked_accuracy']:.4f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- run directory


def checkpoint_dir(cfg: Config) -> epath.Path:
    """``run.checkpoint_dir`` (a path or URL), or the run directory's ``checkpoints/``."""
    if cfg.run.checkpoint_dir:
        return epath.Path(cfg.run.checkpoint_dir)
    if not cfg.run.run_dir:
        raise ConfigError("no run directory: set run.run_dir (--run-dir) or run.checkpoint_dir.")
    return epath.Path(cfg.run.run_dir) / "checkpoints"


def start_run_dir(run_dir: Path, cfg: Config) -> None:
    """Creates ``run_dir`` (or finds it writable), clears it for ``--restart`` and writes
    ``config.yaml``. Process 0 only."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create the run directory {run_dir}: {e.strerror}. Choose another --run-dir."
        ) from None
    if not os.access(run_dir, os.W_OK):
        raise ConfigError(f"the run directory {run_dir} is not writable. Choose another --run-dir.")
    checkpoints = checkpoint_dir(cfg)
    if not cfg.run.resume and checkpoints.exists():
        print(f"--restart: removing the checkpoints in {checkpoints} and the metrics of {run_dir}", flush=True)
        checkpoints.rmtree()
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def log_to_file(path: Path) -> None:
    """Processes other than 0 print nothing; their own events go to their own file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("xlafit").addHandler(handler)
    logging.getLogger("xlafit").setLevel(logging.INFO)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _shown(flat: dict[str, object], key: str) -> str:
    return repr(flat[key]) if key in flat else "(not set)"


def _saved_config(run_dir: Path) -> dict[str, Any]:
    """The run's ``config.yaml``; refuses to go on without it (it is what the resume checks)."""
    path = run_dir / "config.yaml"
    fix = (
        "Without it xlafit cannot check that this command continues the same run. Put the run's config.yaml "
        "back, or start over with --restart (run.resume=false) or another --run-dir."
    )
    if not path.exists():
        raise ConfigError(f"cannot resume {run_dir}: it has checkpoints but no config.yaml. {fix}")
    try:
        saved = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(
            f"cannot resume {run_dir}: its config.yaml is not valid YAML ({where}{problem}). {fix}"
        ) from None
    if not isinstance(saved, dict) or "recipe" not in saved:
        raise ConfigError(f"cannot resume {run_dir}: its config.yaml is not an xlafit run config. {fix}")
    return saved


def check_continuation(run_dir: Path, cfg: Config, announce: bool = True) -> None:
    """Refuses to resume a run whose checkpoints were made under an incompatible config.

    ``cfg`` is the resolved config (:func:`resolve`). Nothing happens when the run has no
    checkpoints yet.

    Raises:
        ConfigError: the run's ``config.yaml`` is missing or unreadable, or a
            :data:`BREAKING` key differs from it; the message names each difference and
            the fix.
    """
    checkpoints = checkpoint_dir(cfg)
    if not (checkpoints.exists() and any(p.name.isdigit() for p in checkpoints.iterdir())):
        return
    saved = _flatten(_saved_config(run_dir))
    now = _flatten(cfg.to_dict())
    restart = "or start over with --restart (run.resume=false) or another --run-dir"
    if saved["recipe"] != now["recipe"]:
        raise ConfigError(
            f"cannot resume {run_dir}: it holds a {saved['recipe']} run, and this is {now['recipe']}. "
            f"Choose another --run-dir, {restart.removeprefix('or ')}."
        )
    changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    # A key that only one side has comes from another xlafit version (a setting added or
    # removed since the run began): announced below, never a reason to refuse.
    breaking = [
        k for k in changed if k in saved and k in now and any(k == b or k.startswith(b + ".") for b in BREAKING)
    ]
    if breaking:
        diffs = "; ".join(f"{k}: {saved[k]!r} in the run, {now[k]!r} now" for k in breaking)
        hint = ""
        if "optimizer.decay_steps" in breaking and "trainer.epochs" in changed:
            hint = (
                f" trainer.epochs {saved.get('trainer.epochs')} -> {now.get('trainer.epochs')} would stretch the "
                "learning-rate schedule over the new length, so the rate would jump back up at the next step. To "
                f"train longer on the run's schedule, add optimizer.decay_steps={saved['optimizer.decay_steps']} "
                "(the added steps then train at its final rate);"
            )
        raise ConfigError(
            f"cannot resume {run_dir}: {diffs}. This change breaks continuation from its checkpoints.{hint} "
            f"Use the run's values (see its config.yaml), {restart}."
        )
    safe = [k for k in changed if k != "run.resume"]
    if safe and announce:
        print(
            "resuming with changed settings: " + "; ".join(f"{k} {_shown(saved, k)} -> {_shown(now, k)}" for k in safe),
            flush=True,
        )
