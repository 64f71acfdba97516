"""The plan's search: compile candidates for each target, cheap refusals first, and predict.

For each target, in order of cost:

1. **Layouts** (:func:`xlafit.plan.candidates.meshes`): every mesh the model's named axes
   allow (for a mixture of experts, the expert-parallel ones too:
   :func:`~xlafit.plan.candidates.expert_meshes`), at the run's per-core batch
   (``global_batch`` over the mesh's batch shards when the user fixed one), compiled side
   by side (as many compiles at once as there are cores).
2. **Levers** for a layout that does not fit: gradient accumulation (as many micro-batches
   as the compiler's shortfall suggests; the global batch stays), the model's
   rematerialisation policies (cheapest first) and, where the model can scan its layers,
   scanned layers with full remat (MaxText's default), each one compile; the first that
   fits is the layout's cheapest way in. Then the memory levers the run leaves room for (a
   LoRA run's 4-bit base, the logits in chunks: ``memory``), each alone, on the
   :data:`~xlafit.plan.candidates.MEMORY_LAYOUTS` refused layouts closest to fitting, and all
   of them together with the costliest remat on the closest one where none of those fits: at
   most ``MEMORY_LAYOUTS x levers + 1`` compiles a target. A refusal is compiled once more with
   the compiler's dump, to name the largest buffers at its peak.
3. **Batch** (only when asked: ``search_batch``, which changes the run's global batch and
   so what its learning rate was tuned for): for the ``top`` layouts by predicted
   throughput, side by side, the largest per-core batch that fits (the ``--max-batch``
   search of :func:`xlafit.check.batch_search.largest_batch`, at 10 % tolerance), predicted again
   there; a layout's search ends early once the largest batch below its smallest refusal
   is predicted to run less than 5 % faster (:func:`xlafit.plan.cost.reachable_gain`).

Every compile is remembered (a layout and batch compile once), and a deadline stops new
compiles: none starts that the longest compile so far says would end more than 5 % of the
budget past it; what was not compiled is reported as such.

A scanned candidate (``model.scan_layers``) fits or not by its own compile, but XLA's cost
analysis counts a loop's body once, so one layer of it: its FLOPs and HBM bytes come from two
unscanned programs of a few layers at the same shapes (the difference is a layer's cost;
every layer costs the same), extrapolated to the model's layers. Its collectives are read
from its own program, whose loop bodies count as many times as they run.

Ctrl-C (:meth:`Planner.stop`) ends the search as a spent budget does: no compile starts after
it, the compiles in flight are abandoned (a compile cannot be interrupted; their threads are
left to the process's exit), and the plan reports what had finished.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from xlafit.check.batch_search import largest_batch
from xlafit.check.program import Program
from xlafit.check.speed import OUTSIDE_BAND, outside_band, program_kind
from xlafit.check.tpu import (
    OutOfMemory,
    Steps,
    TraceFailure,
    eval_fit,
    memory_of,
    needed_bytes,
    no_persistent_cache,
    rollout_fits,
    trainer_refusal,
    tree_bytes,
    usable_hbm,
)
from xlafit.errors import XlafitError
from xlafit.plan.buffers import largest_buffers
from xlafit.plan.candidates import (
    REMAT_LADDER,
    Candidate,
    expert_meshes,
    experts_of,
    memory_candidates,
    mesh_refusal,
    meshes,
    params_of,
)
from xlafit.plan.cost import program_cost, reachable_gain
from xlafit.plan.outcome import Outcome, Prediction
from xlafit.platform.hardware import Target, parse_target
from xlafit.predict.collectives import collectives, summarize
from xlafit.predict.model import predict
from xlafit.predict.rates import rates_for

# A larger batch is worth its compiles while the largest that may fit is predicted to run at
# least this much faster (stage 3, ``Settings.min_gain``): less is within what the prediction ignores.
MIN_GAIN = 0.05

# The program of a candidate: its mesh, remat policy, accumulation, numerics and scanning (the
# batch is set per compile); with a number of layers, the same model that deep (a scanned
# candidate's costs, see the module's docstring).
Maker = Callable[[Candidate, int | None], Program]


class OverBudget(Exception):
    """The plan's deadline passed before this compile started."""


