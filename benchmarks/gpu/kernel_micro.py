"""On a lent GPU: the kinds of kernel the step model prices worst, each alone in a program,
timed and profiled beside the model's prediction of it (micro-benchmarks to fit rates to;
the training steps' own kernels stay held out).

The H200's profiled steps (``benchmarks/validation/gpu-h200``) found the model too fast on
row and column reductions that read a transposed operand or write a second output (BERT's
layer-norm and bias-gradient fusions, the Llama's softmax backward: 1.8-2.2 TB/s where a
bf16 stream runs at 3.35), Triton GEMMs with few output tiles or a batch of small ones, and
ResNet's max-pool (its reduce-window and the gradient's scatter). Each case here is one such
operation at the shape the steps ran it:

  gemm-long-k        bf16 [5120, 30522] @ [30522, 768] (the MLM head's gradient: one wave of tiles)
  gemm-768           bf16 [16384, 768] @ [768, 768] + bias (BERT-128's attention output projection)
  gemm-batched       float32 probabilities [64, 1024, 4096] as bf16 @ [64, 4096, 64] (the Llama's P @ V)
  reduce-rows        layer norm over [32768, 768] bf16, float32 statistics
  reduce-columns     a bias gradient: [32768, 3072] bf16 summed over rows, beside the product it also writes
  reduce-transposed  [128, 12, 128, 64] read as [128, 128, 12, 64] and summed over the sequence
  softmax-backward   float32 [64, 1024, 1024] rows: p * (dp - sum(p * dp))
  gelu-erf-backward  the exact GELU's derivative in float32 on [16384, 3072] bf16
  maxpool            ResNet's stem pool: 3 x 3, stride 2, on [256, 112, 112, 64] bf16
  maxpool-backward   its gradient (XLA's select-and-scatter)

    PYTHONPATH=src python3 benchmarks/gpu/kernel_micro.py --json $OUT/kernel-micro.json   # ~2 min
    JAX_PLATFORMS=cpu PYTHONPATH=src .venv/bin/python benchmarks/gpu/kernel_micro.py --size tiny \
        --json /tmp/kernel-micro.json                                                              # rehearsal

Per case: the program's optimised HLO, its time per call (median of 5 runs of 20 calls
queued back to back, so the host's dispatch hides behind the device), each kernel's time
from a profile of 5 calls, and the step model's time for each kernel with the device's rates
(the built-in row, or a calibration).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from collect import kernels_of

from xlafit.predict.model import predict
from xlafit.predict.ops import kernels
from xlafit.predict.rates import rates_for

# name: (function, argument shapes and dtypes at full size, at tiny size)
Case = tuple[Callable[..., Any], list[tuple[tuple[int, ...], Any]], list[tuple[tuple[int, ...], Any]]]
BF16, F32 = jnp.bfloat16, jnp.float32


def _layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    y = x.astype(F32)
    mean = y.mean(-1, keepdims=True)
    var = jnp.square(y - mean).mean(-1, keepdims=True)
    return ((y - mean) * jax.lax.rsqrt(var + 1e-12) * scale[None, :]).astype(BF16)


def _bias_gradient(g: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    product = g * x
    return product, product.astype(F32).sum(0)


def _transposed_sum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = jnp.transpose(x, (0, 2, 1, 3))  # [batch, heads, seq, dim] -> [batch, seq, heads, dim]
    return y * 2, y.astype(F32).sum(1).astype(BF16)


def _softmax_backward(p: jax.Array, dp: jax.Array) -> jax.Array:
    return p * (dp - (p * dp).sum(-1, keepdims=True))


def _gelu_erf_backward(x: jax.Array, g: jax.Array) -> jax.Array:
    y = x.astype(F32)
    cdf = 0.5 * (1 + jax.lax.erf(y / jnp.sqrt(2.0)))
    pdf = jnp.exp(-0.5 * y * y) / jnp.sqrt(2 * jnp.pi)
    return (g.astype(F32) * (cdf + y * pdf)).astype(BF16)


def _maxpool(x: jax.Array) -> jax.Array:
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")


def _maxpool_backward(x: jax.Array, g: jax.Array) -> jax.Array:
    return jax.vjp(_maxpool, x)[1](g)[0]


CASES: dict[str, Case] = {
    "gemm-long-k": (
        jnp.matmul,
        [((5120, 30522), BF16), ((30522, 768), BF16)],
        [((64, 1024), BF16), ((1024, 32), BF16)],
    ),
    "gemm-768": (
        lambda x, w, b: x @ w + b[None, :],
        [((16384, 768), BF16), ((768, 768), BF16), ((768,), BF16)],
        [((256, 64), BF16), ((64, 64), BF16), ((64,), BF16)],
    ),
    "gemm-batched": (
        lambda p, v: jnp.matmul(p.astype(BF16), v),
        [((64, 1024, 4096), F32), ((64, 4096, 64), BF16)],
        [((4, 64, 128), F32), ((4, 128, 16), BF16)],
    ),
    "reduce-rows": (_layer_norm, [((32768, 768), BF16), ((768,), F32)], [((512, 64), BF16), ((64,), F32)]),
    "reduce-columns": (_bias_gradient, [((32768, 3072), BF16)] * 2, [((512, 128), BF16)] * 2),
    "reduce-transposed": (_transposed_sum, [((128, 12, 128, 64), BF16)], [((4, 4, 32, 16), BF16)]),
    "softmax-backward": (_softmax_backward, [((64, 1024, 1024), F32)] * 2, [((4, 64, 64), F32)] * 2),
    "gelu-erf-backward": (_gelu_erf_backward, [((16384, 3072), BF16)] * 2, [((256, 128), BF16)] * 2),
    "maxpool": (_maxpool, [((256, 112, 112, 64), BF16)], [((2, 16, 16, 8), BF16)]),
    "maxpool-backward": (
        _maxpool_backward,
        [((256, 112, 112, 64), BF16), ((256, 56, 56, 64), BF16)],
        [((2, 16, 16, 8), BF16), ((2, 8, 8, 8), BF16)],
    ),
}


def _per_call(compiled: Any, args: tuple[jax.Array, ...], calls: int = 20) -> float:
    jax.block_until_ready(compiled(*args))
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = compiled(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs)


def _profiled(compiled: Any, args: tuple[jax.Array, ...], calls: int = 5) -> dict[str, list[float]]:
    """Each kernel's microseconds and launches per call, from a profile."""
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace, create_perfetto_trace=True):
            for _ in range(calls):
                out = compiled(*args)
            jax.block_until_ready(out)
        by_name, _ = kernels_of(trace)
    return {name: [us / calls, n / calls] for name, (us, n) in by_name.items()}


