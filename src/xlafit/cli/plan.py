"""``xlafit plan TARGET --tpu SLICES``: the layout, batch and TPU to run on, by compiling them."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from xlafit.cli.common import add_calibration, apply_calibration
from xlafit.errors import INTERRUPTED, ConfigError

DESCRIPTION = (
    "Search the ways to run a model on TPU slices with the TPU compiler (libtpu, no TPU needed): every "
    "mesh (data x fsdp x tensor; x expert for a mixture of experts) the model's named axes allow at the run's own "
    "batch, gradient accumulation and "
    "the model's remat policies where a layout does not fit (and with --search-batch the fastest per-core batch "
    "of the best layouts). Each "
    "candidate is compiled for the slice and predicted from its compiled program (compute, HBM traffic "
    "and the collectives it contains, over the slice's ICI): throughput, MFU, HBM, and the time and cost "
    "of the run. Prints a ranked table, the winner's `xlafit train` overrides and why the others lose; "
    "--write saves the winner as a preset for `xlafit train RECIPE --config` and `xlafit check --config`. "
    "TARGET is a recipe name or a Python file in `xlafit check`'s format. Ctrl-C stops the search and reports "
    "what had been compiled (exit 130)."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="find the fastest layout, batch and TPU slice by compiling them", description=DESCRIPTION
    )
    p.add_argument("target", metavar="TARGET", help="a recipe name (mnist, bert, resnet, llm) or path/to/file.py")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="config overrides: a recipe's keys; a file's mesh.*, trainer.*, data.per_device_batch",
    )
    p.add_argument(
        "--tpu",
        metavar="SLICES",
        default="v5e-8",
        help="TPU slices to plan for, comma-separated (default v5e-8): v5e-8,v6e-8,v5p-8, colab, kaggle, ...",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        metavar="N",
        help="plan at this global batch (the one your learning rate is tuned for); the plan picks per-core batch "
        "and accumulation to reach it. Default: the run's own batch",
    )
    p.add_argument(
        "--search-batch",
        action="store_true",
        help="also search the per-core batch of the best layouts (the largest that runs faster): this changes the "
        "global batch, and with it what the learning rate was tuned for",
    )
    p.add_argument(
        "--per-device-batch", type=int, metavar="N", help="a file's starting per-core batch (default: its batch's rows)"
    )
    p.add_argument("--examples", type=float, metavar="N", help="examples per epoch, for the run's time and cost")
    p.add_argument("--tokens", type=float, metavar="N", help="tokens per epoch, instead of --examples")
    p.add_argument(
        "--epochs", type=float, metavar="N", help="epochs of the run (default: a recipe's trainer.epochs, 1 for a file)"
    )
    p.add_argument(
        "--budget-minutes", type=float, metavar="M", help="start no compile after M minutes; report what was compiled"
    )
    p.add_argument(
        "--top", type=int, default=3, metavar="K", help="--search-batch: search the K fastest layouts (default 3)"
    )
    p.add_argument(
        "--min-gain",
        type=float,
        default=5.0,
        metavar="PCT",
        help="go on searching a layout's batch while a larger one (after a refusal: the largest below it) is "
        "predicted PCT %% faster (default 5; 0: search to the largest batch that fits, more compiles)",
    )
    p.add_argument(
        "--allow-numerics",
        action="store_true",
        help="also try settings that change the numerics (bf16 compute, bf16 Adam moments), marked in the table",
    )
    p.add_argument("--spot", action="store_true", help="price the run at Spot prices (where the table has them)")
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="GEN=USD",
        help="a chip-hour price for a generation, e.g. --price v5e=0.9 (your region, discount or Spot)",
    )
    p.add_argument("--config", metavar="YAML", help="a recipe's preset to start from instead of its own")
    p.add_argument("--write", metavar="PLAN.yaml", help="write the winner's settings as a preset")
    add_calibration(p)
    p.add_argument(
        "--bound",
        action="store_true",
        help="rank by the roofline estimate (FLOPs at peak, bytes at datasheet bandwidth, collectives over ICI) "
        "instead of the step model's prediction",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def _prices(given: list[str]) -> dict[str, float]:
    out = {}
    for item in given:
        name, _, usd = item.partition("=")
        try:
            out[name.strip()] = float(usd)
        except ValueError:
            raise ConfigError(f"--price {item}: give GENERATION=USD per chip-hour, e.g. --price v5e=0.9.") from None
    return out


def run(args: argparse.Namespace) -> int:
    # The library when the command runs: a fast --help.
    from xlafit.plan import format_plan, plan_file, plan_json, plan_recipe
    from xlafit.plan.result import check_plan_path

    apply_calibration(args.calibration)
    if args.write:
        check_plan_path(args.write)
    for flag in ("global_batch", "per_device_batch", "top"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: give a positive number.")
    options = {
        "global_batch": args.global_batch,
        "examples": args.examples,
        "tokens": args.tokens,
        "budget_minutes": args.budget_minutes,
        "top": args.top,
        "min_gain": args.min_gain,
        "bound": args.bound,
        "search_batch": args.search_batch,
        "spot": args.spot,
        "prices": _prices(args.price),
        "command": "xlafit plan " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["plan"] else [args.target]),
    }
    if args.target.endswith(".py") or os.path.sep in args.target:
        if args.config:
            raise ConfigError(
                "--config is a recipe's preset; a file's plan starts from the file's own mesh and config."
            )
        plan = plan_file(
            args.target,
            args.overrides,
            args.tpu,
            per_device_batch=args.per_device_batch,
            epochs=args.epochs or 1,
            **options,
        )
    else:
        if args.per_device_batch:
            raise ConfigError("--per-device-batch is for a file; for a recipe give data.per_device_batch=N.")
        plan = plan_recipe(
            args.target,
            args.overrides,
            args.tpu,
            preset=args.config,
            epochs=args.epochs,
            allow_numerics=args.allow_numerics,
            **options,
        )
    print(json.dumps(plan_json(plan), indent=2, default=str) if args.json else format_plan(plan))
    if args.write and plan.winner is not None:
        written = plan.write(args.write)
        partial = " (the best of a search stopped before it ended)" if plan.stopped else ""
        print(f"wrote {written}{partial}", file=sys.stderr)
    elif args.write and plan.stopped:
        print(f"nothing written to {args.write}: no candidate had fit when the search stopped", file=sys.stderr)
    elif args.write:
        plan.write(args.write)  # says why nothing is written
    if plan.stopped:
        # The compiles the stop abandoned cannot be interrupted, and the interpreter's exit
        # would wait for them: the report is out, so the process ends here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)
    return 0 if plan.winner is not None else 1
