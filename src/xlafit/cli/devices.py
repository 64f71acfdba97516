"""``xlafit devices``: the platform, processes, devices and the training mesh."""

from __future__ import annotations

import argparse
import re

from xlafit.cli.common import add_simulate
from xlafit.errors import ConfigError, DeviceError


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
    try:
        strategy = connect(args.simulate, mesh=sizes)
    except DeviceError as e:
        raise DeviceError(_in_flags(str(e))) from None
    print(strategy.describe())
    return 0


def _in_flags(message: str) -> str:
    """A mesh refusal in this command's words: ``--mesh -1,2,2``, not ``mesh.data=-1 ...``.

    Example:
        >>> _in_flags("mesh.data x mesh.fsdp x mesh.tensor must equal 8. For example mesh.data=-1 mesh.fsdp=2 "
        ...           "mesh.tensor=2 (sizes ...)")
        'DATA x FSDP x TENSOR of --mesh must equal 8. For example --mesh -1,2,2 (sizes ...)'
    """
    message = re.sub(r"mesh\.data=(-?\d+) mesh\.fsdp=(-?\d+) mesh\.tensor=(-?\d+)", r"--mesh \1,\2,\3", message)
    return message.replace("mesh.data x mesh.fsdp x mesh.tensor", "DATA x FSDP x TENSOR of --mesh")
