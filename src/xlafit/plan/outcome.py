"""What one compile of a plan's candidate gave: its verdict and memory (:class:`Outcome`), and
its predicted step (:class:`Prediction`), which the report ranks and the plan writes."""

from __future__ import annotations

import dataclasses

from xlafit.check.program import EvalFit, ProgramFit, decide, used_bytes
from xlafit.plan.buffers import Buffer
from xlafit.plan.candidates import Candidate
from xlafit.predict.collectives import CommReport


@dataclasses.dataclass
class Prediction:
    """A candidate's step time and what follows from it (see :mod:`xlafit.plan`)."""

    compute_s: float  # FLOPs / peak FLOP/s
    memory_s: float  # XLA's bytes accessed / HBM bandwidth
    comm_s: float | None  # the collectives over ICI; None: no ICI figure for the target
    step_s: float  # the step model's prediction (xlafit.predict); the bound where it has no rates
    serial_s: float  # max(compute, memory) + communication: none overlapped
    examples_per_s: float
    tokens_per_s: float | None
    # model FLOPs (analytic, else the fewest XLA counted per example in the plan: Planner.results) / time / peak
    mfu: float
    bound_s: float = 0.0  # the roofline estimate: max(compute, memory, communication)
    predicted: bool = False  # step_s is the step model's, not the roofline estimate
    band: str = ""  # the step model's measured error on this generation, or why there is none
    band_median: float | None = None
    outside_band: bool = False  # a predicted step too short for the band to hold (band_median None)


@dataclasses.dataclass
class Outcome:
    """One compile of one candidate: the verdict, memory, collectives and prediction."""

    candidate: Candidate
    fits: bool | None  # None: an error, or not compiled (``error`` says which)
    capacity: float = 0.0
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    needed: int | None = None  # bytes per core the compiler asked for, when it refused
    compile_s: float = 0.0
    flops: float | None = None  # XLA's, per core per step
    comms: CommReport | None = None
    prediction: Prediction | None = None
    buffers: list[Buffer] = dataclasses.field(default_factory=list)
    error: str | None = None
    stage: str = "layout"  # layout, lever, batch
    cost_compile_s: float = 0.0  # a scanned candidate: compiling the few-layer programs of its cost
    # The eval step, compiled for the plan's answer only (xlafit.plan.evaluation): at the run's
    # eval batch over all cores (eval_batch), its verdict there (None: an error, or not compiled).
    eval_batch: int | None = None
    eval: EvalFit | None = None
    # The programs the run compiles beside its steps (GRPO's rollout: generation and
    # log-probabilities), compiled for the plan's answer only at the run's rows (None: not compiled).
    rollout: list[ProgramFit] | None = None

    @property
    def eval_fix(self) -> int | None:
        """The eval batch over all cores that the plan sets in place of the run's own, which
        does not fit: the largest that compiles on this layout; None: the run's own stands."""
        e = self.eval
        return e.largest * self.candidate.shards if e is not None and not e.fits and e.largest else None

    @property
    def run_fits(self) -> bool | None:
        """Whether the run the plan writes fits: :func:`xlafit.check.program.decide` over the
        train step and, where they were compiled, the eval step at the eval batch the plan sets
        (the run's own, or the largest that compiles: a probe that fit) and the rollout's programs."""
        e = self.eval
        if e is not None and self.eval_fix:
            e = EvalFit(True, e.largest or 0)
        return decide(self.fits, e, self.rollout or ())

    @property
    def hbm_used(self) -> int | None:
        """Per-core bytes as ``check --tpu`` counts them (:func:`~xlafit.check.program.used_bytes`:
        the compiler's peak where it reports one); the need, if refused."""
        if not self.fits:
            return self.needed
        return used_bytes(self.memory)

    @property
    def hbm_free(self) -> float | None:
        used = self.hbm_used
        return None if used is None or not self.capacity else self.capacity - used
