"""A run's checkpoints scored on data without training: :func:`evaluate_run` (``xlafit eval``).

The run's ``config.yaml`` rebuilds its model, loss and data encoding; each checkpoint asked for
is restored into that model and evaluated as the run evaluates (every example counted once,
the loss and metrics the run logs). The data is the run's own evaluation split, or every
record of another file or folder (``data``) encoded as the run encoded its training data (a
language model's tokenizer, chat template, sequence length and loss mask). Nothing in the run
directory is written or moved, so a run may be scored while it trains.

Example:
    >>> scores = evaluate_run("runs/chat-lora", data="held_out.jsonl", steps="all")  # doctest: +SKIP
    >>> for score in scores:                                                       # doctest: +SKIP
    ...     print(score.step, round(score.metrics["loss"], 3))
    20 1.412
    40 1.187
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from flax import nnx

from xlafit.checkpoint import Checkpointer, usable
from xlafit.config import Config
from xlafit.data.dataset import as_dataset
from xlafit.errors import CheckpointError, ConfigError
from xlafit.io.paths import as_path, is_url, reach, reading
from xlafit.kept_files import check_kept_files
from xlafit.models.lora import ADAPTER
from xlafit.overrides import migrate, parse_overrides
from xlafit.parallel.cluster import connect_as_run
from xlafit.parallel.sharding import parse_rules
from xlafit.recipes import config_from_dict, get_recipe
from xlafit.recipes.base import Recipe, shapes_only
from xlafit.recipes.llm import build_from_config
from xlafit.recipes.llm_data import base_config, recorded_model_dir
from xlafit.run import BREAKING, metrics_in_words, model_builder, perplexity
from xlafit.rundir import checkpoint_dir
from xlafit.train.optim import make_optimizer
from xlafit.train.trainer import Trainer

__all__ = ["Score", "evaluate_run"]

log = logging.getLogger("xlafit")

# Settings under BREAKING that change how a step computes, not what it computes: a run may be
# scored with them changed (less memory, another attention kernel).
HOW_IT_COMPUTES = ("model.attention", "model.logits_chunk", "model.remat")
# The settings xlafit eval takes (how the evaluation runs); any other is the run's own, or says
# what to score, which --data and the run directory say.
EVALUATION_SETTINGS = ("data.eval_global_batch", "mesh", "cpu", "run.simulate_devices", *HOW_IT_COMPUTES)


@dataclasses.dataclass(frozen=True)
class Score:
    """One checkpoint's evaluation: its step and the run's metrics over the data (``count``:
    the examples, or the llm recipe's rows or pairs)."""

    step: int
    metrics: dict[str, float]

    def line(self, data: str, unit: str = "examples") -> str:
        """The score in a line: the step, the ``data``, the metrics as a run's final report has
        them and their count in ``unit``; a language model's perplexity after them.

        Example:
            >>> Score(40, {"loss": 1.5, "token_accuracy": 0.5, "count": 12}).line("held.jsonl", "rows")
            'step 40 on held.jsonl: loss=1.5000  token_accuracy=0.5000  (12 rows)  perplexity=4.48'
        """
        line = f"step {self.step} on {data}: {metrics_in_words(self.metrics, unit)}"
        ppl = perplexity(self.metrics)
        return line if ppl is None else f"{line}  perplexity={ppl:.2f}"


def evaluate_run(
    run: str,
    data: str | None = None,
    steps: Sequence[int] | Literal["all"] | None = None,
    overrides: Sequence[str] = (),
    simulate: int | None = None,
    on_score: Callable[[Score], None] | None = None,
) -> list[Score]:
    """Scores checkpoints of ``run`` on ``data``, training nothing.

    Args:
        run: a run directory (local or a URL) with its ``config.yaml`` and checkpoints.
        data: a file, folder, glob or URL the run's recipe reads: for the llm recipe, records
            evaluated whole (no split); for the others, a ``data.data_dir`` whose evaluation
            split is read. None: the run's own evaluation split.
        steps: the checkpoints; ``"all"``: every intact one; None: the newest intact one.
        overrides: ``key=value`` settings for the evaluation (``data.eval_global_batch=8``,
            ``mesh.fsdp=2``); settings that change what the checkpoints mean are refused.
        simulate: simulated CPU devices, as ``xlafit train --simulate``.
        on_score: called with each score as soon as it is known, in a job's process 0 (the
            command prints it); every process returns them all.

    Raises:
        ConfigError: no run there, a refused override, or data with nothing to evaluate.
        CheckpointError: no checkpoint, or one asked for that is absent or damaged.
    """
    cfg = run_config(run, overrides)
    recipe = get_recipe(cfg.recipe)
    if data is not None and not is_url(data):  # as data.data_dir is recorded: absolute
        data = str(Path(data).expanduser().absolute())
    strategy = connect_as_run(
        simulate, cpu=cfg.cpu, mesh=cfg.mesh.sizes, rules=parse_rules(cfg.mesh.rules), same="the scores are the same"
    )
    asked = checkpoint_steps(cfg, run, steps)
    if cfg.recipe == "llm":
        recorded_model_dir(cfg, run)  # the base the checkpoints need, named where it moved
    with shapes_only() if _every_weight_saved(cfg) else contextlib.nullcontext():  # the base's weights unread
        recipe.validate(cfg)
    evaluation = as_dataset(eval_data(recipe, cfg, run, data))
    # the tokenizer the checkpoints learned, the run's classes; its own data's shards, as it trained on them
    # (a recipe that reads --data itself keeps the run's settings for its files: the data's are the run's)
    kept_cfg = cfg if recipe.eval_data is not None else _reading(cfg, data)
    check_kept_files(recipe, kept_cfg, as_path(run), evaluation, scoring=True, given=data)
    _check_sequence_length(cfg, evaluation, data)
    trainer = _trainer(recipe, cfg, strategy, evaluation)
    scores = []
    try:
        for step in asked:
            restored = trainer.restore(step)
            if strategy.process_index == 0:
                print(f"evaluating step {restored} of {run} ...", file=sys.stderr, flush=True)
            scores.append(Score(restored, trainer.evaluate(evaluation)))
            if on_score is not None and strategy.process_index == 0:
                on_score(scores[-1])
    finally:
        trainer.close()
    return scores


def run_config(run: str, overrides: Sequence[str] = ()) -> Config:
    """The config ``run`` recorded, with ``overrides`` that leave its checkpoints' meaning alone.

    Raises:
        ConfigError: ``run`` has no readable ``config.yaml``, or an override changes the
            model, its training or the data's encoding (:data:`~xlafit.run.BREAKING`).
    """
    where = as_path(run)
    path = where / "config.yaml"
    reach(where)
    with reading(path):
        if not path.exists():
            if not where.exists():
                raise ConfigError(f"{run} does not exist; give a run directory (xlafit train --run-dir writes one).")
            raise ConfigError(f"{run} is not a run directory: it has no config.yaml (what xlafit train writes there).")
        try:
            saved = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            problem = f"{run}/config.yaml is not valid YAML ({type(e).__name__})"
            raise ConfigError(f"{problem}; put the run's own back.") from None
    if not isinstance(saved, dict) or "recipe" not in saved:
        raise ConfigError(f"{run}/config.yaml is not an xlafit run config; put the run's own back.")
    given = parse_overrides(overrides)
    takes = "data.eval_global_batch, mesh.*, cpu.*, model.attention, model.logits_chunk, model.remat"
    keys = _dotted_keys(given)
    refused = [key for key in keys if _breaking(key)]
    if refused:
        raise ConfigError(
            f"{', '.join(refused)}: xlafit eval scores the run as it trained, and this would change what its "
            f"checkpoints mean (the model, its training or how the data is encoded). Give evaluation settings only "
            f"({takes}); to score another configuration, train it."
        )
    other = [key for key in keys if not _under(key, EVALUATION_SETTINGS)]
    if other:  # a training setting would change nothing; a data or run setting would score other data unsaid
        raise ConfigError(
            f"{', '.join(other)}: not an evaluation setting; xlafit eval takes {takes}. The data to score is "
            "--data PATH (default: the run's own evaluation split), the run is RUN_DIR."
        )
    tree = {k: v for k, v in migrate(saved, f"{run}/config.yaml").items() if k != "recipe"}
    cfg = config_from_dict(saved["recipe"], tree, given)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=str(run)))


