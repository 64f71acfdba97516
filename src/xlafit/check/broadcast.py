"""Rows compared with every label: NumPy's rank promotion of ``[B, 1]`` against ``[B]``.

A regression loss ``(model(x) - y) ** 2`` with an output ``[B, 1]`` and labels ``[B]``
broadcasts to ``[B, B]``: every prediction against every label. Its mean over the last axis
is ``[B]`` again, so the loss's shape says nothing, and the model learns the labels' mean.
:func:`row_against_every_label` traces the step with JAX's rank promotion warnings on and
names each such broadcast at the user's line (xlafit's own code promotes no rank: its test
suite runs with ``jax_numpy_rank_promotion="raise"``).
"""

from __future__ import annotations

import ast
import re
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from xlafit.check.rules import Finding

_PROMOTION = re.compile(r"automatic rank promotion for (\w+) on shapes ((?:\([\d, ]*\) ?)+)")


def row_against_every_label(trace: Callable[[], Any], user_file: str | None) -> list[Finding]:
    """``trace()`` (a ``jax.eval_shape`` of the step) run with rank promotion warnings on; a
    finding for each ``[..., n, 1]`` met with ``[..., n]`` (n > 1), where ``user_file``'s
    line did it."""
    found: dict[tuple[str | None, int | None], Finding] = {}

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        match = _PROMOTION.search(str(message))
        if match is None:
            return
        shapes = [tuple(ast.literal_eval(s)) for s in re.findall(r"\([\d, ]*\)", match.group(2))]
        pair = _row_and_labels(shapes)
        if pair is None:
            return
        where = _users_line(user_file)
        if where in found:
            return
        column, labels = pair
        code = Path(where[0]).read_text().splitlines()[where[1] - 1].strip() if where[0] and where[1] else None
        n = labels[-1]
        found[where] = Finding(
            0,
            f"{match.group(1)} of shapes {column} and {labels} broadcasts to {(*labels, n)} by NumPy's rank "
            f"promotion: each of {n} rows is met with all {n} values, not its own (a loss of an output [B, 1] "
            "against labels [B] then trains toward the labels' mean); if that is not meant, drop the output's last "
            "axis (out[..., 0]) or give the labels one (y[..., None]).",
            where[0],
            where[1],
            code,
            kind="rows against every label",
        )

    with warnings.catch_warnings(), jax.numpy_rank_promotion("warn"):
        warnings.simplefilter("always")
        warnings.showwarning = show
        trace()
    return list(found.values())


def _row_and_labels(shapes: list[tuple[int, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ``([..., n, 1], [..., n])`` pair among two promoted shapes, if they are one."""
    if len(shapes) != 2:
        return None
    for column, labels in (shapes, shapes[::-1]):
        if (
            len(column) == len(labels) + 1
            and column[-1] == 1
            and labels
            and labels[-1] > 1
            and column[-2] == labels[-1]
            and column[:-2] == labels[:-1]
        ):
            return column, labels
    return None


def _users_line(user_file: str | None) -> tuple[str | None, int | None]:
    """The deepest frame of the running stack in ``user_file``."""
    found: tuple[str | None, int | None] = (None, None)
    if user_file is None:
        return found
    for frame in traceback.extract_stack():
        if Path(frame.filename).resolve() == Path(user_file).resolve():
            found = (frame.filename, frame.lineno)
    return found
