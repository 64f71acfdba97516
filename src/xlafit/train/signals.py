"""SIGTERM/SIGINT as a request to stop at the next step boundary, with a checkpoint.

A preemptible TPU VM gets SIGTERM shortly before it goes away; Ctrl-C sends SIGINT. Either
one sets a flag that the training loop reads after each call; the loop saves a checkpoint
of the last finished step and raises :class:`Preempted`. The ``xlafit`` command turns that
into exit status 75 (``EX_TEMPFAIL``: run me again), which a restart loop or a scheduler
understands. A library user does the same::

    try:
        xlafit.train_and_evaluate(cfg)
    except xlafit.Preempted:
        sys.exit(xlafit.errors.PREEMPTED)   # 75; the next run resumes from the checkpoint

In a multi-process job (``jax.distributed``: ``xlafit launch``, the workers of a TPU slice)
the platform's notice may reach one process only, and every process must save the same
step. JAX's preemption service does that: ``jax.distributed.initialize`` installs its SIGTERM
notifier, which tells the coordination service; the service picks one call, one past the
furthest process's, and :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`
is true at that call in every process. The guard's SIGTERM handler hands the signal on to
that notifier (it took its place), and the loop asks :meth:`SignalGuard.at_sync_point` at
every call. Should JAX not agree on a step within :data:`NOTICE_GRACE_S`, or for SIGINT,
the trainer shares the stop request itself (a small all-gather per call).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from xlafit.train.report import in_notebook

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# After this long without JAX's sync point, a process that got SIGTERM shares the request itself.
NOTICE_GRACE_S = 10.0
_calls = itertools.count()  # this process's calls of the sync point: the same sequence in every process


class SignalGuard:
    """While open, the first SIGTERM/SIGINT sets :attr:`received` instead of killing the process.

    A second signal exits at once (exit status 128 + signal); in a Jupyter kernel a second
    interrupt raises ``KeyboardInterrupt`` instead, which stops the cell and keeps the kernel.
    Guards nest: an inner guard
    (``Trainer.fit``'s) opened inside an outer one (:func:`xlafit.train_and_evaluate`'s, which
    also covers data loading and compiling) shares the outer one's state. Only the main
    thread can own signal handlers; elsewhere a guard never sees a signal.

    Attributes:
        received: the first signal, or None.
        sync_point: :meth:`at_sync_point` was true: JAX's preemption service stopped the job.
    """

    _active: SignalGuard | None = None  # the outermost open guard of this process

    def __init__(self) -> None:
        self.received: int | None = None
        self.sync_point = False
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}
        self._jax_notifier: _CHandler | None = None  # JAX's SIGTERM handler, which ours displaced
        self._handed = False  # the signal went to JAX's notifier: the sync point will carry it

    def _handle(self, signum: int, frame: Any) -> None:
        kernel = in_notebook()
        if self.received is not None:
            if kernel and signum == signal.SIGINT:  # the kernel's interrupt: exiting would kill the kernel
                raise KeyboardInterrupt
            os._exit(128 + signum)
        self.received, self._received_at = signum, time.monotonic()
        then = "then saving a checkpoint"
        if signum == signal.SIGTERM and self._jax_notifier is not None:
            self._hand_to_jax()
            then = "then saving a checkpoint at the step all processes agree on"
        again = (
            "interrupt again to stop at once, without it (the kernel and its variables stay)"
            if kernel and signum == signal.SIGINT
            else "send it again to exit at once"
        )
        print(
            f"xlafit: {signal.Signals(signum).name}: finishing the current step, {then} ({again})",
            file=sys.stderr,
            flush=True,
        )

    def _hand_to_jax(self) -> None:
        assert self._jax_notifier is not None
        self._handed, self._received_at = True, time.monotonic()
        self._jax_notifier.call(signal.SIGTERM)  # JAX's notifier tells every process through the coordinator

    def must_share(self) -> bool:
        """Whether this process must tell the others of its signal itself: a signal that
        JAX's preemption service does not carry (SIGINT, no ``jax.distributed``), or one it
        did not turn into a sync point within :data:`NOTICE_GRACE_S`."""
        if self.received is None:
            return False
        return not self._handed or time.monotonic() - self._received_at > NOTICE_GRACE_S

    def requests(self, processes: int, checkpoint_every_minutes: float, last_save: float) -> tuple[bool, bool]:
        """(stop requested, checkpoint time reached): in a multi-process job, by any process,
        so that all of them stop or save at the same step. A SIGTERM reaches the others
        through JAX's preemption service (its sync point); the all-gather carries the rest."""
        minutes = checkpoint_every_minutes
        flags = np.array([self.must_share(), bool(minutes) and time.monotonic() - last_save >= 60 * minutes], np.int32)
        if processes > 1:
            # note: a small collective per call, only in multi-process jobs
            flags = np.asarray(multihost_utils.process_allgather(flags)).max(axis=0)
        at_sync_point = self.at_sync_point()  # every call, in every process: JAX's contract
        return bool(flags[0]) or at_sync_point, bool(flags[1])

    def at_sync_point(self) -> bool:
        """JAX's preemption sync point: call it once per call of the train step, in every
        process; it is true at the same call in all of them after a preemption notice.

        False without ``jax.distributed`` or with ``jax_enable_preemption_service`` off.
        """
        call = next(_calls)
        if not _preemption_service():
            return False
        from jax.experimental import multihost_utils

        # note: a mutex in JAX, no collective; it blocks only while the service agrees on the step
        if multihost_utils.reached_preemption_sync_point(call):
            self.sync_point = True
        return self.sync_point

    def _take(self, signum: int, handler: Callable[[int, Any], None]) -> Any:
        """Installs ``handler``; remembers JAX's SIGTERM notifier if it is the one displaced."""
        found = _CHandler.current(signum) if signum == signal.SIGTERM and _preemption_service() else None
        previous = signal.signal(signum, handler)
        ours = _CHandler.current(signum)  # Python's own C handler, which runs ``handler``
        if found is not None and (ours is None or found.address != ours.address):
            self._jax_notifier = found
        return previous

    def __enter__(self) -> SignalGuard:
        outer = SignalGuard._active
        on_main = threading.current_thread() is threading.main_thread()
        if outer is not None:
            if on_main:
                # jax.distributed.initialize, called in between, installs its own SIGTERM
                # handler (the coordination service's preemption notifier): take it back,
                # and hand SIGTERM on to it.
                for signum in SIGNALS:
                    outer._take(signum, outer._handle)
                if outer.received == signal.SIGTERM and outer._jax_notifier is not None and not outer._handed:
                    # SIGTERM came before jax.distributed was up (start-up): tell the others now
                    outer._hand_to_jax()
            return outer
        if on_main:
            for signum in SIGNALS:
                self._previous[signum] = self._take(signum, self._handle)
            SignalGuard._active = self
        return self

    def __exit__(self, *exc: object) -> None:
        if SignalGuard._active is self:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            if self._jax_notifier is not None:
                self._jax_notifier.install(signal.SIGTERM)  # JAX's notifier keeps listening
            SignalGuard._active = None


