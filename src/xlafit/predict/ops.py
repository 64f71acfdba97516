"""The kernels of a compiled program, each with the work it does: read from the optimised HLO.

One run of a compiled step launches a sequence of kernels: on a GPU each fusion, library call
(cuBLAS GEMM, cuDNN convolution or attention) and copy is one kernel; on a TPU each fusion
and custom call (a Pallas kernel) is one. :func:`kernels` lists them with, per execution:

- ``flops``: the multiply-adds x 2 of the matrix products and convolutions it runs (a library
  call's from its operand shapes, which XLA's cost analysis leaves out);
- ``vector``: its element-wise work in units of one float add per element
  (:data:`VECTOR_COST`: a divide or an exponential costs several);
- ``bytes_read`` and ``bytes_written``: the HBM traffic of its operands and results, a
  parameter that is only sliced counted at the slice it reads, an output updated in place
  (``dynamic-update-slice``) at the update it writes;
- ``count``: how often one run executes it (a ``while`` body once per trip).

Collectives are listed as kernels of kind ``collective`` with the bytes they move
(:mod:`xlafit.predict.model` prices them over a link), asynchronous ones and asynchronous
copies (``transfer``; ``host`` where one side is the host's memory, ``S(5)`` in a TPU
program's layouts: host offloading) followed by a ``wait`` where the schedule ends them. Instructions that
launch nothing (parameters, tuples, bitcasts, ``get-tuple-element``, scalar arithmetic) are
left out.

Example:
    >>> hlo = '''
    ... %fused (p0: f32[1024,512], p1: f32[512]) -> f32[1024,512] {
    ...   %p0 = f32[1024,512]{1,0} parameter(0)
    ...   %p1 = f32[512]{0} parameter(1)
    ...   %b = f32[1024,512]{1,0} broadcast(%p1), dimensions={1}
    ...   ROOT %e = f32[1024,512]{1,0} exponential(%p0)
    ... }
    ...
    ... ENTRY %main (a: f32[1024,512], c: f32[512]) -> f32[1024,512] {
    ...   %a = f32[1024,512]{1,0} parameter(0)
    ...   %c = f32[512]{0} parameter(1)
    ...   ROOT %loop_exp_fusion = f32[1024,512]{1,0} fusion(%a, %c), kind=kLoop, calls=%fused
    ... }'''
    >>> (k,) = kernels(hlo)
    >>> k.kind, k.bytes_read, k.bytes_written, k.vector
    ('elementwise', 2099200.0, 2097152.0, 5242880.0)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator

from xlafit.predict.collectives import group_size, moved_bytes
from xlafit.predict.fusions import fusion_kernel
from xlafit.predict.hlo import (
    _ARRAY,
    _INSTRUCTION,
    _computations,
    _dims,
    _operand_names,
    _product_shape,
    _trip_count,
    array_bytes,
    kernel_flops,
    product_flops,
    walk,
)
from xlafit.predict.kernel import (
    _BLAS,
    _COLLECTIVES,
    _HOST_MOVES,
    _LAID_OUT,
    _NO_KERNEL,
    _PSEUDO_CALLS,
    _TRANSFERS,
    HOST_SPACE,
    KINDS,
    VECTOR_COST,
    Kernel,
    _Computation,
    _dtype,
    hbm_bytes,
)

__all__ = ["KINDS", "VECTOR_COST", "Kernel", "hbm_bytes", "kernels", "loop_kernels", "loop_state"]


def _parse(hlo: str) -> tuple[dict[str, _Computation], str]:
    bodies, entry = _computations(hlo)
    out = {}
    for name, lines in bodies.items():
        by_name: dict[str, re.Match[str]] = {}
        root = ""
        for line in lines:
            found = _INSTRUCTION.match(line)
            if found is None:
                continue
            by_name[found.group("name")] = found
            if line.lstrip().startswith("ROOT"):
                root = found.group("name")
        out[name] = _Computation(lines, by_name, root)
    return out, entry


def kernels(hlo: str, signatures: bool = False) -> list[Kernel]:
    """The kernels one run of a compiled program launches, each with its work per execution
    and its count (see the module docstring); with ``signatures``, each fusion's
    :attr:`Kernel.signature` (to match a GPU profile's kernel names)."""
    computations, entry = _parse(hlo)
    found = _merged(_visit(computations, entry, 1, signatures))
    splash = kernel_flops(hlo) if "splash_m" in hlo else 0.0
    if splash:  # Pallas splash attention: the FLOPs its kernels' blocks do, shared by its calls
        calls = [k for k in found.values() if k.kind == "attention" and k.target.startswith("tpu_custom_call")]
        runs = sum(k.count for k in calls)
        for k in calls:
            found[k.name] = dataclasses.replace(k, flops=splash / runs)
    return list(found.values())


def loop_kernels(hlo: str, trips: int) -> list[Kernel] | None:
    """The kernels of one loop of a program: a ``while`` that one run enters once and that
    runs ``trips`` times (a generation's decode loop), each counted per run of the program
    (its count in one trip x ``trips``); of several such loops, the one with the longest body.
    None where no loop matches (the compiler unrolled it, or ``trips`` is not its count).

    Example:
        >>> hlo = '''
        ... %cond (c: (s32[], f32[8])) -> pred[] {
        ...   %c = (s32[], f32[8]{0}) parameter(0)
        ...   %i = s32[] get-tuple-element(%c), index=0
        ...   %n = s32[] constant(5)
        ...   ROOT %lt = pred[] compare(%i, %n), direction=LT
        ... }
        ...
        ... %body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
        ...   %b = (s32[], f32[8]{0}) parameter(0)
        ...   %i = s32[] get-tuple-element(%b), index=0
        ...   %x = f32[8]{0} get-tuple-element(%b), index=1
        ...   %e = f32[8]{0} exponential(%x)
        ...   ROOT %t = (s32[], f32[8]{0}) tuple(%i, %e)
        ... }
        ...
        ... ENTRY %main (a: f32[8]) -> (s32[], f32[8]) {
        ...   %a = f32[8]{0} parameter(0)
        ...   %z = s32[] constant(0)
        ...   %t = (s32[], f32[8]{0}) tuple(%z, %a)
        ...   ROOT %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body
        ... }'''
        >>> [(k.name, k.count) for k in loop_kernels(hlo, 5)]
        [('e', 5)]
        >>> loop_kernels(hlo, 4) is None
        True
    """
    computations, _ = _parse(hlo)
    found = _loop(computations, hlo, trips)
    return None if found is None else list(_merged(_visit(computations, found[0], trips, False)).values())


def loop_state(hlo: str, trips: int) -> str | None:
    """The shape of what the loop of :func:`loop_kernels` carries from one trip to the next
    (every array live across its trips, with its layout: ``S(1)`` where the compiler keeps it
    in on-chip memory), or None where no loop matches."""
    found = _loop(_parse(hlo)[0], hlo, trips)
    return None if found is None else found[1]


def _loop(computations: dict[str, _Computation], hlo: str, trips: int) -> tuple[str, str] | None:
    """The body and the shape of the loop that one run enters once and that runs ``trips`` times
    (of several, the one with the longest body)."""
    loops = []
    for found, times, _, _ in walk(hlo):
        if found.group("op") != "while" or times != 1:
            continue
        body = re.search(r"body=%([\w.\-]+)", found.group("rest"))
        condition = re.search(r"condition=%([\w.\-]+)", found.group("rest"))
        if body is None or condition is None or body.group(1) not in computations:
            continue
        lines = computations[body.group(1)].lines
        if condition.group(1) in computations and _trip_count(computations[condition.group(1)].lines, lines) == trips:
            loops.append((body.group(1), found.group("shape")))
    return max(loops, key=lambda loop: len(computations[loop[0]].lines)) if loops else None


def _merged(visited: Iterator[Kernel]) -> dict[str, Kernel]:
    """The kernels visited, one per name, their counts added (a collective carried through
    several fusions once)."""
    found: dict[str, Kernel] = {}
    for kernel in visited:
        before = found.get(kernel.name)
        if before is None:
            found[kernel.name] = kernel
        elif kernel.name.startswith(_CHANNEL):  # one collective carried through many fusions: once
            found[kernel.name] = dataclasses.replace(before, count=max(before.count, kernel.count))
        else:
            found[kernel.name] = dataclasses.replace(before, count=before.count + kernel.count)
    return found


def _visit(computations: dict[str, _Computation], name: str, times: int, signatures: bool) -> Iterator[Kernel]:
    computation = computations.get(name)
    if computation is None:
        return
    shapes = {n: m.group("shape") for n, m in computation.by_name.items()}
    for found in computation.by_name.values():
        op, rest = found.group("op"), found.group("rest")
        if op == "while":
            body = re.search(r"body=%([\w.\-]+)", rest)
            condition = re.search(r"condition=%([\w.\-]+)", rest)
            inner = computations[body.group(1)].lines if body else None
            trips = _trip_count(computations[condition.group(1)].lines, inner) if condition else 1
            if body:
                yield from _visit(computations, body.group(1), times * trips, signatures)
            continue
        if op in ("call", "conditional", "async-start"):
            callees = re.findall(r"(?:to_apply|calls|true_computation|false_computation)=%([\w.\-]+)", rest)
            branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
            callees += re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
            for callee in callees:
                yield from _visit(computations, callee, times, signatures)
            continue
        if op.endswith("-done"):  # the end of an asynchronous collective: a wait, not a kernel
            started = _operand_names(rest)
            yield Kernel(found.group("name"), "wait", times, target=started[0] if started else "")
            continue
        if op in _NO_KERNEL or op.endswith("-update"):
            continue
        kernel = _kernel(found, shapes, computations, signatures)
        if kernel is not None:
            yield dataclasses.replace(kernel, count=times)
        if op == "fusion":
            yield from _fused_collectives(found, computations, times)


_CHANNEL = "channel#"  # the name of a collective fused into compute, by its channel


def _fused_collectives(found: re.Match[str], computations: dict[str, _Computation], times: int) -> Iterator[Kernel]:
    """The collectives inside a fusion (a TPU's asynchronous collective fusion: one
    all-gather carried through the many compute fusions it overlaps, each holding it under
    the same channel), each once per channel, asynchronous beside the compute."""
    callee = re.search(r"calls=%([\w.\-]+)", found.group("rest"))
    fused = computations.get(callee.group(1)) if callee else None
    if fused is None:
        return
    for inner in fused.by_name.values():
        op, rest = inner.group("op"), inner.group("rest")
        kind = op.removesuffix("-start")
        if kind not in _COLLECTIVES:
            continue
        channel = re.search(r"channel_id=(\d+)", rest)
        name = f"{_CHANNEL}{channel.group(1)}" if channel else f"{found.group('name')}/{inner.group('name')}"
        moved = moved_bytes(kind, op, inner.group("shape"), rest)
        yield Kernel(name, "collective", times, target=kind, group=group_size(rest, 0), moved=moved, asynchronous=True)


def _kernel(
    found: re.Match[str], shapes: dict[str, str], computations: dict[str, _Computation], signatures: bool
) -> Kernel | None:
    name, shape, op, rest = found.group("name"), found.group("shape"), found.group("op"), found.group("rest")
    kind = op.removesuffix("-start")
    if op in _HOST_MOVES and HOST_SPACE.search(shape):
        return _host_move(name, shape, op)
    if op in _TRANSFERS:  # a DMA between memories, beside the compute (TPU prefetches into VMEM)
        # ((source), destination, context): what moves is the destination, a slice-start's
        # piece of its source (a weight prefetched into VMEM in parts is read once, not per part).
        arrays = [array_bytes(m.group(0)) for m in _ARRAY.finditer(shape)]
        moved = arrays[1] if len(arrays) > 1 else max(arrays, default=0)
        return Kernel(name, "transfer", 1, bytes_read=moved, target=op, asynchronous=True)
    if kind in _COLLECTIVES:
        moved = moved_bytes(kind, op, shape, rest)
        asynchronous = op.endswith("-start")
        return Kernel(
            name, "collective", 1, target=kind, group=group_size(rest, 0), moved=moved, asynchronous=asynchronous
        )
    if _ARRAY.search(shape) is None or not _dims(shape) and op not in ("custom-call", "fusion"):
        return None  # a scalar: the core's scalar unit (loop counters, indices), no kernel
    operands = _operand_names(rest)
    if op == "fusion":
        return fusion_kernel(name, shape, rest, operands, shapes, computations, signatures)
    read = [hbm_bytes(shapes.get(o, "")) for o in operands]
    written = hbm_bytes(shape)
    if op == "custom-call":
        return _custom_call(name, shape, rest, operands, shapes, read)
    if op in ("dot", "ragged-dot", "convolution"):
        flops = product_flops(op, shape, rest, shapes)
        dims = _product_shape(op, shape, rest, shapes) if op != "ragged-dot" else ()
        return Kernel(
            name,
            "convolution" if op == "convolution" else "matmul",
            1,
            flops,
            0.0,
            sum(read),
            written,
            dims,
            _dtype(shape),
            op,
        )
    if op in ("copy", "transpose"):
        return Kernel(
            name,
            "transpose" if op == "transpose" or _relayout(found, shapes) else "elementwise",
            1,
            bytes_read=sum(read),
            bytes_written=written,
            dtype=_dtype(shape),
            target=op,
        )
    if op in ("gather", "scatter", "sort"):
        return Kernel(name, "gather", 1, bytes_read=sum(read), bytes_written=written, target=op)
    elements = math.prod(_dims(shape)) if _ARRAY.search(shape) else 0
    return Kernel(
        name,
        "elementwise",
        1,
        vector=VECTOR_COST.get(op, 1.0) * elements,
        bytes_read=sum(read),
        bytes_written=written,
        dtype=_dtype(shape),
        target=op,
        elements=elements,
    )


def _host_move(name: str, shape: str, op: str) -> Kernel:
    """An asynchronous move between HBM and the host's memory: its bytes are the device
    side's arrays in its shape (a copy's source or destination, a slice read from or an update
    written into a stacked buffer in host memory), scalars and the context left out.

    Example:
        >>> stack = "bf16[4,8,256]{2,1,0:S(5)}"  # in host memory
        >>> shape = f"(({stack}, bf16[1,8,256]{{2,1,0}}, s32[]), {stack}, u32[]{{:S(2)}})"
        >>> k = _host_move("dus", shape, "dynamic-update-slice-start")
        >>> k.kind, k.bytes, k.target
        ('host', 4096.0, 'dynamic-update-slice-start to host')
    """
    moved = sum(
        array_bytes(m.group(0))
        for m in _LAID_OUT.finditer(shape)
        if m.group(2) and not HOST_SPACE.search(m.group(3) or "")
    )
    first = _LAID_OUT.search(shape)  # a copy's destination; a slice's or update's buffer
    to_host = op == "dynamic-update-slice-start" or (
        op == "copy-start" and first is not None and bool(HOST_SPACE.search(first.group(3) or ""))
    )
    where = "to host" if to_host else "from host"
    return Kernel(name, "host", 1, bytes_read=moved, target=f"{op} {where}", asynchronous=True)


def _relayout(found: re.Match[str], shapes: dict[str, str]) -> bool:
    """Whether a copy changes the layout (a transpose in memory) rather than duplicating."""
    operands = _operand_names(found.group("rest"))
    source = shapes.get(operands[0], "") if operands else ""
    layout = re.search(r"\{([\d,]+)", found.group("shape"))
    before = re.search(r"\{([\d,]+)", source)
    return bool(layout and before and layout.group(1) != before.group(1))


def _custom_call(
    name: str, shape: str, rest: str, operands: list[str], shapes: dict[str, str], read: list[int]
) -> Kernel | None:
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    target_name = target.group(1) if target else ""
    if target_name in _PSEUDO_CALLS:
        return None
    outputs = [m.group(0) for m in _LAID_OUT.finditer(shape)]
    # A library call's last output is its workspace (s8[...] / u8[...]): scratch, not traffic,
    # except a fused attention backward's (below).
    workspace = 0
    if len(outputs) > 1 and re.match(r"[su]8\[", outputs[-1]):
        workspace = hbm_bytes(outputs.pop())
    written = sum(hbm_bytes(o) for o in outputs)
    if target_name in _BLAS:
        dims = _blas_shape(rest, [shapes.get(o, "") for o in operands[:2]])
        flops = 2.0 * math.prod(dims) if dims else 0.0
        return Kernel(name, "matmul", 1, flops, 0.0, sum(read), written, dims, _dtype(outputs[0]), target_name)
    if target_name.startswith("__cudnn$conv"):
        flops, dims = _cudnn_conv(rest, operands, shapes, outputs[0] if outputs else "", target_name)
        return Kernel(name, "convolution", 1, flops, 0.0, sum(read), written, dims, _dtype(shape), target_name)
    if target_name.startswith("__cudnn$fmha"):
        flops, dims = _attention_flops(rest, operands, shapes, target_name)
        extra_read = extra_written = 0
        if "Backward" in target_name:
            # A flash-attention backward (FlashAttention-2's algorithm, which cuDNN's follows)
            # accumulates dQ in float32 in its workspace: the workspace is zeroed, added into,
            # and read back into dQ (two writes, two reads of it); a first pass reads dO again
            # (the query's shape) for the row sums rowsum(dO * O) the workspace also holds.
            extra_read = 2 * workspace + (read[0] if read else 0)
            extra_written = 2 * workspace
        return Kernel(
            name, "attention", 1, flops, 0.0, sum(read) + extra_read, written + extra_written, dims, _dtype(shape),
            target_name,
        )  # fmt: skip
    if target_name == "tpu_custom_call" and re.match(r"ragged-dot-(?!metadata)", name):
        return _ragged_dot(name, shape, operands, shapes, read, written)
    if target_name == "tpu_custom_call" and re.match(r"splash_", name):
        return Kernel(name, "attention", 1, 0.0, 0.0, sum(read), written, (), _dtype(shape), "tpu_custom_call")
    return Kernel(name, "other", 1, 0.0, 0.0, sum(read), written, (), _dtype(shape), target_name)


def _ragged_dot(
    name: str, shape: str, operands: list[str], shapes: dict[str, str], read: list[int], written: int
) -> Kernel:
    """A TPU grouped matrix product (``jax.lax.ragged_dot``'s Mosaic kernel, ``ragged-dot-*``):
    rows ``[m, k]`` sorted by group times each group's ``[k, n]`` matrix (its last two
    operands; the ones before are the groups' offsets). Each row meets only its own group's
    matrix: ``2 m n k`` FLOPs, the routed tokens' count, not the ``g`` times more of a dense
    product over every group.

    Example:
        >>> shapes = {"a": "bf16[1024,256]{1,0}", "b": "bf16[8,256,512]{2,1,0}"}
        >>> k = _ragged_dot("ragged-dot-none", "bf16[1024,512]{1,0}", ["a", "b"], shapes, [0, 0], 0)
        >>> k.kind, k.flops, k.shape
        ('matmul', 268435456.0, (1, 1024, 512, 256))
    """
    lhs = _dims(shapes.get(operands[-2], "")) if len(operands) > 1 else []
    out = _dims(shape)
    if len(lhs) != 2 or len(out) != 2:
        return Kernel(name, "other", 1, 0.0, 0.0, sum(read), written, (), _dtype(shape), "tpu_custom_call")
    (m, n), k = out, lhs[1]
    dims = (1, m, n, k)
    return Kernel(name, "matmul", 1, 2.0 * m * n * k, 0.0, sum(read), written, dims, _dtype(shape), "tpu_custom_call")


def _backend(rest: str) -> dict:
    """A custom call's or fusion's ``backend_config`` JSON (empty if there is none)."""
    start = rest.find("backend_config=")
    if start < 0:
        return {}
    text = rest[start + len("backend_config=") :]
    if not text.startswith("{"):
        return {}
    try:
        config, _ = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return {}
    return config if isinstance(config, dict) else {}


def _blas_shape(rest: str, operands: list[str]) -> tuple[int, ...]:
    """(batch, m, n, k) of a cuBLAS call from its dimension numbers and operand shapes."""
    numbers = _backend(rest).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    lhs, rhs = (_dims(s) for s in operands)
    if not lhs or not rhs:
        return ()
    batch_dims = [int(d) for d in numbers.get("lhs_batch_dimensions", [])]
    lhs_k = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
    rhs_batch = [int(d) for d in numbers.get("rhs_batch_dimensions", [])]
    rhs_k = [int(d) for d in numbers.get("rhs_contracting_dimensions", [])]
    batch = math.prod(lhs[d] for d in batch_dims)
    k = math.prod(lhs[d] for d in lhs_k)
    m = math.prod(s for d, s in enumerate(lhs) if d not in batch_dims and d not in lhs_k)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rhs_batch and d not in rhs_k)
    return (batch, m, n, k)


