"""A plan for a terminal (a ranked table, the winner, why the others lost) and as JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

from xlafit.check.speed import above_prediction
from xlafit.check.tpu_report import gib, rate
from xlafit.plan.candidates import MEMORY_LAYOUTS, layout_of
from xlafit.plan.outcome import Outcome, Prediction
from xlafit.plan.result import Plan


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _hours(h: float | None) -> str:
    if h is None:
        return "-"
    if h * 60 < 1:
        return f"{h * 3600:.2g} s"
    return f"{h * 60:.1f} min" if h < 1 else f"{h:.1f} h"


def _usd(cost: float | None) -> str:
    if cost is None:
        return "-"
    return f"${cost:,.2f}" if cost >= 0.01 else "< $0.01"


def _row(plan: Plan, rank: str, o: Outcome, front: set) -> tuple[str, ...]:
    c, p = o.candidate, o.prediction
    cost = plan.run_cost(o)
    return (
        f"{rank}{'*' if c in front else ''}",
        c.target,
        c.layout,
        c.levers,
        f"{c.per_device_batch} ({c.global_batch})",
        _gib(o.hbm_used),
        _gib(o.hbm_free),
        _step_ms(p) if p else "-",
        f"{p.comm_s * 1e3:.3g}" if p and p.comm_s is not None else "-",
        rate(p.examples_per_s if p else None),
        rate(p.tokens_per_s if p else None),
        f"{p.mfu:.0%}" if p else "-",
        _hours(plan.run_hours(o)),
        _usd(cost),
        f"{o.compile_s:.0f}",
    )


def _step_ms(p: Prediction) -> str:
    """The table's step: the prediction (``?``: outside its error band's population), or the bound."""
    if not p.predicted:
        return f">= {p.step_s * 1e3:.3g}"
    return f"{p.step_s * 1e3:.3g}{'?' if p.outside_band else ''}"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in rows]


HEADER = (
    "#",
    "target",
    "layout",
    "levers",
    "batch/core (global)",
    "HBM GiB",
    "free",
    "step ms",
    "comm ms",
    "examples/s",
    "tokens/s",
    "MFU",
    "run",
    "run cost",
    "compile s",
)


def format_plan(plan: Plan) -> str:
    """The ranked table (fitting candidates first, the refused after), the winner with its
    command, why the layouts that do not fit do not, and what the prediction ignores."""
    fitting, front = plan.fitting(), plan.pareto()
    rows = [HEADER] + [_row(plan, str(i + 1), o, front) for i, o in enumerate(fitting)]
    refused = [o for o in plan.outcomes if o not in fitting]
    shown = [o for o in refused if o.stage != "batch"]  # the batch search's refusals: in --json
    rows += [_row(plan, "no" if o.run_fits is False else "err", o, front) for o in shown]
    probes = len(refused) - len(shown)
    searched = f"; {probes} larger batches that did not fit are in --json" if probes else ""
    lines = [
        plan.command,
        *([plan.stopped] if plan.stopped else []),
        *_table(rows),
        f"  (* the Pareto front: throughput, cost of the run, HBM to spare{searched}"
        + (
            "; of estimates under 1 ms, which launch and dispatch decide: the answer is data parallelism's)"
            if plan.launch_bound(fitting)
            else ")"
        ),
        "  (HBM GiB: the compiler's peak per core, as `check --tpu` counts it, which shows the step's buffers beside "
        "it; a layout that does not fit: what it asked for)",
        "  (run: the run's steps at the predicted step, the device's time alone: compiling, input and checkpoints "
        "are not in it; run cost: that time at the slice's price)",
    ]
    if any(o.prediction and o.prediction.outside_band for o in plan.outcomes):
        lines.append(
            "  (? no error band: the step is outside the programs the step model was validated on (below); the "
            "throughput, run time and cost that follow share it)"
        )
    lines += _winner_lines(plan)
    lines += _why_not_lines(plan, refused)
    grouped: dict[tuple[str, str], list[str]] = {}  # one line per reason: it is often the same for many
    for target, mesh, why in plan.skipped:
        # A mixture of experts' meshes by name (data x fsdp x tensor x expert reads as a riddle).
        grouped.setdefault((target, why), []).append(layout_of(mesh) if len(mesh) > 3 else "x".join(map(str, mesh)))
    for (target, why), meshes in grouped.items():
        lines.append(f"  not tried on {target}: mesh{'es' if len(meshes) > 1 else ''} {', '.join(meshes)}: {why}")
    lines += _prediction_lines(plan)
    lines += _price_lines(plan)
    lines.append(_compiles_line(plan))
    return "\n".join(lines)


def _compiles_line(plan: Plan) -> str:
    """The plan's time and what it compiled: the train steps, and the eval steps of the answer
    (and of a faster candidate whose eval step fit at none of the batches compiled)."""
    n = len(plan.outcomes)
    text = f"{n} compile{'' if n == 1 else 's'} of train steps"
    memory = sum(1 for o in plan.outcomes if o.candidate.memory)
    if memory:
        text += (
            f", {memory} of them with memory levers (each alone on the {MEMORY_LAYOUTS} refused layouts closest to "
            "fitting, all together on the closest where none of those fit)"
        )
    evals = [o for o in plan.outcomes if o.eval_batch is not None]
    evals.sort(key=lambda o: -o.prediction.examples_per_s if o.prediction else 0.0)  # compiled fastest first
    if evals:
        count = sum(1 + (len(o.eval.probes) if o.eval else 0) for o in evals)
        whose = " and ".join("the answer" if o is plan.winner else _name(o) for o in evals)
        text += f"; {count} of {'the eval step' if len(evals) == 1 else 'eval steps'}, for {whose}"
    rollouts = [o for o in plan.outcomes if o.rollout is not None]
    if rollouts:
        count = sum(len(o.rollout or ()) for o in rollouts)
        whose = " and ".join("the answer" if o is plan.winner else _name(o) for o in rollouts)
        text += f"; {count} of rollout programs, for {whose}"
    return f"Planned in {plan.seconds:.0f} s on this machine ({text})."


def _name(o: Outcome) -> str:
    return f"{o.candidate.target} {o.candidate.layout} ({o.candidate.levers})"


def _eval_lines(plan: Plan, o: Outcome) -> list[str]:
    """The answer's eval step: where it fits, or the eval batch the plan sets instead."""
    e = o.eval
    if o.eval_batch is None:
        if not plan.evaluates:
            return []
        if plan.stopped:
            why = "the plan was stopped"
            return [f"  eval step: not compiled ({why}): `xlafit check --tpu` with these settings compiles it"]
        return [
            "  eval step: not compiled (the faster candidates' eval steps fit at none of the batches compiled, and a "
            "plan compiles no more): `xlafit check --tpu` with these settings compiles it"
        ]
    at = f"the run's eval batch of {o.eval_batch}"
    if e is None:
        return [f"  eval step: failed at {at} for another reason than memory: `xlafit check --tpu` shows why"]
    per_core = f"{e.per_device_batch} per core"
    if e.fits:
        peak = e.peak or e.total
        used = f": the compiler's peak {gib(peak)} of {gib(o.capacity)} per core" if peak else ""
        return [f"  eval step: fits at {at} ({per_core}){used}"]
    needs = f", needs {gib(e.needed)} of {gib(o.capacity)} per core" if e.needed else ""
    return [
        f"  eval step: does not fit at {at} ({per_core}{needs}); the largest that compiles is {e.largest} per core: "
        f"the plan sets data.eval_global_batch={o.eval_fix}"
    ]


