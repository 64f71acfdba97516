"""A plan for a recipe (:func:`plan_recipe`) or for a user's model file (:func:`plan_file`):
their settings read, the planner built, every target searched."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xlafit.check import file_program, file_settings, importable, load_file, recipe_program
from xlafit.check.program import Program
from xlafit.errors import ConfigError
from xlafit.overrides import load_yaml
from xlafit.parallel.cluster import start_backends
from xlafit.plan.candidates import OFFLOAD_LADDER, REMAT_LADDER, Candidate
from xlafit.plan.evaluation import check_answer_eval, check_answer_rollout
from xlafit.plan.result import Plan
from xlafit.plan.search import Planner, Settings
from xlafit.platform.hardware import GENERATIONS, PRICES, Price, Target, parse_targets
from xlafit.recipes import preset_path

log = logging.getLogger("xlafit")


def _run_examples(examples: float | None, tokens: float | None, program: Program, epochs: float) -> float | None:
    if examples is not None:
        return examples * epochs
    if tokens is not None:
        if not program.tokens_per_example:
            raise ConfigError("--tokens needs a model that counts tokens per example; give --examples instead.")
        return tokens / program.tokens_per_example * epochs
    return None


def _settings(
    global_batch: int | None,
    budget_minutes: float | None,
    top: int,
    allow_numerics: bool,
    min_gain: float,
    bound: bool = False,
    search_batch: bool = False,
) -> Settings:
    if global_batch is not None and global_batch < 1:
        raise ConfigError(f"--global-batch {global_batch}: give a positive number of examples per step.")
    if min_gain < 0:
        raise ConfigError(f"--min-gain {min_gain:g}: give a percentage of 0 or more (0: search to the largest batch).")
    budget_s = budget_minutes * 60 if budget_minutes else math.inf
    if search_batch and global_batch is not None:
        raise ConfigError(
            f"--search-batch searches the per-core batch, --global-batch {global_batch} fixes it: give one of them."
        )
    return Settings(
        global_batch=global_batch,
        deadline=time.monotonic() + budget_s,
        budget_s=budget_s,
        search_batch=search_batch,
        top=top,
        allow_numerics=allow_numerics,
        min_gain=min_gain / 100,
        bound=bound,
    )


def _numerics(cfg: Any) -> tuple[tuple[str, str], ...]:
    """The settings of a recipe's run that would change its numerics to save memory or time."""
    found = []
    if getattr(cfg.model, "compute_dtype", None) == "float32":
        found.append(("model.compute_dtype", "bfloat16"))
    if cfg.optimizer.name in ("adam", "adamw") and cfg.optimizer.moment_dtype == "float32":
        found.append(("optimizer.moment_dtype", "bfloat16"))
    return tuple(found)


def _prices(given: dict[str, float] | None, targets: Sequence[Target] = ()) -> dict[str, Price]:
    """The price list with ``given`` prices per chip-hour (``--price v5e=0.9``) in place of the
    catalog's.

    A generation none of ``targets`` is of prices nothing, and is warned.

    Raises:
        ConfigError: a name that is no TPU generation (a slice's name, ``v5e-8``, said so).
    """
    prices = dict(PRICES)
    planned = {t.generation.name for t in targets}
    for name, usd in (given or {}).items():
        generation = name.strip().lower()
        if generation not in GENERATIONS:
            base = generation.rsplit("-", 1)[0]
            why = (
                f"prices are per chip-hour of a generation: --price {base}=USD (a slice costs its chips x that)"
                if base in GENERATIONS
                else f"no TPU generation of that name; give one of {', '.join(GENERATIONS)} (per chip-hour)"
            )
            raise ConfigError(f"--price {name}={usd:g}: {why}.")
        if planned and generation not in planned:
            log.warning(
                "--price %s=%g prices no target of this plan (%s): not used",
                name,
                usd,
                ", ".join(t.name for t in targets),
            )
        prices[generation] = Price(usd, usd, "given on the command line (--price)", time.strftime("%Y-%m-%d"))
    return prices


def _run(planner: Planner, targets: list[Target]) -> tuple[float, str | None]:
    """Searches each target: the seconds it took, and what stopped it early (Ctrl-C; None: nothing)."""
    t0 = time.perf_counter()
    for i, target in enumerate(targets):
        try:
            planner.plan_target(target)
        except KeyboardInterrupt:
            planner.stop()
            return time.perf_counter() - t0, stopped_line(time.perf_counter() - t0, [t.name for t in targets[i:]])
    return time.perf_counter() - t0, None