def run(name: str, size: str) -> dict[str, Any]:
    fn, full, tiny = CASES[name]
    specs = full if size == "full" else tiny
    keys = jax.random.split(jax.random.key(0), len(specs))
    args = tuple(jax.random.normal(k, shape, F32).astype(dtype) for k, (shape, dtype) in zip(keys, specs, strict=True))
    compiled = jax.jit(fn).lower(*args).compile()
    hlo = compiled.as_text() or ""
    device = jax.devices()[0]
    rates = rates_for(device.device_kind)
    predicted = predict(kernels(hlo, signatures=True), rates) if rates else None
    measured = _per_call(compiled, args)
    profile = _profiled(compiled, args)
    return {
        "case": name,
        "shapes": [[list(shape), jnp.dtype(dtype).name] for shape, dtype in specs],
        "device_kind": device.device_kind,
        "measured_s": measured,
        "predicted_s": predicted.seconds if predicted else None,
        "rates": rates.origin if rates else None,
        "kernels_predicted": [
            {
                "name": t.kernel.name,
                "kind": t.kernel.kind,
                "s": t.seconds * t.kernel.count,
                "bound": t.bound,
                "bytes": t.kernel.bytes,
                "flops": t.kernel.flops,
                "vector": t.kernel.vector,
            }
            for t in (predicted.kernels if predicted else [])
        ],
        "kernels_measured_us": profile,
        "hlo": hlo,
        "versions": {"jax": jax.__version__, "python": sys.version.split()[0]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated (default: all)")
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--json", required=True, metavar="FILE")
    args = parser.parse_args()
    results = []
    for name in args.cases.split(","):
        if name not in CASES:
            parser.error(f"unknown case {name!r}: one of {', '.join(CASES)}")
        t0 = time.perf_counter()
        try:
            r = run(name, args.size)
        except Exception as e:  # one case failing (memory, a backend) does not lose the others
            r = {"case": name, "error": repr(e)}
            print(f"{name}: failed: {e!r}"[:400], flush=True)
        else:
            error = f"{r['predicted_s'] / r['measured_s'] - 1:+.0%}" if r["predicted_s"] else "-"
            predicted = f"{r['predicted_s'] * 1e6:.1f} us" if r["predicted_s"] else "no rates for this device"
            print(
                f"{name}: measured {r['measured_s'] * 1e6:.1f} us a call, predicted {predicted} ({error}); "
                f"{time.perf_counter() - t0:.0f} s",
                flush=True,
            )
        results.append(r)
        Path(args.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
