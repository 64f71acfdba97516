"""``xlafit launch -- COMMAND``: a P-process job on this machine (rehearse a pod slice)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run a command as a P-process job on this machine (rehearse a pod slice)",
        description="Start P processes of COMMAND that join one JAX job, each with D simulated CPU "
        "devices: xlafit launch --processes 2 --devices-per-process 4 -- xlafit train mnist",
    )
    p.add_argument("--processes", type=int, default=2, metavar="P", help="processes in the job")
    p.add_argument("--devices-per-process", type=int, default=4, metavar="D", help="simulated CPU devices each")
    p.add_argument(
        "--log-dir",
        help="where processes 1..P-1 write their output (default: a new folder under $XLAFIT_CACHE/launch, "
        "else ~/.cache/xlafit/launch)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each process runs")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from xlafit.parallel.launch import launch  # the library when the command runs: a fast --help

    return launch(args.command, args.processes, args.devices_per_process, args.log_dir)
