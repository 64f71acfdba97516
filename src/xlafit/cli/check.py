"""``xlafit check TARGET``: a train step against the XLA rules on the CPU, and compiled for TPUs."""

from __future__ import annotations

import argparse
import os

from xlafit.cli.common import add_calibration, apply_calibration
from xlafit.errors import ConfigError

DESCRIPTION = (
    "Trace and run one train step on the CPU, map failures to the XLA rules (1: data-dependent "
    "control flow, 2: data-dependent shapes, 3: too many input shapes) with file and line and the "
    "standard rewrite, scan the data's shapes, and estimate per-device memory and FLOPs. TARGET is a "
    "recipe name or a Python file defining `model` (an nnx.Module), `loss_fn(model, batch)` and `batch` "
    "(a dict of arrays), optionally `dataset` (examples) or `lengths`. Exit 1 when a rule is violated. "
    "With --tpu, compile the real train and eval steps for TPU slices with the TPU compiler (libtpu, "
    "no TPU needed) and report per-core HBM, whether it fits, FLOPs and a roofline estimate; exit 1 "
    "when a target does not fit. Overrides: a recipe's keys, or for a file mesh.*, trainer.* and "
    "data.per_device_batch (with --tpu), e.g. mesh.fsdp=8."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check", help="check a train step against the XLA rules on the CPU, before the TPU", description=DESCRIPTION
    )
    p.add_argument("target", metavar="TARGET", help="a recipe name (mnist, bert, resnet, llm) or path/to/file.py")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="config overrides: a recipe's keys; for a file, mesh.*, trainer.* and data.per_device_batch (with --tpu)",
    )
    p.add_argument("--per-device-batch", type=int, help="estimate memory and FLOPs at this batch per device")
    p.add_argument("--global-batch", type=int, help="check that it divides over --devices")
    p.add_argument("--devices", type=int, help="devices to plan for (default: this machine's)")
    p.add_argument("--max-shapes", type=int, default=8, help="input shapes allowed before rule 3 is flagged")
    p.add_argument(
        "--tpu",
        metavar="TARGETS",
        help="compile for these TPU slices, comma-separated: v2-8, v3-8, v4-8, v5e-1/4/8, v5p-8, v6e-1/4/8, "
        "tpu7x-8, pod slices such as v4-32 or v5e-256; colab (v5e-1) and kaggle (v5e-8), the notebook TPUs",
    )
    p.add_argument(
        "--max-batch", action="store_true", help="with --tpu: find the largest per-core batch that fits each target"
    )
    p.add_argument(
        "--max-batch-limit",
        type=int,
        metavar="N",
        help="with --max-batch: search up to N examples per core (default 65536)",
    )
    p.add_argument(
        "--config",
        metavar="YAML",
        help="a recipe: a YAML preset instead of its own; a file: YAML with mesh:, trainer: and data: (its batch) "
        "sections (both as `xlafit plan --write` writes them)",
    )
    add_calibration(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # The library when the command runs: a fast --help.
    from xlafit.check import check_file, check_recipe, to_json

    apply_calibration(args.calibration)
    if args.tpu is not None:
        from xlafit.platform.hardware import parse_targets

        parse_targets(args.tpu)  # --tpu "" names none: refused, not a check on the CPU
    if args.max_batch and not args.tpu:
        raise ConfigError("--max-batch searches per TPU target: add --tpu, e.g. --tpu v3-8 --max-batch.")
    if args.max_batch_limit is not None and (args.max_batch_limit < 1 or not args.max_batch):
        raise ConfigError(
            f"--max-batch-limit {args.max_batch_limit}: give a positive per-core batch, with --max-batch."
        )
    options = {
        "per_device_batch": args.per_device_batch,
        "global_batch": args.global_batch,
        "devices": args.devices,
        "max_shapes": args.max_shapes,
        "tpu": args.tpu,
        "max_batch": args.max_batch_limit or args.max_batch,
        "preset": args.config,
    }
    from xlafit.recipes.registry import RECIPES

    # A file by its name, its folder, or its being there and no recipe's name (a data file is refused as such)
    there = os.path.isfile(args.target) and args.target not in RECIPES
    if args.target.endswith(".py") or os.path.sep in args.target or there:
        report = check_file(args.target, args.overrides, **options)
    else:
        report = check_recipe(args.target, args.overrides, **options)
    print(to_json(report) if args.json else report.format())
    return 0 if report.ok else 1