def _dotted_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in tree.items():
        keys += _dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def _breaking(key: str) -> bool:
    """Whether a setting changes what a run's checkpoints mean (:data:`~xlafit.run.BREAKING`)."""
    if _under(key, HOW_IT_COMPUTES):
        return False
    return _under(key, BREAKING)


def _under(key: str, settings: Sequence[str]) -> bool:
    """Whether ``key`` is one of ``settings`` or inside one of them (``mesh.fsdp`` in ``mesh``)."""
    return any(key == s or key.startswith(s + ".") for s in settings)


def checkpoint_steps(cfg: Config, run: str, steps: Sequence[int] | Literal["all"] | None) -> list[int]:
    """The steps of the checkpoints to score, read without moving anything: the newest intact
    one (``steps`` None; older ones are not read), every intact one (``"all"``), or those asked
    for, each verified (its files hashed).

    Raises:
        CheckpointError: the run has no intact checkpoint, or one asked for is absent or
            damaged (the run's checkpoints named).
    """
    directory = checkpoint_dir(cfg)
    with reading(directory):
        exists = directory.exists()
    if not exists:
        raise CheckpointError(f"{run} has no checkpoints ({directory} does not exist); train it until it saves one.")
    ckpt = Checkpointer(directory)
    try:  # each checkpoint's files are hashed to verify it: only those that may be scored
        saved = ckpt.steps()
        if steps is None:  # the newest intact one: the older ones are not read
            status = {}
            for step in reversed(saved):
                status[step] = ckpt.verify(step)
                if usable(status[step]):
                    _say_left_out(run, status, f"scoring step {step}, the newest intact one")
                    return [step]
        else:
            status = {step: ckpt.verify(step) for step in (saved if steps == "all" else steps) if step in saved}
    finally:
        ckpt.close()
    intact = [step for step in saved if step in status and usable(status[step])]
    if steps is None or (steps == "all" and not intact):
        found = "; ".join(f"{step}: {status[step]}" for step in sorted(status)) or "none"
        raise CheckpointError(f"{run} has no intact checkpoint to evaluate (checkpoints: {found}).")
    if steps == "all":
        _say_left_out(run, status, "not scored")
        return intact
    for step in steps:
        if step not in intact:
            what = f"is {status[step]}" if step in status else "does not exist"
            raise CheckpointError(f"checkpoint {step} of {run} {what}; the checkpoints: {saved}.")
    return list(steps)


