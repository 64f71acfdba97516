"""``xlafit``'s entry point: the parser of every command, ``main``, and the log's format."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence

from xlafit import __version__
from xlafit.cli import (
    bench,
    check,
    config_cmd,
    data,
    devices,
    evaluate,
    export,
    generate,
    inspect,
    launch,
    plan,
    tokenizer,
    train,
)
from xlafit.errors import INTERRUPTED, Preempted, XlafitError
from xlafit.logs import OwnWordsFormatter
from xlafit.parallel.env import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

# The commands, in the order `xlafit --help` lists them.
COMMANDS = (
    devices,
    train,
    evaluate,
    launch,
    bench,
    inspect,
    tokenizer,
    data,
    export,
    generate,
    check,
    plan,
    config_cmd,
)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every command's parser, each with its ``run`` as a default."""
    parser = argparse.ArgumentParser(
        prog="xlafit",
        description="Data-parallel training on every XLA device: TPU cores, GPUs, CPUs.",
    )
    parser.add_argument("--version", action="version", version=f"xlafit {__version__}")
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
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    _refuse_a_commands_option_first(parser, argv, commands)
    # Overrides may come before or after options (`train mnist --simulate 8 trainer.epochs=3`);
    # argparse's subparsers stop collecting positionals at the first option, so gather the rest.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        own = commands.get(getattr(args, "command", ""), parser)
        hint = _hint(unknown, args.command, commands, extra if hasattr(args, "overrides") else None)
        own.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    _warn_repeated(getattr(args, "overrides", None) or [])
    return args


def _refuse_a_commands_option_first(
    parser: argparse.ArgumentParser, argv: list[str], commands: dict[str, argparse.ArgumentParser]
) -> None:
    """A command's option given before the command (``xlafit --simulate 8 train mnist``), which
    argparse would answer with its value as an invalid command ("invalid choice: '8'"): named,
    with the commands that take it and where it goes."""
    first = argv[0].partition("=")[0] if argv else ""
    if not first.startswith("-") or first in ("-h", "--help", "--version"):
        return
    takers = [name for name, p in commands.items() if first in p._option_string_actions]
    if takers:
        example = "train mnist" if "train" in takers else takers[0]
        takes_value = commands[takers[0]]._option_string_actions[first].nargs != 0 and "=" not in argv[0]
        given = " ".join(argv[:2] if takes_value and len(argv) > 1 else argv[:1])
        parser.error(
            f"{first} is an option of a command ({', '.join(takers)}): give it after the command, as in "
            f"`xlafit {example} {given}`."
        )


def _warn_repeated(overrides: list[str]) -> None:
    """Names a key given more than once on the command line (the last value wins)."""
    given: dict[str, list[str]] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep:
            given.setdefault(key, []).append(value)
    for key, values in given.items():
        if len(values) > 1:
            print(
                f"warning: {key} given {len(values)} times ({', '.join(values)}): the last, {key}={values[-1]}, "
                "is used",
                file=sys.stderr,
            )


def _hint(
    unknown: list[str], command: str, commands: dict[str, argparse.ArgumentParser], extra: list[str] | None = None
) -> str:
    """Where a misplaced flag belongs: the commands that take it, or the override it spells;
    ``extra``: the words left over, where ``command`` takes config overrides (``check llm
    --data-dir D`` is ``data.data_dir=D`` there)."""
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        takers = [name for name, p in commands.items() if flag in p._option_string_actions]
        if takers:
            where = f"{flag} is a flag of {' and '.join(f'xlafit {t}' for t in takers)}, not of xlafit {command}"
            action = commands["train"]._option_string_actions.get(flag)
            key = train.FLAG_KEYS.get(action.dest) if action is not None else None
            if extra is not None and key == "data.data_dir":  # the data a check or plan reads too
                follows = extra[extra.index(arg) + 1 : extra.index(arg) + 2]
                value = arg.split("=", 1)[1] if "=" in arg else (follows[0] if follows else "...")
                return f" ({where}: give the key it stands for, {key}={value})"
            return f" ({where})"
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
        sys.stdout.flush()  # what the command printed comes before its end, also into a file or a pipe
        print(f"xlafit: {e}", file=sys.stderr)
        return e.exit_code
    except XlafitError as e:
        sys.stdout.flush()
        print(f"xlafit: error: {e}", file=sys.stderr)
        if argv is None:  # the process's own command (the `xlafit` program), not a caller's
            _exit_past_stuck_threads(e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        print("xlafit: interrupted", file=sys.stderr)
        return INTERRUPTED


_GRACE_S = 2.0  # how long a failed command's leftover threads get to finish on their own


def _exit_past_stuck_threads(code: int) -> None:
    """Ends the process now when threads that never finish would hold up its exit.

    A checkpoint whose directory cannot be created (no permission) leaves Orbax's writer
    threads, which are not daemons, waiting for the signal that the directory exists: it never
    comes, and they give up only after Orbax's coordination timeout (300 s). Python waits for
    such threads before it exits, so the command hung after printing its error. Orbax has no
    call that wakes them (its cancel marks them cancelled but leaves them waiting, and
    ``CheckpointManager.close`` joins only the thread that already failed), so a command that
    failed, its error printed, gives its threads a moment and then exits without them.
    """
    deadline = time.monotonic() + _GRACE_S
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            # Thread's own join: Orbax's threads override it to raise when the time runs out.
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.current_thread()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def configure_logging(verbose: bool) -> None:
    """xlafit's messages at WARNING (INFO with ``--verbose``), libraries' at WARNING.

    gcsfs logs every exception it gives up on with its traceback (``_request out of retries``,
    ``non-retriable exception``) and then raises it; xlafit names that same error with the
    fix (:func:`xlafit.io.paths.describe_error`), so those tracebacks are dropped unless verbose.
    So are its warnings that it could not tell a bucket's type (hierarchical or not) and falls
    back to the plain client: the fallback works, and a bucket that cannot be read is named by
    xlafit with its reason.
    """
    handler = logging.StreamHandler()
    handler.setFormatter(OwnWordsFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])
    # Orbax and absl are chatty at INFO; keep xlafit's own messages only.
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Orbax logs a failed background save with its traceback from each of its threads (through
    # absl), then raises the error in the main thread, where xlafit names it with the fix.
    for name in ("gcsfs", "absl"):
        logger = logging.getLogger(name)
        logger.removeFilter(_raised_again)
        if not verbose:
            logger.addFilter(_raised_again)


_FALLBACKS = ("Could not determine bucket type", "storage layout api used to detect bucket type")


def _raised_again(record: logging.LogRecord) -> bool:
    if record.exc_info is not None:
        return False
    message = record.getMessage()
    return not any(fallback in message for fallback in _FALLBACKS)
