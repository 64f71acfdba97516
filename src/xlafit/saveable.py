"""What a checkpoint holds: a state as saveable arrays (typed PRNG keys as their ``uint32``
key data), parameters saved in an older layout, and the fingerprint of parameters."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from xlafit.models.bert import qkv_from_matrix
from xlafit.parallel.mesh import is_prng_key
from xlafit.parallel.sharding import path_name

# Parameters whose layout changed with their values kept: a checkpoint that holds one in its
# older shape (the same number of elements) restores into the new one. Path suffix -> (the
# older layout, the conversion of an array in it).
RESHAPED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "attention/qkv/kernel": ("BERT's (hidden, 3 * hidden) [q|k|v] matrix, xlafit before 2026-11-24", qkv_from_matrix),
    "attention/qkv/bias": ("BERT's (3 * hidden,) [q|k|v] bias", lambda a: a.reshape(*a.shape[:-1], 3, -1)),
}


def older_layout(path: str, saved: tuple[int, ...], wanted: tuple[int, ...]) -> Callable[[Any], Any] | None:
    """The conversion of ``path``'s array from the older layout it was saved in
    (:data:`RESHAPED`), or None when it was saved as ``wanted``."""
    if saved == wanted or math.prod(saved) != math.prod(wanted):
        return None
    name = path.removesuffix("/value")
    return next((convert for suffix, (_, convert) in RESHAPED.items() if name.endswith(suffix)), None)


def to_saveable(tree: Any) -> Any:
    """Replaces typed PRNG key arrays by their ``uint32`` key data."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_prng_key(x) else x, tree)


def from_saveable(raw: Any, like: Any) -> Any:
    """Inverse of :func:`to_saveable`, using ``like`` to know which leaves were keys."""
    return jax.tree.map(
        lambda r, ref: jax.random.wrap_key_data(r, impl=jax.random.key_impl(ref)) if is_prng_key(ref) else r, raw, like
    )


def abstract(tree: Any) -> Any:
    """``tree`` as ``jax.ShapeDtypeStruct``s with their shardings, PRNG keys as their key data."""

    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        data = jax.random.key_data(x) if is_prng_key(x) else x
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


def fingerprint(params: Any) -> str:
    """SHA-256 over every parameter's path, shape, dtype and bytes, in sorted path order.

    Two runs that end with this fingerprint hold bit-identical parameters.

    Example:
        >>> fingerprint({"w": np.zeros(2, np.float32)}) == fingerprint({"w": np.zeros(2, np.float32)})
        True
    """
    digest = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(to_saveable(params))[0]  # a PRNG key as its key data
    for path, leaf in sorted(leaves, key=lambda pl: path_name(pl[0])):
        value = np.ascontiguousarray(jax.device_get(leaf))
        digest.update(f"{path_name(path)}|{value.shape}|{value.dtype}|".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()
