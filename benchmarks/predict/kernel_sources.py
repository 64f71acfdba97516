"""Where a stored GPU step's time goes, kernel by kernel, with the model lines behind each:
the profiled kernels of a step (``kernels.json.gz``) beside the step model's prediction, and
for each fusion the JAX operations it computes and the source lines they were traced from
(the compiled program's stack frames), innermost project line first.

    python benchmarks/predict/kernel_sources.py bert [--top 15] [--folder benchmarks/validation/gpu-h200]

Prints Markdown: one row per kernel (or group of library kernels) that makes up the most of
the measured step, its time per step, launches, predicted time, and what it is.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
from pathlib import Path

from xlafit.predict.rates import rates_for
from xlafit.predict.validation import kernel_units

ROOT = Path(__file__).resolve().parents[2]
_TABLE = re.compile(r"^(\d+) (.*)$")


def _tables(hlo: str) -> tuple[dict[int, str], dict[int, str], dict[int, tuple[int, int, int]], dict[int, tuple]]:
    """The program's FileNames, FunctionNames, FileLocations and StackFrames tables."""
    sections: dict[str, list[str]] = collections.defaultdict(list)
    current = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = line
        elif current and _TABLE.match(line):
            sections[current].append(line)
        elif current and line and not line[0].isdigit():
            current = None
    files = {int(n): text.strip('"') for n, text in (_TABLE.match(x).groups() for x in sections["FileNames"])}
    functions = {int(n): text.strip('"') for n, text in (_TABLE.match(x).groups() for x in sections["FunctionNames"])}
    locations = {}
    for line in sections["FileLocations"]:
        n, text = _TABLE.match(line).groups()
        fields = dict(re.findall(r"(\w+)=(\d+)", text))
        locations[int(n)] = (int(fields["file_name_id"]), int(fields["function_name_id"]), int(fields["line"]))
    frames = {}
    for line in sections["StackFrames"]:
        n, text = _TABLE.match(line).groups()
        fields = dict(re.findall(r"(\w+)=(\d+)", text))
        frames[int(n)] = (int(fields["file_location_id"]), int(fields.get("parent_frame_id", 0)))
    return files, functions, locations, frames


def _source(frame: int, tables: tuple) -> str:
    """The innermost frame in the project's own code (``xlafit/``), else the innermost."""
    files, functions, locations, frames = tables
    chain = []
    seen = set()
    while frame and frame in frames and frame not in seen:
        seen.add(frame)
        location, parent = frames[frame]
        f, fn, line = locations[location]
        chain.append((files[f], functions[fn], line))
        frame = parent
    own = [c for c in chain if "/xlafit/" in c[0]]
    path, function, line = (own or chain or [("?", "?", 0)])[0]
    short = path.split("/xlafit/")[-1] if "/xlafit/" in path else path.split("site-packages/")[-1]
    return f"{short}:{line} {function}"


def _computations(hlo: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            out[name] = []
        elif name and line.startswith("  "):
            out[name].append(line)
    return out


def describe(
    instruction: str, calls: dict[str, str], tables: tuple, computations: dict[str, list[str]]
) -> tuple[str, str]:
    """(the JAX operations a kernel computes, their source lines), from its instruction."""
    line = calls.get(instruction, "")
    callee = re.search(r"calls=%([\w.\-]+)", line)
    body = computations.get(callee.group(1), []) if callee else [line]
    names, sources = collections.Counter(), collections.Counter()
    for inner in body or [line]:
        op = re.search(r'op_name="([^"]+)"', inner)
        if op:
            names[re.sub(r"^jit\([^)]*\)/(while/body/)?(eval_jaxpr/)?", "", op.group(1))] += 1
        frame = re.search(r"stack_frame_id=(\d+)", inner)
        if frame:
            sources[_source(int(frame.group(1)), tables)] += 1
    ops = ", ".join(n for n, _ in names.most_common(3))
    return ops or "-", "; ".join(s for s, _ in sources.most_common(3)) or "-"


def _calls(computations: dict[str, list[str]]) -> dict[str, str]:
    """Each instruction that launches a fusion or library call, by name: its line."""
    out = {}
    for body in computations.values():
        for line in body:
            found = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
            if found and ("calls=%" in line or "custom-call(" in line):
                out[found.group(1)] = line
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", help="bert, resnet or llm (a <name>.hlo.txt.gz in the folder)")
    parser.add_argument("--folder", default=str(ROOT / "benchmarks" / "validation" / "gpu-h200"))
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    folder = Path(args.folder)
    hlo = gzip.open(folder / f"{args.workload}.hlo.txt.gz", "rt").read()
    tables = _tables(hlo)
    computations = _computations(hlo)
    calls = _calls(computations)
    rates = rates_for("NVIDIA H200")
    units = kernel_units(folder, args.workload, rates)
    total = sum(u.measured_s for u in units)
    print(f"{args.workload}: {total * 1e3:.1f} ms of kernels a step ({folder.name})\n")
    print("| kernel | ms/step | share | launches | predicted | computes | from |")
    print("|---|---:|---:|---:|---:|---|---|")
    for u in units[: args.top]:
        instruction = u.name.replace("_", ".")
        found = [n for n in (u.name, instruction, re.sub(r"_(\d+)$", r".\1", u.name)) if f"%{n} = " in hlo]
        ops, sources = describe(found[0], calls, tables, computations) if found else ("library kernels", "-")
        print(
            f"| {u.name} | {u.measured_s * 1e3:.2f} | {u.measured_s / total:.1%} | {u.launches} | "
            f"{u.predicted_s * 1e3:.2f} | {ops} | {sources} |"
        )


if __name__ == "__main__":
    main()
