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
copies (``transfer``) followed by a ``wait`` where the schedule ends them. Instructions that
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
import hashlib
import json
import math
import re
from collections.abc import Iterator

from xlafit.predict.collectives import group_size, moved_bytes
from xlafit.predict.hlo import (
    _ARRAY,
    _DTYPE_BYTES,
    _INSTRUCTION,
    _computations,
    _dims,
    _operand_names,
    _trip_count,
    array_bytes,
    kernel_flops,
    product_flops,
)

__all__ = ["KINDS", "VECTOR_COST", "Kernel", "hbm_bytes", "kernels"]

# What a kernel is, for the rates that price it (xlafit.predict.rates):
KINDS = (
    "matmul",  # a matrix product: a cuBLAS call, a Triton GEMM fusion, a TPU fusion around a dot
    "convolution",  # a cuDNN convolution, a TPU convolution fusion
    "attention",  # a fused attention kernel: cuDNN flash attention, Pallas splash attention
    "elementwise",  # a loop fusion: reads, computes per element, writes
    "reduction",  # a fusion whose root reduces (GPU "input" fusions: layer norms, sums)
    "transpose",  # a fusion or copy that moves data between layouts
    "transfer",  # an asynchronous copy between memories (a TPU's DMA into on-chip memory)
    "gather",  # gathers and scatters: data-dependent addressing
    "collective",  # data sent to other devices
    "other",  # any other custom call or kernel (its bytes only)
)

