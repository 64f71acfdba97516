"""``xlafit bench --calibrate``: this machine's achievable rates, measured, as a calibration
file the step model then uses for its device kind.

Each micro-benchmark is a chain of ``r`` copies of one operation in one compiled program,
each copy's result fed to the next through an optimisation barrier (so XLA neither fuses
the copies nor drops one); the time per operation is the difference between a long and a
short chain over the difference in length, so the host's dispatch cancels out and what
remains is the kernel and its launch on the device:

- matrix products of several shapes (bf16 on accelerators, float32 on a CPU) ->
  :func:`xlafit.predict.fit.fit_matmul`;
- element-wise streams (``x * a + b``) of several sizes -> :func:`xlafit.predict.fit.fit_stream`
  (bandwidth and fixed cost per kernel);
- wider streams at the largest size (float32 ``x * a + b``; three arrays summed into one) ->
  :func:`xlafit.predict.fit.fit_peak_stream` (the bandwidth of kernels moving more bytes per
  element, :func:`xlafit.predict.model.stream_rate`);
- a long element-wise polynomial on a small array -> the vector rate.

Then a short training step (a small MLP; its rows, widths and steps configurable) is timed
and predicted with the fitted rates: its error is the calibration's band. The file is JSON,
a few hundred bytes: a Colab user calibrates a v5e-1 once and plans a v5e-64 with it.

Example (the CPU, tiny sizes, a few seconds):
    >>> rates, record = calibrate(sizes="tiny")
    >>> step = record["step"]
    >>> rates.origin, rates.matmul_flops > 0, step["measured_s"] > 0
    ('calibrated', True, True)
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xlafit.platform.hardware import table_peak
from xlafit.predict.fit import fit_matmul, fit_peak_stream, fit_stream, held_out_band
from xlafit.predict.model import predict
from xlafit.predict.ops import VECTOR_COST
from xlafit.predict.rates import Rates, calibration_dir, save_rates

__all__ = ["SIZES", "calibrate", "calibration_path", "chain_seconds"]

# (matrix products (m, k) with a k x k weight, element-wise streams in MiB, the polynomial's
# array in elements, the MLP step: rows, width, layers), by scale.
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "matmul": [(8192, 8192), (4096, 4096), (32768, 768), (8192, 2048), (2048, 2048), (16384, 1024), (65536, 256)],
        "stream_mib": [16, 64, 256, 1024],
        "vector_elements": 1 << 24,
        "step": (4096, 2048, 4),
    },
    "tiny": {
        "matmul": [(256, 256), (512, 128), (128, 512)],
        "stream_mib": [1, 4],
        "vector_elements": 1 << 14,
        "step": (64, 128, 2),
    },
}
# Multiply-adds per element of the vector benchmark: 256 operations for the 8 bytes it moves
# keep it compute-bound (an H200 computes about 10 float32 operations in the time it streams
# a byte, and 32 steps were memory-bound there; XLA:CPU runs 512 steps 5x slower per step).
_POLYNOMIAL = 128


def chain_seconds(
    op: Callable[..., jax.Array], x: jax.Array, *others: jax.Array, short: int = 4, long: int = 12
) -> float:
    """Seconds per application of ``op(x, *others)`` (an array of ``x``'s shape) on the
    device, from chains of ``short`` and ``long`` applications compiled as one program each
    (median of 5 runs of each); ``others`` are read by every application, unchanged."""

    def chain(r: int) -> Callable[..., jax.Array]:
        def run(y: jax.Array, *rest: jax.Array) -> jax.Array:
            for _ in range(r):
                y = jax.lax.optimization_barrier(op(y, *rest))
            return y

        return jax.jit(run)

    def timed(f: Callable[..., jax.Array]) -> float:
        f(x, *others).block_until_ready()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            f(x, *others).block_until_ready()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    a, b = timed(chain(short)), timed(chain(long))
    return max(b - a, 1e-9) / (long - short)


def _dtype() -> Any:
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _matmuls(shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    rows = []
    dtype = _dtype()
    for m, k in shapes:
        w = jnp.asarray(np.random.default_rng(0).standard_normal((k, k)) / np.sqrt(k), dtype)
        x = jnp.ones((m, k), dtype)

        def product(y: jax.Array, w: jax.Array = w) -> jax.Array:
            return (y @ w).astype(y.dtype)

        seconds = chain_seconds(product, x)
        rows.append({"m": m, "n": k, "k": k, "s": seconds, "tflops": 2 * m * k * k / seconds / 1e12})
    return rows


def _possible(rows: list[dict[str, Any]], device_kind: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(kept, left out)``: the timed products, less those faster than the device's datasheet
    peak (:func:`xlafit.platform.hardware.table_peak`, 2 % of slack), which only a timing error
    makes; all of them where the device has no datasheet row or every one is above it."""
    known = table_peak(device_kind)
    if known is None:
        return rows, []
    kept: list[dict[str, Any]] = []
    left_out: list[dict[str, Any]] = []
    for r in rows:
        (kept if r["tflops"] * 1e12 <= 1.02 * known[0] else left_out).append(r)
    return (kept, left_out) if kept else (rows, [])


def _streams(sizes_mib: list[int]) -> list[dict[str, Any]]:
    rows = []
    dtype = _dtype()
    for mib in sizes_mib:
        x = jnp.ones((mib * 2**20 // jnp.dtype(dtype).itemsize // 1024, 1024), dtype)
        seconds = chain_seconds(lambda y: y * 0.5 + 0.25, x)
        rows.append({"bytes": 2 * x.nbytes, "s": seconds, "gbps": 2 * x.nbytes / seconds / 1e9})
    return rows


def _wide_streams(mib: int) -> list[dict[str, Any]]:
    """Streams of ``mib`` MiB per array that move more bytes per element than
    :func:`_streams`: float32 ``x * a + b`` (on accelerators, where the reference is bf16) and
    ``x * a + b + y + z`` (three arrays read, one written)."""
    dtype = _dtype()
    rows = []
    cases: list[tuple[str, Any, int]] = [("three into one", dtype, 3)]
    if dtype != jnp.float32:
        cases.insert(0, ("float32", jnp.float32, 1))
        cases.append(("three float32 into one", jnp.float32, 3))
    for name, kind, inputs in cases:
        shape = (mib * 2**20 // jnp.dtype(kind).itemsize // 1024, 1024)
        x, *others = (jnp.full(shape, 1.0 + i, kind) for i in range(inputs))
        seconds = chain_seconds(lambda y, *rest: sum(rest, y * 0.5 + 0.25), x, *others)
        moved = (inputs + 1) * x.nbytes
        width = (inputs + 1) * jnp.dtype(kind).itemsize
        rows.append(
            {"name": name, "bytes": moved, "bytes_per_element": width, "s": seconds, "gbps": moved / seconds / 1e9}
        )
    return rows


def _vector(elements: int) -> dict[str, Any]:
    x = jnp.ones((elements // 1024, 1024), jnp.float32)

    def polynomial(y: jax.Array) -> jax.Array:
        z = y
        for i in range(_POLYNOMIAL):
            z = z * 0.999 + 0.001 * i
        return z

    seconds = chain_seconds(polynomial, x)
    ops = 2 * _POLYNOMIAL * VECTOR_COST["multiply"] * elements
    return {"elements": elements, "ops": ops, "bytes": 2 * x.nbytes, "s": seconds}


def _step(rows: int, width: int, layers: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A small MLP's AdamW train step (its loss, gradients and update, one program)."""
    dtype = _dtype()
    keys = jax.random.split(jax.random.key(0), layers)
    params = [jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width) for k in keys]
    tx = optax.adamw(1e-3)
    state = tx.init(params)
    x = jnp.ones((rows, width), dtype)

    def loss(ps: list[jax.Array], batch: jax.Array) -> jax.Array:
        h = batch
        for p in ps:
            h = jax.nn.gelu(h @ p.astype(dtype))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    def step(ps: list[jax.Array], st: Any, batch: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(ps, batch)
        updates, st = tx.update(grads, st, ps)
        return optax.apply_updates(ps, updates), st, value

    return step, (params, state, x)


def _measure_step(step: Callable[..., Any], args: tuple[Any, ...], steps: int = 10) -> tuple[float, str]:
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile()
    params, state, x = args
    params, state, _ = compiled(params, state, x)  # warm-up
    jax.block_until_ready(params)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, state, loss = compiled(params, state, x)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compiled.as_text() or ""


def calibrate(sizes: str = "full", progress: Callable[[str], None] = lambda _: None) -> tuple[Rates, dict[str, Any]]:
    """Measures this machine's default device and fits its rates (see the module docstring).

    Returns:
        ``(rates, record)``: the fitted row (``origin`` "calibrated", its band from the
        training step) and every timing behind it.
    """
    if sizes not in SIZES:
        raise ValueError(f"sizes={sizes!r}: one of {', '.join(SIZES)}")
    plan = SIZES[sizes]
    device = jax.devices()[0]
    units = int(getattr(device, "core_count", 0) or 1)
    progress(f"calibrating {device.device_kind}: matrix products ...")
    matmuls = _matmuls(plan["matmul"])
    progress("element-wise streams ...")
    streams = _streams(plan["stream_mib"])
    progress("wider element-wise streams ...")
    wide = _wide_streams(plan["stream_mib"][-1])
    progress("element-wise arithmetic ...")
    vector = _vector(plan["vector_elements"])
    bandwidth, fixed = fit_stream(streams)
    kept, impossible = _possible(matmuls, device.device_kind)
    for r in impossible:
        progress(
            f"left out: the {r['m']}x{r['n']}x{r['k']} product timed at {r['tflops']:.0f} TFLOP/s, above the "
            "device's datasheet peak (timing noise; calibrate again if many are)"
        )
    peak = fit_peak_stream(bandwidth, fixed, wide)
    # the products' operands streamed as the model streams a product's (stream_rate)
    flops, tile = fit_matmul(kept, units, bandwidth=peak or bandwidth, itemsize=jnp.dtype(_dtype()).itemsize)
    computing = vector["s"] - vector["bytes"] / bandwidth - fixed  # what its bytes do not explain
    vector_rate = vector["ops"] / max(computing, vector["s"] / 10)
    sources = {
        "matmul_flops": f"fitted to {len(kept)} timed products (xlafit bench --calibrate)"
        + (f"; {len(impossible)} timed above the datasheet peak left out" if impossible else ""),
        "matmul_tile": "the wave model's best tile for those products",
        "units": "jax.Device.core_count" if units > 1 else "one unit (the device reports no core count)",
        "hbm_bytes_per_s": f"fitted to {len(streams)} timed element-wise streams",
        "vector_ops_per_s": f"a {_POLYNOMIAL}-step polynomial per element, timed"
        + ("" if computing >= vector["s"] / 2 else " (memory-bound: a lower bound at best)"),
        "kernel_s": "the streams' fixed cost per kernel",
        "stream_bytes_per_element": "the element-wise streams' dtype, read and written",
        "hbm_peak_bytes_per_s": (
            f"the fastest of {len(wide)} timed wider streams"
            if peak
            else f"none: {len(wide)} timed wider streams were no faster"
        ),
    }
    width = 2 * jnp.dtype(_dtype()).itemsize
    rates = Rates(
        device.device_kind, flops, tile, units, bandwidth, vector_rate, fixed,
        stream_bytes_per_element=width if peak else None, hbm_peak_bytes_per_s=peak, sources=sources,
    )  # fmt: skip
    progress("a training step ...")
    step, args = _step(*plan["step"])
    measured, hlo = _measure_step(step, args)
    predicted = predict(hlo, rates).seconds
    error = predicted / measured - 1
    rates = dataclasses.replace(rates, band=held_out_band([error], "measured"), origin="calibrated")
    record = {
        "device_kind": device.device_kind,
        "jax": jax.__version__,
        "sizes": sizes,
        "matmul": kept,
        "matmul_left_out": impossible,
        "stream": streams,
        "wide_stream": wide,
        "vector": vector,
        "step": {"rows_width_layers": plan["step"], "measured_s": measured, "predicted_s": predicted},
    }
    return rates, record


def calibration_path(device_kind: str, folder: Path | None = None) -> Path:
    """Where a device kind's calibration is written: ``<cache>/calibration/<kind>.json``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"
    return (folder or calibration_dir()) / f"{slug}.json"


def write(rates: Rates, path: Path | None = None) -> Path:
    """Writes ``rates`` where :func:`xlafit.predict.rates.rates_for` will find it."""
    return save_rates(rates, path or calibration_path(rates.device_kind))