def _rollout_lines(o: Outcome) -> list[str]:
    """The answer's rollout programs (GRPO's), each one's verdict and memory on its layout."""
    lines = []
    for r in o.rollout or ():
        head = f"  {r.name} ({r.rows} rows over all cores)"
        if r.fits:
            used = f": the compiler's peak {gib(r.peak or r.total)} of {gib(o.capacity)} per core" if r.total else ""
            unvalidated = ", not validated" if r.band_median is None else ""
            kind = f"predicted{unvalidated}" if r.predicted else "roofline estimate"
            took = f"; {r.run_s * 1e3:.3g} ms a run ({kind})" if r.run_s else ""
            lines.append(f"{head}: fits{used}{took}")
        elif r.failed:
            lines.append(f"{head}: does not compile for this layout (the TPU compiler: {r.message})")
        else:
            needs = f", needs {gib(r.needed)} of {gib(o.capacity)} per core" if r.needed else ""
            lines.append(f"{head}: does not fit{needs}")
    return lines


def _prediction_lines(plan: Plan) -> list[str]:
    """What the step times, throughputs, MFUs, run times and costs are, and how far off they were."""
    bands: dict[str, str] = {}
    for o in plan.outcomes:
        if o.prediction is not None and o.prediction.band and not o.prediction.outside_band:
            bands.setdefault(o.candidate.target.split("-")[0], o.prediction.band)
    for o in plan.outcomes:  # a generation whose every step is outside its band's population
        if o.prediction is not None and o.prediction.outside_band:
            bands.setdefault(o.candidate.target.split("-")[0], o.prediction.band)
    lines = [
        "Prediction (not a measurement): each kernel of the compiled step at the generation's achievable rates "
        "(xlafit.predict), summed along the schedule with the collectives over ICI where they are not hidden; "
        "input, host and dispatch time are not in it. Step, throughput, MFU, run time and cost are as good as it is:"
    ]
    lines += [f"  {generation}: {band}" for generation, band in bands.items()]
    if plan.rollout:
        lines.append(
            "  The step is the train step's alone: the rollout that makes its rows (generating the completions, "
            "their log-probabilities) runs before it and is in none of these times, throughputs or costs (the "
            "answer's rollout programs say theirs)."
        )
    return lines


