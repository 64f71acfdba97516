"""What the trainer's loop passes around.

A call of the compiled step (:class:`Call`); what the loop carries from one call to the next
(:class:`Loop`); what is due after a call (:class:`Due`, decided with :func:`itstime`); the
logged record's parts; and what :meth:`~xlafit.train.trainer.Trainer.fit` returns
(:class:`FitResult`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
import optax

from xlafit.train.optim import highest_rate, schedule_at
from xlafit.train.report import RunReport
from xlafit.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of the compiled train step, as :meth:`~xlafit.train.trainer.Trainer.steps` yields it.

    Attributes:
        first: the step the call began at.
        k: optimizer steps it ran (``steps_per_call``, fewer where an epoch ends).
        metrics: per-step metrics ``[k]``, still on the devices (fetching them syncs).
        compile_s: seconds this call spent compiling a new program (0 almost always).
        wait_s: input wait so far: the seconds the loop spent waiting for batches.
    """

    first: int
    k: int
    metrics: dict[str, jax.Array]
    compile_s: float
    wait_s: float


@dataclasses.dataclass
class FitResult:
    """What :meth:`~xlafit.train.trainer.Trainer.fit` returns.

    Attributes:
        state: the final train state (replicated on the devices).
        history: every logged training record of the run, those logged before a resume
            included (read back from its ``metrics.jsonl``, on process 0).
        eval: the last evaluation (``loss``, the metrics, ``count``), or None.
        eval_step: the step ``eval`` evaluated: earlier than ``state.step`` where the run
            stopped (``trainer.stop_at_step``) between evaluations.
        train_compiles: how many times the train step was compiled.
        eval_compiles: how many times the eval step was compiled.
        compile_s: seconds spent compiling, apart from step time.
    """

    state: TrainState
    history: list[dict[str, Any]]
    eval: dict[str, float] | None
    train_compiles: int
    eval_compiles: int
    compile_s: float
    evaluations: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # every one: step, epoch, metrics
    eval_step: int | None = None

    def __repr__(self) -> str:
        # Short: a notebook cell ending in `result = trainer.fit(...)`, or `result`, shows this,
        # not every parameter array of the state.
        last = self.history[-1] if self.history else {}
        train = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if k in ("loss", "accuracy"))
        evaluation = ", ".join(f"{k}={v:.4g}" for k, v in (self.eval or {}).items())
        return (
            f"FitResult(step={int(self.state.step)}, train: {train or '-'}, eval: {evaluation or '-'}, "
            f"{len(self.history)} logged records, compiles: train {self.train_compiles} eval {self.eval_compiles}, "
            f"{self.compile_s:.1f}s compiling)"
        )


def itstime(step: int, every: int, total: int | None = None, *, previous: int | None = None) -> bool:
    """Whether a periodic action is due at ``step``: a multiple of ``every`` was reached since
    ``previous`` (the step before the call that reached ``step``; default ``step - 1``), or
    ``step`` is the ``total`` (the last step is always a time). ``every`` = 0: only at ``total``.
    big_vision's ``itstime``, for calls that run several steps.

    Example:
        >>> itstime(20, 10), itstime(21, 10), itstime(24, 10, previous=18), itstime(7, 0, 7), itstime(7, 0)
        (True, False, True, True, False)
    """
    if total is not None and step == total:
        return True
    before = step - 1 if previous is None else previous
    return bool(every) and step // every > before // every


@dataclasses.dataclass
class Loop:
    """What :meth:`~xlafit.train.trainer.Trainer.fit` carries from one call to the next."""

    spe: int  # steps per epoch
    total: int
    stop: int
    report: RunReport
    step: int
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    evaluations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    last_eval: dict[str, float] | None = None
    last_eval_step: int | None = None  # the step last_eval evaluated
    rolled_back: set[int] = dataclasses.field(default_factory=set)  # steps rolled back once already
    last_save: float = dataclasses.field(default_factory=time.monotonic)
    signals: Any = None  # the SignalGuard and the Watchdog, while the loop runs
    watchdog: Any = None
    # The window since the last log: its calls' metrics (not fetched yet), its start, and the
    # input wait and compile time at its start.
    pending: list[tuple[int, dict[str, jax.Array]]] = dataclasses.field(default_factory=list)
    window_t0: float = 0.0
    window_wait: float = 0.0
    window_compile: float = 0.0
    last_call: Call | None = None

    def open_window(self, wait_s: float = 0.0) -> None:
        self.pending, self.window_t0, self.window_wait, self.window_compile = [], time.perf_counter(), wait_s, 0.0

    def add(self, call: Call) -> None:
        self.last_call = call
        self.pending.append((call.first, call.metrics))
        self.window_compile += call.compile_s

    def stop_note(self, stop_at: int | None, saved: bool) -> str | None:
        """What ``trainer.stop_at_step`` did to this run, once it ended: stopped it before the
        schedule's end, or found it past that step already (nothing trained); None: neither."""
        again = "to go on, run again with a later trainer.stop_at_step or without it"
        if self.stop < self.step < self.total:
            return f"nothing trained: the run is at step {self.step}, past trainer.stop_at_step={stop_at}; {again}"
        if self.step == self.stop < self.total:
            kept = " with a checkpoint" if saved else ""
            return f"stopped at step {self.stop} of {self.total} (trainer.stop_at_step={stop_at}){kept}; {again}"
        return None


@dataclasses.dataclass(frozen=True)
class Due:
    """What is due after a call, as the trainer decides it."""

    log: bool  # fetch the window's metrics, record their means, apply the NaN policy
    stop: bool  # a signal: save and raise Preempted
    eval: bool  # an evaluation (an epoch's end)
    save: bool  # a checkpoint


def nonfinite_steps(pending: list, values: list) -> list[tuple[int, dict[str, float]]]:
    """``(step, that step's metrics)`` of every update the step dropped as non-finite."""
    return [
        (first + i, {key: float(v[key][i]) for key in v})
        for (first, _), v in zip(pending, values, strict=True)
        for i in np.flatnonzero(v["nonfinite"])
    ]


def times(rate: float, per_example: float | None, peak: float | None = 1.0) -> float | None:
    """``rate * per_example / peak``, or None when either is unknown."""
    return rate * per_example / peak if per_example and peak else None


def lr_at(schedule: optax.Schedule | float | None, step: int) -> float | None:
    """The learning rate at ``step``: the schedule's value, the constant, or None (not given)."""
    if schedule is None:
        return None
    return float(schedule_at(schedule, step)) if callable(schedule) else float(schedule)


def peak_lr(schedule: optax.Schedule | float | None, total: int) -> float | None:
    """The highest learning rate over ``total`` steps, or None (not given)."""
    if schedule is None or not callable(schedule):
        return schedule
    return highest_rate(schedule, total)
