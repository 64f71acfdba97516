"""xlafit vs PyTorch eager: the pytorch/examples MNIST CNN, same batch, same machine, one run.

    python benchmarks/mnist_vs_torch.py                       # or: make bench
    python benchmarks/mnist_vs_torch.py --steps 60 --repeats 5 --json out.json

Each configuration trains in a fresh process on the 4,000 embedded MNIST training digits
(Adam, lr 1e-3, dropout on, global batch 128): ``--warmup`` steps first (for xlafit these
include the compile), then ``--steps`` timed steps including the input pipeline. The table
shows the median over ``--repeats`` rounds, configurations interleaved within each round so
that machine noise hits all of them alike. The ratio is examples/s over PyTorch eager's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

DEFAULT_VARIANTS = "torch,xlafit:1,xlafit:8,xlafit:1:bf16,xlafit:8:k4"


def _torch_worker(batch: int, warmup: int, steps: int) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    from xlafit.data import mnist

    class Net(nn.Module):  # pytorch/examples mnist/main.py
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.dropout1 = nn.Dropout(0.25)
            self.dropout2 = nn.Dropout(0.5)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, x):
            x = F.relu(self.conv2(F.relu(self.conv1(x))))
            x = self.dropout1(F.max_pool2d(x, 2))
            x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
            return self.fc2(x)

    torch.manual_seed(0)
    train = mnist.load_embedded()["train"]
    images = torch.from_numpy(np.ascontiguousarray(train["image"].transpose(0, 3, 1, 2)))
    labels = torch.from_numpy(train["label"].astype(np.int64))
    model, n = Net(), len(labels)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    perm, pos = torch.randperm(n), 0

    def step():
        nonlocal perm, pos
        if pos + batch > n:
            perm, pos = torch.randperm(n), 0
        idx = perm[pos : pos + batch]
        pos += batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()
    wall = time.perf_counter() - t0
    return {
        "examples_per_sec": steps * batch / wall,
        "step_ms": 1e3 * wall / steps,
        "compile_s": 0.0,
        "threads": torch.get_num_threads(),
    }


def _xlafit_worker(devices: int, batch: int, warmup: int, steps: int, dtype: str, k: int) -> dict:
    import optax
    from flax import nnx

    import xlafit
    from xlafit.config import TrainerConfig
    from xlafit.data import mnist
    from xlafit.recipes import mnist as recipe

    strategy = xlafit.connect(simulate=devices)
    train = mnist.load_embedded()["train"]
    model = xlafit.models.MnistCNN(rngs=nnx.Rngs(params=0, dropout=1), dtype=None if dtype == "float32" else dtype)
    epochs = (warmup + steps) // (len(train["label"]) // batch) + 1
    trainer = xlafit.Trainer(
        model,
        recipe.loss_fn,
        optax.adam(1e-3),
        strategy=strategy,
        global_batch=batch,
        config=TrainerConfig(epochs=epochs, steps_per_call=k, stop_at_step=warmup, log_every_steps=10**9),
    )
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(train)  # compiles, and warms up
        trainer.config.stop_at_step = warmup + steps
        compile_before = trainer.train_step.compile_s
        t0 = time.perf_counter()
        result = trainer.fit(train)
        # A call that ends an epoch early has a new shape, compiled in this window: not step time.
        wall = time.perf_counter() - t0 - (trainer.train_step.compile_s - compile_before)
    compiled = trainer.train_step.compile_s
    done = int(result.state.step) - warmup
    return {
        "examples_per_sec": done * batch / wall,
        "step_ms": 1e3 * wall / done,
        "compile_s": compiled,
        "compiles": result.train_compiles,
    }


def _run_worker(variant: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--batch",
        str(args.batch),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="torch, xlafit:DEVICES[:bf16][:kK]")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        if args.worker == "torch":
            result = _torch_worker(args.batch, args.warmup, args.steps)
        else:
            parts = args.worker.split(":")
            dtype = "bfloat16" if "bf16" in parts else "float32"
            k = next((int(p[1:]) for p in parts if p.startswith("k")), 1)
            result = _xlafit_worker(int(parts[1]), args.batch, args.warmup, args.steps, dtype, k)
        print(json.dumps(result))
        return

    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            runs[v].append(_run_worker(v, args))
            print(
                f"round {r + 1}/{args.repeats} {v}: {runs[v][-1]['examples_per_sec']:.0f} examples/s", file=sys.stderr
            )
    base = statistics.median(x["examples_per_sec"] for x in runs[variants[0]])
    print(
        f"\nMNIST CNN, global batch {args.batch}, {args.steps} timed steps after {args.warmup} warm-up, "
        f"median of {args.repeats}"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}"
    )
    print(
        f"{'configuration':<18} {'examples/s':>11} {'min-max':>13} {'step ms':>8} {'compile s':>9} "
        f"{'vs ' + variants[0]:>10}"
    )
    table = []
    for v in variants:
        eps = [x["examples_per_sec"] for x in runs[v]]
        med = statistics.median(eps)
        row = {
            "configuration": v,
            "examples_per_sec_median": med,
            "examples_per_sec_all": eps,
            "step_ms_median": statistics.median(x["step_ms"] for x in runs[v]),
            "compile_s_median": statistics.median(x["compile_s"] for x in runs[v]),
            "ratio": med / base,
        }
        table.append(row)
        print(
            f"{v:<18} {med:>11.0f} {min(eps):>6.0f}-{max(eps):<6.0f} {row['step_ms_median']:>8.1f} "
            f"{row['compile_s_median']:>9.2f} {row['ratio']:>9.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": table}, f, indent=2)


if __name__ == "__main__":
    main()
