"""Flags several commands share."""

from __future__ import annotations

import argparse

from xlafit.errors import ConfigError
from xlafit.parallel.env import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV, SIMULATE_ENV


def add_simulate(p: argparse.ArgumentParser) -> None:
    """``--simulate N`` and the flags of a multi-process job."""
    p.add_argument(
        "--simulate",
        type=int,
        metavar="N",
        help=f"use N simulated CPU devices (rehearse an N-core TPU); also ${SIMULATE_ENV}",
    )
    job = p.add_argument_group("multi-process job (docs/guides/multihost.md); default: from the environment")
    job.add_argument("--coordinator", metavar="HOST:PORT", help=f"process 0's address; also ${COORDINATOR_ENV}")
    job.add_argument("--num-processes", type=int, metavar="P", help=f"processes in the job; also ${NUM_PROCESSES_ENV}")
    job.add_argument("--process-id", type=int, metavar="I", help=f"this process, 0..P-1; also ${PROCESS_ID_ENV}")


def ints(flag: str, text: str) -> list[int]:
    """``"1,4"`` -> ``[1, 4]``; anything else is a one-line error naming ``flag``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected whole numbers separated by commas, e.g. 1,4.") from None


def add_calibration(p: argparse.ArgumentParser) -> None:
    """``--calibration FILE``: the step model's rates from a calibration file."""
    p.add_argument(
        "--calibration",
        metavar="FILE.json",
        help="the step model's rates from this calibration file (xlafit bench --calibrate writes one) for the "
        "device kind it names, instead of the built-in or cached ones; also $XLAFIT_CALIBRATION",
    )


def apply_calibration(path: str | None) -> None:
    """Checks a ``--calibration`` file and hands it to the step model (by its environment
    variable, read wherever a prediction is made)."""
    if not path:
        return
    import os

    from xlafit.predict.rates import CALIBRATION_ENV, load_rates

    try:
        load_rates(path)
    except OSError as e:
        raise ConfigError(
            f"--calibration {path}: {e.strerror or e}; give a file xlafit bench --calibrate wrote."
        ) from None
    except ValueError as e:
        raise ConfigError(f"--calibration {path}: {e}") from None
    os.environ[CALIBRATION_ENV] = os.path.abspath(path)
