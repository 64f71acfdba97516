"""The levers that would make a run fit, compiled: ``xlafit check --tpu``'s answer to "which
setting makes it fit, and how fast would it run then?".

A run that does not fit a target (or, under ``--max-batch``, the smallest per-core batch that
did not) is compiled again with each of its program's :class:`~xlafit.check.program.FitLever`
(a recipe's: a 4-bit frozen base for a LoRA run, the loss's logits in chunks, the residual
stream split over a tensor group, the decoder layers' inputs in host memory, full
rematerialisation), one train-step compile each, and,
where none fits alone, once with all of them: :data:`MAX_LEVER_COMPILES` at most a target.
A lever of the activations is not compiled where the train state alone is over the core's
memory, nor one whose own state is: no batch fits then. Each lever that fits is reported with
its memory and the step model's prediction (and its measured error, or "not validated").
"""

from __future__ import annotations

from xlafit.check.program import FitLever, LeverFit, Program, TargetReport, used_bytes
from xlafit.check.tpu import Steps, no_persistent_cache, train_report
from xlafit.errors import XlafitError
from xlafit.platform.hardware import Target

__all__ = ["MAX_LEVER_COMPILES", "fit_levers"]

# Each lever alone, then all together where none fits alone: a recipe offers at most five.
MAX_LEVER_COMPILES = 6


def fit_levers(report: TargetReport, target: Target, program: Program, max_batch: bool | int = False) -> None:
    """Compiles ``program``'s levers for ``target`` where the run does not fit there (at its
    per-core batch) or, with ``max_batch``, at the smallest batch the search refused, into
    ``report.lever_fits``."""
    with no_persistent_cache():
        _fit_levers(report, target, program, max_batch)


def _fit_levers(report: TargetReport, target: Target, program: Program, max_batch: bool | int) -> None:
    if not program.fit_levers or program.with_overrides is None or report.error is not None:
        return
    if report.train_fits is False:
        batch = report.per_device_batch
    elif max_batch and report.train_fits:
        refused = [p.per_device_batch for p in report.probes if not p.fits]
        if not refused:
            return
        batch = min(refused)
    else:
        return
    state = report.memory.get("state", 0)
    over = bool(report.capacity) and state >= report.capacity and report.train_fits is False
    # Where the state alone is over the core, only a lever of the state can help; one that
    # would leave this run as it is (logits that auto chunks already) is not compiled.
    levers = [
        lv
        for lv in program.fit_levers
        if (lv.shrinks == "state" or not over) and (lv.helps is None or lv.helps(batch, target.hbm_bytes))
    ]
    results = [_compile(report, target, program, lever, batch) for lever in levers[: MAX_LEVER_COMPILES - 1]]
    if len(levers) > 1 and not any(r.fits for r in results):
        together = FitLever(
            " + ".join(lv.name for lv in levers),
            tuple(o for lv in levers for o in lv.overrides),
            "state" if any(lv.shrinks == "state" for lv in levers) else "activations",
        )
        results.append(_compile(report, target, program, together, batch))
    report.lever_fits = results


def _compile(report: TargetReport, target: Target, program: Program, lever: FitLever, batch: int) -> LeverFit:
    """One lever's train step for ``target`` at ``batch`` per core."""
    out = LeverFit(lever.name, list(lever.overrides), batch)
    assert program.with_overrides is not None
    try:
        steps = Steps(target, program.with_overrides(lever.overrides))
    except XlafitError as e:  # a setting this run cannot take (a base Qwix cannot tile): said, not compiled
        out.message = str(e)
        return out
    if report.capacity and steps.state_bytes >= report.capacity:  # no batch fits: no compile needed
        out.fits, out.memory = False, steps.state_bytes
        out.message = f"the train state alone takes {steps.state_bytes / 2**30:.2f} GiB per core"
        return out
    trial = TargetReport(
        target.name,
        device_kind=report.device_kind,
        devices=report.devices,
        batch_shards=report.batch_shards,
        per_device_batch=batch,
        steps_per_call=report.steps_per_call,
        capacity=report.capacity,
        capacity_source=report.capacity_source,
    )
    train_report(trial, steps, target, " ".join(lever.overrides))
    out.fits, out.compile_s, out.message = trial.train_fits, trial.compile_s, trial.message
    if trial.error is not None:
        out.fits = None
        return out
    out.memory = used_bytes(trial.memory) if trial.train_fits else trial.memory.get("total")
    if trial.train_fits:
        out.step_s, out.predicted = trial.step_s, trial.predicted
        out.band, out.band_median = trial.band, trial.band_median
        out.tokens_per_s, out.examples_per_s = trial.tokens_per_s, trial.examples_per_s
    return out
