"""BERT train-step time with 16- and 32-bit dropout draws, alternating in one process.

Two compiled steps (``BertConfig.dropout_bits`` 16 and 32; 32 is ``nnx.Dropout``'s draw) on
the same batch, timed in alternating blocks so that machine noise hits both alike; the
median step of each. Model step only (AdamW), no input pipeline.

  .venv/bin/python benchmarks/speed/dropout_bits.py                                   # CPU: BERT mini, batch 32
  python benchmarks/speed/dropout_bits.py --preset base --batch 256 --dtype bfloat16  # GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax
from bert_speed import synthetic
from flax import nnx

from xlafit.models.bert import BertConfig, BertForMaskedLM
from xlafit.recipes import bert as recipe


def compiled_step(cfg: BertConfig):
    model = BertForMaskedLM(cfg, rngs=nnx.Rngs(params=0, dropout=1))
    model.train()
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        def loss(m):
            return recipe.loss_fn(m, batch)[0].mean()

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    return lambda batch: step(model, optimizer, batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--blocks", type=int, default=8, help="timed blocks per variant")
    p.add_argument("--steps", type=int, default=4, help="steps per block")
    args = p.parse_args()

    data = synthetic(args.batch, args.seq_len, 30522)
    batch = jax.device_put(data.take(np.arange(args.batch)))
    steps = {}
    for bits in (16, 32):
        steps[bits] = compiled_step(BertConfig.preset(args.preset, dtype=args.dtype, dropout_bits=bits))
        jax.block_until_ready(steps[bits](batch))  # compile
    times: dict[int, list[float]] = {16: [], 32: []}
    for block in range(args.blocks):
        for bits in (16, 32) if block % 2 == 0 else (32, 16):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = steps[bits](batch)
            jax.block_until_ready(loss)
            times[bits].append((time.perf_counter() - t0) / args.steps)
    print(f"BERT {args.preset}, batch {args.batch}, seq {args.seq_len}, {args.dtype}, {jax.devices()[0].device_kind}")
    for bits, ts in times.items():
        median = statistics.median(ts)
        print(
            f"dropout_bits={bits}: {1000 * median:.1f} ms/step, {args.batch * args.seq_len / median:,.0f} tokens/s "
            f"(blocks: {', '.join(f'{1000 * t:.0f}' for t in ts)} ms)"
        )
    print(f"16 bits vs 32: {statistics.median(times[32]) / statistics.median(times[16]):.3f}x")


if __name__ == "__main__":
    main()
