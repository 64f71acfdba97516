"""A Keras model trained by Keras' own ``fit`` and by xlafit: examples/s and compile time.

The MNIST CNN of the recipe (``xlafit.models.MnistCNN``) written in Keras 3 (JAX backend),
on the 4,000 embedded MNIST digits; the same global batch and optimizer (Keras' Adam; xlafit takes it through
``optax_from_keras``) for both. Keras trains with ``keras.distribution.DataParallel`` over the same
devices; xlafit with ``Trainer.steps``, its one dispatch loop (the loop ``fit`` runs). Each
round times one epoch of every (trainer, devices) pair in turn, so machine noise hits all
alike; the table gives the median epoch's examples/s, the first epoch's extra time
(compiling) and xlafit's ratio to Keras on the same devices.

  .venv/bin/python benchmarks/speed/keras_speed.py                       # 1 and 8 simulated devices, 5 rounds
  .venv/bin/python benchmarks/speed/keras_speed.py --rounds 1 --examples 512   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ["KERAS_BACKEND"] = "jax"

import xlafit  # noqa: E402  (xlafit.connect sets XLA's flags before JAX starts)

SIMULATE = 8
strategy8 = xlafit.connect(simulate=SIMULATE)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from xlafit.config import TrainerConfig  # noqa: E402
from xlafit.data import mnist  # noqa: E402
from xlafit.integrations.keras import KerasLoss, optax_from_keras  # noqa: E402
from xlafit.parallel.mesh import Strategy  # noqa: E402


def keras_cnn(seed: int = 0) -> keras.Model:
    """``MnistCNN`` in Keras: conv 32 -> conv 64 -> max-pool -> dropout -> dense 128 -> dropout -> dense 10."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Dropout(0.25),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10),
        ]
    )


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class SyncEveryStep(keras.callbacks.Callback):
    """Waits for each step's loss: ``fit`` then keeps one step in flight, not all of them.

    Keras' ``fit`` dispatches steps as fast as the host can, so many programs with a
    cross-device all-reduce queue up; on 8 simulated devices on 2 cores XLA:CPU's
    threads then wait for one another until it aborts ("Expected 8 threads to join the
    rendezvous, but only 6 of them arrived on time"), 4 times in 5 attempts on 2026-11-24.
    xlafit keeps at most two calls in flight for that reason (``Trainer.steps``).
    """

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        float(logs["loss"])  # note: a host-device sync point


class KerasFit:
    """Keras' own ``fit``, one epoch per :meth:`epoch`, under ``DataParallel`` over ``devices``."""

    def __init__(self, devices: list, x: np.ndarray, y: np.ndarray, batch: int, lr: float, sync: bool) -> None:
        self.callbacks = [SyncEveryStep()] if sync and len(devices) > 1 else []
        self.distribution = keras.distribution.DataParallel(devices=devices)
        with self.distribution.scope():
            self.model = keras_cnn()
            self.model.compile(optimizer=keras.optimizers.Adam(lr), loss=LOSS, metrics=["accuracy"])
        self.x, self.y, self.batch = x, y, batch

    def epoch(self) -> None:
        with self.distribution.scope():
            # Keras keeps the compiled train function between fit calls; the first call compiles it.
            self.model.fit(
                self.x, self.y, batch_size=self.batch, epochs=1, verbose=0, shuffle=True, callbacks=self.callbacks
            )


class XlafitSteps:
    """xlafit's dispatch loop (``Trainer.steps``), one epoch per :meth:`epoch`."""

    def __init__(self, strategy: Strategy, x: np.ndarray, y: np.ndarray, batch: int, lr: float, k: int) -> None:
        self.trainer = xlafit.Trainer(
            keras_cnn(),
            KerasLoss(LOSS, ["accuracy"]),
            optax_from_keras(keras.optimizers.Adam(lr)),  # Keras' Adam, in Keras' arithmetic
            strategy=strategy,
            global_batch=batch,
            config=TrainerConfig(epochs=1_000_000, steps_per_call=k),
        )
        self.data = {"x": x, "y": y}
        self.steps_per_epoch = len(x) // batch
        self.step = 0

    def epoch(self) -> None:
        last = None
        for call in self.trainer.steps(self.data, self.step, self.step + self.steps_per_epoch):
            last = call.metrics
        jax.block_until_ready(last)  # note: the only sync, at the epoch's end (Keras syncs per step)
        self.step += self.steps_per_epoch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="1,8", help="comma-separated device counts (at most 8)")
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps-per-call", type=int, default=1, help="xlafit's k (Keras: steps_per_execution=1)")
    p.add_argument("--rounds", type=int, default=5, help="timed epochs per configuration, after the first")
    p.add_argument("--examples", type=int, default=4000, help="training examples per epoch (<= 4000)")
    p.add_argument(
        "--keras-queue",
        action="store_true",
        help="let Keras' fit queue every step (its default; aborts on 8 simulated devices here, see SyncEveryStep)",
    )
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()

    train = mnist.load_embedded()["train"]
    x, y = train["image"][: args.examples], train["label"][: args.examples]
    runs: dict[tuple[str, int], object] = {}
    for n in (int(d) for d in args.devices.split(",")):
        devices = jax.devices()[:n]
        runs["keras fit", n] = KerasFit(devices, x, y, args.batch, args.lr, sync=not args.keras_queue)
        runs["xlafit", n] = XlafitSteps(
            Strategy(Mesh(np.array(devices), ("data",))), x, y, args.batch, args.lr, args.steps_per_call
        )
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    for _ in range(args.rounds + 1):  # round 0 compiles
        for key, run in runs.items():
            t0 = time.perf_counter()
            run.epoch()  # type: ignore[attr-defined]
            times[key].append(time.perf_counter() - t0)

    examples = len(x) // args.batch * args.batch
    rows = []
    for (name, n), t in times.items():
        median = statistics.median(t[1:]) if len(t) > 1 else t[0]
        rows.append(
            {
                "trainer": name,
                "devices": n,
                "examples_per_sec": examples / median,
                "epoch_s": median,
                "compile_s": t[0] - median,  # the first epoch's extra time: tracing and compiling
                "epochs_timed": len(t) - 1,
            }
        )
    print(f"MNIST CNN (Keras 3, JAX {jax.__version__}, Keras {keras.version()}), global batch {args.batch}, "
          f"{examples} examples/epoch, median of {args.rounds} epochs, {jax.devices()[0].platform}")  # fmt: skip
    print(f"{'trainer':<10} {'devices':>7} {'examples/s':>11} {'compile s':>10} {'xlafit / keras':>15}")
    keras_rate = {r["devices"]: r["examples_per_sec"] for r in rows if r["trainer"] == "keras fit"}
    for r in rows:
        ratio = r["examples_per_sec"] / keras_rate[r["devices"]] if r["trainer"] == "xlafit" else None
        print(
            f"{r['trainer']:<10} {r['devices']:>7} {r['examples_per_sec']:>11.0f} {r['compile_s']:>10.2f} "
            f"{f'{ratio:.2f}x' if ratio else '':>15}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
