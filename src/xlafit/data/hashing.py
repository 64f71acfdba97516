"""Counter-based random numbers: uniform floats that are a pure function of integer keys.

The data pipelines draw from :func:`hash_uniform` instead of a generator with state (BERT's
masks, the image augmentations, the held-out split of an image folder), so a resumed run,
any number of workers and any device count see the same draws.
"""

from __future__ import annotations

import numpy as np


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scrambles every bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash_uniform(*keys: np.ndarray | int) -> np.ndarray:
    """Uniform floats in [0, 1) from integer keys (broadcast), the same on every machine.

    Example:
        >>> hash_uniform(0, 1, np.arange(3)).shape
        (3,)
    """
    h = np.zeros((), np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps around, by design
        for key in keys:
            h = _mix(h + np.asarray(key, np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53
