"""``xlafit launch``: a real P-process job on this machine, the rehearsal of a pod slice.

Each process gets ``XLAFIT_COORDINATOR`` (process 0's address), ``XLAFIT_NUM_PROCESSES``,
``XLAFIT_PROCESS_ID`` and ``XLAFIT_SIMULATE_DEVICES``; :func:`xlafit.connect` reads them and
joins the job through ``jax.distributed`` with gloo collectives between the CPU devices.
Process 0 writes to this terminal, the others to ``LOG_DIR/process-I.log``; by default
``LOG_DIR`` is a new folder of the user cache (:func:`default_log_dir`), not the working
directory, so that a launch from a clone leaves its tree clean.

When a process fails, a collective in the others would wait for it until JAX's heartbeat
timeout; the launcher does not wait: it stops the rest at once, names the dead process, and
exits with its exit code.
"""

from __future__ import annotations

import datetime
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from xlafit import errors
from xlafit.io.cache import cache_dir
from xlafit.parallel.env import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV, SIMULATE_ENV

GRACE_S = 10.0  # after a process failed: SIGTERM to the others, SIGKILL after this
SIGNAL_GRACE_S = 30.0  # after SIGTERM/Ctrl-C: time for every process to save a checkpoint


def free_port() -> int:
    """A free port whose successor is free too (the coordinator and xlafit's handshake)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def default_log_dir() -> Path:
    """``<cache>/launch/<UTC time>-<pid>``: one new folder per launch (see :func:`xlafit.io.cache.cache_dir`)."""
    return cache_dir() / "launch" / f"{datetime.datetime.now(datetime.UTC):%Y%m%d-%H%M%S}-{os.getpid()}"


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _watch(procs: Sequence[subprocess.Popen], deadline: list[float], log_dir: Path) -> int:
    """Polls every process until all have exited; returns the job's exit code."""
    while [p.poll() for p in procs].count(None):  # poll every process, not only up to the first alive
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0, errors.PREEMPTED)]
        if failed:
            i, code = failed[0]
            alive = sum(p.poll() is None for p in procs)
            print(
                f"xlafit launch: process {i} {_describe(code)}; stopping the other {alive} process(es). "
                f"Its output: {'above' if i == 0 else log_dir / f'process-{i}.log'}",
                file=sys.stderr,
                flush=True,
            )
            _stop(procs)
            return code
        if deadline and time.monotonic() > deadline[0]:
            print(
                f"xlafit launch: processes still running {SIGNAL_GRACE_S:.0f}s after the signal; killing them",
                file=sys.stderr,
            )
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        i, code = failed[0]
        print(f"xlafit launch: process {i} {_describe(code)}", file=sys.stderr)
        return code
    return 0


def max_processes() -> int:
    """The most processes a launch starts here: 4 per CPU core, at least 8.

    Each process is a whole JAX runtime (seconds of start-up, hundreds of MB of memory, its
    own compile): a launch rehearses a pod slice's few hosts on one machine, and hundreds of
    them would only bury the machine's cores.
    """
    return max(8, 4 * (os.cpu_count() or 1))


def _refusal(command: Sequence[str], processes: int, devices_per_process: int) -> str | None:
    """Why the launch cannot start as asked (the fix included), or None."""
    if processes < 1 or devices_per_process < 1:
        return "--processes and --devices-per-process must be at least 1"
    if processes > max_processes():
        return (
            f"--processes {processes} is more than this machine can run as a rehearsal of a pod slice "
            f"(at most {max_processes()}: 4 per CPU core, {os.cpu_count()} core(s), each process a whole JAX "
            f"runtime); give --processes {max_processes()} or fewer, and more --devices-per-process for more devices"
        )
    if not command:
        return "give the command after --, e.g. xlafit launch -- xlafit train mnist"
    simulate = [" ".join(command[i : i + 2]) for i, a in enumerate(command) if a.split("=")[0] == "--simulate"]
    if simulate:
        return (
            f"the command carries {simulate[0]}, but --devices-per-process already sets each process's devices "
            f"({devices_per_process} here; {simulate[0]} would replace them in every process, a job of other "
            "devices than asked); drop it from the command and give the count as --devices-per-process"
        )
    return None