def _say_left_out(run: str, status: dict[int, str], then: str) -> None:
    """Warns of the checkpoints of ``run`` that cannot be scored (damaged), and what is done."""
    damaged = [f"{step} ({status[step]})" for step in sorted(status) if not usable(status[step])]
    if damaged:
        log.warning("warning: checkpoint(s) %s of %s cannot be scored; %s.", ", ".join(damaged), run, then)


def eval_data(recipe: Recipe, cfg: Config, run: str, data: str | None) -> Any:
    """What to evaluate: every record of ``data`` (the recipe's :attr:`~Recipe.eval_data`),
    the evaluation split of a ``data.data_dir=data``, or without ``data`` the run's own.

    Raises:
        ConfigError: there is nothing to evaluate (naming what to give).
    """
    if data is not None and recipe.eval_data is not None:
        found = recipe.eval_data(cfg, data)
    else:
        found = recipe.load_data(_reading(cfg, data))[1]
    if found is None or not len(as_dataset(found)):
        if data is None:
            raise ConfigError(f"{run} has no evaluation data; give the data to score with --data.")
        raise ConfigError(
            f"{data} holds no evaluation split: --data of a {cfg.recipe} run is a data directory whose evaluation "
            "split is scored (prepare one with --eval-fraction, or from a folder with train/ and val/)."
        )
    return found


def _reading(cfg: Config, data: str | None) -> Config:
    """``cfg`` reading ``data`` as its ``data.data_dir``; as it is without."""
    if data is None:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data_dir=data))


def _check_sequence_length(cfg: Config, evaluation: Any, data: str | None) -> None:
    """Refuses data prepared at another sequence length than the run trained at (positions it
    never trained, or sequences cut otherwise).

    Raises:
        ConfigError: naming both lengths.
    """
    length, trained = getattr(evaluation, "seq_len", None), getattr(cfg.data, "seq_len", None)
    if length is not None and trained is not None and length != trained:
        raise ConfigError(
            f"{data} holds sequences of {length} tokens and the run trained at data.seq_len={trained}; prepare the "
            f"data to score at --seq-len {trained}."
        )


def _every_weight_saved(cfg: Config) -> bool:
    """Whether an llm run started from ``model.init_from_hf`` holds every weight in its
    checkpoints (a full fine-tune): its base's ``config.json`` is all it needs of it."""
    return cfg.recipe == "llm" and bool(cfg.model.init_from_hf) and not cfg.lora.rank


def _trainer(recipe: Recipe, cfg: Config, strategy: Any, evaluation: Any) -> Trainer:
    """A trainer of the run's model, loss and optimizer state over its checkpoints, writing
    nothing (no run directory: no metrics; nothing saved without ``fit``)."""
    batch = cfg.data.global_batch
    assert batch is not None  # a run's config.yaml records the batch it resolved
    if _every_weight_saved(cfg):
        config = base_config(cfg, cfg.run.run_dir)
        builder: Any = lambda: build_from_config(cfg, config)  # noqa: E731  (no weight of the base read)
    else:
        builder = model_builder(recipe, cfg, evaluation)  # the data's vocabulary, classes and shapes are the run's
    return Trainer(
        builder,
        recipe.loss(cfg),
        make_optimizer(cfg.optimizer, batch).tx,
        strategy=strategy,
        global_batch=batch,
        config=cfg.trainer,
        checkpoint_dir=checkpoint_dir(cfg),
        eval_global_batch=cfg.data.eval_global_batch or batch,
        data_seed=cfg.data.seed,
        trainable=ADAPTER if cfg.lora.rank else nnx.Param,
    )
