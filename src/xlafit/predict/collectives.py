"""The collectives a compiled program contains, read from its HLO, and their time over ICI.

XLA's cost analysis counts FLOPs and bytes of each core's own work; what the cores send one
another is in the program text. Each collective instruction of the optimised HLO
(``compiled.as_text()``) gives its kind, the bytes it moves and the size of its replica
groups; instructions inside a ``while`` body count once per trip (the trip count read from
the loop's condition, ``i < N``), inside a fusion or a call once per use.

The TPU compiler writes a reduce-scatter as an ``all-reduce`` inside a fused computation
named ``all-reduce-scatter``: it is counted as the reduce-scatter it is. Asynchronous pairs
(``all-gather-start`` / ``-done``) count once, at the start; the copies of one collective
that an asynchronous collective fusion holds share its channel id and count once.

Time, per collective over a group of ``n`` chips moving ``V`` bytes (the full-size array),
on a ring at the bandwidth of :meth:`xlafit.platform.hardware.Target.ici_bandwidth`:

- all-gather and reduce-scatter: ``(n - 1) / n * V / bandwidth``;
- all-reduce: twice that (a reduce-scatter, then an all-gather);
- all-to-all: ``(n - 1) / n * V / bandwidth`` (each chip keeps 1/n of its data);
- collective-permute: ``V / bandwidth``.

Latency per collective and contention between simultaneous collectives are not modelled.

Example:
    >>> hlo = '''
    ... ENTRY %main (p: bf16[128,64]) -> bf16[1024,64] {
    ...   %p = bf16[128,64]{1,0} parameter(0)
    ...   ROOT %ag = bf16[1024,64]{1,0} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={0}
    ... }'''
    >>> (found,) = collectives(hlo)
    >>> found.kind, found.bytes, found.group
    ('all-gather', 131072, 8)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

from xlafit.platform.hardware import Target
from xlafit.predict.hlo import _ARRAY, array_bytes, loop_trips, walk

__all__ = [
    "KINDS",
    "Collective",
    "CommReport",
    "array_bytes",
    "collectives",
    "group_size",
    "loop_trips",
    "moved_bytes",
    "summarize",
]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# A ring moves (n - 1) / n of the data this many times.
_PASSES = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2, "all-to-all": 1}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, the bytes of the full array it moves, the chips
    of each replica group, and how often one run of the program executes it."""

    kind: str
    bytes: int
    group: int
    count: int = 1
    name: str = ""

    def seconds(self, target: Target) -> float | None:
        """Its time on ``target`` (see the module docstring), or None: no ICI figure."""
        if self.group <= 1:
            return 0.0
        bandwidth = target.ici_bandwidth(self.group)
        if bandwidth is None:
            return None
        share = 1.0 if self.kind == "collective-permute" else _PASSES[self.kind] * (self.group - 1) / self.group
        return self.count * share * self.bytes / bandwidth


def group_size(attributes: str, devices: int) -> int:
    """Chips per replica group from an instruction's attributes, in any of XLA's notations:
    ``{{0,1},{2,3}}``, the iota form ``[4,2]<=[8]`` (4 groups of 2), or the mesh form
    ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (the named axes' sizes multiplied); a
    collective-permute's ``source_target_pairs`` is a group of 2; none given: all ``devices``."""
    found = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if found:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", found.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", found.group(2)))
    found = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)
    if found:
        return int(found.group(2))
    found = re.search(r"replica_groups=\{\{([^}]*)\}", attributes)
    if found:
        return len(found.group(1).split(","))
    if "source_target_pairs" in attributes:
        return 2
    return devices


def collectives(hlo: str, devices: int = 1) -> list[Collective]:
    """Every collective of a compiled program's HLO text, each with how often it runs.

    ``devices``: the group size of a collective that names no replica groups (all of them).
    """
    counts: dict[tuple[str, str], Collective] = {}
    for found, times, computation, fused_in in walk(hlo):
        op, rest = found.group("op"), found.group("rest")
        kind = op.removesuffix("-start")
        if kind not in KINDS or op.endswith("-done"):
            continue
        if kind == "all-reduce" and fused_in.startswith("all-reduce-scatter"):
            kind = "reduce-scatter"
        size = moved_bytes(kind, op, found.group("shape"), rest)
        # The TPU compiler copies one collective into the pieces of an asynchronous fusion
        # (its start and continuations), all with the collective's channel id: a channel is
        # one collective, run as often as its most frequent copy.
        channel = re.search(r"channel_id=(\d+)", rest)
        key = ("channel", channel.group(1)) if channel else (computation, found.group("name"))
        before = counts.get(key)
        if before is None:
            counts[key] = Collective(kind, size, group_size(rest, devices), times, found.group("name"))
        elif channel is None:
            counts[key] = dataclasses.replace(before, count=before.count + times)
        else:
            counts[key] = dataclasses.replace(before, count=max(before.count, times))
    return list(counts.values())


def moved_bytes(kind: str, op: str, shape: str, rest: str) -> int:
    """The full array's bytes: the result of an all-gather (its largest tuple element for the
    ``-start`` form, which also holds the operand), the operand of a reduce-scatter."""
    if kind == "reduce-scatter" and op == "reduce-scatter":
        operands = rest.split(")", 1)[0]
        return array_bytes(operands) or array_bytes(shape) * group_size(rest, 1)
    if op.endswith("-start") and kind in ("all-gather", "collective-permute"):
        return max((array_bytes(m.group(0)) for m in _ARRAY.finditer(shape)), default=0)
    return array_bytes(shape)


@dataclasses.dataclass
class CommReport:
    """Collectives summed by kind (bytes per run of the program, and seconds on a target)."""

    by_kind: dict[str, dict[str, float]]
    seconds: float | None  # None: the target's ICI bandwidth is not in the hardware table
    count: int

    def to_json(self) -> dict:
        return {"by_kind": self.by_kind, "seconds": self.seconds, "count": self.count}


def summarize(found: Iterable[Collective], target: Target, per: int = 1) -> CommReport:
    """Bytes and seconds per kind, divided by ``per`` (the steps one run of the program does)."""
    by_kind: dict[str, dict[str, float]] = {}
    total: float | None = 0.0
    count = 0
    for c in found:
        row = by_kind.setdefault(c.kind, {"bytes": 0.0, "count": 0, "seconds": 0.0})
        row["bytes"] += c.bytes * c.count / per
        row["count"] += c.count / per
        count += c.count
        seconds = c.seconds(target)
        if seconds is None:
            total = None
        else:
            row["seconds"] += seconds / per
            total = None if total is None else total + seconds / per
    return CommReport(by_kind, total, count // per)
