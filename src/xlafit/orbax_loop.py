"""Orbax's synchronous calls made to let their reads finish before their event loop closes,
and its errors in one line.

A failed restore (a truncated or removed file) otherwise printed a traceback for every read
still in flight ("Event loop is closed") and "Exception ignored" when they were collected.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


_SETTLE_S = 60.0  # the longest a failed call waits for its other reads (a slow store): then it closes anyway


def _run_until_settled(coro: Coroutine[Any, Any, _T]) -> _T:
    """Orbax's way to run a coroutine from synchronous code (a new event loop, closed after
    it), where a failure first lets the loop's other tasks finish (for :data:`_SETTLE_S` at
    most).

    A restore reads every array at once (``asyncio.gather``). When one read fails (a
    truncated file), gather raises at once, and Orbax closed its loop with the other reads
    in flight: TensorStore then delivered each into the closed loop ("RuntimeError: Event
    loop is closed", a traceback per read), and the abandoned reads printed "Exception
    ignored" when collected. Cancelling them is not enough: TensorStore still calls back into
    the loop from its own threads after a cancel. So they run to their end (a failed
    restore costs the rest of its reads, as a successful one would). ``asyncio.all_tasks``
    takes this loop's tasks only, retrying its walk over a set other threads change (the
    reason Orbax does not use ``asyncio.run``). A call that succeeds, or stops on Ctrl-C,
    closes its loop at once, as Orbax does.
    """
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    except Exception:
        deadline = time.monotonic() + _SETTLE_S
        while (pending := asyncio.all_tasks(loop)) and (left := deadline - time.monotonic()) > 0:
            done, _ = loop.run_until_complete(asyncio.wait(pending, timeout=left))  # it may start others
            for task in done:  # their errors are the first one's echoes: retrieved, so never logged
                _ = task.cancelled() or task.exception()
        raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def settle_orbax_reads() -> None:
    """Makes Orbax's synchronous calls finish their reads before closing their event loop
    (:func:`_run_until_settled`). Idempotent. The function replaced is a private one of
    Orbax's: with a version that lacks it, nothing is replaced and a failed restore is only
    noisier (``test_checkpoint`` says when that happens)."""
    try:
        from orbax.checkpoint._src import asyncio_utils
    except ImportError:
        return
    if hasattr(asyncio_utils, "_run_sync_via_new_loop"):
        asyncio_utils._run_sync_via_new_loop = _run_until_settled


_SPEC = re.compile(r"\s*\[tensorstore_spec='.*?'\]")


def first_line(e: BaseException) -> str:
    """The innermost cause of ``e``, its type and first line: Orbax wraps a TensorStore read
    error (the array, the file, the byte range) in one that appends the array's whole
    TensorStore spec, some 60 lines.

    Example:
        >>> try:
        ...     try:
        ...         raise ValueError("OUT_OF_RANGE: w/0.0")
        ...     except ValueError as inner:
        ...         raise Exception("error reading w; spec:\\n{...}") from inner
        ... except Exception as e:
        ...     first_line(e)
        'ValueError: OUT_OF_RANGE: w/0.0'
        >>> first_line(ValueError("OUT_OF_RANGE: size 10 [tensorstore_spec='{\\"driver\\":\\"zarr\\"}']"))
        'ValueError: OUT_OF_RANGE: size 10'
    """
    while e.__cause__ is not None:
        e = e.__cause__
    # TensorStore appends the array's whole spec to the line itself (some 1,400 characters)
    lines = [_SPEC.sub("", line) for line in str(e).strip().splitlines()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
