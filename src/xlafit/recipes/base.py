"""What a recipe is: the :class:`Recipe` record that :func:`xlafit.train_and_evaluate` runs.

A recipe is config + model + data wiring, nothing else (the loop is :class:`xlafit.Trainer`,
the run is :mod:`xlafit.run`). Like optax's ``GradientTransformation``, it is a record of
functions: the required ones, and optional hooks whose defaults do nothing, so the run
calls every hook without asking what a recipe can do. A recipe module ``xlafit/recipes/
NAME.py`` defines its functions, a YAML preset ``NAME.yaml`` beside it, and at the end::

    RECIPE = Recipe(name="mnist", model_config=MnistModelConfig, load_data=load_data,
                    build_model=build_model, loss_fn=loss_fn)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
from flax import nnx

from xlafit.config import Config, DataConfig
from xlafit.data.dataset import Dataset
from xlafit.train.step import LossFn
from xlafit.train.trainer import Rollout

# True while a recipe's data is read for its programs' shapes alone (`xlafit check --tpu`,
# `plan`): a recipe skips there the work that only fills values no compiler reads (a DPO
# run's precomputed reference, a forward pass of the whole model over every pair).
_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("xlafit_shapes_only", default=False)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Data read inside it is read for its shapes alone (:func:`reading_shapes_only`)."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def reading_shapes_only() -> bool:
    """Whether the data being read serves its programs' shapes alone (:func:`shapes_only`)."""
    return _SHAPES_ONLY.get()


class Throughput(TypedDict, total=False):
    """Per-example work, for the logs' ``tokens_per_sec`` and ``mfu``."""

    tokens_per_example: float
    flops_per_example: float


def _config_as_is(cfg: Config, train: Dataset) -> Config:
    return cfg


def _no_throughput(cfg: Config, train: Dataset) -> Throughput:
    return {}


def _nothing_to_save(cfg: Config, run_dir: Path, train: Dataset) -> None:
    return None


def _no_lengths(cfg: Config) -> np.ndarray | None:
    return None


def _nothing_to_check(cfg: Config) -> None:
    return None


def _shapes_from_data(cfg: Config) -> None:
    return None


def _examples(cfg: Config) -> str:
    return "examples"


def _no_rollout(cfg: Config, train: Any) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One workload: its config types and the functions that wire data, model and loss.

    Attributes:
        name: the recipe's name on the command line (``xlafit train NAME``).
        model_config: the dataclass of the config's ``model`` section.
        load_data: ``(cfg) -> (train, eval)``: datasets (or dicts of arrays); eval may be None.
        build_model: ``(cfg, train) -> nnx.Module``.
        loss_fn: ``(model, batch) -> losses [B]`` or ``(losses [B], {metric: [B]})``.
        loss_for: ``(cfg) -> loss_fn``: the loss a config trains with, where settings choose
            it (the llm recipe's ``model.objective``); None: ``loss_fn`` always.
        data_config: the dataclass of the ``data`` section (a :class:`DataConfig` subclass
            with the recipe's own keys).
        from_data: ``(cfg, train) -> cfg``: settings the data decides (BERT: the sequence
            length and vocabulary of prepared data), so that the run records what it used.
            A contradiction with what the user set is a ``ConfigError``.
        throughput: ``(cfg, train) -> Throughput`` for the logs.
        save_artifacts: ``(cfg, run_dir, train)``: files a run keeps beside its checkpoints
            (a tokenizer).
        kept_files: those of the files ``save_artifacts`` writes that give the checkpoints'
            numbers their meaning (a tokenizer's ids, the class names), each with what it is:
            a resumed run whose files would differ is refused before anything is written.
        data_fingerprint: ``(cfg) -> dict or None``: the hashes of the data files a run of
            ``cfg`` reads (None: the package's own demo data), kept as
            :data:`xlafit.data.files.FINGERPRINT_FILE` (list it in ``kept_files``); None: the
            recipe keeps none, or writes its own in ``save_artifacts``.
        sequence_lengths: ``(cfg) -> lengths or None``: the data's example lengths, for
            ``xlafit check``'s padding plans.
        validate: ``(cfg) -> None``: raises ``ConfigError`` for model settings that cannot
            work, before any data is read (preparing data can take hours).
        bit_identical_chunks: whether ``trainer.invariant_chunks`` makes the recipe's runs
            bit-identical on any device count (checked by the suite); elsewhere they agree to
            float rounding, and a run with it says so.
        shapes: ``(cfg) -> dataset or None``: placeholder rows with the data's shapes and
            vocabulary when the config alone decides them (a named model's vocabulary, the
            configured sequence length), for what needs shapes only (``check --tpu``,
            ``plan``): no corpus is read. None: the shapes come from the data.
        rollout: ``(cfg, train) -> rollout or None``: what makes each train-step call's
            batch from the data's with the model being trained (the llm recipe's GRPO:
            :class:`xlafit.train.rollout.Rollout`); None: the data's batches are the step's.
        eval_data: ``(cfg, path) -> dataset``: every record of ``path`` to be evaluated,
            encoded as a run of ``cfg`` encodes its data (``xlafit eval RUN --data PATH``);
            None: the evaluation split of ``load_data`` with ``data.data_dir=path``.
        eval_unit: ``cfg -> `` what an evaluation counts, in its report's last line
            ("examples"; the llm recipe's "rows" of packed sequences, "pairs" for a preference
            objective).
    """

    name: str
    model_config: type
    load_data: Callable[[Config], tuple[Any, Any]]
    build_model: Callable[[Config, Any], nnx.Module]
    loss_fn: LossFn
    data_config: type[DataConfig] = DataConfig
    # The hooks take the recipe's own dataset type (what its load_data returns): typed Any.
    from_data: Callable[[Config, Any], Config] = _config_as_is
    throughput: Callable[[Config, Any], Throughput] = _no_throughput
    save_artifacts: Callable[[Config, Path, Any], None] = _nothing_to_save
    kept_files: dict[str, str] = dataclasses.field(default_factory=dict)
    data_fingerprint: Callable[[Config], dict[str, Any] | None] | None = None
    sequence_lengths: Callable[[Config], np.ndarray | None] = _no_lengths
    validate: Callable[[Config], None] = _nothing_to_check
    bit_identical_chunks: bool = False
    shapes: Callable[[Config], Any] = _shapes_from_data
    loss_for: Callable[[Config], LossFn] | None = None
    rollout: Callable[[Config, Any], Rollout | None] = _no_rollout
    eval_unit: Callable[[Config], str] = _examples
    eval_data: Callable[[Config, str], Any] | None = None

    def loss(self, cfg: Config) -> LossFn:
        """The loss a run of ``cfg`` trains and evaluates with."""
        return self.loss_for(cfg) if self.loss_for is not None else self.loss_fn
