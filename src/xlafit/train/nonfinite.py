"""What ``trainer.nan_policy`` does with the updates a train step dropped because their loss
or gradient was not finite (:func:`xlafit.train.loop.nonfinite_steps` finds them):

- ``stop``: raise :class:`~xlafit.errors.NonFiniteError`, naming the step, the values and
  the last good checkpoint;
- ``skip``: go on, the updates left out, with a warning;
- ``rollback``: restore the newest checkpoint and go on from it (each offending step once:
  the second time it is skipped, its update dropped again on the way).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from xlafit.checkpoint import Checkpointer
from xlafit.errors import NonFiniteError
from xlafit.train.report import RunReport

__all__ = ["applied_means", "apply_nan_policy"]


def applied_means(values: list[dict[str, np.ndarray]]) -> dict[str, float | int]:
    """The means of the calls' per-step metrics (``values``: one dict of arrays per call) over
    the applied updates only (one dropped update's NaN would hide the rest), and
    ``nonfinite_steps``, the count of dropped ones, where there are any."""
    ok = np.concatenate([v["nonfinite"] for v in values]) == 0
    means: dict[str, float | int] = {}
    for key in values[0]:
        if key != "nonfinite" and ok.any():
            means[key] = float(np.mean(np.concatenate([v[key] for v in values])[ok]))
    if not ok.all():
        means["nonfinite_steps"] = int((~ok).sum())
    return means


def apply_nan_policy(
    policy: str,
    bad: list[tuple[int, dict[str, float]]],
    rolled_back: set[int],
    report: RunReport,
    ckpt: Checkpointer | None,
    rollback: Callable[[], int],
) -> int | None:
    """Applies ``policy`` to the dropped updates ``bad`` (``(step, its metrics)``); returns
    the step to go on from after a rollback (``rollback()`` restores the newest checkpoint
    and returns its step), or None to go on where the run is.

    Raises:
        NonFiniteError: ``policy`` is ``stop``.
    """
    step, values = bad[0]
    which = ", ".join(f"{k}={v}" for k, v in values.items() if k != "nonfinite" and not np.isfinite(v))
    which = which or ", ".join(f"{k}={v}" for k, v in values.items() if k != "nonfinite")
    steps = ", ".join(str(s + 1) for s, _ in bad)
    last = ckpt.latest_step() if ckpt is not None else None
    where = f"checkpoint {last} in {ckpt.directory}" if ckpt is not None and last is not None else "none"
    if policy == "stop":
        # nan_policy=stop's step drops an update whose loss is not finite; one with a finite loss
        # and a non-finite gradient was applied (checking the gradient first costs memory).
        applied = (
            "its update was not applied"
            if not np.isfinite(values.get("loss", np.nan))
            else "its update was applied (the loss was finite, the gradient not), so the model in memory "
            "holds non-finite values"
        )
        raise NonFiniteError(
            f"non-finite values at step {step + 1} ({which}); {applied}. "
            f"Last good checkpoint: {where}. Lower optimizer.learning_rate, set optimizer.grad_clip_norm, "
            "check the data (an integer label >= the model's number of classes gives NaN too), "
            "or set trainer.nan_policy=skip or rollback."
        )
    fresh = [s for s, _ in bad if s not in rolled_back]
    if policy == "rollback" and fresh and ckpt is not None and last is not None:
        rolled_back.update(fresh)
        restored = rollback()
        report.print(
            f"warning: non-finite values at step(s) {steps} ({which}): rolled back to checkpoint {restored}; "
            "the offending batch's update is dropped again on the way"
        )
        return restored
    report.print(f"warning: non-finite values at step(s) {steps} ({which}): update(s) skipped")
    return None
