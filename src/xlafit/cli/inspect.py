"""``xlafit inspect RUN_DIR``: a run's checkpoints (intact or not) and its parameters' fingerprint."""

from __future__ import annotations

import argparse
import json
from typing import Any

from xlafit import errors
from xlafit.errors import CheckpointError, ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="list a run's checkpoints (intact or not) and fingerprint its parameters",
        description="Lists the checkpoints of RUN_DIR with step, time, size and integrity, and prints the "
        "SHA-256 fingerprint of the newest intact checkpoint's parameters (or --step S's).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run or checkpoint directory, local or a URL (gs://...)")
    p.add_argument("--step", type=int, help="fingerprint this checkpoint instead of the newest intact one")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # The library when the command runs (a fast --help); the backends start as connect() starts
    # them, without libtpu's start-up errors on a host that has libtpu but no TPU.
    from xlafit.checkpoint import Checkpointer, fingerprint
    from xlafit.parallel.cluster import start_backends
    from xlafit.run import checkpoints_of

    start_backends()
    directory = str(checkpoints_of(args.run_dir))  # a run or checkpoint directory, local or gs://
    ckpt = Checkpointer(directory)
    infos = ckpt.list()
    if not infos:
        ckpt.close()
        raise CheckpointError(
            f"{args.run_dir} holds no checkpoint: give a run directory (what `xlafit train --run-dir` writes) "
            "or its checkpoints/ folder."
        )
    usable = [i.step for i in infos if i.usable]
    step = args.step if args.step is not None else (usable[-1] if usable else None)
    if args.step is not None and args.step not in [i.step for i in infos]:
        raise ConfigError(f"no checkpoint {args.step} in {directory}; there are: {[i.step for i in infos]}.")
    digest = fingerprint(ckpt.restore_params(step)) if step is not None else None
    ckpt.close()
    # A scheduler or script acts on the exit code: a corrupt newest checkpoint means the next
    # resume loses the steps since the one before it.
    newest_corrupt = not infos[-1].usable
    code = errors.DAMAGED if step is None or newest_corrupt else 0
    if args.json:
        rows = [_row(i) for i in infos]
        print(json.dumps({"checkpoints": rows, "fingerprint": {"step": step, "sha256": digest}}, indent=2))
        return code
    _print_table(infos, step, digest, newest_corrupt)
    return code


def _row(i: Any) -> dict[str, Any]:
    return {
        "step": i.step,
        "time": i.time.isoformat(),
        "time_source": i.time_source,
        "size_bytes": i.size_bytes,
        "status": i.status,
    }


def _print_table(infos: list[Any], step: int | None, digest: str | None, newest_corrupt: bool) -> None:
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
    if newest_corrupt:
        print(
            f"checkpoint {infos[-1].step}, the newest, is corrupt: resuming sets it aside and continues from "
            f"checkpoint {[i.step for i in infos if i.usable][-1]}, losing the steps in between."
        )
