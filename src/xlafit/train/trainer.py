"""The data-parallel trainer: one program for 1 CPU, 8 TPU cores, a GPU or a pod.

Example:
    >>> import optax, xlafit
    >>> from flax import nnx
    >>> strategy = xlafit.connect(simulate=8)                          # doctest: +SKIP
    >>> model = xlafit.models.MnistCNN(rngs=nnx.Rngs(0))              # doctest: +SKIP
    >>> def loss_fn(model, batch):
    ...     logits = model(batch["image"])
    ...     losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    ...     return losses, {"accuracy": (logits.argmax(-1) == batch["label"]).astype("float32")}
    >>> trainer = xlafit.Trainer(model, loss_fn, optax.adam(1e-3), strategy=strategy,
    ...                          global_batch=128)                      # doctest: +SKIP
    >>> result = trainer.fit(train_arrays, eval=test_arrays)           # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xlafit.checkpoint import Checkpointer, is_prng_key
from xlafit.config import TrainerConfig
from xlafit.data.loader import ArrayDataset, Prefetcher, TrainOrder, as_dataset, eval_batches, to_global
from xlafit.devices import Strategy, connect
from xlafit.train.report import RunReport
from xlafit.train.step import (
    CompiledStep,
    LossFn,
    TrainState,
    build_eval_step,
    build_invariant_train_step,
    build_train_step,
)

log = logging.getLogger("xlafit")


@dataclasses.dataclass
class FitResult:
    """What :meth:`Trainer.fit` returns.

    Attributes:
        state: the final train state (replicated on the devices).
        history: every logged training record.
        eval: the last evaluation (``loss``, the metrics, ``count``), or None.
        train_compiles: how many times the train step was compiled.
        eval_compiles: how many times the eval step was compiled.
        compile_s: seconds spent compiling, apart from step time.
    """

    state: TrainState
    history: list[dict[str, Any]]
    eval: dict[str, float] | None
    train_compiles: int
    eval_compiles: int
    compile_s: float


class Trainer:
    """Trains an ``nnx.Module`` data-parallel over every device of the strategy.

    Args:
        model: the model; its ``nnx.Param`` variables are trained.
        loss_fn: ``loss_fn(model, batch)`` -> per-example losses ``[B]``, or
            ``(losses [B], {metric: [B]})``. Per-example values let evaluation weight
            padding rows by zero and count every example exactly once.
        optimizer: an optax transformation.
        strategy: from :func:`xlafit.connect`; default: all devices.
        global_batch: examples per optimizer step over all devices (must divide evenly).
        config: loop settings (epochs, steps per call, logging, checkpoints).
        learning_rate: the schedule inside ``optimizer``, only to log the rate.
        run_dir: where metrics, TensorBoard logs and checkpoints go; None keeps nothing.
        eval_global_batch: evaluation batch; default ``global_batch``.
        data_seed: seed of the data order.
        prefetch: batches moved to the devices ahead of the step.
        resume: continue from the newest checkpoint in ``run_dir``.
    """

    def __init__(
        self,
        model: nnx.Module,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        *,
        strategy: Strategy | None = None,
        global_batch: int,
        config: TrainerConfig | None = None,
        learning_rate: optax.Schedule | float | None = None,
        run_dir: str | Path | None = None,
        eval_global_batch: int | None = None,
        data_seed: int = 0,
        prefetch: int = 2,
        resume: bool = True,
    ) -> None:
        self.strategy = strategy or connect()
        self.config = config or TrainerConfig()
        self.global_batch = global_batch
        self.eval_global_batch = eval_global_batch or global_batch
        for name, batch in (("global batch", self.global_batch), ("eval global batch", self.eval_global_batch)):
            if batch % self.strategy.num_replicas:
                raise ValueError(
                    f"the {name} {batch} does not divide over {self.strategy.num_replicas} devices; "
                    f"use a multiple of {self.strategy.num_replicas}."
                )
        self.learning_rate = learning_rate
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.data_seed = data_seed
        self.prefetch = prefetch
        self.resume = resume
        self.tx = optimizer

        model.train()
        train_graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
        model.eval()
        eval_graphdef = nnx.graphdef(model)
        model.train()

        replicated = self.strategy.replicated
        params, model_state = replicate((params, model_state), replicated)
        self._state = TrainState(
            step=replicate(jnp.zeros((), jnp.int32), replicated),
            params=params,
            opt_state=jax.jit(optimizer.init, out_shardings=replicated)(params),
            model_state=model_state,
        )
        chunks = self.config.invariant_chunks
        if chunks is not None:
            devices = self.strategy.num_replicas
            if chunks % devices or self.global_batch % chunks:
                raise ValueError(
                    f"trainer.invariant_chunks={chunks} must be a multiple of the {devices} devices and divide "
                    f"the global batch {self.global_batch}; try {devices * max(1, chunks // devices)} or null."
                )
            step_fn = build_invariant_train_step(train_graphdef, loss_fn, optimizer, self.strategy.mesh, chunks)
        else:
            step_fn = build_train_step(train_graphdef, loss_fn, optimizer, unroll=self.strategy.platform == "cpu")
        self.train_step = CompiledStep(
            "train step",
            step_fn,
            in_shardings=(replicated, self.strategy.batch_sharding(1)),
            out_shardings=(replicated, replicated),
            donate_argnums=0,
        )
        self.eval_step = CompiledStep(
            "eval step",
            build_eval_step(eval_graphdef, loss_fn),
            in_shardings=(replicated, self.strategy.batch, self.strategy.batch),
            out_shardings=replicated,
        )
        self._ckpt = (
            Checkpointer(self.run_dir / "checkpoints", keep=self.config.keep_checkpoints)
            if self.run_dir is not None
            else None
        )

    @property
    def state(self) -> TrainState:
        return self._state

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, data: ArrayDataset | Mapping[str, np.ndarray]) -> dict[str, float]:
        """Loss and metrics over every example of ``data``, each counted exactly once.

        The last partial batch is padded to the full batch shape and its padding rows are
        masked out, so the result equals a single-device computation over the whole set.
        """
        data = as_dataset(data)
        s = self.strategy
        totals: dict[str, float] = {}
        for batch, mask in eval_batches(data, self.eval_global_batch, s.process_index, s.process_count):
            sums = self.eval_step(self._state, to_global(s, batch), to_global(s, mask))
            # note: a host sync per eval batch; evaluation is short next to training.
            for key, value in jax.device_get(sums).items():
                totals[key] = totals.get(key, 0.0) + float(value)
        count = totals.pop("count")
        return {**{k: v / count for k, v in totals.items()}, "count": int(round(count))}

    # ------------------------------------------------------------------ training

    def batches(
        self, train: ArrayDataset | Mapping[str, np.ndarray], start: int = 0, stop: int | None = None
    ) -> Prefetcher:
        """The train step's inputs for steps ``[start, stop)``, gathered ahead in a thread.

        Yields ``(first_step, k, batches)``: ``k`` global batches stacked on a leading axis
        (``config.steps_per_call``, fewer where an epoch ends), already on the devices.
        ``stop`` defaults to the end of ``config.epochs``. Its ``wait_s`` is the time the
        consumer spent waiting for input.
        """
        train = as_dataset(train)
        order = TrainOrder(len(train), self.global_batch, self.data_seed)
        stop = self.config.epochs * order.steps_per_epoch if stop is None else stop
        return Prefetcher(self._batches(train, order, start, stop), self.prefetch)

    def _batches(self, data: ArrayDataset, order: TrainOrder, start: int, stop: int) -> Iterator:
        s, spe, k_max = self.strategy, order.steps_per_epoch, self.config.steps_per_call
        step = start
        while step < stop:
            # A call never crosses an epoch end, so evaluation and checkpoints fall between calls.
            k = min(k_max, spe - step % spe, stop - step)
            # One gather for the k batches (a copy of k x rows examples), then a view [k, rows, ...].
            idx = np.concatenate([order.local_indices(step + i, s.process_index, s.process_count) for i in range(k)])
            stacked = {name: x.reshape(k, -1, *x.shape[1:]) for name, x in data.take(idx).items()}
            yield step, k, to_global(s, stacked, leading_axes=1)
            step += k

    def fit(
        self,
        train: ArrayDataset | Mapping[str, np.ndarray],
        eval: ArrayDataset | Mapping[str, np.ndarray] | None = None,
    ) -> FitResult:
        """Trains for ``config.epochs`` epochs, evaluating and checkpointing as configured.

        Resumes from the newest checkpoint in ``run_dir`` when there is one (and
        ``resume`` is set): the data order is a function of the step, so the resumed run
        sees exactly the batches the uninterrupted one would have.
        """
        cfg, s = self.config, self.strategy
        train = as_dataset(train)
        order = TrainOrder(len(train), self.global_batch, self.data_seed)
        spe = order.steps_per_epoch
        total = cfg.epochs * spe
        stop = min(total, cfg.stop_at_step) if cfg.stop_at_step else total

        if self._ckpt is not None and self.resume and self._ckpt.latest_step() is not None:
            self._state = self._ckpt.restore(self._state)
        start = int(self._state.step)

        report = RunReport(self.run_dir, total, start, enabled=s.process_index == 0)
        report.print(
            f"devices: {s.num_replicas} x {s.platform} ({s.process_count} process(es))   "
            f"per-device batch: {self.global_batch // s.num_replicas}   global batch: {self.global_batch}"
        )
        peak = _peak_lr(self.learning_rate, total)
        report.print(
            f"steps: {spe}/epoch x {cfg.epochs} epochs = {total}   steps per call: {cfg.steps_per_call}"
            + (f"   peak learning rate: {peak:.4g}" if peak is not None else "")
        )
        if start:
            report.print(f"resumed from checkpoint at step {start} (epoch {start // spe + 1})")

        history: list[dict[str, Any]] = []
        last_eval: dict[str, float] | None = None
        pending: list[tuple[int, Any]] = []
        window_t0, window_wait, window_compile = time.perf_counter(), 0.0, 0.0
        batches = self.batches(train, start, stop)
        try:
            for first, k, batch in batches:
                compile_before = self.train_step.compile_s
                self._state, metrics = self.train_step(self._state, batch)
                window_compile += self.train_step.compile_s - compile_before
                pending.append((first, metrics))
                step = first + k
                epoch_end = step % spe == 0
                if step // cfg.log_every_steps > first // cfg.log_every_steps or epoch_end or step == stop:
                    # note: device_get is a host-device sync point; only at log steps.
                    values = jax.device_get([m for _, m in pending])
                    now = time.perf_counter()
                    steps_done = step - pending[0][0]
                    busy = max(now - window_t0 - window_compile, 1e-9)
                    record = {
                        "step": step,
                        "epoch": round(step / spe, 3),
                        **{key: float(np.mean(np.concatenate([v[key] for v in values]))) for key in values[0]},
                        "learning_rate": _lr_at(self.learning_rate, step - 1),
                        "examples_per_sec": steps_done * self.global_batch / busy,
                        "step_time_s": busy / steps_done,
                        "input_wait_s": batches.wait_s - window_wait,
                        "compiles": self.train_step.compiles,
                    }
                    record = {k: v for k, v in record.items() if v is not None}
                    history.append(record)
                    report.record(record)
                    pending = []
                    window_t0, window_wait, window_compile = time.perf_counter(), batches.wait_s, 0.0
                if epoch_end and eval is not None and (step // spe) % cfg.eval_every_epochs == 0:
                    last_eval = self.evaluate(eval)
                    report.record({"step": step, "epoch": step // spe, **last_eval}, prefix="eval")
                    window_t0 = time.perf_counter()
                if self._ckpt is not None and (
                    (
                        cfg.checkpoint_every_steps
                        and step // cfg.checkpoint_every_steps > first // cfg.checkpoint_every_steps
                    )
                    or epoch_end
                    or step == stop
                ):
                    self._ckpt.save(step, self._state)
        finally:
            batches.close()
            if self._ckpt is not None:
                self._ckpt.wait()
            report.print(
                f"train step compiled {self.train_step.compiles} time(s), eval step "
                f"{self.eval_step.compiles} time(s); {self.train_step.compile_s + self.eval_step.compile_s:.1f}s "
                "compiling, excluded from step times"
            )
            report.close()
        if eval is not None and last_eval is None and int(self._state.step) == total:
            last_eval = self.evaluate(eval)
        return FitResult(
            state=self._state,
            history=history,
            eval=last_eval,
            train_compiles=self.train_step.compiles,
            eval_compiles=self.eval_step.compiles,
            compile_s=self.train_step.compile_s + self.eval_step.compile_s,
        )

    def close(self) -> None:
        if self._ckpt is not None:
            self._ckpt.close()


def replicate(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """Copies host or single-device values to every device of ``sharding``, in every process.

    ``jax.device_put`` cannot target devices of other processes; each process instead
    contributes its (identical) copy through ``make_array_from_process_local_data``.
    """

    def put(x: Any) -> jax.Array:
        if is_prng_key(x):
            return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, x.shape)

    return jax.tree.map(put, tree)


def _lr_at(schedule: optax.Schedule | float | None, step: int) -> float | None:
    if schedule is None:
        return None
    return float(schedule(step)) if callable(schedule) else float(schedule)


def _peak_lr(schedule: optax.Schedule | float | None, total: int) -> float | None:
    if schedule is None or not callable(schedule):
        return schedule
    return float(jnp.max(schedule(jnp.arange(max(total, 1)))))
