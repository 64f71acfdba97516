"""Evaluation: loss and metrics over every example of a dataset, each counted once; the eval
step compiled before training; the evaluation after the last step, which a signal stops."""

from __future__ import annotations

from collections.abc import Callable

import jax

from xlafit.checkpoint import Checkpointer
from xlafit.data.dataset import Dataset
from xlafit.data.loader import eval_batches, to_global
from xlafit.errors import DataError, Preempted
from xlafit.parallel.mesh import Strategy
from xlafit.train.compiled import CompiledStep
from xlafit.train.signals import handle_signals
from xlafit.train.state import TrainState
from xlafit.train.step import WEIGHT

__all__ = ["compile_eval_step", "evaluate", "final_evaluation"]


def evaluate(
    eval_step: CompiledStep,
    state: TrainState,
    s: Strategy,
    data: Dataset,
    global_batch: int,
    stop: Callable[[], bool] | None = None,
) -> dict[str, float]:
    """Loss and metrics over every example of ``data``, each counted exactly once, in batches
    of ``global_batch`` (:meth:`xlafit.Trainer.evaluate`)."""
    totals: dict[str, float] = {}
    for batch, mask in eval_batches(data, global_batch, s.process_index, s.process_count):
        if stop is not None and stop():
            break
        sums = eval_step(state, to_global(s, batch), to_global(s, mask))
        # note: a host sync per eval batch; evaluation is short next to training.
        for key, value in jax.device_get(sums).items():
            totals[key] = totals.get(key, 0.0) + float(value)
    count = totals.pop("count", 0.0)
    total = max(totals.pop(WEIGHT), 1e-9) if WEIGHT in totals else count  # weighted means (step.WEIGHT)
    return {**{k: v / total for k, v in totals.items()}, "count": int(round(count))}


def compile_eval_step(
    eval_step: CompiledStep, state: TrainState, s: Strategy, eval: Dataset, global_batch: int
) -> None:
    """Compiles the eval step on the first evaluation batch now, so that a ``loss_fn`` that
    cannot evaluate fails before training, not after the first epoch.

    Raises:
        DataError: the loss read a key the evaluation data lacks (it was a ``KeyError`` from
            inside the loss).
    """
    batch, mask = next(eval_batches(eval, global_batch, s.process_index, s.process_count))
    try:
        eval_step.precompile(state, to_global(s, batch), to_global(s, mask))
    except KeyError as e:
        key = e.args[0] if e.args else None
        if not isinstance(key, str) or key in batch:
            raise
        raise DataError(
            f"the loss reads batch[{key!r}], which the evaluation data lacks (its keys: {', '.join(sorted(batch))}): "
            "give the evaluation set every key the loss reads, as the training set has them."
        ) from None


def final_evaluation(
    evaluator: Callable[..., dict[str, float]], eval: Dataset, step: int, alone: bool, ckpt: Checkpointer | None
) -> dict[str, float]:
    """The evaluation after the last step. A SIGTERM/SIGINT here stops it (between batches,
    in a single process; a job's processes evaluate together and finish it) and raises
    :class:`Preempted`: the training is done and saved, and running again evaluates.

    ``evaluator``: :meth:`xlafit.Trainer.evaluate`; ``alone``: the job is one process.
    """
    with handle_signals() as signals:
        last_eval = evaluator(eval, stop=(lambda: signals.received is not None) if alone else None)
        received = signals.received
    if received is not None:
        saved = (
            f"the training is done: checkpoint {step} in {ckpt.directory} holds its last step, and "
            "running again evaluates it"
            if ckpt is not None
            else "the training is done, but with no run directory nothing was saved"
        )
        raise Preempted(step, received, f"the final evaluation did not finish; {saved}")
    return last_eval
