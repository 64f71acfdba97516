"""Reward functions of a GRPO run: Python callables with TRL's signature, read from a file,
and called on each generation batch.

A reward function takes ``prompts`` and ``completions`` (lists with one item per completion:
texts, or for conversations the prompt's messages and ``[{"role": "assistant", "content":
...}]``), ``completion_ids`` (token ids), and every other column of the prompt records as a
keyword (one value per completion), and returns one number per completion::

    def exact_answer(prompts, completions, answer, **kwargs):
        return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]

``model.grpo.rewards=rewards.py:exact_answer,format_ok`` names them: the file runs as a
script (its directory importable, as ``python rewards.py`` would have it), once.

Example:
    >>> parse_spec("rewards.py:exact,format")
    ('rewards.py', ['exact', 'format'])
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import runpy
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xlafit.errors import ConfigError, RewardError

__all__ = ["KEYWORDS", "Reward", "check_arguments", "importable", "load_rewards", "parse_spec", "score"]

Reward = tuple[str, Callable[..., Sequence[float]]]  # (name, function)


@contextlib.contextmanager
def importable(path: Path) -> Iterator[None]:
    """``path``'s directory and the working directory on ``sys.path``, as ``python path``
    (and ``python -m``) would have them, so the file can import its neighbours; restored after."""
    saved = list(sys.path)
    sys.path[:0] = [str(path.parent.resolve()), os.getcwd()]
    try:
        yield
    finally:
        sys.path[:] = saved


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``(file, names)`` of ``FILE.py:fn_a,fn_b``.

    Raises:
        ConfigError: no file or no function named.
    """
    file, _, names = spec.rpartition(":")
    functions = [n.strip() for n in names.split(",") if n.strip()]
    if not file or not functions:
        raise ConfigError(
            f"model.grpo.rewards={spec!r}: give a Python file and its reward functions, as "
            "model.grpo.rewards=rewards.py:exact_answer,format_ok."
        )
    return file, functions


def load_rewards(spec: str) -> list[Reward]:
    """The reward functions ``spec`` names (``FILE.py:fn_a,fn_b``), in order. The file runs
    once per version of it (its modification time and size): checking a config and starting
    its run load it once, and an edited file is read again.

    Raises:
        ConfigError: the file is missing or is not Python (its line named), a function is
            not in it or is not callable.
    """
    file, names = parse_spec(spec)
    path = Path(file).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"model.grpo.rewards: {file} is not a file; give the path of a Python file of reward functions."
        )
    stat = path.stat()
    return list(_load(str(path.resolve()), tuple(names), stat.st_mtime_ns, stat.st_size, file))


@functools.lru_cache(maxsize=8)
def _load(path_str: str, names: tuple[str, ...], mtime: int, size: int, file: str) -> tuple[Reward, ...]:
    """:func:`load_rewards` of one version of the file (the cache key)."""
    path = Path(path_str)
    try:
        with importable(path), contextlib.redirect_stdout(sys.stderr):
            namespace = runpy.run_path(str(path), run_name="__xlafit_rewards__")
    except SyntaxError as e:
        raise ConfigError(
            f"model.grpo.rewards: {file} is not Python: line {e.lineno}: {e.msg}; give a .py file that defines "
            f"{', '.join(names)}."
        ) from None
    except Exception as e:
        raise ConfigError(
            f"model.grpo.rewards: {file} failed while being loaded: {type(e).__name__}: {e}; fix it and run again."
        ) from None
    out: list[Reward] = []
    for name in names:
        fn = namespace.get(name)
        if fn is None:
            defined = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_"))
            raise ConfigError(
                f"model.grpo.rewards: {file} has no function {name!r} (it defines {', '.join(defined) or 'none'}); "
                "name one it defines, or define it there."
            )
        if not callable(fn):
            raise ConfigError(f"model.grpo.rewards: {name} in {file} is a {type(fn).__name__}, not a function.")
        out.append((name, fn))
    return tuple(out)


