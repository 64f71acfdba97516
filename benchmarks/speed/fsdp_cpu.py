"""Step time and per-device memory of BERT under DP, FSDP, FSDP + remat and FSDP x TP, on
8 simulated CPU devices (issue 17).

    flock -x /tmp/xlafit-cpu.lock python benchmarks/speed/fsdp_cpu.py --rounds 3 --steps 5

Every layout trains the same model on the same batches through the trainer's own dispatch
loop (``Trainer.steps``); the layouts are interleaved within each round (the shared VM's
noise drifts), and each reports the median over rounds of its mean step time. Memory per
device comes from XLA's memory analysis of the compiled train step: arguments (parameters,
optimizer state, batch), temporaries (activations and workspace), and the state alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import xlafit  # noqa: E402
from xlafit.config import TrainerConfig  # noqa: E402
from xlafit.data import mlm  # noqa: E402
from xlafit.models.bert import BertConfig, BertForMaskedLM  # noqa: E402
from xlafit.parallel.sharding import bytes_per_device  # noqa: E402
from xlafit.recipes import bert as recipe  # noqa: E402

LAYOUTS = {
    "DP 8": ((8, 1, 1), "none"),
    "FSDP 8": ((1, 8, 1), "none"),
    "FSDP 8 + remat full": ((1, 8, 1), "full"),
    "FSDP 8 + remat dots_saveable": ((1, 8, 1), "dots_saveable"),
    "FSDP 4 x TP 2": ((1, 4, 2), "none"),
}


def data(n: int, t: int, vocab: int) -> mlm.MLMDataset:
    rng = np.random.default_rng(0)
    ids = rng.integers(5, vocab, (n, t)).astype(np.int32)
    arrays = {"input_ids": ids, "token_type_ids": np.zeros_like(ids, np.int8), "length": np.full(n, t, np.int32)}
    return mlm.MLMDataset(arrays, vocab, mlm.MaskingConfig())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    xlafit.connect()
    bert = dict(vocab_size=8192, num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024)
    ds = data(args.batch * (args.steps * args.rounds + 1), args.seq, bert["vocab_size"])
    trainers, memory, compile_s = {}, {}, {}
    for name in args.layouts.split(","):
        mesh, remat = LAYOUTS[name]
        cfg = BertConfig(**bert, max_position_embeddings=args.seq, remat=remat)
        trainer = xlafit.Trainer(
            lambda cfg=cfg: BertForMaskedLM(cfg, rngs=nnx.Rngs(params=0, dropout=1)),
            recipe.loss_fn,
            optax.adamw(1e-4),
            strategy=xlafit.connect(mesh=mesh),
            global_batch=args.batch,
            config=TrainerConfig(epochs=1),
        )
        _, _, batch = next(iter(trainer.batches(ds)))
        t0 = time.perf_counter()
        m = trainer.train_step.precompile(trainer.state, batch).memory_analysis()
        compile_s[name] = time.perf_counter() - t0
        memory[name] = {
            "state": bytes_per_device(trainer.state),
            "arguments": int(m.argument_size_in_bytes),
            "temporaries": int(m.temp_size_in_bytes),
            "outputs_not_aliased": int(m.output_size_in_bytes - m.alias_size_in_bytes),
            "peak": int(getattr(m, "peak_memory_in_bytes", 0) or 0),
        }
        trainers[name] = trainer
        print(f"{name}: compiled in {compile_s[name]:.1f}s, {memory[name]}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    step = 1  # step 0's call compiled nothing new but warms the caches
    for trainer in trainers.values():  # warm-up call per layout
        for call in trainer.steps(ds, 0, 1):
            call.metrics["loss"].block_until_ready()
    for r in range(args.rounds):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            last = None
            for call in trainer.steps(ds, step, step + args.steps):
                last = call
            assert last is not None
            last.metrics["loss"].block_until_ready()
            times[name].append((time.perf_counter() - t0) / args.steps)
        step += args.steps
        shown = ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in trainers)
        print(f"round {r + 1}: {shown}", flush=True)
    base = statistics.median(times["DP 8"]) if "DP 8" in times else None
    print(
        f"\n| layout | step ms (median of {args.rounds}) | rounds | vs DP | state MiB/device "
        "| temporaries MiB/device | peak MiB/device |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in trainers:
        med = statistics.median(times[name])
        ratio = f"{med / base:.2f}x" if base else "-"
        runs = " / ".join(f"{t * 1e3:.0f}" for t in times[name])
        mem = memory[name]
        print(
            f"| {name} | {med * 1e3:.0f} | {runs} | {ratio} | {mem['state'] / 2**20:.2f} | "
            f"{mem['temporaries'] / 2**20:.2f} | {mem['peak'] / 2**20:.2f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "times_s": times, "memory": memory, "compile_s": compile_s}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
