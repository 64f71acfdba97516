"""``xlafit``'s entry point: the parser of every command, ``main``, and the log's format."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from xlafit.cli import (
    bench,
    check,
    config_cmd,
    data,
    devices,
    export,
    generate,
    inspect,
    launch,
    plan,
    tokenizer,
    train,
)
from xlafit.errors import INTERRUPTED, Preempted, XlafitError
from xlafit.parallel.env import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

# The commands, in the order `xlafit --help` lists them.
COMMANDS = (devices, train, launch, bench, inspect, tokenizer, data, export, generate, check, plan, config_cmd)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every command's parser, each with its ``run`` as a default."""
    parser = argparse.ArgumentParser(
        prog="xlafit",
        description="Data-parallel training on every XLA device: TPU cores, GPUs, CPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["launch"]:
        # Everything after "--" belongs to the launched command, options included.
        args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
        if "--" in argv:
            args.command = argv[argv.index("--") + 1 :]
        return args
    # Overrides may come before or after options (`train mnist --simulate 8 trainer.epochs=3`);
    # argparse's subparsers stop collecting positionals at the first option, so gather the rest.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        own = commands.get(getattr(args, "command", ""), parser)
        own.error(f"unrecognized arguments: {' '.join(unknown)}{_hint(unknown, args.command, commands)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _hint(unknown: list[str], command: str, commands: dict[str, argparse.ArgumentParser]) -> str:
    """Where a misplaced flag belongs: the commands that take it, or the override it spells."""
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        takers = [name for name, p in commands.items() if flag in p._option_string_actions]
        if takers:
            return f" ({flag} is a flag of {' and '.join(f'xlafit {t}' for t in takers)}, not of xlafit {command})"
        if arg.startswith("--") and "." in flag and "=" in arg:
            return f" (config overrides take no dashes: {arg[2:]})"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, list(sys.argv[1:] if argv is None else argv))
    # The job flags travel as the environment variables that xlafit.connect() reads.
    for flag, env in (
        ("coordinator", COORDINATOR_ENV),
        ("num_processes", NUM_PROCESSES_ENV),
        ("process_id", PROCESS_ID_ENV),
    ):
        if getattr(args, flag, None) is not None:
            os.environ[env] = str(getattr(args, flag))
    configure_logging(verbose=getattr(args, "verbose", False))
    try:
        return int(args.run(args))
    except Preempted as e:
        print(f"xlafit: {e}", file=sys.stderr)
        return e.exit_code
    except XlafitError as e:
        print(f"xlafit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("xlafit: interrupted", file=sys.stderr)
        return INTERRUPTED


def configure_logging(verbose: bool) -> None:
    """xlafit's messages at WARNING (INFO with ``--verbose``), libraries' at WARNING.

    gcsfs logs every exception it gives up on with its traceback (``_request out of retries``,
    ``non-retriable exception``) and then raises it; xlafit names that same error with the
    fix (:func:`xlafit.io.paths.describe_error`), so those tracebacks are dropped unless verbose.
    So are its warnings that it could not tell a bucket's type (hierarchical or not) and falls
    back to the plain client: the fallback works, and a bucket that cannot be read is named by
    xlafit with its reason.
    """
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # Orbax and absl are chatty at INFO; keep xlafit's own messages only.
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)
    gcsfs = logging.getLogger("gcsfs")
    gcsfs.removeFilter(_raised_again)
    if not verbose:
        gcsfs.addFilter(_raised_again)


_FALLBACKS = ("Could not determine bucket type", "storage layout api used to detect bucket type")


def _raised_again(record: logging.LogRecord) -> bool:
    if record.exc_info is not None:
        return False
    message = record.getMessage()
    return not any(fallback in message for fallback in _FALLBACKS)