def _cudnn_conv(
    rest: str, operands: list[str], shapes: dict[str, str], output: str, target: str
) -> tuple[float, tuple[int, ...]]:
    """FLOPs and (1, m, n, k) of a cuDNN convolution, from its dimension labels and window:
    a forward pass computes its output; the two backward passes compute the forward's input
    gradient or kernel gradient, the same multiply-adds as the forward they differentiate."""
    conv_shapes = {"lhs": shapes.get(operands[0], "") if operands else "", "out": output}
    if len(operands) > 1:
        conv_shapes["rhs"] = shapes.get(operands[1], "")
    if target == "__cudnn$convBackwardInput":  # operands: output gradient, kernel; result: input gradient
        forward_out, kernel, forward_in = conv_shapes["lhs"], conv_shapes.get("rhs", ""), output
    elif target == "__cudnn$convBackwardFilter":  # operands: input, output gradient; result: kernel gradient
        forward_in, forward_out, kernel = conv_shapes["lhs"], conv_shapes.get("rhs", ""), output
    else:
        forward_in, kernel, forward_out = conv_shapes["lhs"], conv_shapes.get("rhs", ""), output
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", rest)
    if not labels:
        return 0.0, ()
    lhs_l, rhs_l, out_l = labels.groups()
    # The dimension labels describe the forward convolution for all three calls.
    fin, ker, fout = _dims(forward_in), _dims(kernel), _dims(forward_out)
    if not (len(fin) == len(lhs_l) and len(ker) == len(rhs_l) and len(fout) == len(out_l)):
        return 0.0, ()
    taps = math.prod(ker[rhs_l.index(c)] for c in rhs_l if c.isdigit())
    in_features = ker[rhs_l.index("i")]
    out_features = fout[out_l.index("f")]
    positions = math.prod(fout) // max(out_features, 1)
    fmas = positions * out_features * taps * in_features
    if target == "__cudnn$convBackwardFilter":
        return 2.0 * fmas, (1, out_features, taps * in_features, positions)
    if target == "__cudnn$convBackwardInput":
        return 2.0 * fmas, (1, positions, in_features, taps * out_features)
    return 2.0 * fmas, (1, positions, out_features, taps * in_features)


