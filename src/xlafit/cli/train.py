"""``xlafit train RECIPE|FILE.py [key=value ...]``: flags become dotted overrides, then the run."""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

from xlafit.cli.common import add_simulate
from xlafit.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a recipe, or the model of your own Python file",
        description="Train a recipe, or the model a Python file defines. Overrides are dotted key=value pairs, "
        "e.g. trainer.epochs=3 data.per_device_batch=32; `xlafit config RECIPE` shows every key of a recipe. "
        "FILE.py defines model, loss_fn(model, batch), batch, dataset and optimizer (an optax transformation), "
        "optionally eval_dataset, config (TrainerConfig), mesh (MeshConfig) and global_batch or "
        "per_device_batch (docs/guides/own-model.md); it takes trainer.*, mesh.*, cpu.*, data.global_batch and "
        "data.per_device_batch overrides.",
    )
    p.add_argument(
        "recipe",
        metavar="RECIPE|FILE.py",
        help="a recipe's name (mnist, bert, resnet, llm) or the path of a Python file that defines your model",
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    add_simulate(p)
    p.add_argument("--run-dir", help="where config, metrics, TensorBoard logs and checkpoints go")
    p.add_argument(
        "--data-dir",
        help="the recipe's data (mnist: a directory of IDX files; bert: the output of `xlafit data mlm`; "
        "resnet: of `xlafit data images`; llm: text, JSON-lines or Parquet files, a directory or glob of them, "
        "gs:// or hf://datasets/ URLs)",
    )
    p.add_argument(
        "--config",
        help="a whole YAML config used instead of the recipe's preset: start from `xlafit config RECIPE`; for "
        "FILE.py, YAML with mesh:, trainer: and data: sections (what `xlafit plan FILE.py --write` writes)",
    )
    p.add_argument(
        "--checkpoint-dir", help="checkpoints here instead of RUN_DIR/checkpoints: a path or gs://bucket/dir"
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="start over: the earlier run (checkpoints, metrics) moves to RUN_DIR-before-restart-<time>",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log compiles and checkpoint events")
    p.set_defaults(run=run)


# Flags that stand for a config key: flag (argparse's name) -> key.
FLAG_KEYS = {
    "simulate": "run.simulate_devices",
    "run_dir": "run.run_dir",
    "data_dir": "data.data_dir",
    "checkpoint_dir": "run.checkpoint_dir",
    "restart": "run.resume",
}


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The command's flags as the dotted overrides they stand for, after the user's own.

    Raises:
        ConfigError: a flag and an override set the same key to different values.
    """
    from xlafit.overrides import parse_overrides  # the library when the command runs: a fast --help

    # Given: any value but None, "" and --restart's False (a 0 is given: --simulate 0 is refused, not ignored)
    values = {flag: getattr(args, flag) for flag in FLAG_KEYS}
    given = {flag: v for flag, v in values.items() if v is not None and v is not False and v != ""}
    flags = [f"{FLAG_KEYS[flag]}={'false' if flag == 'restart' else value}" for flag, value in given.items()]
    user, flagged = parse_overrides(args.overrides), parse_overrides(flags)
    for (flag, value), override in zip(given.items(), flags, strict=True):
        theirs = _lookup(user, FLAG_KEYS[flag])
        if theirs is not _ABSENT and not _same(theirs, _lookup(flagged, FLAG_KEYS[flag])):
            option = "--" + flag.replace("_", "-") + ("" if flag == "restart" else f" {value}")
            written = [o for o in args.overrides if o.partition("=")[0] == FLAG_KEYS[flag]]
            given_as = written[-1] if written else f"{FLAG_KEYS[flag]}={theirs}"  # else inside a section's value
            raise ConfigError(
                f"{option} ({override}) and the override {given_as} set {FLAG_KEYS[flag]} to different values; "
                "keep one of them."
            )
    return list(args.overrides) + flags


_ABSENT = object()


def _same(a: Any, b: Any) -> bool:
    """Whether two values of one key agree; paths as the same place (``runs/a`` is ``runs/a/``
    and ``./runs/a``; a URL up to its trailing ``/``)."""
    if isinstance(a, str) and isinstance(b, str):
        if "://" in a or "://" in b:
            return a.rstrip("/") == b.rstrip("/")
        return os.path.normpath(os.path.expanduser(a)) == os.path.normpath(os.path.expanduser(b))
    return bool(a == b)


def _lookup(nested: dict[str, Any], key: str) -> Any:
    """The value of dotted ``key`` in ``nested`` (parsed overrides), or ``_ABSENT``."""
    node: Any = nested
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def run(args: argparse.Namespace) -> int:
    # The library when the command runs: `xlafit --help` stays fast.
    if args.recipe.endswith(".py"):  # a user's file: its model, loss, data and optimizer
        from xlafit.run_file import train_file

        if args.data_dir:
            raise ConfigError(
                f"--data-dir {args.data_dir}: the data directory of a recipe; {args.recipe} defines its own dataset."
            )
        train_file(args.recipe, overrides_of(args), preset=args.config)
    else:
        from xlafit.recipes import load_config
        from xlafit.run import train_and_evaluate

        train_and_evaluate(load_config(args.recipe, overrides_of(args), preset=args.config))
    # A SIGTERM from here on finds the work done: exit 0 rather than die by the signal.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0
