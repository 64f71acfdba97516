"""A mixture of experts' training step on a CPU: grouped products (``model.moe.impl=ragged``)
against every expert computing every token (``dense``), at 8 experts, 2 a token (issue 66).

    flock -x /tmp/xlafit-cpu.lock python benchmarks/speed/moe_cpu.py --rounds 5 --steps 5 \\
        --out benchmarks/results/2026-12-05/moe/moe_cpu.json

Both train the same Qwen3-MoE-shaped model on the same batches through the trainer's own
dispatch loop (``Trainer.steps``), with the llm recipe's loss (the load-balancing loss
included), on one CPU device. The two are interleaved within each round (a shared VM's noise
drifts); each reports the median over rounds of its mean step time, compile time apart. On a
CPU the grouped product is computed in tiles of one expert each
(:func:`xlafit.models.moe.tiled_ragged_dot`); on TPUs and GPUs it is ``jax.lax.ragged_dot``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import xlafit  # noqa: E402
from xlafit.config import TrainerConfig  # noqa: E402
from xlafit.data.dataset import ArrayDataset  # noqa: E402
from xlafit.models import moe  # noqa: E402
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from xlafit.recipes import llm as recipe  # noqa: E402

# model.moe.impl, and "lax_ragged_dot": the grouped products as jax.lax.ragged_dot on a CPU
# (JAX lowers it there to a product over every group), to show why the CPU path is tiled.
IMPLS = ("ragged", "dense", "lax_ragged_dot")


def rows(n: int, t: int, vocab: int) -> ArrayDataset:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, (n, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy()
    return ArrayDataset({"input_ids": ids, "segment_ids": np.ones_like(ids), "positions": positions})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sizes = dict(vocab_size=1024, num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512,
                 moe_intermediate_size=256, num_experts=args.experts, num_experts_per_tok=2,
                 max_position_embeddings=args.seq)  # fmt: skip
    ds = rows(args.batch * (args.steps * args.rounds + 1), args.seq, sizes["vocab_size"])
    strategy = xlafit.Strategy(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))
    trainers, compile_s = {}, {}
    for impl in IMPLS:
        cfg = LlamaConfig.preset("tiny-moe", **sizes, moe_impl="dense" if impl == "dense" else "ragged")
        trainer = xlafit.Trainer(
            lambda cfg=cfg: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)),
            recipe.loss_fn,
            optax.adamw(1e-4),
            strategy=strategy,
            global_batch=args.batch,
            config=TrainerConfig(epochs=1),
        )
        _, _, batch = next(iter(trainer.batches(ds)))
        tiled = moe.grouped_dot
        if impl == "lax_ragged_dot":  # traced once, here: the compiled step keeps it
            moe.grouped_dot = jax.lax.ragged_dot
        t0 = time.perf_counter()
        trainer.train_step.precompile(trainer.state, batch)
        compile_s[impl] = time.perf_counter() - t0
        moe.grouped_dot = tiled
        trainers[impl] = trainer
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for r in range(args.rounds):
        for impl in IMPLS:
            trainer = trainers[impl]
            calls = trainer.steps(ds, start=r * args.steps, stop=(r + 1) * args.steps)
            jax.block_until_ready(next(calls).metrics)  # the round's first call: after the order is drawn
            t0 = time.perf_counter()
            done = 1
            for call in calls:
                jax.block_until_ready(call.metrics)
                done += 1
            times[impl].append((time.perf_counter() - t0) / max(done - 1, 1))
        print(f"round {r}: " + "  ".join(f"{i} {times[i][-1] * 1e3:.1f} ms" for i in IMPLS), flush=True)
    median = {impl: statistics.median(times[impl]) for impl in IMPLS}
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "model": sizes,
        "tokens_per_step": args.batch * args.seq,
        "step_s_median": median,
        "step_s_per_round": times,
        "compile_s": compile_s,
        "dense_over_ragged": median["dense"] / median["ragged"],
        "lax_ragged_dot_over_ragged": median["lax_ragged_dot"] / median["ragged"],
        "platform": f"{jax.default_backend()} x{jax.device_count()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, jax {jax.__version__}",
    }
    shown = ("step_s_median", "compile_s", "dense_over_ragged", "lax_ragged_dot_over_ragged")
    print(json.dumps({k: result[k] for k in shown}, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
