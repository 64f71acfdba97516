"""``--max-batch``: the largest per-core batch that compiles for a target, in few compiles."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from xlafit.check.program import MAX_PROBES, Probe, Program, progress
from xlafit.check.tpu_report import gib
from xlafit.parallel.mesh import Strategy
from xlafit.platform import hardware as tpu


class BatchProber(Protocol):
    """What :func:`largest_batch` probes: a program on a target, compiled at any batch
    (:class:`Steps`, or a planner's recording of them)."""

    program: Program
    strategy: Strategy

    @property
    def target(self) -> tpu.Target | None: ...

    def fits(self, per_device: int) -> tuple[bool, float, int | None]: ...


def largest_batch(
    steps: BatchProber,
    start: int,
    start_fits: bool | None,
    start_bytes: int | None = None,
    capacity: float = 0.0,
    multiple: int = 8,
    limit: int = 2**16,
    tolerance: float = 0.02,
    fixed_bytes: int | None = None,
    enough: Callable[[int], bool] | None = None,
    label: str | None = None,
    max_probes: int = MAX_PROBES,
    probe_name: str = "--max-batch probe",
) -> tuple[int, list[Probe]]:
    """The largest per-core batch that compiles, and the probes that found it.

    A probe that does not fit is cheap (the compiler refuses it at buffer assignment, in
    seconds, and says how much it needed); one that fits costs a whole compile (minutes for
    BERT-base). So the search reaches far first: 16x ``start`` (again while that fits), or
    halving when ``start`` does not fit. Then it narrows the bracket between the last fit
    and the first refusal by interpolating the bytes each needed (per-core memory grows about
    linearly with the batch: the state is fixed, activations scale) at ``capacity``, falling
    back to bisection when an interpolation lands on the same side twice, until the first
    refusal is within ``tolerance`` (2 %) of the last fit: a fit of 55,000 examples per core
    costs two minutes to compile, and the next multiple of 8 is no answer worth them. Batches stay
    multiples of ``multiple`` (8: a TPU vector register holds 8 rows of a float32 tile) and
    of what the loop needs (``trainer.accumulate_steps``, ``invariant_chunks`` per core);
    below ``multiple``, of the loop's unit only. 0: not even the smallest batch fits.
    With ``fixed_bytes`` (what does not grow with the batch: the state), each reach follows
    a line to the capacity instead of 16x: from the state through the first fit, then
    through the last two fits. ``enough(batch)``, asked after each new fit, ends the search
    there when it says so (a planner stops once a larger batch no longer runs faster).
    ``start`` itself, known to fit, may be below ``multiple``: it is not compiled again.
    ``label`` names the search in its progress lines (several may run at once), ``probe_name``
    each of its compiles there. The search
    compiles at most ``max_probes`` batches: then the last fit is the answer, and the first
    refusal above it the bound the report prints.
    """
    config = steps.program.config
    base = config.accumulate_steps
    if config.invariant_chunks:
        base = math.lcm(base, config.invariant_chunks // steps.strategy.num_replicas)
    unit = math.lcm(base, multiple)
    name = label or (steps.target.name if steps.target else "this host")
    probing = _Probing(steps, f"{name}: {probe_name}", enough, max_probes)
    first = start if start_fits and start % base == 0 else max(unit, start // unit * unit)
    known = start_fits is not None and first == start
    if known and start_bytes is not None:
        probing.needs[first] = start_bytes
    if start_fits if known else probing.fits(first):
        good, bad = _reach_up(probing, first, fixed_bytes, capacity, unit, limit)
        if not bad:
            return good, probing.probes
    else:
        (good, bad), unit = _halve_down(probing, first, base), base
        if not good:
            return 0, probing.probes
    return _narrow(probing, good, bad, capacity, unit, tolerance, base), probing.probes


class _Probing:
    """The probes of one batch search: each compiled once, announced as it starts and ends,
    with the bytes the compiler reported; ``enough`` may end the search after a fit."""

    def __init__(self, steps: BatchProber, name: str, enough: Callable[[int], bool] | None, budget: int) -> None:
        self.steps, self.name, self.enough, self.budget = steps, name, enough, budget
        self.probes: list[Probe] = []
        self.needs: dict[int, int] = {}  # per-core batch -> bytes per core, as the compiler said
        self.done = False  # ``enough`` said so

    def fits(self, batch: int) -> bool:
        n = len(self.probes) + 1
        progress(f"{self.name} {n}: {batch} per core ...")
        ok, seconds, needed = self.steps.fits(batch)
        self.probes.append(Probe(batch, ok, seconds))
        verdict = "fits" if ok else "does not fit" + (f", needs {gib(needed)}" if needed is not None else "")
        progress(f"{self.name} {n}: {batch} per core {verdict} ({seconds:.0f} s)")
        if needed is not None:
            self.needs[batch] = needed
        self.done = bool(ok and self.enough is not None and self.enough(batch))
        return ok

    @property
    def spent(self) -> bool:
        """The search's compiles are used up."""
        return len(self.probes) >= self.budget


def _reach_up(
    probing: _Probing, good: int, fixed_bytes: int | None, capacity: float, unit: int, limit: int
) -> tuple[int, int]:
    """From a fit, far probes upward until one is refused: ``(last fit, refusal)``, the
    refusal 0 when the search ends without one (the limit, or ``enough``)."""
    line = (0, fixed_bytes)  # the reach's line starts at the state, then runs through the last two fits
    while True:
        far = _reach(good, probing.needs.get(good), line, capacity, unit, limit)
        if far <= good or probing.spent:
            return good, 0
        if not probing.fits(far):
            return good, far
        line, good = (good, probing.needs.get(good)), far
        if probing.done:
            return good, 0


def _halve_down(probing: _Probing, bad: int, base: int) -> tuple[int, int]:
    """From a refusal, halving until a batch fits: ``(that fit, the last refusal)``, the fit
    0 when not even ``base`` does."""
    while True:
        half = bad // 2 // base * base
        if half < base or probing.spent:
            return 0, bad
        if probing.fits(half):
            return half, bad
        bad = half


def _narrow(probing: _Probing, good: int, bad: int, capacity: float, multiple: int, tolerance: float, base: int) -> int:
    """The bracket between a fit and a refusal narrowed to ``tolerance``: the last fit.
    Probes are multiples of ``multiple``, or of ``base`` once the refusal is at or below it."""
    streak: list[bool] = []  # the outcomes of the interpolated probes since the last bisection
    while not probing.done and not probing.spent:
        unit = base if bad <= multiple else multiple
        if _up(good + 1, unit) >= bad or bad - good <= tolerance * good:
            break
        floor = good // unit * unit  # the start may be a known fit below the unit
        guess = _interpolate(good, bad, probing.needs, capacity, unit)
        if guess is not None:
            # Near the capacity the compiler packs tighter and the line lands just above the
            # last fit, which crept up 8 at a time (a v5p search: 33800, 33808, 33816, 33824,
            # two minutes each). A guess at least `tolerance` above it ends the search with one
            # cheap refusal, or moves it up that much.
            guess = min(max(guess, floor + max(unit, int(tolerance * good) // unit * unit)), bad - unit)
        if guess is None or streak[-2:] in ([True, True], [False, False]):
            guess, streak = floor + (bad - floor) // unit // 2 * unit, []
            ok = probing.fits(guess)
        else:
            ok = probing.fits(guess)
            streak.append(ok)
        good, bad = (guess, bad) if ok else (good, guess)
    return good


def _reach(batch: int, used: int | None, line: tuple[int, int | None], capacity: float, unit: int, limit: int) -> int:
    """The next far probe above a fitting ``batch``: 16x, or, given the line's other point
    (``(0, the state's bytes)`` at first, then the previous fit), 5 % beyond where the line
    through it and ``(batch, used)`` crosses ``capacity``: most likely a cheap refusal that
    brackets the answer closely. A fit there moves the line to the last two fits, whose slope
    is the activations' own (the state's line also carries the gradients and the update's
    buffers, which do not grow with the batch, and so undershoots)."""
    other, other_used = line
    if used is None or other_used is None or not capacity or used <= other_used or batch <= other:
        return min(limit, batch * 16) // unit * unit
    per_example = (used - other_used) / (batch - other)
    crossing = batch + (capacity - used) / per_example
    return min(limit, max(_up(batch + 1, unit), int(crossing * 1.05) // unit * unit))


def _up(batch: int, unit: int) -> int:
    """The smallest multiple of ``unit`` at or above ``batch``."""
    return -(-batch // unit) * unit


def _interpolate(good: int, bad: int, needs: dict[int, int], capacity: float, unit: int) -> int | None:
    """The batch at which the line through the bracket's (batch, bytes) meets ``capacity``,
    rounded down to ``unit`` and kept strictly inside the bracket; None when unknown."""
    if not capacity or good not in needs or bad not in needs or needs[bad] <= needs[good]:
        return None
    slope = (needs[bad] - needs[good]) / (bad - good)
    guess = int(good + (capacity - needs[good]) / slope) // unit * unit
    return min(max(guess, _up(good + 1, unit)), bad - unit)