def _price_lines(plan: Plan) -> list[str]:
    """The price behind each target's run cost, and where it was read."""
    kind = "Spot" if plan.spot else "on-demand"
    lines = []
    for generation in dict.fromkeys(t.generation.name for t in plan.targets):
        row = plan.prices.get(generation)
        usd = None if row is None else row.spot if plan.spot else row.on_demand
        if row is None or usd is None:
            lines.append(f"Price {generation}: no {kind} price in the table (give one: --price {generation}=USD)")
        else:
            lines.append(f"Price {generation}: ${usd:.4g} per chip-hour {kind} ({row.source}, read {row.read})")
    return lines


def _winner_lines(plan: Plan) -> list[str]:
    o = plan.winner
    if o is None:
        return ["No candidate fits: see why below."]
    c, p = o.candidate, o.prediction
    first = "Fastest"
    if plan.launch_bound(plan.fitting()):
        first = "First (every step is estimated under 1 ms, where launch and dispatch decide: the fewest collectives)"
    lines = [f"{first}: {c.target}, {c.layout}, {c.levers}, {c.per_device_batch} per core (global {c.global_batch})"]
    if p is not None:
        comm = f", collectives {p.comm_s * 1e3:.3g} ms" if p.comm_s is not None else ", collectives not priced"
        if p.predicted:
            band = f" ±{p.band_median:.0%}" if p.band_median is not None else ""
            lines.append(f"  step (predicted): {p.step_s * 1e3:.3g} ms{band}, MFU {p.mfu:.0%}")
            if p.outside_band:
                lines.append(f"    {p.band}")
        lines.append(
            f"  roofline estimate: {p.bound_s * 1e3:.3g} ms (compute {p.compute_s * 1e3:.3g} ms at peak, a strict "
            f"lower bound; memory {p.memory_s * 1e3:.3g} ms for XLA's bytes accessed, which overstates HBM "
            f"traffic{comm}; "
            f"{p.serial_s * 1e3:.3g} ms with no overlap)"
        )
        if p.predicted and (why := above_prediction(p.step_s, p.compute_s, p.memory_s)):
            lines.append(f"    {why}")
    lines += _eval_lines(plan, o) + _rollout_lines(o)
    own = plan.own_batch(o)
    if not plan.batch_fixed and own and own != c.global_batch:
        lines.append(
            f"  batch: {c.global_batch:,} examples per step, {c.global_batch / own:.3g}x the run's own {own:,}: the "
            f"learning rate and warm-up tuned for {own:,} may not hold (and past some size more examples per step "
            f"stop paying back); without --search-batch the plan keeps the run's own batch"
        )
    lines.append(f"  {'run' if plan.preset is not None else 'check'} it: {plan.command_line(o)}")
    fitting = plan.fitting()
    if plan.launch_bound(fitting):  # the estimates rank no layouts there: data parallelism's, as the answer is
        fitting = [x for x in fitting if x.candidate.data_parallel] or fitting
    by_cost = [x for x in fitting if plan.run_cost(x) is not None]
    if len(plan.targets) > 1 and by_cost:
        cheapest = min(by_cost, key=lambda x: plan.run_cost(x) or 0.0)
        lines.append(
            f"Cheapest run: {cheapest.candidate.target}, {cheapest.candidate.layout}: "
            f"{_usd(plan.run_cost(cheapest))} in {_hours(plan.run_hours(cheapest))}"
        )
        lines += _slices(plan)
    return lines


def _slices(plan: Plan) -> list[str]:
    """Each target's best candidate, ranked by time and by cost: which TPU."""
    best: dict[str, Outcome] = {}
    for o in plan.fitting():
        best.setdefault(o.candidate.target, o)
    by_time = sorted(best.values(), key=lambda o: plan.run_hours(o) or 0.0)
    by_cost = sorted(best.values(), key=lambda o: plan.run_cost(o) or float("inf"))
    name = lambda o: o.candidate.target  # noqa: E731
    return [
        "Slices by time: " + " < ".join(name(o) for o in by_time),
        "Slices by cost: " + " < ".join(name(o) for o in by_cost),
    ]


