"""``xlafit inspect RUN_DIR``: a run's checkpoints (intact or not) and its parameters' fingerprint."""

from __future__ import annotations

import argparse
import json
from typing import Any

from xlafit import errors
from xlafit.errors import CheckpointError, ConfigError, NoIntactCheckpoint


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="list a run's checkpoints (intact or not) and fingerprint its parameters",
        description="Lists the checkpoints of RUN_DIR with step, time, size and integrity, and prints the "
        "SHA-256 fingerprint of the newest intact checkpoint's parameters (or --step S's).",
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a run or checkpoint directory, or one checkpoint's folder (as --step), local or a URL (gs://...)",
    )
    p.add_argument("--step", type=int, help="fingerprint this checkpoint instead of the newest intact one")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # The library when the command runs (a fast --help); the backends start as connect() starts
    # them, without libtpu's start-up errors on a host that has libtpu but no TPU.
    from xlafit.checkpoint import Checkpointer, fingerprint, set_aside, unfinished_saves
    from xlafit.checkpoint_read import read_checkpoint
    from xlafit.parallel.cluster import start_backends
    from xlafit.rundir import checkpoints_of

    start_backends()
    where, folder_step = checkpoints_of(args.run_dir)  # a run or checkpoint directory, local or gs://
    if folder_step is not None:  # one checkpoint's folder: that checkpoint, in its directory
        if args.step not in (None, folder_step):
            raise ConfigError(
                f"{args.run_dir} is checkpoint {folder_step}'s folder, and --step {args.step} asks for another: give "
                f"{where} (or the run directory) with --step {args.step}."
            )
        args.step = folder_step
    directory = str(where)
    ckpt = Checkpointer(directory)  # the run may be training meanwhile
    try:
        infos = ckpt.list()
        unfinished = unfinished_saves(where)
        if not infos:
            aside = set_aside(sorted(p.name for p in where.iterdir())) if where.is_dir() else []
            if aside:  # none is intact: the exit code of a damaged run, not of a wrong path
                raise NoIntactCheckpoint(
                    f"{args.run_dir} holds no checkpoint, only ones a resume set aside as corrupt "
                    f"({', '.join(aside)}); nothing there can be read."
                )
            raise CheckpointError(
                f"{args.run_dir} holds no checkpoint: give a run directory (what `xlafit train --run-dir` writes) "
                "or its checkpoints/ folder."
            )
        # --step must read, as export and generate require; by default the newest that reads
        wanted = args.step is not None or any(i.usable for i in infos)
        unreadable = None
        try:
            read = read_checkpoint(ckpt, args.step, infos) if wanted else None
        except CheckpointError as e:
            if args.step is not None:
                raise
            read, unreadable = None, e  # none of them reads: none is intact, shown in the table
    finally:
        ckpt.close()
    step = read.step if read else None
    digest = fingerprint(read.arrays["params"]) if read else None
    # A scheduler or script acts on the exit code: a corrupt (or unreadable) newest checkpoint
    # means the next resume loses the steps since the one before it.
    newest_bad = not infos[-1].usable or (args.step is None and step != infos[-1].step)
    code = errors.DAMAGED if step is None or newest_bad else 0
    if args.json:
        rows = [_row(i) for i in infos]
        fingerprinted = {"step": step, "sha256": digest}
        print(json.dumps({"checkpoints": rows, "unfinished": unfinished, "fingerprint": fingerprinted}, indent=2))
        return code
    _print_table(infos, step, digest)
    for s in unfinished:
        print(
            f"step {s}: a save that has not finished (being written, or its process stopped while writing it: the "
            "next run discards it)"
        )
    if unreadable is not None:
        print(unreadable)
    if read is not None and newest_bad:
        usable = [i.step for i in infos if i.usable]
        resumes_from = step if args.step is None else usable[-1]
        newest = infos[-1]
        why = "is corrupt" if not newest.usable else "cannot be read"
        for passed, what in read.passed_over:  # unreadable ones, which the table shows unsealed
            if passed in usable:
                print(f"checkpoint {passed} is {what}")
        print(
            f"checkpoint {newest.step}, the newest, {why}: resuming sets it aside and continues from checkpoint "
            f"{resumes_from}, losing the steps in between."
        )
    return code


def _row(i: Any) -> dict[str, Any]:
    return {
        "step": i.step,
        "time": i.time.isoformat(),
        "time_source": i.time_source,
        "size_bytes": i.size_bytes,
        "status": i.status,
    }


def _print_table(infos: list[Any], step: int | None, digest: str | None) -> None:
    print(f"{'step':>8}  {'written (UTC)':<21}  {'size':>10}  status")
    for i in infos:
        mark = "  " if i.time_source == "commit" else " *"
        print(f"{i.step:>8}  {i.time:%Y-%m-%d %H:%M:%S}{mark}  {i.size_bytes / 2**20:>7.2f} MiB  {i.status}")
    if any(i.time_source != "commit" for i in infos):
        print("       * no commit time recorded in the checkpoint: the files' last modification time")
    if step is None:
        print("no intact checkpoint")
        return
    print(f"parameters at step {step}: sha256 {digest}")
