"""What the step model knows of one kernel: its kind, its work (:class:`Kernel`), and the
HLO operations that decide it (which launch nothing, which update in place, which gather).

Shared by :mod:`xlafit.predict.ops` (a program's kernels) and :mod:`xlafit.predict.fusions`
(the work inside one fusion).
"""

from __future__ import annotations

import dataclasses
import math
import re

from xlafit.predict.hlo import _ARRAY, _DTYPE_BYTES

__all__ = ["HOST_SPACE", "KINDS", "VECTOR_COST", "Kernel", "hbm_bytes"]

# What a kernel is, for the rates that price it (xlafit.predict.rates):
KINDS = (
    "matmul",  # a matrix product: a cuBLAS call, a Triton GEMM fusion, a TPU fusion around a dot
    "convolution",  # a cuDNN convolution, a TPU convolution fusion
    "attention",  # a fused attention kernel: cuDNN flash attention, Pallas splash attention
    "elementwise",  # a loop fusion: reads, computes per element, writes
    "reduction",  # a fusion whose root reduces (GPU "input" fusions: layer norms, sums)
    "transpose",  # a fusion or copy that moves data between layouts
    "transfer",  # an asynchronous copy between memories (a TPU's DMA into on-chip memory)
    "host",  # an asynchronous copy between HBM and the host's memory (host offloading, over PCIe)
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
# Asynchronous moves that may have one side in the host's memory (host offloading): a copy,
# and a scanned loop's slice of a stacked buffer read or written in place.
_HOST_MOVES = ("copy-start", "slice-start", "dynamic-slice-start", "dynamic-update-slice-start")
# XLA's memory space of the host's memory in a layout (xla::Layout::kHostMemorySpace).
HOST_SPACE = re.compile(r"S\(5\)")
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
    elements: int = 0  # an element-wise kernel's elements: its (largest) output's, or its update's in place

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written


@dataclasses.dataclass
class _Computation:
    lines: list[str]
    by_name: dict[str, re.Match[str]]
    root: str


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
