"""oneDNN's convolutions and max-pooling on XLA:CPU, for ResNet on one CPU device.

XLA:CPU runs a convolution as Eigen's im2col + GEMM and a max-pool as a reduce-window with
a gradient of compares and selects. oneDNN, the library behind PyTorch's CPU layers, has
direct kernels: 1.4x faster over ResNet-50's convolutions, 4x over its max-pool
(BENCHMARKS.md). :func:`conv_general_dilated` is a drop-in for ``lax.conv_general_dilated``
(``nnx.Conv(conv_general_dilated=...)``) and :func:`max_pool` wraps a max-pool; each runs
its forward pass and gradients as oneDNN calls (XLA FFI custom calls, ``onednn.cc``) when
:func:`applies`, and XLA's own operations otherwise:

- only where the program runs on a CPU (``lax.platform_dependent``: the same model compiles
  for TPUs and GPUs unchanged);
- only in a process with one device: a custom call does not split across a mesh, so XLA's
  operations stay for data parallelism (``--simulate 8``, several hosts);
- float32, or bfloat16 on CPUs with AVX512-BF16 instructions (Zen 4 and later, Cooper Lake and
  later Xeons), where oneDNN runs it natively (elsewhere it would emulate it):
  :attr:`Status.bfloat16`; convolutions: NHWC input, HWIO kernel, no dilation, no groups;
- when the extension is built: oneDNN comes from the ``onednn-cpu-gomp`` wheels
  (``pip install 'xlafit[onednn]'``, x86-64 Linux), and ``onednn.cc`` is compiled once
  with ``g++`` (``$CXX``) into the user cache (``native/``), in a few seconds.

``XLAFIT_ONEDNN=0`` turns it off. :func:`status` says whether it is on and, if not, why.
oneDNN runs on its own OpenMP threads (``OMP_NUM_THREADS``, default: every core), beside
XLA's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xlafit.cache import cache_dir

log = logging.getLogger("xlafit")

SOURCE = Path(__file__).with_name("onednn.cc")
ENV = "XLAFIT_ONEDNN"
LIBRARY_WHEEL, HEADERS_WHEEL = "onednn-cpu-gomp", "onednn-devel-cpu-gomp"
TARGETS = ("conv_fwd", "conv_bwd_data", "conv_bwd_weights", "max_pool_fwd", "max_pool_bwd")
# nnx.Conv's layout, as lax.ConvDimensionNumbers: NHWC input and output, HWIO kernel.
NHWC_HWIO = lax.ConvDimensionNumbers(lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 1, 2))

Pads = tuple[tuple[int, int], tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Status:
    """Whether the oneDNN operations are available in this process, and if not, why."""

    available: bool
    reason: str  # the extension's path, or what is missing and how to get it
    bfloat16: bool = False  # this CPU runs oneDNN's bfloat16 kernels natively


class BuildError(RuntimeError):
    """The extension could not be built: the message names the step and the fix."""


def _wheel_file(wheel: str, suffix: str) -> Path:
    try:
        files = importlib.metadata.files(wheel) or []
    except importlib.metadata.PackageNotFoundError:
        raise BuildError(f"the {wheel} wheel is not installed: pip install 'xlafit[onednn]' (x86-64 Linux).") from None
    for f in files:
        if str(f).endswith(suffix):
            return Path(str(f.locate())).resolve()
    raise BuildError(f"the {wheel} wheel has no {suffix}: reinstall it (pip install --force-reinstall {wheel}).")


def _build(out: Path) -> None:
    """Compiles :data:`SOURCE` against oneDNN and XLA's FFI headers into ``out``."""
    library = _wheel_file(LIBRARY_WHEEL, "/libdnnl.so.3")
    include = _wheel_file(HEADERS_WHEEL, "/oneapi/dnnl/dnnl.hpp").parents[2]
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler {compiler!r} on PATH: install g++ (or set CXX).")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        command = [
            compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
            f"-I{jax.ffi.include_dir()}", f"-I{include}", str(SOURCE),
            f"-L{library.parent}", "-l:libdnnl.so.3", f"-Wl,-rpath,{library.parent}", "-o", str(built),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed on {SOURCE.name}:\n{done.stderr[-2000:]}")
        os.replace(built, out)  # atomic: processes that build at once each put a whole file


def library_path() -> Path:
    """The compiled extension in the user cache, built first if this version is not there."""
    _wheel_file(LIBRARY_WHEEL, "/libdnnl.so.3")  # a missing wheel is named before anything else
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(jax.__version__.encode())
    key.update(importlib.metadata.version(LIBRARY_WHEEL).encode())
    path = cache_dir() / "native" / f"onednn-{key.hexdigest()[:16]}.so"
    if not path.exists():
        log.info("building xlafit's oneDNN extension once (g++, a few seconds) into %s", path.parent)
        _build(path)
    return path


@functools.cache
def status() -> Status:
    """Builds (once, kept on disk) and loads the extension, and registers its FFI targets."""
    if os.environ.get(ENV, "1").lower() in ("0", "false", "no", "off"):
        return Status(False, f"turned off by {ENV}=0")
    # OpenMP's threads sleep as soon as a oneDNN call ends instead of spinning, which would take
    # the cores from XLA's own threads running the operations in between (BENCHMARKS.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        path = library_path()
        library = ctypes.CDLL(str(path))
    except (BuildError, OSError) as e:
        log.info("oneDNN operations unavailable, XLA's are used: %s", e)
        return Status(False, str(e))
    for name in TARGETS:
        target = f"xlafit_onednn_{name}"
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    return Status(True, str(path), bfloat16=bool(library.xlafit_onednn_native_bf16()))


