"""The ``xlafit`` command: parses arguments and calls the library, nothing else."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import yaml

from xlafit.config import ConfigError
from xlafit.data.mnist import DataError
from xlafit.devices import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV, SIMULATE_ENV, DeviceError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xlafit",
        description="Data-parallel training on every XLA device: TPU cores, GPUs, CPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add_simulate(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--simulate",
            type=int,
            metavar="N",
            help=f"use N simulated CPU devices (rehearse an N-core TPU); also ${SIMULATE_ENV}",
        )
        job = p.add_argument_group("multi-process job (docs/multihost.md); default: from the environment")
        job.add_argument("--coordinator", metavar="HOST:PORT", help=f"process 0's address; also ${COORDINATOR_ENV}")
        job.add_argument("--num-processes", type=int, metavar="P", help=f"also ${NUM_PROCESSES_ENV}")
        job.add_argument("--process-id", type=int, metavar="I", help=f"this process, 0..P-1; also ${PROCESS_ID_ENV}")

    devices = sub.add_parser("devices", help="show the platform, processes, devices and the training mesh")
    add_simulate(devices)

    train = sub.add_parser(
        "train",
        help="train a recipe",
        description="Train a recipe. Overrides are dotted key=value pairs, e.g. trainer.epochs=3 "
        "data.per_device_batch=32. `xlafit config RECIPE` shows every key.",
    )
    train.add_argument("recipe", help="recipe name: mnist")
    train.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    add_simulate(train)
    train.add_argument("--run-dir", help="where config, metrics, TensorBoard logs and checkpoints go")
    train.add_argument("--data-dir", help="directory of the recipe's data files (mnist: the IDX files)")
    train.add_argument("--config", help="a YAML preset to use instead of the recipe's own")
    train.add_argument("--restart", action="store_true", help="ignore and remove checkpoints in --run-dir")
    train.add_argument("-v", "--verbose", action="store_true", help="log compiles and checkpoint events")

    launch = sub.add_parser(
        "launch",
        help="run a command as a P-process job on this machine (rehearse a pod slice)",
        description="Start P processes of COMMAND that join one JAX job, each with D simulated CPU "
        "devices: xlafit launch --processes 2 --devices-per-process 4 -- xlafit train mnist",
    )
    launch.add_argument("--processes", type=int, default=2, metavar="P")
    launch.add_argument("--devices-per-process", type=int, default=4, metavar="D")
    launch.add_argument("--log-dir", default="launch-logs", help="where processes 1..P-1 write their output")
    launch.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each process runs")

    config = sub.add_parser("config", help="print a recipe's resolved config")
    config.add_argument("recipe")
    config.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return parser


def _train(args: argparse.Namespace) -> int:
    from xlafit.recipes import load_config, train

    overrides = list(args.overrides)
    if args.simulate is not None:
        overrides.append(f"run.simulate_devices={args.simulate}")
    if args.run_dir:
        overrides.append(f"run.run_dir={args.run_dir}")
    if args.data_dir:
        overrides.append(f"data.data_dir={args.data_dir}")
    if args.restart:
        overrides.append("run.resume=false")
    cfg = load_config(args.recipe, overrides, preset=args.config)
    train(cfg)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        # Everything after "--" belongs to the launched command, options included.
        args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
        command = argv[argv.index("--") + 1 :] if "--" in argv else args.command
        from xlafit.launch import launch

        return launch(command, args.processes, args.devices_per_process, args.log_dir)
    # Overrides may come before or after options (`train mnist --simulate 8 trainer.epochs=3`);
    # argparse's subparsers stop collecting positionals at the first option, so gather the rest.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    # The job flags travel as the environment variables that xlafit.connect() reads.
    for flag, env in (
        ("coordinator", COORDINATOR_ENV),
        ("num_processes", NUM_PROCESSES_ENV),
        ("process_id", PROCESS_ID_ENV),
    ):
        if getattr(args, flag, None) is not None:
            os.environ[env] = str(getattr(args, flag))
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # Orbax and absl are chatty at INFO; keep xlafit's own messages only.
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        if args.command == "devices":
            from xlafit.devices import connect

            print(connect(args.simulate).describe())
            return 0
        if args.command == "config":
            from xlafit.recipes import load_config

            print(yaml.safe_dump(load_config(args.recipe, args.overrides).to_dict(), sort_keys=False), end="")
            return 0
        return _train(args)
    except (ConfigError, DeviceError, DataError) as e:
        print(f"xlafit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("xlafit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
