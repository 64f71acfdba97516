"""``xlafit devices``: the platform, processes, devices and the training mesh."""

from __future__ import annotations

import argparse

from xlafit.cli.common import add_simulate
from xlafit.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="show the platform, processes, devices and the training mesh")
    add_simulate(p)
    p.add_argument(
        "--mesh",
        metavar="DATA,FSDP,TENSOR",
        default="-1,1,1",
        help="mesh sizes as the run's mesh.data, mesh.fsdp, mesh.tensor (one may be -1); default -1,1,1",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from xlafit.parallel.cluster import connect  # the library when the command runs: a fast --help

    try:
        sizes = tuple(int(v) for v in args.mesh.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) != 3:
        raise ConfigError(f"--mesh {args.mesh}: give three whole numbers DATA,FSDP,TENSOR, e.g. --mesh -1,4,2.")
    print(connect(args.simulate, mesh=sizes).describe())
    return 0