def stopped_line(seconds: float, unfinished: list[str]) -> str:
    """What a plan stopped by Ctrl-C after ``seconds`` reports, ``unfinished`` the targets
    whose search it cut short."""
    return (
        f"stopped by Ctrl-C after {seconds:.0f} s: the plan reports the compiles that had finished; "
        f"the search of {', '.join(unfinished)} was cut short (compiles in flight abandoned, those after "
        "not started). Run it again with --budget-minutes to bound its time."
    )


def plan_recipe(
    name: str,
    overrides: Sequence[str] = (),
    tpu: str = "v5e-8",
    *,
    preset: str | Path | None = None,
    global_batch: int | None = None,
    examples: float | None = None,
    tokens: float | None = None,
    epochs: float | None = None,
    budget_minutes: float | None = None,
    top: int = 3,
    min_gain: float = 5.0,
    bound: bool = False,
    search_batch: bool = False,
    spot: bool = False,
    prices: dict[str, float] | None = None,
    allow_numerics: bool = False,
    command: str = "",
) -> Plan:
    """Plans a recipe (with ``overrides``) on the TPU targets of ``tpu`` (``"v5e-8,v6e-8"``).

    The run's size is ``examples`` (or ``tokens``) per epoch, by default the recipe's
    dataset, times ``epochs`` (the recipe's ``trainer.epochs``). ``allow_numerics`` adds the
    levers that change the numerics (bf16 compute, bf16 Adam moments), marked in the table.
    A layout's batch search stops once a larger batch is predicted less than ``min_gain``
    percent faster (after a refusal: the largest below it; 0: it searches to the largest
    batch that fits). The answer's eval step is compiled too, at the run's eval batch
    (:mod:`xlafit.plan.evaluation`): where it does not fit, the plan sets the largest that does.
    """
    targets = parse_targets(tpu)
    priced = _prices(prices, targets)  # before any compile: a wrong name is said at once
    start_backends()
    settings = _settings(global_batch, budget_minutes, top, allow_numerics, min_gain, bound, search_batch)
    planner, cfg, train_examples = recipe_planner(name, overrides, preset, settings)
    base = planner.base
    seconds, stopped = _run(planner, targets)
    size = _run_examples(examples if examples or tokens else train_examples, tokens, base, epochs or cfg.trainer.epochs)
    # The plan sets the per-core batch (and so the global one): the recipe's global batch gives way.
    batch_overrides = ["data.global_batch=null"]
    plan = Plan(
        name,
        command or f"xlafit plan {name} --tpu {tpu}",
        targets,
        planner.results(),
        planner.skipped,
        size,
        [*overrides, *batch_overrides],
        load_yaml(preset_path(name, preset)),
        spot=spot,
        prices=priced,
        seconds=seconds,
        evaluates=bool(base.eval_global_batch),
        rollout=base.rollout is not None,
        stopped=stopped,
        **_own_batch(base, global_batch, search_batch),
    )
    # The answer's eval step, at the run's own eval batch (None: its global batch), or its
    # rollout's programs (GRPO: a run that evaluates nothing).
    if (plan.evaluates or plan.rollout) and stopped is None:
        t0 = time.perf_counter()
        what = "eval step" if plan.evaluates else "rollout"
        try:
            if plan.evaluates:
                check_answer_eval(plan, planner.evaluate_eval, cfg.data.eval_global_batch)
            else:
                check_answer_rollout(plan, planner.evaluate_rollout)
        except KeyboardInterrupt:
            planner.stop()
            plan.stopped = (
                f"stopped by Ctrl-C while compiling the answer's {what}: the train steps were all searched "
                f"({plan.seconds:.0f} s); whether the answer's {what} fits is not known. Run it again to know."
            )
        plan.seconds += time.perf_counter() - t0
    return plan


def _own_batch(base: Program, global_batch: int | None, search_batch: bool) -> dict[str, Any]:
    return {
        "own_global_batch": base.global_batch if not base.per_device_batch else None,
        "own_per_device_batch": base.per_device_batch,
        "batch_fixed": global_batch is not None or not search_batch,
    }