def applies(*arrays: jax.Array | jax.ShapeDtypeStruct) -> bool:
    """The oneDNN operations can take these arrays: all float32 (or all bfloat16, where
    :attr:`Status.bfloat16`), one device, extension loaded."""
    if jax.device_count() != 1 or not status().available:
        return False
    types = {jnp.dtype(a.dtype) for a in arrays}
    return types == {jnp.dtype(jnp.float32)} or (types == {jnp.dtype(jnp.bfloat16)} and status().bfloat16)


def _call(target: str, outputs, *args: jax.Array, **attrs: int) -> jax.Array:
    attributes = {k: np.int64(v) for k, v in attrs.items()}
    return jax.ffi.ffi_call(f"xlafit_onednn_{target}", outputs, vmap_method="sequential")(*args, **attributes)


# --------------------------------------------------------------------------- convolution


def _conv_attrs(stride: tuple[int, int], pads: Pads) -> dict[str, int]:
    (top, bottom), (left, right) = pads
    return dict(stride_h=stride[0], stride_w=stride[1], pad_top=top, pad_bottom=bottom, pad_left=left, pad_right=right)


def _xla_conv(x: jax.Array, w: jax.Array, stride: tuple[int, int], pads: Pads) -> jax.Array:
    return lax.conv_general_dilated(x, w, stride, pads, dimension_numbers=NHWC_HWIO)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _conv(x: jax.Array, w: jax.Array, stride: tuple[int, int], pads: Pads) -> jax.Array:
    out = jax.eval_shape(functools.partial(_xla_conv, stride=stride, pads=pads), x, w)

    def onednn(x, w):
        return _call("conv_fwd", out, x, w, **_conv_attrs(stride, pads))

    return lax.platform_dependent(x, w, cpu=onednn, default=functools.partial(_xla_conv, stride=stride, pads=pads))


def _conv_fwd(x, w, stride, pads):
    return _conv(x, w, stride, pads), (x, w)


def _conv_bwd(stride, pads, residuals, g):
    x, w = residuals

    def xla(g, x, w):
        return jax.vjp(functools.partial(_xla_conv, stride=stride, pads=pads), x, w)[1](g)

    def onednn(g, x, w):
        attrs = _conv_attrs(stride, pads)
        dw = _call("conv_bwd_weights", jax.ShapeDtypeStruct(w.shape, w.dtype), x, g, **attrs)
        # dw as an operand orders the two calls (onednn.cc); XLA drops this one where dx is unused
        dx = _call("conv_bwd_data", jax.ShapeDtypeStruct(x.shape, x.dtype), g, w, dw, **attrs)
        return dx, dw

    return lax.platform_dependent(g, x, w, cpu=onednn, default=xla)


_conv.defvjp(_conv_fwd, _conv_bwd)


def _explicit_pads(padding) -> Pads | None:
    if isinstance(padding, str) or len(padding) != 2:
        return None
    (top, bottom), (left, right) = ((int(lo), int(hi)) for lo, hi in padding)
    return ((top, bottom), (left, right)) if min(top, bottom, left, right) >= 0 else None


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers=None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
) -> jax.Array:
    """``lax.conv_general_dilated``, by oneDNN where the module docstring says it applies."""
    pads = _explicit_pads(padding)
    plain = (
        pads is not None
        and lhs.ndim == 4
        and lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers) == NHWC_HWIO
        and (preferred_element_type is None or jnp.dtype(preferred_element_type) == lhs.dtype)
        and all(d == 1 for d in (*(lhs_dilation or ()), *(rhs_dilation or ())))
        and feature_group_count == batch_group_count == 1
        and out_sharding is None
    )
    if not (plain and applies(lhs, rhs)):
        return lax.conv_general_dilated(
            lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, preferred_element_type, out_sharding=out_sharding,
        )  # fmt: skip
    assert pads is not None
    return _conv(lhs, rhs, (int(window_strides[0]), int(window_strides[1])), pads)


# --------------------------------------------------------------------------- max-pooling


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _max_pool(x: jax.Array, window: int, stride: int, pad: int, xla: Callable[[jax.Array], jax.Array]) -> jax.Array:
    return _max_pool_fwd(x, window, stride, pad, xla)[0]


def _max_pool_fwd(x, window, stride, pad, xla):
    y_shape = jax.eval_shape(xla, x)
    workspace = jax.ShapeDtypeStruct(y_shape.shape, jnp.uint8)  # which window position won, per output

    def onednn(x):
        return tuple(_call("max_pool_fwd", (y_shape, workspace), x, window=window, stride=stride, pad=pad))

    def default(x):
        return xla(x), jnp.zeros(workspace.shape, workspace.dtype)

    y, won = lax.platform_dependent(x, cpu=onednn, default=default)
    return y, (x, won)


def _max_pool_bwd(window, stride, pad, xla, residuals, g):
    x, won = residuals

    def onednn(x, won, g):
        return _call(
            "max_pool_bwd", jax.ShapeDtypeStruct(x.shape, x.dtype), g, won, window=window, stride=stride, pad=pad
        )

    def default(x, won, g):
        return jax.vjp(xla, x)[1](g)[0]

    return (lax.platform_dependent(x, won, g, cpu=onednn, default=default),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


def max_pool(x: jax.Array, window: int, stride: int, pad: int, xla: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """A ``window``x``window`` max-pool of ``[B, H, W, C]`` with stride ``stride`` and ``pad``
    on every side (PyTorch's ``MaxPool2d(window, stride, pad)``), by oneDNN where it
    :func:`applies`, else ``xla(x)``, the same pool in XLA's operations (a module-level
    function: it is part of the cache key of the traced program).

    The gradient goes to the first maximum of each window, as PyTorch's and XLA's
    select-and-scatter send it.
    """
    if x.ndim != 4 or not applies(x):
        return xla(x)
    return _max_pool(x, window, stride, pad, xla)
