"""What fills a core's HBM at a program's peak, read from the TPU compiler's own dump.

A program that does not fit is refused at buffer assignment, after the compiler has placed
every buffer; with ``xla_dump_to`` it writes that assignment even for a refusal
(``*after_optimizations-buffer-assignment.txt``) beside the optimised program
(``*after_optimizations.txt``), whose instructions carry the JAX operation and the Python
line that made them. :func:`largest_buffers` joins the two: the largest live regions of the
program's temporary allocation, each named by the operation, shape and source line of the
values placed there, identical ones counted together (the attention scores of 24 layers
are one line, ``24 x``).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

_VALUE = re.compile(
    r"value: <\d+ (?P<name>[\w.\-]+)(?:\{[^}]*\})? @\d+> \(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>\S+)"
)
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+),(.*)$")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One kind of buffer at the peak: how many, the bytes of each, what and where."""

    count: int
    bytes: int
    shape: str
    operation: str
    where: str

    def describe(self) -> str:
        many = f"{self.count} x " if self.count > 1 else ""
        where = f" at {self.where}" if self.where else ""
        return f"{many}{self.shape} ({_size(self.bytes * self.count)}): {self.operation}{where}"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 / 100 else f"{n / 2**20:.1f} MiB"


def _temporaries(assignment: str) -> list[tuple[str, int, int, str]]:
    """``(instruction, size, offset, shape)`` of the values of the largest temporary allocation."""
    best: list[tuple[str, int, int, str]] = []
    current: list[tuple[str, int, int, str]] | None = None  # the allocation being read, if a temporary one
    best_size, current_size = -1, 0
    for line in assignment.splitlines():
        head = _ALLOCATION.match(line)
        if head:
            if current is not None and current_size > best_size:
                best, best_size = current, current_size
            current = [] if "preallocated-temp" in head.group(2) and "color" not in head.group(2) else None
            current_size = int(head.group(1))
            continue
        found = _VALUE.search(line)
        if found and current is not None and not found.group("shape").startswith("("):  # a tuple: pointers
            shape = re.sub(r"\{[^}]*\}", "", found.group("shape"))
            current.append((found.group("name"), int(found.group("size")), int(found.group("offset")), shape))
    if current is not None and current_size > best_size:
        best = current
    return best


def _sources(program: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (JAX operation, ``file:line``) from the optimised program's metadata.

    The line is the innermost frame of the call stack outside installed packages (the
    user's or xlafit's line that called into Flax or JAX); the stack table's parents are
    numbered from 1, 0 meaning none.
    """
    files = dict(re.findall(r'^(\d+) "([^"]*)"$', program.split("FunctionNames")[0], re.M))
    locations = {
        i: (files.get(f, "?"), line)
        for i, f, line in re.findall(r"^(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)", program, re.M)
    }
    frames = {
        i: (loc, int(parent) - 1)
        for i, loc, parent in re.findall(r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", program, re.M)
    }

    def where(frame: str) -> str:
        chain: list[tuple[str, str]] = []
        while frame in frames and len(chain) < 64:
            loc, parent = frames[frame]
            chain.append(locations.get(loc, ("", "")))
            frame = str(parent)
        own = [(f, line) for f, line in chain if f and "site-packages" not in f]
        file, line = (own or chain or [("", "")])[0]
        return f"{_short(file)}:{line}" if file else ""

    out = {}
    for name, op_name, frame in re.findall(
        r"%([\w.\-]+) = .*?metadata=\{op_name=\"([^\"]*)\"(?: stack_frame_id=(\d+))?", program
    ):
        out[name] = (op_name.rsplit("/", 1)[-1], where(frame))
    return out


def _short(path: str) -> str:
    """A source path from the package or project down (``xlafit/models/bert.py``)."""
    parts = Path(path).parts
    for anchor in ("xlafit", "site-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + (anchor == "site-packages") :])
    return "/".join(parts[-2:])


def largest_buffers(dump: Path, top: int = 5) -> list[Buffer]:
    """The largest kinds of buffer in the temporary memory of the program dumped in ``dump``
    (the train step: the dump's largest module); [] when the dump has none."""
    assignments = sorted(dump.glob("*after_optimizations-buffer-assignment.txt"), key=lambda p: p.stat().st_size)
    if not assignments:
        return []
    assignment = assignments[-1]
    program_file = Path(str(assignment).replace("-buffer-assignment.txt", ".txt"))
    sources = _sources(program_file.read_text()) if program_file.exists() else {}
    regions: dict[int, tuple[int, str, str]] = {}  # offset -> the largest value placed there
    for name, size, offset, shape in _temporaries(assignment.read_text()):
        if size > regions.get(offset, (0, "", ""))[0]:
            regions[offset] = (size, name, shape)
    kinds: collections.Counter[tuple[int, str, str, str]] = collections.Counter()
    for size, name, shape in regions.values():
        operation, where = sources.get(name, (name, ""))
        kinds[(size, shape, operation, where)] += 1
    ranked = sorted(kinds.items(), key=lambda kv: -kv[0][0] * kv[1])
    return [Buffer(n, size, shape, op, where) for (size, shape, op, where), n in ranked[:top]]
