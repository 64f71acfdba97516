"""Reward functions of a GRPO run: Python callables with TRL's signature, read from a file,
and called on each generation batch.

A reward function takes ``prompts`` and ``completions`` (lists with one item per completion:
texts, or for conversations the prompt's messages and ``[{"role": "assistant", "content":
...}]``), ``completion_ids`` (token ids), and every other column of the prompt records as a
keyword (one value per completion), and returns one number per completion::

    def exact_answer(prompts, completions, answer, **kwargs):
        return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]

``model.grpo.rewards=rewards.py:exact_answer,format_ok`` names them: the file runs as a
script (its directory importable, as ``python rewards.py`` would have it), once. A function
that takes ``trainer_state`` (by name, or through ``**kwargs``) gets the run's
:class:`TrainerState` as TRL gives its own; an ``async def`` function is awaited, as TRL
awaits it. TRL's logging hooks (``log_extra``, ``log_metric``) are not given: the run logs
each function's mean and standard deviation itself.

Example:
    >>> parse_spec("rewards.py:exact,format")
    ('rewards.py', ['exact', 'format'])
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import functools
import inspect
import math
import os
import runpy
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from xlafit.errors import ConfigError, RewardError

__all__ = [
    "KEYWORDS",
    "Reward",
    "TrainerState",
    "check_arguments",
    "importable",
    "load_rewards",
    "parse_spec",
    "score",
]

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
# TRL's trainer state: given to the functions that take it (TrainerState).
STATE = "trainer_state"
# TRL's logging hooks, which xlafit does not give (it logs each function's mean and std).
TRL_HOOKS = ("log_extra", "log_metric")


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """The run as a reward function's ``trainer_state`` sees it (the fields of TRL's that a
    reward reads, for a curriculum or a schedule), at the generation batch being scored.

    Attributes:
        global_step: the steps trained before this batch (0 at the first).
        max_steps: the steps of the whole run (``trainer.epochs`` x the steps of an epoch).
        epoch: the epochs trained before this batch, fractional.
    """

    global_step: int
    max_steps: int
    epoch: float


def _parameters(fn: Callable) -> list[inspect.Parameter] | None:
    """``fn``'s parameters; None where Python cannot read its signature (a builtin)."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _takes(fn: Callable, keyword: str) -> bool:
    """Whether ``fn`` takes ``keyword``: by name, or through ``**kwargs``."""
    parameters = _parameters(fn) or []
    return any(p.name == keyword or p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def check_arguments(rewards: Sequence[Reward], columns: Sequence[str]) -> None:
    """Refuses a reward function that takes, with no default, an argument neither among
    :data:`KEYWORDS` (nor ``trainer_state``) nor a column of the data (``columns``): it would
    fail on every batch, and no record can fix that. A name one letter or so from one it would
    get is named as the likely fix; TRL's logging hooks are named as what they are.

    Raises:
        ConfigError: naming the function, the argument and the columns the data has.
    """
    given = [*KEYWORDS, STATE, *columns]
    for name, fn in rewards:
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        missing = [
            p.name for p in _parameters(fn) or [] if p.kind in kinds and p.default is p.empty and p.name not in given
        ]
        hooks = [m for m in missing if m in TRL_HOOKS]
        if hooks:
            raise ConfigError(
                f"reward function {name} takes {', '.join(hooks)} (TRL's logging hook{'s' if len(hooks) > 1 else ''}), "
                "which xlafit does not give: the run logs each function's mean and standard deviation itself "
                f"(rewards/{name}/mean, rewards/{name}/std); take it out of the signature, or give it a default (None)."
            )
        if missing:
            have = ", ".join(columns) or "none"
            close = {m: difflib.get_close_matches(m, given, n=1, cutoff=0.8) for m in missing}
            meant = [f"{m} -> {close[m][0]}" for m in missing if close[m]]
            fix = (
                f"rename {'it' if len(missing) == 1 else 'them'} ({', '.join(meant)}), "
                if meant
                else f"add {'that field' if len(missing) == 1 else 'those fields'} to every record, "
            )
            raise ConfigError(
                f"reward function {name} takes {', '.join(missing)}, which the prompts' records do not have (their "
                f"columns: {have}; every function also gets {', '.join(KEYWORDS)}, and {STATE} if it takes it); "
                f"{fix}or give the argument a default."
            )


_LOOP: dict[str, asyncio.AbstractEventLoop] = {}  # the event loop that awaits async rewards, once started


def _awaited(awaitable: Any) -> Any:
    """What ``awaitable`` gives, awaited on an event loop of its own thread: the caller's
    thread may run a loop already (a notebook's kernel does), where ``asyncio.run`` cannot."""
    if "loop" not in _LOOP:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="xlafit-async-rewards", daemon=True).start()
        _LOOP["loop"] = loop
    return asyncio.run_coroutine_threadsafe(awaitable, _LOOP["loop"]).result()


def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``fn(**kwargs)``, awaited where ``fn`` is ``async def``."""
    values = fn(**kwargs)
    return _awaited(values) if inspect.isawaitable(values) else values


def _called(name: str, fn: Callable[..., Sequence[float]], n: int, kwargs: dict[str, Any]) -> list[Any]:
    """``fn(**kwargs)`` as a list of ``n`` values; raises what it raises."""
    values = _call(fn, kwargs)
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
        part = {k: v if k == STATE else v[start : start + group] for k, v in kwargs.items()}
        try:
            _call(fn, part)
        except Exception as e:
            return start // group, e
    return None


def score(
    rewards: Sequence[Reward],
    kwargs: dict[str, list[Any]],
    prompt_index: Sequence[int],
    group: int,
    state: TrainerState | None = None,
) -> np.ndarray:
    """``[N, F]`` float32: each reward function's value for each completion.

    Args:
        rewards: the functions, with their names.
        kwargs: ``prompts``, ``completions``, ``completion_ids`` and the data's columns, one
            item per completion.
        prompt_index: the index in the data of each completion's prompt, from 0 (the errors
            count records from 1, as the data's other messages do).
        group: the completions of a prompt (adjacent).
        state: the run's ``trainer_state``, given to the functions that take it.

    Raises:
        RewardError: a function raised (its name, the prompt's index in the data and what it
            raised), returned other than one number per completion, or NaN.
    """
    n = len(kwargs["prompts"])
    out = np.zeros((n, len(rewards)), np.float32)
    for column, (name, fn) in enumerate(rewards):
        given = kwargs | {STATE: state} if state is not None and _takes(fn, STATE) else kwargs
        try:
            values = _called(name, fn, n, given)
        except RewardError:
            raise
        except Exception as e:
            found = _first_failing(name, fn, group, given)
            which, error = (found[0], found[1]) if found is not None else (0, e)
            hook = isinstance(error, KeyError) and error.args and error.args[0] in (*TRL_HOOKS, STATE)
            fix = (
                f"xlafit gives {STATE} to a function that takes it and never gives TRL's logging hooks "
                f"({', '.join(TRL_HOOKS)}): fix the function"
                if hook
                else "fix the function (or that record)"
            )
            raise RewardError(
                f"reward function {name} raised {type(error).__name__}: {error} on the completions of the prompt "
                f"of record {prompt_index[which * group] + 1} of the data (counted from 1); {fix} and run again."
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
