"""Reading a compiled program's optimised HLO text (``compiled.as_text()``).

What XLA's cost analysis leaves out is in the program text: the collectives one core sends
the others (:mod:`xlafit.predict.collectives`) and the work inside custom calls, such as the Pallas
kernels of splash attention, whose FLOPs the cost analysis does not see
(:func:`kernel_flops`). :func:`walk` visits every instruction with how often one run of
the program executes it: inside a ``while`` body once per trip (the trip count read from
the loop's condition, ``i < N``), inside a fusion or a call once per use.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterator

from xlafit.models.splash import block_size

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")


def array_bytes(shape: str) -> int:
    """Bytes of an HLO shape: ``bf16[768,3072]{1,0:T(8,128)}``, or the sum over a tuple's arrays."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """The program's computations (name -> instruction lines) and the entry's name."""
    bodies: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group("name")
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.rstrip() == "}":  # a custom call's config may hold lines that start with "}" too
            current = None
        elif current is not None:
            bodies[current].append(line)
    return bodies, entry


def _trip_count(condition: list[str], body: list[str] | None = None) -> int:
    """The trip count of a ``while`` whose condition compares its counter against a constant
    (``i < N``, as ``lax.scan`` and ``fori_loop`` lower), the counter starting at 0 and
    stepping by what the body adds to it (a windowed einsum's bidirectional loop steps by 2);
    1 when it is not that simple."""
    constants = [int(c) for line in condition for c in re.findall(r"constant\((\d+)\)", line)]
    compares = [line for line in condition if "compare(" in line and "direction=LT" in line]
    if not (compares and constants):
        return 1
    bound = max(constants)
    step = _counter_step(condition, body) if body else 1
    return max(1, -(-bound // step))


def _counter_step(condition: list[str], body: list[str]) -> int:
    """What the loop body adds to the counter the condition compares (1 if not found)."""
    index = next((re.search(r"index=(\d+)", line) for line in condition if "get-tuple-element(" in line), None)
    root = next((line for line in reversed(body) if line.lstrip().startswith("ROOT")), None)
    found = _INSTRUCTION.match(root) if root and " tuple(" in root else None
    if index is None or found is None:
        return 1
    outputs = _operand_names(found.group("rest"))
    k = int(index.group(1))
    if k >= len(outputs):
        return 1
    update = _defined(body, outputs[k])
    if update is None or update.group("op") != "add":
        return 1
    for operand in _operand_names(update.group("rest")):
        constant = _defined(body, operand)
        if constant is not None and constant.group("op") == "constant":
            value = re.match(r"(\d+)\)", constant.group("rest"))
            if value and int(value.group(1)) > 0:
                return int(value.group(1))
    return 1


def _defined(lines: list[str], name: str) -> re.Match[str] | None:
    """The instruction of ``lines`` that defines ``%name``."""
    prefix = f"%{name} = "
    for line in lines:
        if prefix in line:
            found = _INSTRUCTION.match(line)
            if found and found.group("name") == name:
                return found
    return None


def loop_trips(hlo: str) -> list[int]:
    """The trip count of every ``while`` loop of a program (see :func:`_trip_count`)."""
    bodies, _ = _computations(hlo)
    return [
        _trip_count(bodies.get(condition, []), bodies.get(body, []))
        for lines in bodies.values()
        for line in lines
        for condition, body in re.findall(r"\bwhile\(.*condition=%([\w.\-]+), body=%([\w.\-]+)", line)
    ]


def walk(hlo: str, outer: Collection[int] = ()) -> Iterator[tuple[re.Match[str], int, str, str]]:
    """Every instruction of a program: ``(match, times, computation, fused_in)``, the match's
    groups ``name``, ``shape``, ``op`` and ``rest`` (operands and attributes), ``times`` how
    often one run executes it, ``fused_in`` the fusion computation it sits in ("" if none).
    Loops whose trip count is in ``outer`` are not counted in ``times``."""
    bodies, entry = _computations(hlo)

    def visit(name: str, times: int, fused_in: str) -> Iterator[tuple[re.Match[str], int, str, str]]:
        for line in bodies.get(name, ()):
            found = _INSTRUCTION.match(line)
            if found is None:
                continue
            yield found, times, name, fused_in
            op, rest = found.group("op"), found.group("rest")
            if op == "while":
                body = re.search(r"body=%([\w.\-]+)", rest)
                condition = re.search(r"condition=%([\w.\-]+)", rest)
                trips = (
                    _trip_count(bodies.get(condition.group(1), []), bodies.get(body.group(1), []) if body else None)
                    if condition
                    else 1
                )
                if body:
                    yield from visit(body.group(1), times * (1 if trips in outer else trips), fused_in)
                continue
            for callee in re.findall(r"(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)", rest):
                yield from visit(callee, times, callee if op == "fusion" else fused_in)
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            for callee in re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else ():
                yield from visit(callee, times, fused_in)

    yield from visit(entry, 1, "")


# Splash attention's kernels, by the name the program gives their custom call, and the
# matrix products each does per query head and per (query block, key block) pair it visits:
# the forward S = QK^T and O = PV; the backward's dq kernel recomputes S, then dP = dO V^T
# and dQ = dS K; its dkv kernel recomputes S and dP, then dV = P^T dO and dK = dS^T Q.
SPLASH_PRODUCTS = {"fwd": 2, "dq": 3, "dkv": 4}
_SPLASH = re.compile(r"^splash_mh?q?a_(fwd|dq|dkv)")


def kernel_flops(hlo: str) -> float:
    """FLOPs of the splash-attention kernels one run of a program executes (per core): each
    call's products over the blocks a causal mask leaves, ``2 * T * T * D`` per head and
    product for a full square. The query heads come from the forward's and dq kernel's
    output ``[B, heads, T, D]`` (``[heads, T, D]`` for one row per shard); a dkv kernel,
    whose outputs are per key/value head, is counted with the program's query heads."""
    calls = []
    heads = 0
    for found, times, _, _ in walk(hlo):
        splash = _SPLASH.match(found.group("name"))
        if splash is None or found.group("op") != "custom-call":
            continue
        dims = [[int(d) for d in shape.split(",") if d] for _, shape in _ARRAY.findall(found.group("shape"))]
        # Scratch buffers come first, then the output [B, heads, T, D] (the batch dimension
        # is dropped when a shard holds one row), then residuals: the first of highest rank.
        rank = max((len(d) for d in dims), default=0)
        if rank not in (3, 4):
            continue
        b, h, t, d = ([1] if rank == 3 else []) + next(d for d in dims if len(d) == rank)
        if splash.group(1) != "dkv":
            heads = max(heads, h)
        calls.append((splash.group(1), times, b, h, t, d))
    total = 0.0
    for kind, times, b, h, t, d in calls:
        block = block_size(t) or t
        blocks = t // block
        visited = blocks * (blocks + 1) / 2 / blocks**2  # the causal mask's share of the blocks
        if kind == "dkv":
            h = heads or h
        total += times * SPLASH_PRODUCTS[kind] * 2 * b * h * t * t * d * visited
    return total


def _dims(shape: str) -> list[int]:
    """The dimensions of an HLO shape's first array (``f32[64,512]{1,0}`` -> ``[64, 512]``)."""
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _operand_names(rest: str) -> list[str]:
    """The operands' names of an instruction: up to the parenthesis that closes its list (a
    GPU or CPU program prints each operand with its shape, whose layout may hold parentheses)."""
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        if ch == ")":
            if depth == 0:
                return re.findall(r"%([\w.\-]+)", rest[:i])
            depth -= 1
    return re.findall(r"%([\w.\-]+)", rest)


def product_flops(op: str, shape: str, rest: str, shapes: dict[str, str]) -> float:
    """FLOPs of one matrix product (``dot``, or ``ragged-dot``: a grouped product, whose rows
    each meet one group's matrix) or convolution, as XLA's cost analysis counts them: 2 x
    the multiply-adds. TPU programs write products, batched ones too, as
    convolutions whose window strides and dilations lay batch dimensions out as spatial ones
    (:func:`_convolution_fmas`). 0 for any other operation, or where a shape is not known."""
    names = _operand_names(rest)
    if op in ("dot", "ragged-dot") and names and names[0] in shapes:
        lhs = _dims(shapes[names[0]])
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        summed = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting else 1
        ragged = re.search(r"lhs_ragged_dims=\{(\d+)\}", rest)
        if op == "ragged-dot" and ragged and contracting and ragged.group(1) in contracting.group(1).split(","):
            # Contracting over the ragged rows (a weight gradient, [g, k, n] out): each group
            # sums its own rows only, so the rows are summed once, not once per group.
            return 2.0 * math.prod(_dims(shape)) * summed / max(_dims(shape)[0], 1)
        # A ragged dot's rows meet their own group's matrix only: 2 m n k, as a dot's.
        return 2.0 * math.prod(_dims(shape)) * summed
    if op == "convolution" and len(names) > 1 and names[0] in shapes and names[1] in shapes:
        return 2.0 * _convolution_fmas(_dims(shapes[names[0]]), _dims(shapes[names[1]]), _dims(shape), rest)
    return 0.0


def _product_shape(op: str, shape: str, rest: str, shapes: dict[str, str]) -> tuple[int, ...]:
    """(batch, m, n, k) of a ``dot``; a convolution's (1, positions, output features, taps x
    input features), from its FLOPs and output."""
    names = _operand_names(rest)
    if op == "dot" and len(names) > 1:
        lhs, rhs = _dims(shapes.get(names[0], "")), _dims(shapes.get(names[1], ""))

        def dims(key: str) -> list[int]:
            found = re.search(key + r"=\{([\d,]*)\}", rest)
            return [int(d) for d in found.group(1).split(",") if d] if found else []

        lb, lk, rb, rk = (
            dims("lhs_batch_dims"),
            dims("lhs_contracting_dims"),
            dims("rhs_batch_dims"),
            dims("rhs_contracting_dims"),
        )
        if not lhs or not rhs:
            return ()
        m = math.prod(s for d, s in enumerate(lhs) if d not in lb and d not in lk)
        n = math.prod(s for d, s in enumerate(rhs) if d not in rb and d not in rk)
        return (math.prod(lhs[d] for d in lb), m, n, math.prod(lhs[d] for d in lk))
    flops = product_flops(op, shape, rest, shapes)
    out = _dims(shape)
    labels = re.search(r"dim_labels=\w+_\w+->(\w+)", rest)
    if not out or not labels or "f" not in labels.group(1):
        return ()
    features = out[labels.group(1).index("f")]
    positions = math.prod(out) // max(features, 1)
    return (1, positions, features, round(flops / 2 / max(positions * features, 1)))


def _convolution_fmas(lhs: list[int], rhs: list[int], out: list[int], rest: str) -> int:
    """Multiply-adds of a convolution, counted as XLA's cost analysis counts them: per spatial
    dimension, the (output, kernel) position pairs that land on an input element (not on
    padding, not between the elements of a dilated input), times batch, input features per
    group and output features."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if not labels or not (len(labels.group(1)) == len(lhs) and len(labels.group(2)) == len(rhs) == len(out)):
        return 0
    lhs_l, rhs_l, out_l = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", rest)
    attrs = dict(re.findall(r"(\w+)=([-\w.x]+)", window.group(1))) if window else {}  # pads may be negative
    spatial = sorted(c for c in lhs_l if c.isdigit())

    def per_dim(key: str, default: int) -> list[int]:
        values = attrs.get(key)
        found = [int(v.split("_")[0]) for v in values.split("x")] if values else []
        return found if len(found) == len(spatial) else [default] * len(spatial)

    strides, lhs_dilate, rhs_dilate = per_dim("stride", 1), per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
    pads = per_dim("pad", 0)  # the low side of each dimension's low_high padding
    fmas = 1
    for d, c in enumerate(spatial):
        size, kernel, outputs = lhs[lhs_l.index(c)], rhs[rhs_l.index(c)], out[out_l.index(c)]
        dilated = (size - 1) * lhs_dilate[d] + 1
        valid = 0
        for o in range(outputs):
            for k in range(kernel):
                at = o * strides[d] - pads[d] + k * rhs_dilate[d]
                valid += 0 <= at < dilated and at % lhs_dilate[d] == 0
        fmas *= valid
    groups = re.search(r"feature_group_count=(\d+)", rest)
    batch_groups = re.search(r"batch_group_count=(\d+)", rest)
    features_in = lhs[lhs_l.index("f")] // (int(groups.group(1)) if groups else 1)
    batch = lhs[lhs_l.index("b")] // (int(batch_groups.group(1)) if batch_groups else 1)
    return fmas * batch * features_in * out[out_l.index("f")]


def loop_flops(hlo: str, outer: Collection[int] = ()) -> float:
    """FLOPs of matrix products and convolutions that XLA's cost analysis leaves out of a
    program's loops.

    The cost analysis counts a ``while`` body once, however often it runs: a model that scans
    its layers (``nnx.scan``, ``lax.scan``) is counted as one layer. Here each product in a
    loop (:func:`product_flops`, fused ones included) counts ``trips - 1`` more times; small
    element-wise FLOPs are left out. Loops whose trip count is in ``outer`` (the steps of one
    call, the micro-batches of an accumulation: the caller accounts for them) are not
    multiplied. HBM bytes are not corrected: in such a loop XLA counts the whole stacked
    buffer that each trip slices or updates in place, which a per-trip count cannot undo.
    """
    bodies, _ = _computations(hlo)
    shapes = {
        name: {m.group("name"): m.group("shape") for line in lines if (m := _INSTRUCTION.match(line))}
        for name, lines in bodies.items()
    }
    total = 0.0
    for found, times, computation, _ in walk(hlo, outer):
        if times > 1:
            op, shape, rest = found.group("op"), found.group("shape"), found.group("rest")
            total += (times - 1) * product_flops(op, shape, rest, shapes.get(computation, {}))
    return total
