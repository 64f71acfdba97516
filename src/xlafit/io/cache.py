"""Where xlafit keeps things between runs: the user cache directory.

- ``jax/``: JAX's persistent compilation cache, so a restarted or resumed run loads its XLA
  programs instead of compiling them again (on by default; ``XLAFIT_COMPILE_CACHE=0`` turns
  it off, ``JAX_COMPILATION_CACHE_DIR`` chooses another place).
- ``bert-demo-*/``: the Korean demo's tokenizer and shards.
- ``mlm/``: prepared masked-LM splits decoded to memory-mapped ``.npy`` files
  (:func:`xlafit.data.mlm.load_split`).
- ``images/``: prepared image splits, their encoded bytes checked and memory-mapped
  (:func:`xlafit.data.images.load_split`); ``mnist-images-*/``: the resnet demo's PNG folder
  and shards.
- ``cpu-peak.json``: the measured FLOP/s of this machine's CPU, which MFU on a CPU is
  reported against (:func:`xlafit.platform.hardware.measured_cpu_peak`); safe to delete.
- ``launch/<time>-<pid>/``: the output of processes 1..P-1 of each ``xlafit launch``
  (:func:`xlafit.parallel.launch.default_log_dir`); safe to delete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import jax

CACHE_ENV = "XLAFIT_CACHE"
COMPILE_CACHE_ENV = "XLAFIT_COMPILE_CACHE"
COMPLETE = "complete"  # written last into a cache entry's directory: it is whole


def cache_dir() -> Path:
    """``$XLAFIT_CACHE``, else ``$XDG_CACHE_HOME/xlafit``, else ``~/.cache/xlafit``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "xlafit"


def enable_compilation_cache() -> Path | None:
    """Turns on JAX's persistent compilation cache in the user cache; returns its path.

    Programs that took at least a second to compile are kept (JAX's default threshold).
    """
    if os.environ.get(COMPILE_CACHE_ENV, "1") in ("0", "false", "no"):
        return None
    path = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR") or cache_dir() / "jax")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: run without the cache rather than fail
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path


def publish(tmp: Path, where: Path) -> None:
    """Puts a finished build ``tmp`` (a ``*.tmp`` sibling of ``where``) in place as ``where``.

    The build is marked whole (:data:`COMPLETE`) and renamed: processes of one host may
    build the same entry at once, and the rename of the one that finishes second fails
    harmlessly. Then the entry's older versions go (``<name>-<other hash>``; a run that has
    one memory-mapped keeps reading it), and so do temporary builds a killed process left
    more than a day ago.
    """
    (tmp / COMPLETE).touch()
    try:
        tmp.rename(where)
    except OSError:  # another process on this host finished first
        if not (where / COMPLETE).exists():
            raise
    prefix = where.name.rsplit("-", 1)[0] + "-"
    for old in where.parent.glob(prefix + "*"):
        if old != where and not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    for stale in where.parent.glob("*.tmp"):
        with contextlib.suppress(OSError):  # another process may be removing it too
            if time.time() - stale.stat().st_mtime > 24 * 3600:
                shutil.rmtree(stale, ignore_errors=True)
