"""A plan's answer: the candidates compiled for one model, ranked, and the winner's settings."""

from __future__ import annotations

import dataclasses
import math
import shlex
from pathlib import Path
from typing import Any

import yaml

from xlafit.check.speed import outside_band
from xlafit.errors import ConfigError
from xlafit.overrides import deep_merge, merge_overrides, parse_overrides
from xlafit.plan.candidates import Candidate
from xlafit.plan.outcome import Outcome
from xlafit.platform.hardware import PRICES, Price, Target, command_name


@dataclasses.dataclass
class Plan:
    """The candidates compiled for one model, ranked; see the module docstring."""

    source: str  # the recipe's name or the file's path
    command: str  # how the plan was asked for
    targets: list[Target]
    outcomes: list[Outcome]
    skipped: list[tuple[str, tuple[int, ...], str]]
    run_examples: float | None  # examples the run trains on (all epochs); None: unknown
    base_overrides: list[str]
    preset: dict[str, Any] | None  # a recipe's preset (the file written is it, with the winner's keys)
    batch_key: str = "data.per_device_batch"
    spot: bool = False
    prices: dict[str, Price] = dataclasses.field(default_factory=lambda: dict(PRICES))
    seconds: float = 0.0
    # The run's own batch, as configured: a global batch, or a per-core one (None: unknown),
    # and whether the plan kept it (--global-batch): a plan that did not may change it.
    own_global_batch: int | None = None
    own_per_device_batch: int | None = None
    batch_fixed: bool = False
    # Whether the run evaluates (a recipe's does: plan compiles its answer's eval step).
    evaluates: bool = False
    # Whether the run makes its batches with its model (GRPO's rollout): its programs are
    # compiled for the answer, and the step times are the train step's alone.
    rollout: bool = False
    # What stopped the search before it ended (Ctrl-C), said first in the report; None: it ended.
    stopped: str | None = None

    def own_batch(self, o: Outcome) -> int | None:
        """The run's own global batch on ``o``'s layout (None: unknown)."""
        if self.own_global_batch:
            return self.own_global_batch
        return self.own_per_device_batch * o.candidate.shards if self.own_per_device_batch else None

    def fitting(self) -> list[Outcome]:
        """The candidates that fit, fastest first: their train step fits, and their eval step
        where it was compiled (at the run's eval batch, or the largest that compiles). Where
        every one is :meth:`launch_bound`, pure data parallelism comes first."""
        found = [o for o in self.outcomes if o.fits and o.prediction is not None and o.run_fits is not False]
        first = self.launch_bound(found)
        return sorted(
            found,
            key=lambda o: (not (first and o.candidate.data_parallel), -o.prediction.examples_per_s),  # type: ignore[union-attr]
        )

    @staticmethod
    def launch_bound(fitting: list[Outcome]) -> bool:
        """Whether every fitting candidate's step is estimated under 1 ms (by the step model, or
        the roofline where a generation has none): there launch and dispatch, which neither
        prices, decide the step, and the layout with the fewest collectives (pure data
        parallelism: one gradient all-reduce a step) is the one to start from, whatever the
        estimated microseconds say."""
        return bool(fitting) and all(o.prediction is not None and outside_band(o.prediction.step_s) for o in fitting)

    @property
    def winner(self) -> Outcome | None:
        fitting = self.fitting()
        return fitting[0] if fitting else None

    def target(self, o: Outcome) -> Target:
        return next(t for t in self.targets if t.name == o.candidate.target)

    def run_hours(self, o: Outcome) -> float | None:
        if self.run_examples is None or o.prediction is None:
            return None
        return self.run_examples / o.prediction.examples_per_s / 3600

    def run_cost(self, o: Outcome) -> float | None:
        hours, price = self.run_hours(o), self.target(o).price_per_hour(self.spot, self.prices)
        return None if hours is None or price is None else hours * price

    def pareto(self) -> set[Candidate]:
        """Fitting candidates that no other beats on throughput, cost of the run (or price
        per example when the run's size is unknown) and HBM to spare all at once."""

        def score(o: Outcome) -> tuple[float, float, float]:
            cost = self.run_cost(o)
            if cost is None:
                price = self.target(o).price_per_hour(self.spot, self.prices) or math.inf
                cost = price / o.prediction.examples_per_s  # type: ignore[union-attr]
            return (o.prediction.examples_per_s, -cost, o.hbm_free or 0.0)  # type: ignore[union-attr]

        scores = {o.candidate: score(o) for o in self.fitting()}
        return {
            c
            for c, s in scores.items()
            if not any(all(x >= y for x, y in zip(t, s, strict=True)) and t != s for t in scores.values())
        }

    def overrides(self, o: Outcome) -> dict[str, Any]:
        """The winner's (or ``o``'s) settings as ``xlafit train`` keys: with the largest eval
        batch that compiles where the run's own does not."""
        out = o.candidate.overrides(self.batch_key)
        if o.eval_fix:
            out["data.eval_global_batch"] = o.eval_fix
        return out

    def command_line(self, o: Outcome) -> str:
        """The command that runs ``o`` (a recipe) or checks it (a file), each key once."""
        keys = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.overrides(o).items()]
        keys = merge_overrides(self.base_overrides, keys)
        if self.preset is None:  # a user's file: its model, the plan's mesh, loop and batch
            batch = f"--per-device-batch {o.candidate.per_device_batch}"
            return shlex.join(["xlafit", "check", self.source, "--tpu", command_name(o.candidate.target)]) + (
                f" {batch} {shlex.join(keys)}"
            )
        return shlex.join(["xlafit", "train", self.source, *keys])

    def write(self, path: str | Path) -> Path:
        """The winner's settings as YAML: a recipe's whole preset with them applied (for
        ``xlafit train RECIPE --config``), or a file's ``mesh:``, ``trainer:`` and ``data:``
        (its per-core batch) sections, for ``xlafit check FILE --config``."""
        o = self.winner
        if o is None:
            raise ConfigError("no candidate fits any target: there is no plan to write.")
        keys = parse_overrides([f"{k}={v}" for k, v in self.overrides(o).items()])
        if self.preset is not None:
            content = deep_merge(self.preset, deep_merge(parse_overrides(self.base_overrides), keys))
            use = f"xlafit train {self.source} --config {path}"
        else:
            content = {k: v for k, v in keys.items() if k in ("mesh", "trainer")}
            content["data"] = {"per_device_batch": o.candidate.per_device_batch}  # check FILE --config reads it
            use = f"xlafit check {self.source} --tpu {command_name(o.candidate.target)} --config {path}"
        p = o.prediction
        head = [
            f"# {self.command}",
            f"# The plan's choice for {o.candidate.target}: {o.candidate.layout}, {o.candidate.levers}, "
            f"{o.candidate.per_device_batch} per core (global {o.candidate.global_batch})",
            f"# predicted (not measured) {p.examples_per_s:,.0f} examples/s, MFU {p.mfu:.0%}; {p.band}"
            if p and p.predicted
            else f"# about {p.examples_per_s:,.0f} examples/s, MFU {p.mfu:.0%} (the roofline estimate)"
            if p
            else "#",
            f"#   {use}",
        ]
        if o.eval_fix:
            head.insert(
                -1,
                f"# data.eval_global_batch={o.eval_fix}: the largest eval batch that compiles on this layout "
                f"(the run's own {o.eval_batch} does not)",
            )
        out = check_plan_path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(head) + "\n" + yaml.safe_dump(content, sort_keys=False))
        return out


def check_plan_path(path: str | Path) -> Path:
    """``path`` as a place to write a plan: new, or a plan written before (replaced); a
    folder, or a file of anything else, is refused before the plan's compiles, not after."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"--write {path} is a directory; give a file name, e.g. {out / 'plan.yaml'}.")
    if out.exists():
        try:
            earlier = out.read_text(encoding="utf-8").startswith("# xlafit plan ")
        except (OSError, UnicodeDecodeError):
            earlier = False
        if not earlier:
            raise ConfigError(
                f"--write {path}: the file exists and is not a plan xlafit wrote, so it is kept; give another path, "
                "or move it away first."
            )
    return out