@dataclasses.dataclass
class Settings:
    global_batch: int | None = None  # fixed: each layout's per-core batch and accumulation reach it
    top: int = 3  # layouts whose largest batch is searched (without a fixed global batch)
    deadline: float = math.inf  # time.monotonic() by which the plan should be done
    budget_s: float = math.inf  # the time the plan was given (the deadline's distance from its start)
    search_batch: bool = False  # stage 3: search the best layouts' per-core batch (the global batch changes)
    workers: int = max(1, os.cpu_count() or 1)
    max_batch_limit: int = 2**16
    allow_numerics: bool = False  # also try the levers that change the numerics
    min_gain: float = MIN_GAIN  # stage 3 goes on while a larger batch is this much faster; 0: to the largest
    bound: bool = False  # rank by the roofline estimate, not the step model


class Planner:
    """Compiles and predicts the candidates of one model (``maker``) on ``targets``."""

    def __init__(
        self,
        maker: Maker,
        base: Program,
        settings: Settings,
        remat: str | None = None,
        numerics: tuple[tuple[str, str], ...] = (),
        scan: bool | None = None,
        layers: int = 0,
        memory: tuple[tuple[str, str], ...] = (),
        remat_ladder: tuple[str, ...] = REMAT_LADDER,
    ) -> None:
        """``base``: the run as configured; ``remat``: its ``model.remat`` (None: the model has
        none) and ``remat_ladder`` the policies its model takes, cheapest first; ``numerics``:
        the settings that would change its numerics, each a lever with
        ``settings.allow_numerics``; ``scan``: its ``model.scan_layers`` (None: the model has
        none) and ``layers`` the model's number of layers; ``memory``: the memory levers
        (dotted key, value) the run leaves room for."""
        self.maker, self.base, self.settings, self.remat = maker, base, settings, remat
        self.memory, self.remat_ladder = memory, remat_ladder
        self.numerics = numerics if settings.allow_numerics else ()
        self.scan, self.layers = (scan, layers) if layers >= 2 else (None, 0)
        self._programs: dict[tuple, Program] = {}
        self._steps: dict[tuple, Steps] = {}
        self.outcomes: dict[Candidate, Outcome] = {}
        self.skipped: list[tuple[str, tuple[int, ...], str]] = []  # target, mesh, why
        # Set by stop() (Ctrl-C): no compile starts after it, and none finishing later is kept.
        self.stopped = False
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Ends the search: no compile starts after this, and a compile in flight, when it
        ends, is not added to :attr:`outcomes` (the report is being made from them)."""
        with self._lock:
            self.stopped = True

    def _keep(self, c: Candidate, out: Outcome) -> Outcome:
        """Records ``c``'s outcome, unless the search was stopped while it compiled."""
        with self._lock:
            if not self.stopped:
                self.outcomes.setdefault(c, out)
        return out

    # ------------------------------------------------------------------ compiling

    def steps(self, target: Target, c: Candidate, layers: int | None = None) -> Steps:
        """The compiler of ``c``'s program for ``target`` (``layers``: of that many layers)."""
        key = (target.name, c.mesh, c.remat, c.accumulate, c.numerics, c.scan, c.memory, layers)
        if key not in self._steps:
            pkey = key[1:]
            if pkey not in self._programs:
                self._programs[pkey] = self.maker(c, layers)
            self._steps[key] = Steps(target, self._programs[pkey])
        return self._steps[key]

    def _cost_depths(self) -> tuple[int, int]:
        """The depths of the unscanned programs whose difference is a scanned candidate's layer."""
        return (2, 4) if self.layers >= 4 else (1, 2)

    def _prepare(self, target: Target, c: Candidate) -> None:
        """Builds the programs ``c`` compiles (model building is not thread-safe: tracing
        shares the model objects)."""
        self.steps(target, c)
        if c.scan:
            for n in self._cost_depths():
                try:
                    self.steps(target, dataclasses.replace(c, scan=False), n)
                except Exception:  # said by the compile that needs it (no prediction)
                    pass

    def evaluate(self, target: Target, c: Candidate, stage: str) -> Outcome:
        """Compiles ``c`` once (later calls return the first outcome) and predicts its step."""
        if c in self.outcomes:
            return self.outcomes[c]
        if self.over_budget(target):
            raise OverBudget
        capacity = usable_hbm(target)[0]
        out = Outcome(c, None, capacity, stage=stage)
        quiet = stage == "batch"  # largest_batch says what each of its probes does
        if not quiet:
            _progress(f"{target.name}: compiling {c.layout}, {c.levers}, {c.per_device_batch} per core ...")
        steps = self.steps(target, c)
        if steps.state_bytes > capacity:  # refused without a compile: the state alone is too big
            out.fits, out.needed = False, steps.state_bytes
            gib = steps.state_bytes / 2**30
            out.error = f"the train state alone (parameters, optimizer state) takes {gib:.2f} GiB per core"
            return self._keep(c, out)
        try:
            compiled, out.compile_s = steps.compile_train(c.per_device_batch)
        except OutOfMemory as e:
            out.fits, out.needed, out.error = False, needed_bytes(e.message), e.message
        except TraceFailure as e:
            out.error = f"fails while tracing: {type(e.original).__name__}: {e.original}"
        except Exception as e:  # a layout the model's code cannot take (a reshape by heads, ...)
            out.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            out.fits = True
            k = steps.program.config.steps_per_call
            out.memory = memory_of(
                compiled, steps.state_bytes, tree_bytes(steps.program.example) * c.per_device_batch * k
            )
            hlo = compiled.as_text()
            try:
                flops, accessed = self._scanned_cost(target, out) if c.scan else program_cost(compiled, c, k, hlo)
            except Exception as e:  # a few-layer program that fails: the verdict stands, no prediction
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                n1, n2 = self._cost_depths()
                out.error = (
                    f"fits, but no prediction: the unscanned {n1}- and {n2}-layer programs that price a scanned "
                    f"layer did not compile ({first}); plan it unscanned (model.scan_layers=false) for one"
                )
            else:
                out.flops = flops or None
                out.comms = summarize(collectives(hlo, target.num_devices), target, per=k)
                self._predict(out, target, steps, flops, accessed, hlo)
        self._keep(c, out)  # before the verdict is said: a Ctrl-C after it reports this outcome
        verdict = "fits" if out.fits else "does not fit" if out.fits is False else "error"
        if not quiet:
            _progress(f"{target.name}: {c.layout}, {c.levers}, {c.per_device_batch} per core: {verdict}")
        return out

    def evaluate_eval(self, target: Target, o: Outcome, eval_batch: int) -> None:
        """Compiles ``o``'s eval step at ``eval_batch`` examples over all cores (each core's
        share rounded up: the last batch is padded) with ``o``'s layout; where it does not
        fit, searches the largest eval batch that does (``check --tpu``'s :func:`eval_fit`)."""
        steps = self.steps(target, o.candidate)
        per_core = -(-eval_batch // steps.strategy.num_replicas)
        with no_persistent_cache():
            o.eval_batch, o.eval = eval_batch, eval_fit(steps, per_core, o.capacity)

    def evaluate_rollout(self, target: Target, o: Outcome) -> None:
        """Compiles ``o``'s rollout programs (GRPO's generation and log-probabilities) with
        ``o``'s layout, at the rows of its train step over all cores."""
        steps = self.steps(target, o.candidate)
        with no_persistent_cache():
            o.rollout = rollout_fits(steps, o.candidate.per_device_batch * steps.strategy.num_replicas)

    def over_budget(self, target: Target) -> bool:
        """Whether a compile for ``target`` started now would end past the deadline (by more
        than 5 % of the budget), judged by the longest compile for it so far."""
        now = time.monotonic()
        if self.stopped or now > self.settings.deadline:
            return True
        seen = [o.compile_s for o in list(self.outcomes.values()) if o.candidate.target == target.name]
        expected = max((s for s in seen if s), default=0.0)
        return now + expected > self.settings.deadline + 0.05 * self.settings.budget_s

    def explain(self, target: Target, out: Outcome) -> None:
        """The largest buffers of a refused candidate, from a compile with the compiler's dump."""
        if out.fits is not False or out.buffers or self.over_budget(target):
            return
        if out.needed is not None and out.needed <= self.steps(target, out.candidate).state_bytes:
            return  # the state alone: nothing for the dump to add
        with tempfile.TemporaryDirectory(prefix="xlafit-plan-") as dump:
            try:
                self.steps(target, out.candidate).compile_train(out.candidate.per_device_batch, Path(dump))
            except OutOfMemory:
                out.buffers = largest_buffers(Path(dump))

    def _scanned_cost(self, target: Target, out: Outcome) -> tuple[float, float]:
        """FLOPs and HBM bytes per step of a scanned candidate: from its unscanned programs of
        ``n1`` and ``n2`` layers, each layer costing ``(cost(n2) - cost(n1)) / (n2 - n1)``."""
        c = out.candidate
        flat = dataclasses.replace(c, scan=False)
        (n1, n2), costs = self._cost_depths(), []
        for n in (n1, n2):
            steps = self.steps(target, flat, n)
            compiled, seconds = steps.compile_train(c.per_device_batch)
            out.cost_compile_s += seconds
            costs.append(program_cost(compiled, flat, steps.program.config.steps_per_call, compiled.as_text()))
        (f1, b1), (f2, b2) = costs
        more = (self.layers - n1) / (n2 - n1)
        return f1 + more * (f2 - f1), b1 + more * (b2 - b1)

    def _predict(self, out: Outcome, target: Target, steps: Steps, flops: float, accessed: float, hlo: str) -> None:
        c, p = out.candidate, steps.program
        assert out.comms is not None
        rows = c.global_batch
        model_flops = p.flops_per_example * rows / target.num_devices if p.flops_per_example else flops
        # As check's roofline: never faster than the model's own FLOPs at peak (XLA's count
        # of a TPU program can fall short of them).
        compute, memory = max(flops, model_flops) / target.peak_flops, accessed / target.hbm_bandwidth
        comm = out.comms.seconds
        roof = max(compute, memory)
        bound = max(roof, comm or 0.0)
        if bound <= 0:
            return
        step, band, median = bound, "", None
        rates = None if self.settings.bound else rates_for(target.generation.device_kinds[0])
        if self.settings.bound:
            band = "the roofline (--bound): XLA's counts at the datasheet's peak and bandwidth, not a prediction"
        elif rates is None:
            band = f"no step model for {target.generation.name}: the roofline estimate"
        else:
            k = p.config.steps_per_call
            step = predict(hlo, rates, target.ici_bandwidth, target.num_devices).seconds / k or bound
            band, median = rates.band_for(program_kind(p, target.num_devices, step))
            if outside_band(step):
                band, median = OUTSIDE_BAND, None
        out.prediction = Prediction(
            compute,
            memory,
            comm,
            step,
            roof + (comm or 0.0),
            rows / step,
            rows / step * p.tokens_per_example if p.tokens_per_example else None,
            model_flops / step / target.peak_flops,
            bound_s=bound,
            predicted=rates is not None,
            band=band,
            band_median=median,
            outside_band=rates is not None and rates.band is not None and median is None,
        )

    def results(self) -> list[Outcome]:
        """The outcomes, each prediction's MFU on the model's FLOPs: the program's analytic count
        where it has one, else the fewest FLOPs per example XLA counted in any compiled layout (a
        layout that splits a product less repeats it on every core: hardware FLOPs, not the
        model's)."""
        outcomes = list(self.outcomes.values())
        if self.base.flops_per_example:
            return outcomes
        counted = [(o, parse_target(o.candidate.target)) for o in outcomes if o.flops and o.prediction]
        if not counted:
            return outcomes
        per_example = min(o.flops * t.num_devices / o.candidate.global_batch for o, t in counted)  # type: ignore[operator]
        for o, t in counted:
            p = o.prediction
            assert p is not None
            p.mfu = per_example * p.examples_per_s / (t.num_devices * t.peak_flops)
        return outcomes

    def _map(self, jobs: Iterable[tuple[Target, Candidate, str]]) -> list[Outcome]:
        """Outcomes of several compiles, ``workers`` at a time; a job past the deadline is
        reported as not compiled."""

        def run(job: tuple[Target, Candidate, str]) -> Outcome:
            target, c, stage = job
            try:
                return self.evaluate(target, c, stage)
            except OverBudget:
                out = Outcome(c, None, error="not compiled: the plan's time budget ran out", stage=stage)
                return self._keep(c, out)

        jobs = list(jobs)
        for target, c, _ in jobs:  # built here, one at a time
            self._prepare(target, c)
        return self._pooled(run, jobs)

    def _pooled(self, fn: Callable, items: list, workers: int | None = None) -> list:
        """``fn`` of each item, ``workers`` (default: the settings') at a time, in threads: the
        calling thread only waits, so Ctrl-C reaches it at once. It stops the search and leaves
        the compiles in flight to finish unheard, rather than waiting for them."""
        pool = concurrent.futures.ThreadPoolExecutor(workers or self.settings.workers)
        try:
            return list(pool.map(fn, items))
        except KeyboardInterrupt:
            self.stop()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            pool.shutdown(wait=not self.stopped)

    # ------------------------------------------------------------------ the search

    def plan_target(self, target: Target) -> None:
        """Stages 1 to 3 of the module docstring for one target."""
        with no_persistent_cache():
            usable_hbm(target)  # asked once, here: the worker threads then read the cache
            layouts = self._layouts(target)
            first = self._map((target, c, "layout") for c in layouts)
            refused = [o for o in first if o.fits is False]
            self._map(job for o in refused for job in self._lever_jobs(target, o))
            self._map(self._memory_jobs(target, refused))
            self._map(self._memory_jobs(target, refused, together=True))  # where no lever alone fits
            self._pooled(lambda o: self.explain(target, o), refused, workers=1)  # one dump at a time
            if self.numerics:  # the fastest layout with each setting that changes the numerics
                best = self._best(target)
                if best is not None:
                    jobs = [
                        (target, dataclasses.replace(best.candidate, numerics=(n,)), "numerics") for n in self.numerics
                    ]
                    self._map(jobs)
            if self.settings.search_batch and self.settings.global_batch is None:
                self._largest(target)

    def _best(self, target: Target) -> Outcome | None:
        fitting = [o for o in self.outcomes.values() if o.candidate.target == target.name and o.prediction]
        return max(fitting, key=lambda o: o.prediction.examples_per_s, default=None)  # type: ignore[union-attr]

    def _layouts(self, target: Target) -> list[Candidate]:
        """Every mesh of :func:`meshes` and, for a mixture of experts, of :func:`expert_meshes`
        (its other meshes then say ``mesh.expert=1``), less those the model or trainer refuse.
        The expert meshes come before the tensor-parallel ones: compiled first where a budget
        leaves room for only some."""
        params = params_of(self.base.model)
        experts = experts_of(params, self.base.rules)
        layouts: list[tuple[int, ...]] = list(meshes(target.num_devices))
        if experts:
            plain = [(*m, 1) for m in layouts]
            layouts = [
                *(m for m in plain if m[2] == 1),
                *expert_meshes(target.num_devices, experts),
                *(m for m in plain if m[2] > 1),
            ]
        found = []
        for mesh in layouts:
            why = trainer_refusal(self.base, target, mesh) or mesh_refusal(params, mesh, self.base.rules)
            shards = math.prod(mesh) // mesh[2]  # data x fsdp (x expert): a tensor group shares its rows
            g = self.settings.global_batch
            if why is None and g is not None and g % shards:
                why = f"the global batch {g} does not divide over its {shards} batch shards"
            if why is not None:
                self.skipped.append((target.name, mesh, why))
                continue
            per = (
                g // shards if g else self.base.per_device_batch or max(1, (self.base.global_batch or shards) // shards)
            )
            candidate = Candidate(target.name, mesh, per, self.base.config.accumulate_steps, self.remat, scan=self.scan)
            try:  # the mesh over the slice's hosts: a tensor group must stay on one
                self.steps(target, candidate)
            except XlafitError as e:
                self.skipped.append((target.name, mesh, str(e)))
                continue
            found.append(candidate)
        return found

    def _lever_jobs(self, target: Target, o: Outcome) -> list[tuple[Target, Candidate, str]]:
        """Accumulation sized from the shortfall, each costlier remat policy, and scanned
        layers with full remat (where the run does not scan them already)."""
        c, jobs = o.candidate, []
        state = self.steps(target, c).state_bytes
        if o.needed and o.capacity > state:
            ratio = (o.needed - state) / (o.capacity * 0.95 - state)
            k = c.accumulate * 2 ** max(1, math.ceil(math.log2(max(ratio, 1.0))))
            if ratio > 0 and c.per_device_batch % k == 0:
                jobs.append((target, dataclasses.replace(c, accumulate=k), "lever"))
        if c.remat is not None:
            ladder = self.remat_ladder
            for policy in ladder[ladder.index(c.remat) + 1 :] if c.remat in ladder else ("full",):
                jobs.append((target, dataclasses.replace(c, remat=policy), "lever"))
        if self.scan is False:
            jobs.append((target, dataclasses.replace(c, scan=True, remat="full" if c.remat else None), "lever"))
        jobs += [(target, dataclasses.replace(c, numerics=(n,)), "lever") for n in self.numerics]
        return jobs

    def _memory_jobs(
        self, target: Target, refused: list[Outcome], together: bool = False
    ) -> list[tuple[Target, Candidate, str]]:
        """:func:`~xlafit.plan.candidates.memory_candidates` of the refused layouts, those the
        compiler asked least of first: each lever alone, or (``together``) all at once."""
        closest = [o.candidate for o in sorted(refused, key=lambda o: o.needed or math.inf)]
        fitted = [o.candidate for o in self.outcomes.values() if o.fits] if together else None
        return [(target, c, "lever") for c in memory_candidates(closest, self.memory, self.remat_ladder, fitted)]

    def _largest(self, target: Target) -> None:
        """Stage 3: for the best layouts, side by side, the per-core batch that runs fastest:
        the largest that fits, or the first whose larger neighbour no longer runs faster."""
        fitting = [o for o in self.outcomes.values() if o.candidate.target == target.name and o.fits and o.prediction]
        fitting.sort(key=lambda o: -self._potential(target, o))
        self._pooled(lambda o: self._search_batch(target, o), fitting[: self.settings.top])

    def _search_batch(self, target: Target, o: Outcome) -> None:
        c = o.candidate
        label = f"{target.name} {c.layout}"

        def enough(batch: int) -> bool:
            """A larger batch is not worth its compiles: at most ``min_gain`` faster, by
            :func:`reachable_gain` (before any refusal: the newest fit against the largest
            fit below it)."""
            siblings = [x for x in list(self.outcomes.values()) if _sibling(x, c)]  # other threads add outcomes
            fits = {x.candidate.per_device_batch: x for x in siblings if x.fits and x.prediction}
            below = [b for b in fits if b < batch]
            if batch not in fits or not below:
                return False
            b0 = max(below)
            larger = [
                x.candidate.per_device_batch
                for x in siblings
                if x.fits is False and x.candidate.per_device_batch > batch
            ]
            speeds = [(b, fits[b].prediction.examples_per_s) for b in (b0, batch)]  # type: ignore[union-attr]
            gain = reachable_gain(speeds, min(larger, default=None))
            if gain is None:
                gain = speeds[1][1] / speeds[0][1] - 1
            return gain < self.settings.min_gain

        try:
            best, _ = largest_batch(
                _Recorder(self, target, c),
                c.per_device_batch,
                True,
                o.hbm_used,
                o.capacity,
                limit=self.settings.max_batch_limit,
                tolerance=0.1,
                fixed_bytes=self.steps(target, c).state_bytes,
                enough=enough if self.settings.min_gain > 0 else None,
                label=label,
            )
        except OverBudget:
            return
        _progress(f"{label}, {c.levers}: searched up to {best} per core")

    def _potential(self, target: Target, o: Outcome) -> float:
        """Examples/s at the largest batch the memory of this compile predicts: per-core bytes
        grow linearly from the state with the batch, compute and HBM time in proportion, the
        collectives (the parameters' and gradients') stay. Ranks layouts before the search:
        at a small batch a layout's fixed cost hides what it would do at its largest."""
        c, p, used = o.candidate, o.prediction, o.memory.get("total", 0)
        state = self.steps(target, c).state_bytes
        if p is None or used <= state:
            return 0.0 if p is None else p.examples_per_s
        scale = max(1.0, (o.capacity - state) / (used - state))
        if p.predicted:  # the step model's kernels grow with the batch, the collectives stay
            step = max(p.step_s * scale, p.comm_s or 0.0)
        else:
            step = max(p.compute_s * scale, p.memory_s * scale, p.comm_s or 0.0)
        return c.global_batch * scale / step


def _sibling(x: Outcome, c: Candidate) -> bool:
    """``x`` is ``c`` at another per-core batch."""
    return dataclasses.replace(x.candidate, per_device_batch=c.per_device_batch) == c


class _Recorder:
    """What :func:`largest_batch` needs of a :class:`Steps`, each probe an evaluated candidate."""

    def __init__(self, planner: Planner, target: Target, c: Candidate) -> None:
        self.planner, self.target, self.candidate = planner, target, c
        steps = planner.steps(target, c)
        self.program, self.strategy = steps.program, steps.strategy

    def fits(self, per_device: int) -> tuple[bool, float, int | None]:
        out = self.planner.evaluate(
            self.target, dataclasses.replace(self.candidate, per_device_batch=per_device), "batch"
        )
        if out.fits is None:  # an error at this batch: no larger one either
            return False, out.compile_s, None
        return bool(out.fits), out.compile_s, out.hbm_used


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
