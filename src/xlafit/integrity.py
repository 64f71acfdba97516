"""What a checkpoint is checked against before it is used: its seal, and its arrays' checksums.

- The *seal*, ``xlafit-integrity.json`` beside a committed checkpoint, holds the SHA-256 of
  every file. It is written in the background as soon as Orbax commits the save, so a
  checkpoint lacks one only when the process died between the commit and the seal (a
  kill -9 in that window).
- The *array checksums*, computed on the devices from the state being saved and stored in
  the step's own metadata (committed with the arrays), hold two 32-bit sums of every
  array's bytes (one plain, one weighted by position). A restore computes them again from
  the arrays it read and compares: a changed bit in the data is found whether or not the
  checkpoint was sealed. Any one flipped bit changes the plain sum (it adds or takes
  ``2**k``, ``k < 32``); the weighted one also catches words swapped or moved.

Example:
    >>> import numpy as np
    >>> state = {"w": np.arange(4.0, dtype=np.float32)}
    >>> _, record = split_record({CHECKSUMS: checksum_record(state, {})})
    >>> changed({"w": np.arange(4.0, dtype=np.float32)}, record) is None
    True
    >>> flipped = np.arange(4.0, dtype=np.float32).view(np.uint32) ^ np.uint32(1 << 7)
    >>> changed({"w": flipped.view(np.float32)}, record)
    'w'
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from xlafit.io.paths import files_under, is_url
from xlafit.parallel.sharding import path_name

SEAL = "xlafit-integrity.json"
# The step metadata's key of the array checksums (a JSON string, beside the run's settings).
CHECKSUMS = "xlafit_array_checksums"


# --------------------------------------------------------------------------- the seal: every file's SHA-256


def file_hashes(directory: epath.Path) -> dict[str, str]:
    """The SHA-256 of every file under ``directory`` but the seal, by relative name."""
    hashes = {}
    for name, path in files_under(directory).items():
        if path.name.startswith(SEAL):
            continue
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(1 << 20):  # hashlib lets go of the GIL: training goes on meanwhile
                digest.update(block)
        hashes[name] = digest.hexdigest()
    return hashes


def write_seal(directory: epath.Path, step: int) -> None:
    """Seals the committed checkpoint in ``directory``: whole or absent, never half written."""
    seal = json.dumps({"step": step, "sha256": file_hashes(directory)}, indent=1)
    if is_url(directory):
        (directory / SEAL).write_text(seal)  # object stores write an object whole or not at all
    else:
        tmp = directory / f"{SEAL}.tmp"
        tmp.write_text(seal)
        tmp.replace(directory / SEAL)  # atomic rename


def check_seal(directory: epath.Path) -> str:
    """``"intact"``, ``"unsealed"`` (no seal) or ``"corrupt: <why>"`` for a committed checkpoint."""
    if not (directory / SEAL).exists():
        return "unsealed"
    try:
        expected = json.loads((directory / SEAL).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"corrupt: unreadable {SEAL} ({e})"
    actual = file_hashes(directory)
    for name, digest in expected.items():
        if name not in actual:
            return f"corrupt: {name} is missing"
        if actual[name] != digest:
            return f"corrupt: {name} does not match its checksum"
    return "intact"


# --------------------------------------------------------------------------- array checksums, on the devices


def _words(x: jax.Array) -> jax.Array:
    """``x``'s bytes as uint32 words, one per element (8-byte elements: two)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size in (4, 8):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: a trailing axis of 2
    unsigned = {2: jnp.uint16, 1: jnp.uint8}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _sums(x: jax.Array) -> jax.Array:
    """``[sum(w), sum(w * (2i + 1))]`` over ``x``'s words ``w`` at flat positions ``i``, mod 2**32.

    The position comes from one iota per axis (no reshape: a sharded array stays where it
    is, and each device sums its own shard before one all-reduce of two words); integer
    sums are exact in any order, so any sharding gives the same two numbers.
    """
    w = _words(x)
    position = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= w.shape[axis]
    odd = position * jnp.uint32(2) + jnp.uint32(1)  # odd: a change of 2**k (k < 32) stays non-zero mod 2**32
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)])


# An array kept in host memory (trainer.optimizer_offload's optimizer state) is summed on its
# device: XLA computes on device memory only.
_device_sums = jax.jit(
    lambda arrays: {name: _sums(jax.device_put(x, jax.memory.Space.Device)) for name, x in arrays.items()}
)