def _attention_flops(rest: str, operands: list[str], shapes: dict[str, str], target: str) -> tuple[float, tuple]:
    """FLOPs of a cuDNN fused attention call from its query and key shapes ``[B, T, H, D]``:
    the forward's two products (``QK^T``, ``PV``), the backward's five (``QK^T`` again, then
    ``dP``, ``dV``, ``dQ``, ``dK``); half the score blocks under a causal mask."""
    if len(operands) < 2:
        return 0.0, ()
    q, k = _dims(shapes.get(operands[0], "")), _dims(shapes.get(operands[1], ""))
    if len(q) != 4 or len(k) != 4:
        return 0.0, ()
    config = _backend(rest).get("cudnn_fmha_backend_config", {})
    b, t, h, d = q
    s = k[1]
    if config.get("bmm1_dot_dimension_numbers", {}).get("lhs_batch_dimensions") == ["0", "2"] or (
        config.get("bmm1_grad_gemm1_dot_dimension_numbers")
    ):
        b, t, h, d = q  # [B, T, H, D], the layout the operand constraints name
    products = 5 if "Backward" in target else 2
    causal = 0.5 if config.get("mask_type") == "CAUSAL" or config.get("is_causal_mask") else 1.0
    return products * 2.0 * b * h * t * s * d * causal, (b * h, t, s, d)
