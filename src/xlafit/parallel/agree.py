"""What the processes of a job must agree on, checked as a run starts.

Each process of a job reads its own command line and its own files: workers of a pod slice
started with a setting that differs (a seed, the global batch) train a blend of two runs
without an error (the gradients' shapes agree, so no collective fails), and a run directory on
each host's own disk leaves process 0's checkpoint waiting for files the others write
elsewhere until JAX's distributed service gives up. Both are refused in one line instead,
before anything trains.

Every process calls these functions at the same point (each is a few small collectives).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from xlafit.errors import ConfigError

__all__ = ["from_process_0", "same_settings", "shared_directory"]


def same_settings(settings: Mapping[str, Any]) -> None:
    """Refuses a job whose processes were given other ``settings`` (flat: ``name -> value``,
    as each process read them), naming each setting that differs and its value in every
    process that differs from process 0.

    Raises:
        ConfigError: in every process of the job, with the same message.
    """
    if jax.process_count() == 1:
        return
    mine = json.loads(json.dumps(dict(settings), sort_keys=True, default=str))
    first = json.loads(_from_process_0(json.dumps(mine).encode()))
    differ = {k: mine.get(k) for k in sorted(set(mine) | set(first)) if mine.get(k) != first.get(k)}
    everyone = [json.loads(text) for text in _gathered(json.dumps(differ).encode())]
    named: dict[str, list[str]] = {}
    for process, theirs in enumerate(everyone):
        for key, value in theirs.items():
            named.setdefault(key, [f"{_shown(first.get(key))} in process 0"]).append(
                f"{_shown(value)} in process {process}"
            )
    if named:
        raise ConfigError(
            "the job's processes were given other settings: "
            + "; ".join(f"{key} is {', '.join(values)}" for key, values in named.items())
            + ". Start every process with the same command and settings (on a pod slice, one command for all "
            "workers: --worker=all)."
        )


def shared_directory(directory: epath.Path, what: str = "the run directory") -> None:
    """Refuses a job whose processes do not see the same ``directory`` (process 0 made it):
    process 0 writes a file there that every other process must find.

    Raises:
        ConfigError: in every process, naming the processes that did not see it and the fix.
    """
    if jax.process_count() == 1:
        return
    marker = directory / f".xlafit-shared-{_from_process_0(os.urandom(8).hex().encode()).decode()}"
    if jax.process_index() == 0:
        marker.write_text("")
    multihost_utils.sync_global_devices("xlafit: the run directory's marker is written")
    sees = np.asarray(multihost_utils.process_allgather(np.int32(marker.exists())))
    if jax.process_index() == 0:
        marker.unlink()
    blind = [str(p) for p in np.flatnonzero(sees == 0)]
    if blind:
        raise ConfigError(
            f"{what} {directory} is not shared by the job's processes: process(es) {', '.join(blind)} do not see the "
            "file process 0 wrote there. Put it where every host reads and writes the same files: a bucket "
            "(gs://...) or a shared mount (NFS, Filestore), not a path on each VM's own disk."
        )


def from_process_0(text: str) -> str:
    """Process 0's ``text`` in every process of a job (a name each process would make its own,
    as a new run directory's time); ``text`` itself in one process."""
    return text if jax.process_count() == 1 else _from_process_0(text.encode()).decode()


def _shown(value: Any) -> str:
    return "not set" if value is None else json.dumps(value)


def _from_process_0(data: bytes) -> bytes:
    """Process 0's ``data`` in every process."""
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(data))))
    buffer = np.zeros(size, np.uint8)
    if jax.process_index() == 0:
        buffer[:] = np.frombuffer(data, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer)))


def _gathered(data: bytes) -> list[bytes]:
    """Every process's ``data``, by process."""
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(len(data)))).reshape(-1)
    buffer = np.zeros(int(sizes.max()), np.uint8)
    buffer[: len(data)] = np.frombuffer(data, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buffer)).reshape(len(sizes), -1)
    return [bytes(row[:size]) for row, size in zip(rows, sizes, strict=True)]