def _preemption_service() -> bool:
    """Whether this process runs JAX's preemption service (``jax.distributed`` is up with it)."""
    return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)  # type: ignore[attr-defined]


class _CHandler:
    """A signal handler installed from C (JAX's SIGTERM notifier), read with ``sigaction``.

    Python's :func:`signal.signal` neither reports such a handler nor can reinstall it. Linux
    only (glibc's ``struct sigaction``: the handler first, ``sa_flags`` at byte 136); elsewhere
    :meth:`current` finds none, and a signal reaches the other processes by the trainer's
    all-gather alone.
    """

    _SA_SIGINFO = 4  # a three-argument handler: not called from here

    def __init__(self, action: bytes) -> None:
        self._action = action
        self.address = ctypes.c_void_p.from_buffer_copy(action[:8]).value or 0

    @classmethod
    def current(cls, signum: int) -> _CHandler | None:
        """The handler installed now, unless it is SIG_DFL, SIG_IGN or a siginfo handler."""
        if not sys.platform.startswith("linux"):
            return None
        action = ctypes.create_string_buffer(256)  # glibc's struct sigaction is 152 bytes
        if ctypes.CDLL(None, use_errno=True).sigaction(signum, None, action) != 0:
            return None
        handler = cls(action.raw)
        flags = int.from_bytes(action.raw[136:140], sys.byteorder)
        if handler.address in (0, 1) or flags & cls._SA_SIGINFO:
            return None
        return handler

    def call(self, signum: int) -> None:
        ctypes.CFUNCTYPE(None, ctypes.c_int)(self.address)(signum)

    def install(self, signum: int) -> None:
        ctypes.CDLL(None, use_errno=True).sigaction(signum, ctypes.create_string_buffer(self._action), None)


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
