"""``xlafit plan``'s answer fits only when every program its run compiles fits: the eval step
is compiled for the answer at the run's eval batch, and where it does not fit, the plan sets
the largest eval batch that compiles.

The model is ``tests/test_tpu_verdict.py``'s: Meta's 1B preset cut to one narrow layer, whose
vocabulary (128,256 tokens), its logits kept whole (``model.logits_chunk=0``), makes the eval
step's logits what fills the core.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from helpers import SMALL_LLM
from xlafit.check.program import EvalFit, Probe, ProgramFit
from xlafit.plan import format_plan, plan_json, plan_recipe
from xlafit.plan.candidates import Candidate
from xlafit.plan.evaluation import EVAL_CHECKS, check_answer_eval, check_answer_rollout
from xlafit.plan.outcome import Outcome, Prediction
from xlafit.plan.result import Plan
from xlafit.platform.hardware import Target, parse_target
from xlafit.recipes import load_config

pytest.importorskip("libtpu")  # the TPU compiler (the dev extra installs it)

SMALL = SMALL_LLM


@pytest.fixture(scope="module")
def eval_over():
    """A plan whose train step fits one v5e core at 1 per core and whose eval batch (4,096
    rows of 64 tokens: float32 logits of 32 MiB a row) does not."""
    return plan_recipe("llm", [*SMALL, "data.eval_global_batch=4096"], "v5e-1")


def test_a_plans_answer_sets_the_largest_eval_batch_that_compiles(eval_over, tmp_path):
    """The plan recommended the layout and batch of a train step that fits, with the run's
    eval batch of 4,096, which does not: the run it wrote died at its first evaluation."""
    o = eval_over.winner
    assert o is not None and o.fits and o.eval_batch == 4096
    e = o.eval
    assert e is not None and not e.fits and e.per_device_batch == 4096 and e.needed > o.capacity
    assert 0 < e.largest < 4096 and o.eval_fix == e.largest and o.run_fits  # one core: per core = global
    fitted = {p.per_device_batch: p.fits for p in e.probes}
    assert fitted[e.largest] is True  # compiled: the batch the plan sets is one the compiler placed
    assert not any(ok for batch, ok in fitted.items() if batch > e.largest)

    text = format_plan(eval_over)
    assert (
        "  eval step: does not fit at the run's eval batch of 4096 (4096 per core, needs " in text
        and f"the largest that compiles is {e.largest} per core: the plan sets data.eval_global_batch={e.largest}"
        in text
    )
    assert f" data.eval_global_batch={e.largest} " in eval_over.command_line(o) + " "
    assert "data.eval_global_batch=4096" not in eval_over.command_line(o)  # each key once, the plan's value
    assert f"(1 compile of train steps; {1 + len(e.probes)} of the eval step, for the answer)." in text

    data = plan_json(eval_over)
    w = data["winner"]
    assert w["eval_global_batch"] == 4096 and w["eval_fix"] == e.largest and w["run_fits"] is True
    assert w["eval"]["fits"] is False and w["overrides"]["data.eval_global_batch"] == e.largest
    assert f"data.eval_global_batch={e.largest}" in data["winner_command"]

    written = eval_over.write(tmp_path / "plan.yaml")
    assert yaml.safe_load(written.read_text())["data"]["eval_global_batch"] == e.largest
    assert f"# data.eval_global_batch={e.largest}: the largest eval batch that compiles" in written.read_text()
    assert load_config("llm", preset=written).data.eval_global_batch == e.largest  # what `train --config` runs


def _outcome(target: Target, mesh: tuple[int, int, int], examples_per_s: float) -> Outcome:
    prediction = Prediction(0.01, 0.02, 0.001, 0.02, 0.021, examples_per_s, None, 0.5)
    c = Candidate(target.name, mesh, 8)
    return Outcome(c, True, capacity=16 * 2**30, memory={"total": 2**30}, prediction=prediction)


def test_an_answer_whose_eval_step_fits_at_no_batch_gives_way_and_the_plan_compiles_two_at_most():
    """The selection over eval steps: an answer whose eval step fit at none of the batches
    compiled is ruled out for the runner-up, and a plan compiles the eval steps of
    EVAL_CHECKS candidates at most. The compiles are stood in for: a train step that fits
    beside an eval step that fits at no batch is the case no small model builds."""
    v5e = parse_target("v5e-8")
    fast, second, third = (
        _outcome(v5e, m, s) for m, s in (((8, 1, 1), 3000.0), ((4, 2, 1), 2000.0), ((2, 4, 1), 1000.0))
    )
    plan = Plan("llm", "xlafit plan llm", [v5e], [third, second, fast], [], None, [], {}, evaluates=True)
    compiled: list[tuple[Candidate, int]] = []

    def nowhere(target: Target, o: Outcome, batch: int) -> None:  # fits at none of the batches tried
        compiled.append((o.candidate, batch))
        probes = [Probe(4, False, 1.0), Probe(2, False, 1.0), Probe(1, False, 1.0)]
        o.eval_batch, o.eval = batch, EvalFit(False, batch // o.candidate.shards, largest=0, probes=probes)

    check_answer_eval(plan, nowhere, None)
    assert EVAL_CHECKS == 2 and [c for c, _ in compiled] == [fast.candidate, second.candidate]
    assert [b for _, b in compiled] == [64, 64]  # no eval batch configured: the run's global batch
    assert fast.run_fits is False and second.run_fits is False and plan.fitting() == [third]
    text = format_plan(plan)
    assert (
        "Why not v5e-8 DP 8 (-): its eval step fits at none of the eval batches compiled (8 down to 1 per core" in text
    )
    assert "  eval step: not compiled (the faster candidates' eval steps fit at none of the batches" in text
    assert "(3 compiles of train steps; 8 of eval steps, for v5e-8 DP 8 (-) and v5e-8 DP 4 x FSDP 2 (-))." in text
    rows = [line.split()[0] for line in text.splitlines()[2:5]]
    assert rows == ["1*", "no", "no"]
    assert plan_json(plan)["winner"]["candidate"]["mesh"] == (2, 4, 1)

    # The runner-up's eval step fits at the run's own eval batch: it is the answer, no search.
    fast2, second2 = (dataclasses.replace(o, eval=None, eval_batch=None) for o in (fast, second))
    plan2 = Plan("llm", "xlafit plan llm", [v5e], [second2, fast2], [], None, [], {}, evaluates=True)

    def only_second(target: Target, o: Outcome, batch: int) -> None:
        if o is fast2:
            nowhere(target, o, batch)
        else:
            o.eval_batch, o.eval = batch, EvalFit(True, batch // o.candidate.shards, total=2**30, peak=2**29)

    check_answer_eval(plan2, only_second, 256)
    assert plan2.winner is second2 and second2.eval_batch == 256 and second2.eval_fix is None
    text = format_plan(plan2)
    assert (
        "  eval step: fits at the run's eval batch of 256 (32 per core): the compiler's peak 0.50 GiB of 16.00" in text
    )
    assert "(2 compiles of train steps; 5 of eval steps, for v5e-8 DP 8 (-) and the answer)." in text
    assert "data.eval_global_batch" not in plan2.command_line(second2)  # the run's own stands


def test_an_answer_whose_rollout_does_not_fit_gives_way_to_the_runner_up():
    """GRPO: the answer's rollout programs are compiled after the search; one that does not
    fit rules the answer out, and the runner-up's are compiled (two candidates at most). The
    compiles are stood in for, as above."""
    v5e = parse_target("v5e-8")
    fast, second, third = (
        _outcome(v5e, m, s) for m, s in (((8, 1, 1), 3000.0), ((4, 2, 1), 2000.0), ((2, 4, 1), 1000.0))
    )
    plan = Plan("llm", "xlafit plan llm", [v5e], [third, second, fast], [], None, [], {}, rollout=True)
    compiled: list[Candidate] = []

    def generation_over(target: Target, o: Outcome) -> None:  # data parallelism's cache does not fit
        compiled.append(o.candidate)
        fits = o.candidate.mesh[0] < 8
        o.rollout = [ProgramFit("rollout generation", 64, fits, total=2**30, needed=None if fits else 20 * 2**30)]

    check_answer_rollout(plan, generation_over)
    assert compiled == [fast.candidate, second.candidate] and fast.run_fits is False
    assert plan.winner is second and third.rollout is None
    text = format_plan(plan)
    assert (
        "Why not v5e-8 DP 8 (-): its rollout generation does not fit at the run's 64 rows (rollout generation "
        "needs 20.00 GiB of 16.00 GiB per core)" in text
    )
    assert "  rollout generation (64 rows over all cores): fits: the compiler's peak 1.00 GiB of 16.00 GiB" in text