# Element-wise work per output element, in float adds. GPU SMs (compute capability 8.0-9.0)
# execute 64-128 float adds, multiplies or FMAs per clock but 16 of the special functions
# (exp2, log2, reciprocal, rsqrt, sin, cos) and 16 type conversions between 32-bit and
# other types (CUDA C++ Programming Guide, "Arithmetic Instructions", throughput table);
# an exponential is a multiply and an exp2, a divide a reciprocal and two FMAs.
VECTOR_COST = {
    **dict.fromkeys(("add", "subtract", "multiply", "negate", "abs", "maximum", "minimum"), 1.0),
    **dict.fromkeys(("compare", "select", "and", "or", "xor", "not", "clamp", "sign"), 1.0),
    **dict.fromkeys(("shift-left", "shift-right-logical", "shift-right-arithmetic", "popcnt"), 2.0),
    **dict.fromkeys(("floor", "ceil", "round-nearest-even", "round-nearest-afz", "is-finite"), 1.0),
    "convert": 2.0,
    "divide": 10.0,
    "remainder": 12.0,
    "power": 20.0,
    **dict.fromkeys(("exponential", "log", "log-plus-one", "exponential-minus-one"), 10.0),
    **dict.fromkeys(("rsqrt", "sqrt", "cbrt", "logistic"), 10.0),
    **dict.fromkeys(("tanh", "sine", "cosine", "tan", "atan2", "erf"), 20.0),
    "rng-bit-generator": 40.0,
}
# Instructions that move or name data without computing on it.
_FREE = {
    "parameter", "constant", "broadcast", "bitcast", "reshape", "transpose", "slice", "dynamic-slice",
    "concatenate", "pad", "tuple", "get-tuple-element", "iota", "copy", "reverse", "bitcast-convert",
    "dynamic-update-slice", "gather", "scatter", "dot", "convolution", "custom-call", "fusion", "reduce-precision",
    "partition-id", "replica-id", "after-all", "optimization-barrier", "call",
}  # fmt: skip
# Top-level instructions that launch no kernel.
_NO_KERNEL = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
    "replica-id", "optimization-barrier", "add-dependency", "opt-barrier",
}  # fmt: skip
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_SLICING = {"slice", "dynamic-slice", "gather"}
# Root instructions that update their first operand in place, and the operand that holds the update.
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
_PASS_THROUGH = {"bitcast", "reshape"}
_BLAS = ("__cublas$gemm", "__cublas$lt$matmul")
# Asynchronous copies between memories (their -done is the wait).
_TRANSFERS = ("copy-start", "slice-start")
# Custom calls that only allocate or name memory.
_PSEUDO_CALLS = ("AllocateBuffer", "ConcatBitcast", "SliceToDynamic", "PadToStatic")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a program, with its work per execution (see the module docstring).

    ``shape`` is a matrix product's ``(batch, m, n, k)``, a convolution's ``(1, output
    elements / output features, output features, contraction)``, else ``()``.
    """

    name: str
    kind: str
    count: int
    flops: float = 0.0
    vector: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    shape: tuple[int, ...] = ()
    dtype: str = ""
    target: str = ""  # a custom call's target, a fusion's kind (kLoop, kInput, kCustom, kOutput)
    # A fusion's computation with its names left out: fusions with equal signatures compile to
    # one kernel, which a GPU profile names after one of them.
    signature: str = ""
    group: int = 1  # a collective's devices per replica group
    moved: float = 0.0  # a collective's full array, bytes
    asynchronous: bool = False  # a collective's -start, ended by a "wait" kernel naming it

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written


@dataclasses.dataclass
class _Computation:
    lines: list[str]
    by_name: dict[str, re.Match[str]]
    root: str


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
    found: dict[str, Kernel] = {}
    for kernel in _visit(computations, entry, 1, signatures):
        before = found.get(kernel.name)
        found[kernel.name] = (
            kernel if before is None else dataclasses.replace(before, count=before.count + kernel.count)
        )
    splash = kernel_flops(hlo) if "splash_m" in hlo else 0.0
    if splash:  # Pallas splash attention: the FLOPs its kernels' blocks do, shared by its calls
        calls = [k for k in found.values() if k.kind == "attention" and k.target.startswith("tpu_custom_call")]
        runs = sum(k.count for k in calls)
        for k in calls:
            found[k.name] = dataclasses.replace(k, flops=splash / runs)
    return list(found.values())


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


def _kernel(
    found: re.Match[str], shapes: dict[str, str], computations: dict[str, _Computation], signatures: bool
) -> Kernel | None:
    name, shape, op, rest = found.group("name"), found.group("shape"), found.group("op"), found.group("rest")
    kind = op.removesuffix("-start")
    if op in _TRANSFERS:  # a DMA between memories, beside the compute (TPU prefetches into VMEM)
        moved = max((array_bytes(m.group(0)) for m in _ARRAY.finditer(shape)), default=0)
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
        return _fusion(name, shape, rest, operands, shapes, computations, signatures)
    read = [hbm_bytes(shapes.get(o, "")) for o in operands]
    written = hbm_bytes(shape)
    if op == "custom-call":
        return _custom_call(name, shape, rest, operands, shapes, read)
    if op in ("dot", "convolution"):
        flops = product_flops(op, shape, rest, shapes)
        dims = _product_shape(op, shape, rest, shapes)
        return Kernel(
            name, "matmul" if op == "dot" else "convolution", 1, flops, 0.0, sum(read), written, dims, _dtype(shape), op
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
    )


_LAID_OUT = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")


def hbm_bytes(shape: str) -> int:
    """Bytes of an HLO shape that live in HBM: arrays a TPU program placed in another memory
    space (``S(1)``, the core's on-chip VMEM; ``S(2)``, its scalar memory) are left out.

    Example:
        >>> hbm_bytes("(bf16[512]{0:T(512)(128)(2,1)S(1)}, f32[4,512]{1,0:T(4,128)})")
        8192
    """
    total = 0
    for dtype, dims, layout in _LAID_OUT.findall(shape):
        if dtype in _DTYPE_BYTES and not re.search(r"S\([1-9]\)", layout or ""):
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _dtype(shape: str) -> str:
    found = _ARRAY.search(shape)
    return found.group(1) if found else ""


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
    # A library call's last output is its workspace (s8[...] / u8[...]): scratch, not traffic.
    if len(outputs) > 1 and re.match(r"[su]8\[", outputs[-1]):
        outputs = outputs[:-1]
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
        return Kernel(name, "attention", 1, flops, 0.0, sum(read), written, dims, _dtype(shape), target_name)
    if target_name == "tpu_custom_call" and re.match(r"splash_", name):
        return Kernel(name, "attention", 1, 0.0, 0.0, sum(read), written, (), _dtype(shape), "tpu_custom_call")
    return Kernel(name, "other", 1, 0.0, 0.0, sum(read), written, (), _dtype(shape), target_name)


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


def _fusion(
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
    read, in_place = _fusion_reads(fused, [shapes.get(o, "") for o in operands])
    written = _fusion_writes(fused, in_place)
    flops, vector = 0.0, 0.0
    dims: tuple[int, ...] = ()
    ops: set[str] = set()
    local = {n: m.group("shape") for n, m in fused.by_name.items()}
    for inner in fused.by_name.values():
        op = inner.group("op")
        ops.add(op)
        if op in ("dot", "convolution"):
            flops += product_flops(op, inner.group("shape"), inner.group("rest"), local)
            dims = dims or _product_shape(op, inner.group("shape"), inner.group("rest"), local)
        elif op == "reduce":
            source = _operand_names(inner.group("rest"))
            vector += math.prod(_dims(local.get(source[0], ""))) if source else 0
        elif op not in _FREE:
            vector += VECTOR_COST.get(op, 1.0) * math.prod(_dims(inner.group("shape")))
    kind = _fusion_kind(name, target, ops, fused, flops)
    signature = _signature(fused) if signatures else ""
    return Kernel(name, kind, 1, flops, vector, read, written, dims, _dtype(shape), target, signature)


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


def _fusion_reads(fused: _Computation, operand_shapes: list[str]) -> tuple[float, set[str]]:
    """Bytes a fusion reads of its operands, and the parameters it updates in place.

    A parameter used only through slices (a layer's weights out of a scanned stack) is read
    at the slices' size; one that is the buffer of a root ``dynamic-update-slice`` or
    ``scatter`` is updated in place, not read."""
    users = _users(fused)
    params = {}
    for inner in fused.by_name.values():
        if inner.group("op") == "parameter":
            number = re.match(r"(\d+)", inner.group("rest"))
            if number:
                params[int(number.group(1))] = inner.group("name")
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
        if uses and all(u.group("op") in _SLICING and pos == 0 for u, pos in uses):
            total += min(full, sum(hbm_bytes(u.group("shape")) for u, _ in uses))
            continue
        total += full
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


def _fusion_writes(fused: _Computation, in_place: set[str]) -> float:
    """Bytes a fusion writes: each output's, a ``dynamic-update-slice`` or ``scatter`` of an
    operand updated in place at its update's size."""
    total = 0.0
    for name in _root_outputs(fused):
        inner = fused.by_name.get(name)
        if inner is None:
            continue
        if inner.group("op") in _IN_PLACE:
            names = _operand_names(inner.group("rest"))
            position = _IN_PLACE[inner.group("op")]
            update = fused.by_name.get(names[position]) if len(names) > position else None
            total += hbm_bytes(update.group("shape")) if update is not None else hbm_bytes(inner.group("shape"))
        else:
            total += hbm_bytes(inner.group("shape"))
    return total
