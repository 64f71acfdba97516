"""Compile time of BERT's train step with the encoder layers unrolled or scanned (issue 17).

    flock -x /tmp/xlafit-cpu.lock python benchmarks/speed/scan_compile.py --layers 12 --repeats 3

Each compile is a fresh trace + lower + XLA compile of the trainer's own train step
(``Trainer.train_step.precompile``), with JAX's persistent compilation cache off; the two
variants alternate, and each reports the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import xlafit  # noqa: E402
from xlafit.config import TrainerConfig  # noqa: E402
from xlafit.data import mlm  # noqa: E402
from xlafit.models.bert import BertConfig, BertForMaskedLM  # noqa: E402
from xlafit.recipes import bert as recipe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mesh", default="1,8,1")
    args = parser.parse_args()
    xlafit.connect()
    jax.config.update("jax_enable_compilation_cache", False)
    mesh = tuple(int(v) for v in args.mesh.split(","))
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 8192, (64, 128)).astype(np.int32)
    arrays = {"input_ids": ids, "token_type_ids": np.zeros_like(ids, np.int8), "length": np.full(64, 128, np.int32)}
    ds = mlm.MLMDataset(arrays, 8192, mlm.MaskingConfig())
    seconds: dict[str, list[float]] = {"unrolled": [], "scanned": []}
    for _ in range(args.repeats):
        for name in seconds:
            cfg = BertConfig(
                vocab_size=8192,
                num_layers=args.layers,
                hidden_size=256,
                num_heads=4,
                intermediate_size=1024,
                max_position_embeddings=128,
                scan_layers=name == "scanned",
            )
            trainer = xlafit.Trainer(
                lambda cfg=cfg: BertForMaskedLM(cfg, rngs=nnx.Rngs(0)),
                recipe.loss_fn,
                optax.adamw(1e-4),
                strategy=xlafit.connect(mesh=mesh),  # type: ignore[arg-type]
                global_batch=16,
                config=TrainerConfig(epochs=1),
            )
            _, _, batch = next(iter(trainer.batches(ds)))
            t0 = time.perf_counter()
            trainer.train_step.precompile(trainer.state, batch)
            seconds[name].append(time.perf_counter() - t0)
            print(f"{name}: {seconds[name][-1]:.1f} s", flush=True)
    for name, values in seconds.items():
        runs = " / ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {statistics.median(values):.1f} | {runs} |")


if __name__ == "__main__":
    main()
