"""Runs one plan of a recipe and keeps its table and JSON beside this script.

    python benchmarks/results/2026-11-26/plan/run_plan.py NAME RECIPE TPU [--global-batch N] [overrides ...]

Writes NAME.txt (what `xlafit plan` prints) and NAME.json (its --json, plus the wall time of
the whole plan on this machine, compiles included).
"""

import json
import sys
import time
from pathlib import Path

from xlafit.plan import format_plan, plan_json, plan_recipe

here = Path(__file__).parent
name, recipe, tpu, *rest = sys.argv[1:]
global_batch = None
if rest[:1] == ["--global-batch"]:
    global_batch, rest = int(rest[1]), rest[2:]
command = f"xlafit plan {recipe} {' '.join(rest)} --tpu {tpu}" + (f" --global-batch {global_batch}" if global_batch else "")
t0 = time.perf_counter()
plan = plan_recipe(recipe, rest, tpu, global_batch=global_batch, command=command)
wall = time.perf_counter() - t0
(here / f"{name}.txt").write_text(format_plan(plan) + f"\nwall time of the whole plan: {wall:.0f} s\n")
(here / f"{name}.json").write_text(json.dumps({**plan_json(plan), "wall_s": wall}, indent=2, default=str))
print(f"{name}: {wall:.0f} s")
