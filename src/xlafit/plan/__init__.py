"""``xlafit plan``: the layout, batch and TPU to run a model on, chosen by the TPU compiler.

``xlafit check --tpu`` answers whether one configuration fits. ``plan`` searches: every
mesh (``data x fsdp x tensor``, and ``expert`` for a mixture of experts) the model's named
axes allow on each target, the levers that make a refused one fit (gradient accumulation,
the model's remat policies), and the largest per-core batch of the best
(:mod:`xlafit.plan.search`). Each candidate is compiled by libtpu for the target, on this
machine, and predicted from its compiled program:

- **step time**: the step model's prediction (:mod:`xlafit.predict`): every kernel of the
  compiled program at the generation's achievable rates (fitted to published measured runs,
  or a calibration file's), summed along its schedule, the collectives priced over the
  slice's ICI and hidden where the schedule overlaps them; each plan says the model's
  measured error for the generation. Ignored: the input pipeline, the host, step-to-step
  dispatch. ``--bound`` ranks by the roofline estimate instead: ``max(compute, memory,
  communication)``, XLA's FLOPs at the datasheet's peak, its bytes at HBM bandwidth and the
  collectives (:mod:`xlafit.predict.collectives`); only its compute term is a strict lower
  bound on the step (XLA's bytes accessed include buffers kept in on-chip memory);
- **throughput** (examples and tokens per second), **MFU** (the model's FLOPs, analytic
  where it has a count, over the step time and peak), **HBM** used and free per core;
- **time and cost of the run**: the run's examples over the throughput, at the slice's
  price per hour (:data:`xlafit.platform.hardware.PRICES`, on-demand or Spot).

The answer is ranked, the Pareto front (throughput, cost of the run, HBM to spare) marked;
the winner's eval step is compiled too, at the run's eval batch, and where it does not fit
the largest eval batch that does is part of the answer (:mod:`xlafit.plan.evaluation`): a
run fits only when every program it compiles fits. The winner's settings are the
``xlafit train`` overrides; :meth:`Plan.write` writes them
as a preset that ``xlafit train RECIPE --config plan.yaml`` and ``xlafit check --config``
read.

Example:
    >>> plan = plan_recipe("bert", ["model.preset=base", "data.source=synthetic"], "v5e-8")  # doctest: +SKIP
    >>> print(format_plan(plan))  # doctest: +SKIP
"""

from xlafit.plan.entry import plan_file, plan_recipe, recipe_planner
from xlafit.plan.report import format_plan, plan_json
from xlafit.plan.result import Plan

__all__ = ["Plan", "format_plan", "plan_file", "plan_json", "plan_recipe", "recipe_planner"]
