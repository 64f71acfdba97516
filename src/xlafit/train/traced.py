"""What a user's model or loss does that a compiled step cannot, said at the user's line.

Tracing a step runs the user's Python once on abstract values: an ``if`` on an array, a
boolean mask's selection or ``jnp.nonzero`` without a size, a float label where an integer
one is needed, fail there with JAX's or optax's own words, under frames of xlafit and JAX.
:func:`at_users_line` turns those into one :class:`~xlafit.errors.ConfigError` that names
the line and the rewrite, as ``xlafit check FILE`` does for every such line of a file.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import jax

from xlafit.errors import ConfigError

# Python's own, installed packages', JAX's and xlafit's frames are not the user's.
_NOT_USERS = ("site-packages", "/lib/python", "xlafit/", "<frozen")


def users_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The deepest frame of ``e``'s traceback in the user's code, if any."""
    frames = traceback.extract_tb(e.__traceback__)
    return next((f for f in reversed(frames) if not any(p in f.filename for p in _NOT_USERS)), None)


def frame_in(e: BaseException, file: str | Path | None) -> traceback.FrameSummary | None:
    """The deepest frame of ``e``'s traceback in ``file`` (a user's file that ``xlafit check``
    or ``xlafit train`` runs), if any."""
    if file is None:
        return None
    target = Path(file).resolve()
    frames = traceback.extract_tb(e.__traceback__)
    return next((f for f in reversed(frames) if Path(f.filename).resolve() == target), None)


def where(e: BaseException) -> str:
    """`` at file:line (`code`)`` of :func:`users_frame`, or ``""``."""
    frame = users_frame(e)
    return f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)" if frame else ""


def at_users_line(e: Exception, step: str) -> Exception:
    """``e``, raised tracing ``step`` (``train step``, ``eval step``), as one line naming the
    user's line and the fix where it is a data-dependent branch or shape or float labels for
    an integer-label loss; any other error as it is."""
    errors = jax.errors
    branch = isinstance(e, errors.TracerBoolConversionError | errors.TracerIntegerConversionError)
    shape = isinstance(e, errors.NonConcreteBooleanIndexError | errors.ConcretizationTypeError)
    labels = isinstance(e, TypeError) and "subdtype of <class 'numpy.integer'>" in str(e)
    if not (branch or shape or labels) or users_frame(e) is None:
        return e
    check = "`xlafit check FILE` names every such line with its rewrite."
    if branch:
        return ConfigError(
            f"the {step} cannot follow Python control flow on a traced value{where(e)}: the branch taken would "
            f"depend on the data. Compute both and select (jnp.where), or use jax.lax.cond; {check}"
        )
    if shape:
        return ConfigError(
            f"the {step} cannot compile an array whose shape depends on the data{where(e)} (a boolean mask's "
            "selection, jnp.nonzero or jnp.unique without size=). Weight by the mask instead (jnp.sum(losses * "
            f"mask) / jnp.maximum(jnp.sum(mask), 1)), or give the result a fixed size; {check}"
        )
    return ConfigError(
        f"the loss takes integer labels and the batch gave floats{where(e)}: cast the labels' key of the batch to "
        "integers (y.astype(np.int32)) where the data is made."
    )
