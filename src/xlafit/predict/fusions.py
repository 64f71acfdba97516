"""The work inside one fusion: its FLOPs, element-wise work and HBM traffic, read from its
fused computation.

A parameter that is only sliced is read at the slices' size; one that is the buffer of a
root ``dynamic-update-slice`` or ``scatter`` is updated in place (its update written, the
buffer not read); one that is unused, passed straight out, or only sent by a collective
inside the fusion (a TPU's asynchronous collective fusion carries an all-gather's buffers
through the compute it overlaps) costs no HBM traffic here.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterator
from typing import cast

from xlafit.predict.hlo import _INSTRUCTION, _dims, _operand_names, _product_shape, product_flops
from xlafit.predict.kernel import (
    _COLLECTIVES,
    _FREE,
    _IN_PLACE,
    _PASS_THROUGH,
    _SLICING,
    VECTOR_COST,
    Kernel,
    _Computation,
    _dtype,
    hbm_bytes,
)

__all__ = ["fusion_kernel"]


def fusion_kernel(
    name: str,
    shape: str,
    rest: str,
    operands: list[str],
    shapes: dict[str, str],
    computations: dict[str, _Computation],
    signatures: bool,
) -> Kernel:
    callee = re.search(r"calls=%([\w.\-]+)", rest)
    fused = computations.get(callee.group(1)) if callee else None
    fusion_kind = re.search(r"kind=(k\w+)", rest)
    target = fusion_kind.group(1) if fusion_kind else ""
    if fused is None:
        return Kernel(
            name,
            "other",
            1,
            bytes_read=sum(hbm_bytes(shapes.get(o, "")) for o in operands),
            bytes_written=hbm_bytes(shape),
            target=target,
        )
    read, in_place = _fusion_reads(fused, [shapes.get(o, "") for o in operands], computations)
    written = _fusion_writes(fused, in_place)
    flops, dims = _products(fused, computations)
    vector = 0.0
    ops: set[str] = set()
    local = {n: m.group("shape") for n, m in fused.by_name.items()}
    for inner in fused.by_name.values():
        op = inner.group("op")
        ops.add(op)
        if op == "reduce":
            source = _operand_names(inner.group("rest"))
            vector += math.prod(_dims(local.get(source[0], ""))) if source else 0
        elif op not in _FREE:
            vector += VECTOR_COST.get(op, 1.0) * math.prod(_dims(inner.group("shape")))
    kind = _fusion_kind(name, target, ops, fused, flops)
    signature = _signature(fused) if signatures else ""
    elements = _fusion_elements(fused) if kind == "elementwise" else 0
    return Kernel(
        name, kind, 1, flops, vector, read, written, dims, _dtype(shape), target, signature, elements=elements
    )


def _products(fused: _Computation, computations: dict[str, _Computation]) -> tuple[float, tuple[int, ...]]:
    """The FLOPs of the matrix products in ``fused`` and in the fusions nested in it (XLA's TPU
    backend fuses a product's producer fusion into the next product: an MLP's gate inside its
    down projection's fusion), and the first one's shape."""
    flops, dims = 0.0, cast(tuple[int, ...], ())
    local = {n: m.group("shape") for n, m in fused.by_name.items()}
    for inner in fused.by_name.values():
        op = inner.group("op")
        if op in ("dot", "convolution"):
            flops += product_flops(op, inner.group("shape"), inner.group("rest"), local)
            dims = dims or _product_shape(op, inner.group("shape"), inner.group("rest"), local)
        elif op == "fusion" and (callee := re.search(r"calls=%([\w.\-]+)", inner.group("rest"))):
            nested = computations.get(callee.group(1))
            if nested is not None:
                more, more_dims = _products(nested, computations)
                flops, dims = flops + more, dims or more_dims
    return flops, dims


def _signature(fused: _Computation) -> str:
    """A fused computation's text with instruction names numbered in order and metadata
    dropped: equal for the copies of one layer's fusion."""
    numbers: dict[str, str] = {}
    lines = []
    for line in fused.lines:
        found = _INSTRUCTION.match(line)
        if found is None:
            continue
        numbers[found.group("name")] = str(len(numbers))
        rest = re.sub(r",\s*(metadata|backend_config)=.*$", "", found.group("rest"))
        rest = re.sub(r"%([\w.\-]+)", lambda m: "%" + numbers.get(m.group(1), "c"), rest)
        lines.append(f"{found.group('shape')} {found.group('op')}({rest}")
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:16]


def _fusion_kind(name: str, target: str, ops: set[str], fused: _Computation, flops: float) -> str:
    if flops and "convolution" in ops:
        return "convolution" if not name.startswith(("gemm_fusion", "fusion")) or "dot" not in ops else "matmul"
    if flops:
        return "matmul"
    if ops & {"scatter", "gather", "sort"}:
        return "gather"
    if "reduce" in ops or "reduce-window" in ops or name.startswith("input_"):
        return "reduction"
    root = fused.by_name.get(fused.root)
    moves = {"parameter", "bitcast", "reshape", "transpose", "copy", "tuple", "convert"}
    if "transpose" in ops and ops <= moves or (root is not None and "transpose" in name and ops <= moves):
        return "transpose"
    return "elementwise"