def _why_not_lines(plan: Plan, refused: list[Outcome]) -> list[str]:
    lines = []
    for o in refused:
        if o.fits and o.eval is not None and o.run_fits is False:
            tried = sorted({o.eval.per_device_batch, *(p.per_device_batch for p in o.eval.probes)})
            lines.append(
                f"Why not {_name(o)}: its eval step fits at none of the eval batches compiled "
                f"({tried[-1]} down to {tried[0]} per core; the run's is {o.eval_batch} over all cores)"
            )
            continue
        unfit = [r for r in o.rollout or () if not r.fits]
        if o.fits and unfit and all(r.failed for r in unfit):
            lines.append(
                f"Why not {_name(o)}: its {' and '.join(r.name for r in unfit)} does not compile for its layout at "
                f"the run's {unfit[0].rows} rows (the TPU compiler: {unfit[0].message})"
            )
            continue
        if o.fits and unfit:
            needs = "; ".join(f"{r.name} needs {_gib(r.needed)} GiB" for r in unfit if r.needed)
            lines.append(
                f"Why not {_name(o)}: its {' and '.join(r.name for r in unfit)} does not fit at the run's "
                f"{unfit[0].rows} rows ({needs or 'refused'} of {_gib(o.capacity)} GiB per core)"
            )
            continue
        if o.fits is not False:  # an error, or a fit without a prediction
            lines.append(f"  {o.candidate.target} {o.candidate.layout} ({o.candidate.levers}): {o.error}")
            continue
        if o.stage != "layout":
            continue
        over = f" needs {_gib(o.needed)} GiB of {_gib(o.capacity)} GiB per core" if o.needed else ""
        lines.append(f"Why not {o.candidate.target} {o.candidate.layout} ({o.candidate.levers}):{over}")
        if o.error and o.error.startswith("the train state alone"):
            lines.append(f"    {o.error}: split it (FSDP) or use a TPU with more HBM per core")
        lines += [f"    {b.describe()}" for b in o.buffers]
        fixed = [x for x in plan.fitting() if _same_layout(x, o)]
        if fixed:
            f = min(
                fixed,
                key=lambda x: (
                    x.candidate.accumulate,
                    bool(x.candidate.scan),
                    x.candidate.remat or "",
                    -x.candidate.per_device_batch,
                ),
            )
            lines.append(f"    fits with {f.candidate.levers} (compiled: {_gib(f.hbm_used)} GiB per core)")
    return lines


def _same_layout(a: Outcome, b: Outcome) -> bool:
    return a.candidate.target == b.candidate.target and a.candidate.mesh == b.candidate.mesh


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan for tools: every outcome with its prediction, run time and cost, and the winner."""
    front = plan.pareto()

    def outcome(o: Outcome) -> dict[str, Any]:
        return {
            "candidate": {**dataclasses.asdict(o.candidate), "layout": o.candidate.layout},
            "overrides": plan.overrides(o),
            "fits": o.fits,
            "stage": o.stage,
            "hbm_used": o.hbm_used,
            "hbm_free": o.hbm_free,
            "capacity": o.capacity,
            "memory": o.memory,
            "compile_s": o.compile_s,
            "cost_compile_s": o.cost_compile_s,
            "flops_per_step": o.flops,
            "collectives": o.comms.to_json() if o.comms else None,
            "prediction": dataclasses.asdict(o.prediction) if o.prediction else None,
            "run_hours": plan.run_hours(o),
            "run_cost_usd": plan.run_cost(o),
            "own_global_batch": plan.own_batch(o),  # the run's own, as configured (None: unknown)
            "pareto": o.candidate in front,
            "largest_buffers": [dataclasses.asdict(b) for b in o.buffers],
            "error": o.error,
            # The eval step (the answer's, compiled at the run's eval batch over all cores): its
            # verdict, and the eval batch the plan sets where that one does not fit.
            "eval_global_batch": o.eval_batch,
            "eval": dataclasses.asdict(o.eval) if o.eval else None,
            "eval_fix": o.eval_fix,
            "rollout": [dataclasses.asdict(r) for r in o.rollout] if o.rollout is not None else None,
            "run_fits": o.run_fits,
        }

    winner, fitting = plan.winner, plan.fitting()
    return {
        "command": plan.command,
        "source": plan.source,
        "targets": [t.name for t in plan.targets],
        "run_examples": plan.run_examples,
        "prices": {k: dataclasses.asdict(v) for k, v in plan.prices.items()},
        "spot": plan.spot,
        "seconds": plan.seconds,
        "stopped": plan.stopped,
        "outcomes": [outcome(o) for o in fitting] + [outcome(o) for o in plan.outcomes if o not in fitting],
        "skipped": [{"target": t, "mesh": m, "why": w} for t, m, w in plan.skipped],
        "winner": outcome(winner) if winner else None,
        "winner_command": plan.command_line(winner) if winner else None,
    }