def _host_sums(x: np.ndarray) -> tuple[int, int]:
    """:func:`_sums` of a NumPy array, on the host (uint32 arithmetic wraps as it does there)."""
    x = np.ascontiguousarray(x)
    w = x.astype(np.uint32) if x.dtype == np.bool_ else x.view(f"<u{min(x.dtype.itemsize, 4)}").astype(np.uint32)
    w = w.reshape(-1)
    odd = np.arange(w.size, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    return int(np.sum(w, dtype=np.uint32)), int(np.sum(w * odd, dtype=np.uint32))


def checksums(tree: Any) -> dict[str, str]:
    """Every array's two sums (:func:`_sums`) by its path, as ``"<hex>-<hex>"``: a
    ``jax.Array`` on its devices, a NumPy one on the host.

    A host-device sync point: one small read-back of two words an array, after one pass over
    the state (the save's copy to the host waits for the state anyway).
    """
    leaves = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    on_device = {name: x for name, x in leaves.items() if isinstance(x, jax.Array)}
    sums = {name: _host_sums(np.asarray(x)) for name, x in leaves.items() if name not in on_device}
    sums |= {name: (int(s[0]), int(s[1])) for name, s in jax.device_get(_device_sums(on_device)).items()}
    return {name: f"{a:08x}-{b:08x}" for name, (a, b) in sums.items()}


def _metadata_digest(metadata: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(metadata), sort_keys=True).encode()).hexdigest()


def checksum_record(tree: Any, metadata: Mapping[str, str]) -> str:
    """What :data:`CHECKSUMS` holds for a save of ``tree`` (saveable arrays) with ``metadata``:
    each array's shape, dtype and sums, and the SHA-256 of the rest of the metadata."""
    shapes = {path_name(p): (list(x.shape), str(x.dtype)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    arrays = {name: [*shapes[name], sums] for name, sums in checksums(tree).items()}
    return json.dumps({"arrays": arrays, "metadata": _metadata_digest(metadata)}, separators=(",", ":"))


class Damaged(Exception):
    """A checkpoint whose metadata or arrays are not what its save recorded."""


def split_record(saved: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any] | None]:
    """A step's saved metadata without its :data:`CHECKSUMS`, and the record read from them
    (None: saved before xlafit recorded checksums).

    Raises:
        Damaged: the record is unreadable, or the rest of the metadata changed since the save.
    """
    metadata = dict(saved)
    text = metadata.pop(CHECKSUMS, None)
    if text is None:
        return metadata, None
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or not isinstance(record.get("arrays"), dict):
            raise ValueError("not a record of checksums")
    except (ValueError, TypeError) as e:
        raise Damaged(f"its array checksums are unreadable ({e})") from None
    if record.get("metadata") != _metadata_digest(metadata):
        raise Damaged("its saved settings are not the ones it was saved with")
    return metadata, record


def check_shapes(record: Mapping[str, Any] | None, shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """Checks Orbax's array metadata (``path -> (shape, dtype)``) against the ``record``: a
    difference is a damaged metadata file, not a model change.

    Raises:
        Damaged: naming the first array that differs.
    """
    if record is None:
        return
    recorded = {name: (tuple(entry[0]), entry[1]) for name, entry in record["arrays"].items()}
    name = next((n for n in sorted(set(recorded) | set(shapes)) if recorded.get(n) != shapes.get(n)), None)
    if name is not None:
        raise Damaged(f"its array metadata ({name}) is not what was saved")


def changed(tree: Any, record: Mapping[str, Any]) -> str | None:
    """The first array of ``tree`` (as read back) whose sums are not the ``record``'s, or None.

    An array read back in another dtype than it was saved in is not compared: a NumPy
    float64 read into a ``jax.Array`` without ``jax_enable_x64`` is float32 (a state the
    trainer saves is all ``jax.Array``s, read back as saved).
    """
    recorded = record["arrays"]
    leaves = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    missing = sorted(set(recorded) - set(leaves))
    if missing:
        return missing[0]
    now = checksums({name: x for name, x in leaves.items() if name in recorded and str(x.dtype) == recorded[name][1]})
    return next((name for name in sorted(now) if now[name] != recorded[name][2]), None)


def check_arrays(tree: Any, record: Mapping[str, Any] | None) -> None:
    """Checks the arrays read back against the ``record`` saved with them.

    Raises:
        Damaged: naming the first array that differs.
    """
    if record is not None and (name := changed(tree, record)) is not None:
        raise Damaged(f"{name} does not match the checksum recorded when it was saved")