# What every reward function is called with, beside the data's columns (TRL's keywords).
KEYWORDS = ("prompts", "completions", "completion_ids")


def check_arguments(rewards: Sequence[Reward], columns: Sequence[str]) -> None:
    """Refuses a reward function that takes, with no default, an argument neither among
    :data:`KEYWORDS` nor a column of the data (``columns``): it would fail on every batch,
    and no record can fix that.

    Raises:
        ConfigError: naming the function, the argument and the columns the data has.
    """
    given = {*KEYWORDS, *columns}
    for name, fn in rewards:
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin or an object whose signature Python cannot read
            continue
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        missing = [p.name for p in parameters if p.kind in kinds and p.default is p.empty and p.name not in given]
        if missing:
            have = ", ".join(columns) or "none"
            raise ConfigError(
                f"reward function {name} takes {', '.join(missing)}, which the prompts' records do not have (their "
                f"columns: {have}; every function also gets {', '.join(KEYWORDS)}); add "
                f"{'that field' if len(missing) == 1 else 'those fields'} to every record, or give the argument a "
                "default."
            )


def _called(name: str, fn: Callable[..., Sequence[float]], n: int, kwargs: dict[str, Any]) -> list[Any]:
    """``fn(**kwargs)`` as a list of ``n`` values; raises what it raises."""
    values = fn(**kwargs)
    try:
        values = list(values)
    except TypeError:
        raise RewardError(
            f"reward function {name} returned a {type(values).__name__}, not a list; return one float per completion."
        ) from None
    if len(values) != n:
        raise RewardError(
            f"reward function {name} returned {len(values)} values for {n} completions; return one float per "
            "completion (in the order given)."
        )
    return values


def _first_failing(name: str, fn: Callable, group: int, kwargs: dict[str, Any]) -> tuple[int, BaseException] | None:
    """The first group of completions ``fn`` raises on alone, and what it raised."""
    n = len(kwargs["prompts"])
    for start in range(0, n, group):
        part = {k: v[start : start + group] for k, v in kwargs.items()}
        try:
            fn(**part)
        except Exception as e:
            return start // group, e
    return None


def score(
    rewards: Sequence[Reward], kwargs: dict[str, list[Any]], prompt_index: Sequence[int], group: int
) -> np.ndarray:
    """``[N, F]`` float32: each reward function's value for each completion.

    Args:
        rewards: the functions, with their names.
        kwargs: ``prompts``, ``completions``, ``completion_ids`` and the data's columns, one
            item per completion.
        prompt_index: the index in the data of each completion's prompt, from 0 (the errors
            count records from 1, as the data's other messages do).
        group: the completions of a prompt (adjacent).

    Raises:
        RewardError: a function raised (its name, the prompt's index in the data and what it
            raised), returned other than one number per completion, or NaN.
    """
    n = len(kwargs["prompts"])
    out = np.zeros((n, len(rewards)), np.float32)
    for column, (name, fn) in enumerate(rewards):
        try:
            values = _called(name, fn, n, kwargs)
        except RewardError:
            raise
        except Exception as e:
            found = _first_failing(name, fn, group, kwargs)
            which, error = (found[0], found[1]) if found is not None else (0, e)
            raise RewardError(
                f"reward function {name} raised {type(error).__name__}: {error} on the completions of the prompt "
                f"of record {prompt_index[which * group] + 1} of the data (counted from 1); fix the function (or "
                "that record) and run again."
            ) from e
        for i, value in enumerate(values):
            try:  # a number (or a value that is one: numpy's, a 0-d tensor); not a text that spells one
                number = math.nan if isinstance(value, str | bytes) else float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number):
                raise RewardError(
                    f"reward function {name} returned {value!r} for completion {i % group + 1} of {group} of the "
                    f"prompt of record {prompt_index[i] + 1} of the data (counted from 1); return a finite number "
                    "for every completion (0.0 where the reward does not apply)."
                )
            out[i, column] = number
    return out
