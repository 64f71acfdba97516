"""Runs one plan and keeps what it printed, its JSON and its preset in a results folder.

    python benchmarks/tpu/run_plan.py OUT_DIR NAME RECIPE|FILE.py TPU [--global-batch N] [--budget-minutes M]
        [--examples N] [--bound] [--search-batch] [overrides ...]

Writes OUT_DIR/NAME.txt (what `xlafit plan` prints, and the wall time of the whole plan on
this machine, compiles included), NAME.json (its --json, with the wall time) and
NAME.plan.yaml (--write).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from xlafit.plan import format_plan, plan_file, plan_json, plan_recipe


def main() -> None:
    out, name, recipe, tpu, *rest = sys.argv[1:]
    here = Path(out)
    here.mkdir(parents=True, exist_ok=True)
    options: dict = {}
    while rest[:1] in (["--global-batch"], ["--budget-minutes"], ["--examples"], ["--bound"], ["--search-batch"]):
        if rest[0] in ("--bound", "--search-batch"):
            options[rest[0][2:].replace("-", "_")], rest = True, rest[1:]
            continue
        options[rest[0][2:].replace("-", "_")], rest = float(rest[1]), rest[2:]
    if "global_batch" in options:
        options["global_batch"] = int(options["global_batch"])
    flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v:g}") for k, v in options.items())
    command = f"xlafit plan {recipe} {' '.join(rest)} --tpu {tpu} {flags}".strip()
    t0 = time.perf_counter()
    planner = plan_file if recipe.endswith(".py") else plan_recipe
    plan = planner(recipe, rest, tpu, command=command, **options)
    wall = time.perf_counter() - t0
    (here / f"{name}.txt").write_text(format_plan(plan) + f"\nwall time of the whole plan: {wall:.0f} s\n")
    (here / f"{name}.json").write_text(json.dumps({**plan_json(plan), "wall_s": wall}, indent=2, default=str))
    if plan.winner is not None:
        plan.write(here / f"{name}.plan.yaml")
    print(f"{name}: {wall:.0f} s")


if __name__ == "__main__":
    main()