def _make_log_dir(log_dir: Path) -> str | None:
    """Creates ``log_dir``; what stands in the way (the fix included), or None."""
    if log_dir.exists() and not log_dir.is_dir():
        return f"--log-dir {log_dir} is a file, not a folder; give a folder (it is created if missing)"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create --log-dir {log_dir} ({e.strerror or e}); give a folder this user can write"
    return None


def launch(command: Sequence[str], processes: int, devices_per_process: int, log_dir: str | Path | None = None) -> int:
    """Runs ``command`` as ``processes`` cooperating processes; returns the job's exit code.

    Processes 1..P-1 write to ``log_dir/process-I.log``; default: :func:`default_log_dir`.

    Example:
        >>> launch(["xlafit", "train", "mnist"], processes=2, devices_per_process=4)  # doctest: +SKIP
    """
    log_dir = Path(log_dir) if log_dir is not None else default_log_dir()
    refusal = _refusal(command, processes, devices_per_process) or (processes > 1 and _make_log_dir(log_dir))
    if refusal:
        print(f"xlafit launch: {refusal}", file=sys.stderr)
        return 2
    if processes > 1:
        others = "process 1" if processes == 2 else f"processes 1-{processes - 1}"
        print(f"xlafit launch: the output of {others} goes to {log_dir} (--log-dir)", file=sys.stderr)
    address = f"127.0.0.1:{free_port()}"
    print(  # what a pod slice's workers run, each with its own id: how to start them by hand
        f"xlafit launch: each process runs {shlex.join(command)} with {COORDINATOR_ENV}={address} "
        f"{NUM_PROCESSES_ENV}={processes} {PROCESS_ID_ENV}=<0..{processes - 1}> {SIMULATE_ENV}={devices_per_process}",
        file=sys.stderr,
    )
    procs: list[subprocess.Popen] = []
    logs = []
    for i in range(processes):
        env = {
            **os.environ,
            COORDINATOR_ENV: address,
            NUM_PROCESSES_ENV: str(processes),
            PROCESS_ID_ENV: str(i),
            SIMULATE_ENV: str(devices_per_process),
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("XLA_FLAGS", None)  # each process makes its own devices
        if i == 0:
            out = None
        else:
            log = open(log_dir / f"process-{i}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            out = log
        try:
            procs.append(
                subprocess.Popen(list(command), env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
            )
        except FileNotFoundError:
            print(f"xlafit launch: command not found: {command[0]}", file=sys.stderr)
            _stop(procs)
            return 127
        where = "this terminal" if i == 0 else log_dir / f"process-{i}.log"
        print(f"xlafit launch: process {i} (pid {procs[-1].pid}) -> {where}", file=sys.stderr, flush=True)

    # SIGTERM (or Ctrl-C, which the processes receive too) asks every process to save a
    # checkpoint and exit with errors.PREEMPTED; they agree on the step among themselves. The
    # launcher only forwards the signal once, then waits up to SIGNAL_GRACE_S before SIGKILL: a
    # second signal would make them exit at once, mid-save.
    deadline: list[float] = []

    def forward(*_: object) -> None:
        if not deadline:
            deadline.append(time.monotonic() + SIGNAL_GRACE_S)
            for p in procs:
                if p.poll() is None:
                    p.terminate()

    previous = signal.signal(signal.SIGTERM, forward)
    code = 0
    try:
        while True:
            try:
                code = _watch(procs, deadline, log_dir)
                break
            except KeyboardInterrupt:
                if not deadline:
                    deadline.append(time.monotonic() + SIGNAL_GRACE_S)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for log in logs:
            log.close()
    return 128 - code if code < 0 else code
