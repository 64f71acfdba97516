"""The eval step of a plan's answer: a run fits only when every program it compiles fits.

The search ranks candidates by their train step; the run also compiles its eval step, at
its own batch (``data.eval_global_batch``, by default the train step's global batch), and
dies at its first evaluation where that does not fit. So the answer's eval step is compiled
with the answer's layout at the run's eval batch; where it does not fit, the largest eval
batch that does (``check --tpu``'s search) goes into the plan's settings. Only an eval step
that fits at no batch rules the answer out: then the runner-up's is compiled, and no more
(the eval steps of :data:`EVAL_CHECKS` candidates at most: each can cost a search).

A run that makes its batches with its model (GRPO's rollout) evaluates nothing, and compiles
the rollout's programs (the generation with its cache, the log-probabilities) beside its train
step, on the same layout and rows: the answer's are compiled, and where one does not fit, the
runner-up's (:func:`check_answer_rollout`).
"""

from __future__ import annotations

from collections.abc import Callable

from xlafit.plan.outcome import Outcome
from xlafit.plan.result import Plan
from xlafit.platform.hardware import Target

# The candidates whose eval step a plan compiles at most: the answer, and the runner-up where
# the answer's eval step fits at no batch (an eval step holds the parameters and one forward
# pass, less than the train step that fit: rarely needed).
EVAL_CHECKS = 2

# Compiles an outcome's eval step at a batch over all cores, into the outcome (Planner.evaluate_eval).
CompileEval = Callable[[Target, Outcome, int], None]
# Compiles an outcome's rollout programs at its rows, into the outcome (Planner.evaluate_rollout).
CompileRollout = Callable[[Target, Outcome], None]


def check_answer_eval(plan: Plan, compile_eval: CompileEval, eval_batch: int | None) -> None:
    """Compiles the eval step of ``plan``'s answer at the run's eval batch (``eval_batch``
    over all cores; None: the answer's global batch, as a run defaults it), and of the
    runner-up where the answer's fits at no batch. ``plan.winner`` is then the fastest
    candidate whose run fits."""
    for _ in range(EVAL_CHECKS):
        o = plan.winner
        if o is None or o.eval_batch is not None:
            return
        compile_eval(plan.target(o), o, eval_batch or o.candidate.global_batch)
        if o.run_fits is not False:
            return


def check_answer_rollout(plan: Plan, compile_rollout: CompileRollout) -> None:
    """Compiles the rollout programs of ``plan``'s answer, and of the runner-up where one of
    the answer's does not fit (:data:`EVAL_CHECKS` candidates at most). ``plan.winner`` is then
    the fastest candidate whose run fits."""
    for _ in range(EVAL_CHECKS):
        o = plan.winner
        if o is None or o.rollout is not None:
            return
        compile_rollout(plan.target(o), o)
        if o.run_fits is not False:
            return
