"""Runs one plan of a recipe and keeps its table and JSON beside this script.

    python run_plan.py NAME RECIPE|FILE.py TPU [--global-batch N] [--budget-minutes M] [--examples N] [overrides ...]

Writes NAME.txt (what `xlafit plan` prints), NAME.json (its --json, plus the wall time of
the whole plan on this machine, compiles included) and NAME.plan.yaml (--write).
"""

import json
import sys
import time
from pathlib import Path

from xlafit.plan import format_plan, plan_file, plan_json, plan_recipe

here = Path(__file__).parent
name, recipe, tpu, *rest = sys.argv[1:]
options = {}
while rest[:1] in (["--global-batch"], ["--budget-minutes"], ["--examples"]):
    options[rest[0][2:].replace("-", "_")], rest = float(rest[1]), rest[2:]
if "global_batch" in options:
    options["global_batch"] = int(options["global_batch"])
flags = " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in options.items())
command = f"xlafit plan {recipe} {' '.join(rest)} --tpu {tpu} {flags}".strip()
t0 = time.perf_counter()
planner = plan_file if recipe.endswith(".py") else plan_recipe
plan = planner(here / recipe if recipe.endswith(".py") else recipe, rest, tpu, command=command, **options)
wall = time.perf_counter() - t0
(here / f"{name}.txt").write_text(format_plan(plan) + f"\nwall time of the whole plan: {wall:.0f} s\n")
(here / f"{name}.json").write_text(json.dumps({**plan_json(plan), "wall_s": wall}, indent=2, default=str))
if plan.winner is not None:
    plan.write(here / f"{name}.plan.yaml")
print(f"{name}: {wall:.0f} s")
