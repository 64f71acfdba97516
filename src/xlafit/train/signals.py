"""SIGTERM/SIGINT as a request to stop at the next step boundary, with a checkpoint.

A preemptible TPU VM gets SIGTERM shortly before it goes away; Ctrl-C sends SIGINT. Either
one sets a flag that the training loop reads after each call; the loop saves a checkpoint
of the last finished step and raises :class:`Preempted`. The ``xlafit`` command turns that
into exit status 75 (``EX_TEMPFAIL``: run me again), which a restart loop or a scheduler
understands. A library user does the same::

    try:
        xlafit.train_and_evaluate(cfg)
    except xlafit.Preempted:
        sys.exit(xlafit.exitcodes.PREEMPTED)   # 75; the next run resumes from the checkpoint
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """Training stopped on SIGTERM/SIGINT at ``step``; ``where`` says what was saved.

    Running the same command (or calling :func:`xlafit.train_and_evaluate` / ``Trainer.fit``
    again with the same run directory) resumes from that checkpoint.
    """

    def __init__(self, step: int, signum: int, where: str) -> None:
        self.step, self.signum = step, signum
        super().__init__(
            f"{signal.Signals(signum).name} received: stopped at step {step}; {where}. "
            "Run the same command again to resume."
        )


class SignalGuard:
    """While open, the first SIGTERM/SIGINT sets :attr:`received` instead of killing the process.

    A second signal exits at once (exit status 128 + signal). Guards nest: an inner guard
    (``Trainer.fit``'s) opened inside an outer one (:func:`xlafit.train_and_evaluate`'s, which
    also covers data loading and compiling) shares the outer one's state. Only the main
    thread can own signal handlers; elsewhere a guard never sees a signal.
    """

    _active: SignalGuard | None = None  # the outermost open guard of this process

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            os._exit(128 + signum)
        self.received = signum
        print(
            f"xlafit: {signal.Signals(signum).name}: finishing the current step, then saving a checkpoint "
            "(send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> SignalGuard:
        outer = SignalGuard._active
        on_main = threading.current_thread() is threading.main_thread()
        if outer is not None:
            if on_main:
                # jax.distributed.initialize, called in between, installs its own SIGTERM
                # handler (the coordination service's preemption notifier): take it back.
                for signum in SIGNALS:
                    signal.signal(signum, outer._handle)
            return outer
        if on_main:
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            SignalGuard._active = self
        return self

    def __exit__(self, *exc: object) -> None:
        if SignalGuard._active is self:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            SignalGuard._active = None


def handle_signals() -> SignalGuard:
    """A context in which SIGTERM/SIGINT ask training to stop at the next step boundary.

    ``Trainer.fit`` opens one itself; open one around your own start-up (data loading,
    building the model) too, as :func:`xlafit.train_and_evaluate` does, so that a signal
    there is not fatal either.

    Example:
        >>> with handle_signals() as signals:
        ...     signals.received is None
        True
    """
    return SignalGuard()