def recipe_planner(
    name: str, overrides: Sequence[str], preset: str | Path | None, settings: Settings
) -> tuple[Planner, Any, int | None]:
    """The planner of a recipe's run: ``(planner, config, train examples)``. Its candidates'
    programs are the recipe's with their remat, scanning and numerics as overrides."""
    base, cfg, train_examples = recipe_program(name, overrides, preset)
    remat, scan = getattr(cfg.model, "remat", None), getattr(cfg.model, "scan_layers", None)
    cache: dict[tuple, Program] = {(remat, (), scan, (), None): base}
    # The preset's trainer.invariant_chunks holds for pure data parallelism only: it gives way
    # to a candidate that splits the model, as it does to the user's mesh (config.load);
    # asked for by the user, it stays, and such candidates say why they cannot run.
    asked = any(o.split("=", 1)[0].strip() == "trainer.invariant_chunks" for o in overrides)

    def maker(c: Candidate, layers: int | None) -> Program:
        key = (c.remat, c.numerics, c.scan, c.memory, layers)
        if key not in cache:
            keys = [f"model.remat={c.remat}"] if c.remat is not None else []
            keys += [f"model.scan_layers={str(c.scan).lower()}"] if c.scan is not None else []
            keys += [f"model.num_layers={layers}"] if layers is not None else []
            keys += [f"{k}={v}" for k, v in (*c.memory, *c.numerics)]
            assert base.with_overrides is not None  # a recipe's program is rebuilt on the data read once
            cache[key] = base.with_overrides(tuple(keys))
        config = dataclasses.replace(cache[key].config, accumulate_steps=c.accumulate)
        if not asked and any(n > 1 for n in c.mesh[1:]):  # fsdp, tensor or expert
            config = dataclasses.replace(config, invariant_chunks=None)
        return dataclasses.replace(cache[key], mesh=c.mesh, config=config)

    layers = getattr(getattr(base.model, "cfg", None), "num_layers", 0) if scan is not None else 0
    # The levers check --tpu compiles (fit_levers_of), as a plan tries them: remat on its ladder.
    levers = [lv.overrides[0].split("=", 1) for lv in base.fit_levers if len(lv.overrides) == 1]
    memory = tuple((k, v) for k, v in levers if k != "model.remat")
    ladder = OFFLOAD_LADDER if ["model.remat", "offload"] in levers or remat == "offload" else REMAT_LADDER
    planner = Planner(maker, base, settings, remat, _numerics(cfg), scan, layers, memory, ladder)
    return planner, cfg, train_examples


def plan_file(
    path: str | Path,
    overrides: Sequence[str] = (),
    tpu: str = "v5e-8",
    *,
    per_device_batch: int | None = None,
    global_batch: int | None = None,
    examples: float | None = None,
    tokens: float | None = None,
    epochs: float = 1,
    budget_minutes: float | None = None,
    top: int = 3,
    min_gain: float = 5.0,
    bound: bool = False,
    search_batch: bool = False,
    spot: bool = False,
    prices: dict[str, float] | None = None,
    command: str = "",
) -> Plan:
    """Plans a user file's model (``check``'s format) on the targets of ``tpu``. Its
    ``mesh`` and ``config`` (with ``overrides``) are the starting point; the plan's answer
    is their ``mesh.*`` and ``trainer.*`` keys."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path} does not exist.")
    targets = parse_targets(tpu)
    priced = _prices(prices, targets)  # before any compile: a wrong name is said at once
    nested = file_settings(overrides, tpu)
    start_backends()
    with importable(path):
        namespace = load_file(path)
        base = file_program(path, namespace, nested, {"per_device_batch": per_device_batch})

        def maker(c: Candidate, layers: int | None) -> Program:  # a file's model: no remat, no scan
            config = dataclasses.replace(base.config, accumulate_steps=c.accumulate)
            return dataclasses.replace(base, mesh=c.mesh, config=config)

        planner = Planner(
            maker, base, _settings(global_batch, budget_minutes, top, False, min_gain, bound, search_batch)
        )
        seconds, stopped = _run(planner, targets)
    return Plan(
        str(path),
        command or f"xlafit plan {path} --tpu {tpu}",
        targets,
        planner.results(),
        planner.skipped,
        _run_examples(examples, tokens, base, epochs),
        list(overrides),
        None,
        batch_key="",
        spot=spot,
        prices=priced,
        seconds=seconds,
        stopped=stopped,
        **_own_batch(base, global_batch, search_batch),
    )
