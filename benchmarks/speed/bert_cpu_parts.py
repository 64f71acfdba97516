"""Pieces of a BERT-mini MLM step on the CPU, timed alone (BENCHMARKS.md, the CPU section).

1. A hidden-dropout mask on [32, 128, 256]: ``xlafit.models.bert.Dropout`` with 32 random
   bits per decision (``nnx.Dropout``) and 16, under each of JAX's PRNG implementations.
2. The MLM head's matmul at every position, [4096, 256] x [256, 30522], and 2048^3:
   XLA against PyTorch.
3. Softmax cross-entropy over [4096, 30522], forward + backward: optax against PyTorch.
4. The tied head's forward + backward with JAX's autodiff and with a hand-written backward.

  .venv/bin/python benchmarks/speed/bert_cpu_parts.py

Medians of 5 calls after a warm-up call; XLA with the flags ``xlafit.connect()`` sets by
default (YNNPACK for dot,eltwise,reduce; the BERT recipe now hands only dots to YNNPACK),
PyTorch with as many threads as cores.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import optax
import torch
from flax import nnx

import xlafit
from xlafit.models.bert import Dropout


def median_ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def masks() -> None:
    x = jnp.ones((32, 128, 256))
    for impl in ("threefry2x32", "philox4x32", "rbg", "unsafe_rbg"):
        row = []
        for bits in (32, 16):
            layer = Dropout(0.1, bits=bits, rngs=nnx.Rngs(dropout=jax.random.key(0, impl=impl)))
            layer.train()
            row.append(median_ms(nnx.jit(lambda layer, x: layer(x).sum()), layer, x))
        print(f"dropout mask {impl:<13} 32 bits {row[0]:7.2f} ms   16 bits {row[1]:7.2f} ms")


def matmuls() -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    for m, k, n in ((4096, 256, 30522), (2048, 2048, 2048)):
        a, b = jnp.ones((m, k)), jnp.ones((k, n))
        ta, tb = torch.ones(m, k), torch.ones(k, n)
        xla = 2 * m * k * n / median_ms(jax.jit(jnp.matmul), a, b) / 1e6
        pt = 2 * m * k * n / median_ms(torch.matmul, ta, tb) / 1e6
        print(f"matmul {m}x{k}x{n}: XLA {xla:6.1f} GFLOP/s   PyTorch {pt:6.1f} GFLOP/s")


def cross_entropy() -> None:
    logits = jax.random.normal(jax.random.key(0), (4096, 30522))
    labels = jnp.zeros((4096,), jnp.int32)
    grad = jax.jit(jax.grad(lambda z: optax.softmax_cross_entropy_with_integer_labels(z, labels).mean()))
    tz = torch.randn(4096, 30522, requires_grad=True)
    tl = torch.zeros(4096, dtype=torch.long)

    def torch_grad():
        torch.nn.functional.cross_entropy(tz, tl).backward()

    ours, theirs = median_ms(grad, logits), median_ms(torch_grad)
    print(f"cross-entropy fwd+bwd [4096, 30522]: optax {ours:7.1f} ms   PyTorch {theirs:7.1f} ms")


@jax.custom_vjp
def _tied(x, table):
    return x @ table.T


def _tied_fwd(x, table):
    return x @ table.T, (x, table)


def _tied_bwd(saved, g):
    x, table = saved
    return g @ table, (x.T @ g).T  # the table's gradient as (x^T g)^T: no transpose of g


_tied.defvjp(_tied_fwd, _tied_bwd)


def tied_head() -> None:
    x = jax.random.normal(jax.random.key(0), (4096, 256))
    table = 0.02 * jax.random.normal(jax.random.key(1), (30522, 256))
    bias = jnp.zeros((30522,))
    labels = jnp.zeros((4096,), jnp.int32)

    def loss(project):
        return lambda x, t, b: optax.softmax_cross_entropy_with_integer_labels(project(x, t) + b, labels).mean()

    auto = jax.jit(jax.grad(loss(lambda x, t: x @ t.T), argnums=(0, 1, 2)))
    hand = jax.jit(jax.grad(loss(_tied), argnums=(0, 1, 2)))
    print(
        f"tied head + cross-entropy fwd+bwd: autodiff {median_ms(auto, x, table, bias):7.1f} ms   "
        f"hand-written backward {median_ms(hand, x, table, bias):7.1f} ms"
    )


if __name__ == "__main__":
    xlafit.connect()  # xlafit's default XLA:CPU flags
    print(f"jax {jax.__version__}, torch {torch.__version__}, {os.cpu_count()} cores")
    masks()
    matmuls()
    cross_entropy()
    tied_head()
