"""``xlafit config RECIPE [--config YAML] [key=value ...]``: the resolved config as YAML."""

from __future__ import annotations

import argparse

import yaml


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print a recipe's resolved config")
    p.add_argument("recipe", help="recipe name: mnist, bert, resnet, llm")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument(
        "--config",
        metavar="YAML",
        help="a whole YAML config instead of the recipe's preset, as `xlafit train --config` takes it: "
        "prints what that train would use",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from xlafit.recipes import load_config  # the library when the command runs: a fast --help

    cfg = load_config(args.recipe, args.overrides, preset=args.config)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0