def _users(fused: _Computation) -> dict[str, list[tuple[re.Match[str], int]]]:
    """Each instruction's users in a fused computation, with the operand position it fills."""
    users: dict[str, list[tuple[re.Match[str], int]]] = {}
    for inner in fused.by_name.values():
        for position, operand in enumerate(_operand_names(inner.group("rest"))):
            users.setdefault(operand, []).append((inner, position))
    return users


def _parameters(fused: _Computation) -> dict[int, str]:
    """A fused computation's parameters by number."""
    params = {}
    for inner in fused.by_name.values():
        if inner.group("op") == "parameter":
            number = re.match(r"(\d+)", inner.group("rest"))
            if number:
                params[int(number.group(1))] = inner.group("name")
    return params


def _sliced_bytes(
    param: str, fused: _Computation, computations: dict[str, _Computation], depth: int = 0
) -> float | None:
    """The bytes read of a parameter used only through slices, directly or inside the
    fusions nested in ``fused`` (a TPU fusion around a product slices a scanned stack in
    an inner fusion); None when some use reads it whole, or when it flows out of ``fused``
    (a nested fusion's output: what uses it there reads it)."""
    uses = _terminal_uses(param, _users(fused))
    if not uses:
        return None
    total = 0.0
    for use, position in uses:
        op = use.group("op")
        if op in _SLICING and position == 0:
            total += hbm_bytes(use.group("shape"))
            continue
        callee = re.search(r"calls=%([\w.\-]+)", use.group("rest")) if op == "fusion" else None
        nested = computations.get(callee.group(1)) if callee else None
        inner = _parameters(nested).get(position) if nested is not None else None
        read = _sliced_bytes(inner, nested, computations, depth + 1) if inner and nested and depth < 4 else None
        if read is None:
            return None
        total += read
    return total


def _fusion_reads(
    fused: _Computation, operand_shapes: list[str], computations: dict[str, _Computation] | None = None
) -> tuple[float, set[str]]:
    """Bytes a fusion reads of its operands, and the parameters it updates in place.

    A parameter used only through slices (a layer's weights out of a scanned stack, here or
    in a fusion nested in this one) is read at the slices' size; one that is the buffer of a
    root ``dynamic-update-slice`` or ``scatter`` is updated in place, not read."""
    users = _users(fused)
    params = _parameters(fused)
    roots = _root_outputs(fused)
    total, in_place = 0.0, set()
    for index, operand in enumerate(operand_shapes):
        param = params.get(index)
        full = hbm_bytes(operand)
        if param is None:
            total += full
            continue
        uses = _terminal_uses(param, users)
        if uses and all(u.group("op") in _IN_PLACE and pos == 0 and u.group("name") in roots for u, pos in uses):
            in_place.add(param)
            continue
        if all(u.group("op") == "tuple" or u.group("op").removesuffix("-start") in _COLLECTIVES for u, _ in uses):
            continue  # unused, carried through (an asynchronous collective's buffers) or sent: no HBM read here
        sliced = _sliced_bytes(param, fused, computations or {}) if uses else None
        total += full if sliced is None else min(full, sliced)
    return total, in_place


def _terminal_uses(name: str, users: dict[str, list[tuple[re.Match[str], int]]]) -> list[tuple[re.Match[str], int]]:
    """The uses of ``name``, looking through bitcasts and reshapes."""
    out = []
    for user, position in users.get(name, []):
        if user.group("op") in _PASS_THROUGH:
            out += _terminal_uses(user.group("name"), users)
        else:
            out.append((user, position))
    return out


def _root_outputs(fused: _Computation) -> set[str]:
    """The instructions a fused computation returns (the root, or a root tuple's elements)."""
    root = fused.by_name.get(fused.root)
    if root is None:
        return set()
    names = _operand_names(root.group("rest")) if root.group("op") == "tuple" else [fused.root]
    out = set()
    for name in names:  # through bitcasts: a root bitcast of an in-place update is that update
        inner = fused.by_name.get(name)
        while inner is not None and inner.group("op") in _PASS_THROUGH:
            name = _operand_names(inner.group("rest"))[0]
            inner = fused.by_name.get(name)
        out.add(name)
    return out


def _written_shapes(fused: _Computation) -> Iterator[str]:
    """The shape each output of a fusion writes: the output's, or the update's of an operand
    updated in place (``dynamic-update-slice``, ``scatter``); a buffer carried through and a
    collective's result (priced as the collective) write nothing."""
    for name in _root_outputs(fused):
        inner = fused.by_name.get(name)
        if inner is None:
            continue
        if inner.group("op") == "parameter" or inner.group("op").removesuffix("-start") in _COLLECTIVES:
            continue
        if inner.group("op") in _IN_PLACE:
            names = _operand_names(inner.group("rest"))
            position = _IN_PLACE[inner.group("op")]
            update = fused.by_name.get(names[position]) if len(names) > position else None
            inner = update or inner
        yield inner.group("shape")


def _fusion_elements(fused: _Computation) -> int:
    """The elements a loop fusion computes: its largest output's (an update's, in place)."""
    return max((math.prod(_dims(shape)) for shape in _written_shapes(fused)), default=0)


def _fusion_writes(fused: _Computation, in_place: set[str]) -> float:
    """Bytes a fusion writes: each output's, a ``dynamic-update-slice`` or ``scatter`` of an
    operand updated in place at its update's size."""
    return float(sum(hbm_bytes(shape) for shape in _written_shapes(fused)))
