"""Keras' ``x`` and ``y`` (an array, a list of arrays, a dict of arrays by input or output
name) as the entries of one flat batch dict, and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from xlafit.errors import ConfigError


def flatten(key: str, value: Any, what: str) -> dict[str, np.ndarray]:
    """One of Keras' ``x`` / ``y`` as batch entries: an array as ``key``, a list's items as
    ``key/0``, ``key/1``, ..., a dict's as ``key/<name>`` (:func:`unflatten` undoes it).

    Example:
        >>> import numpy as np
        >>> sorted(flatten("x", {"image": np.zeros(2), "tags": np.ones(2)}, "data"))
        ['x/image', 'x/tags']
    """
    if isinstance(value, Mapping):
        parts = {f"{key}/{name}": v for name, v in value.items()}
    elif isinstance(value, list | tuple):
        parts = {f"{key}/{i}": v for i, v in enumerate(value)}
    else:
        parts = {key: value}
    bad = [k for k, v in parts.items() if not hasattr(v, "shape")]
    if bad or not parts:
        kind = type(parts[bad[0]]).__name__ if bad else "an empty " + type(value).__name__
        raise ConfigError(
            f"{what}: {key} must be an array, a list of arrays or a dict of arrays (NumPy), as Keras' fit takes "
            f"it; {bad[0] if bad else key} is {kind}. tf.data pipelines and generators do not carry over: xlafit "
            "draws batches by index, so resume and evaluation are exact."
        )
    return {k: np.asarray(v) for k, v in parts.items()}


def unflatten(batch: Mapping[str, Any], key: str) -> Any:
    """What :func:`flatten` made of ``key``: the array, the list, or the dict; None if absent."""
    if key in batch:
        return batch[key]
    parts = {k[len(key) + 1 :]: v for k, v in batch.items() if k.startswith(key + "/")}
    if not parts:
        return None
    if all(name.isdigit() for name in parts):
        return [parts[name] for name in sorted(parts, key=int)]
    return parts
