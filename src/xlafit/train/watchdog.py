"""A hang watchdog: a multi-process job whose step stops advancing exits with 75.

A process whose peer is alive but stuck (a deadlock, a wedged device, a collective that one
process never joins: jax-ml/jax#38503) waits in its own collective forever. JAX's heartbeat
only notices peers that died, so such a job burns its reservation until a person looks.

:class:`Watchdog` is a daemon thread that the training loop beats after every call of the
train step. When no call finishes for ``max(floor_s, factor x the median call time)`` it
writes the Python stacks of every thread of the process (:mod:`faulthandler`) to stderr and
to the process's log files, then ends the process with :data:`xlafit.errors.PREEMPTED`
(75), so that a scheduler or a restart loop runs the job again from its last checkpoint.
Every process has its own watchdog: the stuck one and the ones waiting for it all fire,
each after its own limit, and each log shows where its process was. The limit is when the
process is gone: the hang is declared a little earlier (the exit grace and one poll, see
:meth:`Watchdog._reserve_s`), so that the stacks are written and the peers have declared
it too before anyone leaves.

It exits with ``os._exit``: a thread stuck in a collective cannot be interrupted, and
nothing that could wait on it (``atexit`` hooks, a checkpoint in flight, JAX's shutdown
barrier) may run. The checkpoint in flight is left partial; the next run skips it. It is a
Python thread, so it needs the GIL, which JAX releases while it waits for devices and
collectives (a C extension stuck while holding the GIL would silence it).

Not timed: everything before the first beat (the first call compiles), and whatever runs
inside :meth:`Watchdog.paused` (evaluations). A later compile of a new shape or a
checkpoint save counts; the floor must exceed them.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

from xlafit import errors
from xlafit.config import TrainerConfig, validate_watchdog
from xlafit.parallel.mesh import Strategy

# Test hook, read once per watchdog: "P:S" makes process P sleep for good once step S is
# done, so that the tests can make one process of a real job stall (tests/test_watchdog.py).
STALL_ENV = "XLAFIT_TEST_STALL"
SAMPLES = 100  # the median is over the last this many call times


class Watchdog:
    """Ends the process when no call of the train step finishes in time.

    Args:
        factor: the limit is ``factor`` x the median time between two beats (0: off) ...
        floor_s: ... but never less than this many seconds.
        process_index: this process, for the messages (and the test hook).
        on_hang: called by the watchdog thread with the report instead of writing the
            stacks and exiting; for tests of this class.

    Example:
        >>> hangs = []
        >>> with Watchdog(factor=10, floor_s=0.2, on_hang=hangs.append) as watchdog:
        ...     watchdog.beat(step=1)  # the first call, compiled: the clock starts now
        ...     time.sleep(0.6)        # the next call never finishes
        >>> hangs[0].startswith("no call of the train step finished for"), "after step 1;" in hangs[0]
        (True, True)
    """

    def __init__(
        self,
        factor: float,
        floor_s: float,
        *,
        process_index: int = 0,
        on_hang: Callable[[str], object] | None = None,
    ) -> None:
        self.factor, self.floor_s, self.process_index = factor, floor_s, process_index
        self._exits = on_hang is None  # the default: stacks, a grace, then exit by the limit
        self._on_hang = on_hang or self._dump_stacks_and_exit
        self._intervals: collections.deque[float] = collections.deque(maxlen=SAMPLES)
        self._last: float | None = None  # monotonic time of the last beat; None: not armed
        self._step = 0
        self._paused = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="xlafit-watchdog", daemon=True)
        self._stall = _stall_hook(process_index)

    def __enter__(self) -> Watchdog:
        if self.factor > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # After a hang was declared, a collective may fail in the main thread (a peer left)
        # and bring it here: the join waits for the watchdog's exit with 75.
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def limit(self) -> float:
        """Seconds without a beat that count as a hang, from the call times so far."""
        with self._lock:
            median = statistics.median(self._intervals) if self._intervals else 0.0
        return max(self.floor_s, self.factor * median)

    def beat(self, step: int) -> None:
        """A call of the train step finished at ``step``; the first beat starts the clock."""
        now = time.monotonic()
        with self._lock:
            if self._last is not None and not self._paused:
                self._intervals.append(now - self._last)
            self._last, self._step = now, step
        if self._stall is not None and step >= self._stall:
            print(f"xlafit: {STALL_ENV}: process {self.process_index} stalls after step {step}", flush=True)
            self._stall = None
            threading.Event().wait()  # for good: only the watchdog ends this process now

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work inside is not timed (an evaluation); the clock restarts after it."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if self._last is not None:
                    self._last = time.monotonic()

    def _overdue(self) -> float | None:
        """Seconds since the last beat when the hang must be declared now, else None."""
        declare_at = self.limit() - self._reserve_s()
        with self._lock:
            if self._last is None or self._paused:
                return None
            waited = time.monotonic() - self._last
        return waited if waited > declare_at else None

    def _poll_s(self) -> float:
        return min(max(self.limit() / 20, 0.05), 1.0)

    def _grace_s(self) -> float:
        """How long a process lingers after declaring the hang, before it exits.

        A process that leaves breaks its peers' collectives, and they must have declared the
        hang by then (or they would fail with that error instead): two polls of theirs. Process
        0 lingers longest: it hosts JAX's coordination service, and when that goes JAX aborts
        every other process at once.
        """
        return 2 * self._poll_s() + (1.0 if self.process_index == 0 else 0.5)

    def _reserve_s(self) -> float:
        """How much earlier than the limit the hang is declared, so the process is gone by it."""
        if not self._exits:
            return 0.0
        # Every process declares at the same time, noticed one poll late at worst (and one
        # more to spare for a busy machine); process 0's grace is the longest; never more
        # than half the limit.
        longest_grace = 2 * self._poll_s() + 1.0
        return min(2 * self._poll_s() + longest_grace, self.limit() / 2)

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s()):
            waited = self._overdue()
            if waited is None:
                continue
            with self._lock:
                median = statistics.median(self._intervals) if self._intervals else 0.0
            self._on_hang(
                f"no call of the train step finished for {waited:.1f}s after step {self._step}; the process ends "
                f"at the limit of {self.limit():.1f}s = max(trainer.watchdog_floor_s={self.floor_s:g}, "
                f"trainer.watchdog_factor={self.factor:g} x the median call time {median:.3g}s). "
                f"This is process {self.process_index}; "
                "one process of the job is stuck, and the others wait for it in a collective"
            )
            return

    def _dump_stacks_and_exit(self, report: str) -> None:
        """Writes ``report`` and every thread's Python stack to each log, lingers for the
        exit grace (:meth:`_grace_s`), then exits with 75."""
        message = (
            f"xlafit: hang watchdog: {report}. The Python stacks of every thread of this process follow; "
            f"exiting with {errors.PREEMPTED} so that the job runs again from its last checkpoint."
        )
        for stream in _log_streams():
            try:
                stream.write(message + "\n")
                stream.flush()
                faulthandler.dump_traceback(stream, all_threads=True)
                stream.flush()
            except (OSError, ValueError):  # a closed or unwritable log must not keep the process alive
                pass
        time.sleep(self._grace_s())
        os._exit(errors.PREEMPTED)


def _stall_hook(process_index: int) -> int | None:
    """The step after which :data:`STALL_ENV` makes this process stall, if it names it."""
    value = os.environ.get(STALL_ENV, "")
    if not value:
        return None
    process, _, step = value.partition(":")
    return int(step) if int(process) == process_index else None


def _log_streams() -> list[IO[str]]:
    """stderr, and the files the ``xlafit`` logger writes to (processes other than 0)."""
    streams: list[IO[str]] = [sys.__stderr__] if sys.__stderr__ is not None else []
    for handler in logging.getLogger("xlafit").handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            streams.append(handler.stream)
    return streams


def job_watchdog(config: TrainerConfig, strategy: Strategy) -> Watchdog:
    """The hang watchdog of a multi-process job's training loop; off in a single process (no
    peer to wait for).

    Raises:
        ConfigError: ``trainer.watchdog_*`` settings out of range.
    """
    validate_watchdog(config)
    factor = config.watchdog_factor if strategy.process_count > 1 else 0.0
    return Watchdog(factor, config.watchdog_floor_s, process_index=strategy.process_index)
