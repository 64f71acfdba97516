"""The data-parallel trainer: one program for 1 CPU, 8 TPU cores, a GPU or a pod.

Example (a linear model on 8 simulated devices; any ``nnx.Module`` trains the same way):
    >>> import numpy as np, optax, xlafit
    >>> from flax import nnx
    >>> strategy = xlafit.connect()           # every device; xlafit.connect(simulate=8) on a laptop
    >>> def loss_fn(model, batch):            # per-example losses (and metrics)
    ...     logits = model(batch["x"])
    ...     losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    ...     return losses, {"accuracy": (logits.argmax(-1) == batch["y"]).astype("float32")}
    >>> data = {"x": np.eye(4, dtype=np.float32).repeat(16, 0), "y": np.arange(64, dtype=np.int32) // 16}
    >>> trainer = xlafit.Trainer(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), loss_fn, optax.sgd(1.0), strategy=strategy,
    ...                          global_batch=32, config=xlafit.config.TrainerConfig(epochs=20, log_every_steps=40))
    >>> result = trainer.fit(data, eval=data)  # doctest: +ELLIPSIS
    devices: 8 x cpu (1 process(es))   per-device batch: 4   global batch: 32
    ...
    >>> result.eval["accuracy"], result.eval["count"]
    (1.0, 64)
    >>> result  # doctest: +ELLIPSIS
    FitResult(step=40, train: accuracy=1, loss=..., eval: accuracy=1, loss=..., count=64, 20 logged records, ...)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

from xlafit.checkpoint import Checkpointer, check_not_all_set_aside, unfinished_save, unfinished_saves
from xlafit.config import OptimizerConfig, TrainerConfig
from xlafit.data.dataset import Batch, Dataset, StreamedDataset, as_dataset, checked_batch
from xlafit.data.loader import Prefetcher, TakeRequests, TrainOrder, to_global
from xlafit.errors import ConfigError, Preempted, RewardError
from xlafit.io.paths import as_path
from xlafit.parallel.cluster import connect
from xlafit.parallel.mesh import Strategy
from xlafit.platform.host_memory import check_train_state
from xlafit.train.adapter import Adapted, adapt, framework_of
from xlafit.train.arguments import built, check_arguments, check_batches, global_batch_of
from xlafit.train.compiled import limit_compiles
from xlafit.train.evaluation import compile_eval_step, final_evaluation
from xlafit.train.evaluation import evaluate as evaluate_data
from xlafit.train.frozen import check_trainable, checkpointed, frozen_filter, frozen_fingerprint, restore, run_settings
from xlafit.train.loop import Call, Due, FitResult, Loop, itstime, nonfinite_steps
from xlafit.train.nonfinite import apply_nan_policy
from xlafit.train.optim import chain_of, make_optimizer, schedule_words, warmup_steps
from xlafit.train.progress import IN_MEMORY, announce, in_memory_start, progress_record
from xlafit.train.report import RunReport
from xlafit.train.signals import handle_signals
from xlafit.train.state import TrainState, abstract_state, initial_state, state_shardings
from xlafit.train.step import LossFn, make_steps
from xlafit.train.watchdog import job_watchdog

log = logging.getLogger("xlafit")

Data = Dataset | Mapping[str, np.ndarray]  # a Dataset, or a dict of arrays with one row per example
# (model, first step, k, host batch [k, rows, ...]) -> the call's train batch [k, rows', ...] (GRPO's rollout)
Rollout = Callable[[nnx.Module, int, int, Batch], Batch]


class Trainer:
    """Trains an ``nnx.Module`` data-parallel over every device of the strategy.

    Args:
        model: the model; its ``nnx.Param`` variables are trained, and the trained values
            are written into it (copies: the state the trainer trains is its own) at every
            checkpoint, at a stop and at the end of :meth:`fit`. Or a function that
            builds it (``lambda: BertForMaskedLM(cfg, rngs=nnx.Rngs(0))``): it then runs
            inside ``jax.jit`` with the state's shardings as outputs, so every device
            creates only its own slices and a model larger than one device (or the host)
            can be built, split over ``mesh.fsdp`` / ``mesh.tensor``. A Keras 3 model
            (``KERAS_BACKEND=jax``) trains too: it is converted first (:mod:`xlafit.train.adapter`,
            :mod:`xlafit.integrations.keras`), its trainable variables are the parameters, and
            the trained values are written back into it at every checkpoint and at the end of
            :meth:`fit`; a ``torch.nn.Module`` too (:mod:`xlafit.integrations.torch`).
        loss_fn: ``loss_fn(model, batch)`` -> per-example losses ``[B]``, or
            ``(losses [B], {metric: [B]})``. Per-example values let evaluation weight
            padding rows by zero and count every example exactly once. A metric named
            ``weight`` (:data:`xlafit.train.step.WEIGHT`) is each example's weight: the loss and
            metrics are then means weighted by it (a language model's tokens per row). With a Keras model:
            a Keras loss, its name, ``loss(y_true, y_pred)``, a
            :class:`~xlafit.integrations.keras.KerasLoss` (with metrics), or None for the loss of
            ``model.compile``; batches are ``{"x": inputs, "y": targets}``.
        optimizer: an ``optax.GradientTransformation`` (``optax.adamw(1e-3)``; a Keras
            optimizer converts with :func:`xlafit.integrations.keras.optax_from_keras`:
            ``optax_from_keras(optimizer, model)``), or an
            :class:`~xlafit.config.OptimizerConfig`: its rate, tuned at ``reference_batch``,
            scaled to the global batch, with its warmup and decay over the run's steps, as
            the recipes' ``optimizer.*`` (built when :meth:`fit` knows the run's length).
        strategy: what :func:`xlafit.connect` returns; None: all devices.
        global_batch: a positive int, the examples per optimizer step over all devices; a
            multiple of ``strategy.num_replicas``.
        per_device_batch: instead of ``global_batch``, the examples per device: the global
            batch is ``per_device_batch * strategy.num_replicas`` (the recipes'
            ``data.per_device_batch``; TPUStrategy's ``16 * num_replicas_in_sync``). Give one
            of the two, e.g. ``Trainer(model, loss_fn, optax.adam(1e-3), per_device_batch=16)``.
        config: a :class:`~xlafit.config.TrainerConfig`, the loop's settings (epochs, steps per
            call, logging, checkpoints); None: its defaults.
        learning_rate: the schedule inside an optax ``optimizer`` (or a number), only to log
            the rate.
        run_dir: a str or ``os.PathLike``: where metrics, TensorBoard logs and checkpoints go;
            None keeps nothing.
        checkpoint_dir: a str or ``os.PathLike``: where checkpoints go instead of
            ``run_dir/checkpoints``, a local path or a URL such as ``gs://bucket/run`` (Orbax;
            ``gcsfs`` for gs://).
        eval_global_batch: the evaluation batch, a positive int as ``global_batch``; None:
            ``global_batch``.
        data_seed: an int, the seed of the data order.
        prefetch: an int, the batches moved to the devices ahead of the step (0 or more).
        resume: a bool: continue from the newest checkpoint in ``run_dir`` (refused if it was
            trained with another ``global_batch`` or ``data_seed``); False starts over, in a
            ``run_dir`` without checkpoints (one with them is refused: nothing is written over).
        tokens_per_example: adds ``tokens_per_sec`` to the logs (sequence models).
        flops_per_example: model FLOPs to train on one example; adds ``mfu`` to the logs
            (model FLOPs utilisation against :func:`xlafit.platform.hardware.peak_flops`).
        trainable: an ``nnx`` filter of the variables to train (differentiate, give
            optimizer state, checkpoint); default every ``nnx.Param``. Parameters it leaves
            out are frozen: they live in the state's ``model_state``, are not written in
            checkpoints (their fingerprint is: :func:`xlafit.models.lora.state_fingerprint`)
            and a resume onto other frozen weights is refused. LoRA:
            ``trainable=xlafit.models.lora.ADAPTER``.
        rollout: makes each call's train batch from the data's batch with the model as it
            is then (``rollout(model, first_step, k, batch)``, batches ``[k, rows, ...]`` on
            the host), in the dispatch loop before the call: reinforcement learning whose
            examples the model generates (:class:`xlafit.train.rollout.Rollout`, GRPO). The
            model shares the train state's arrays (no copy); the data is read ahead, the
            rollout is not.

    Raises:
        ConfigError: an argument of the wrong kind or value (:mod:`xlafit.train.arguments`),
            refused before anything is compiled or written.
    """

    def __init__(
        self,
        model: nnx.Module | Adapted | Callable[[], nnx.Module],
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation | OptimizerConfig,
        *,
        strategy: Strategy | None = None,
        global_batch: int | None = None,
        per_device_batch: int | None = None,
        config: TrainerConfig | None = None,
        learning_rate: optax.Schedule | float | None = None,
        run_dir: str | Path | None = None,
        checkpoint_dir: str | Path | None = None,
        eval_global_batch: int | None = None,
        data_seed: int = 0,
        prefetch: int = 2,
        resume: bool = True,
        tokens_per_example: float | None = None,
        flops_per_example: float | None = None,
        trainable: nnx.filterlib.Filter = nnx.Param,
        rollout: Rollout | None = None,
    ) -> None:
        check_arguments(
            model, loss_fn, optimizer, strategy=strategy, config=config, learning_rate=learning_rate,
            run_dir=run_dir, checkpoint_dir=checkpoint_dir, data_seed=data_seed, prefetch=prefetch, resume=resume,
            tokens_per_example=tokens_per_example, flops_per_example=flops_per_example,
        )  # fmt: skip
        self.strategy = strategy or connect()
        global_batch = global_batch_of(global_batch, per_device_batch, self.strategy.num_replicas)
        check_batches(global_batch, eval_global_batch, self.strategy.num_replicas)
        self.config = config or TrainerConfig()
        self.global_batch = int(global_batch)
        self.eval_global_batch = int(eval_global_batch or global_batch)
        self.learning_rate = learning_rate
        self.run_dir = as_path(run_dir) if run_dir is not None else None  # keeps gs://'s //
        self.data_seed = data_seed
        self.prefetch = prefetch
        self.resume = resume
        self._optimizer_config = optimizer if isinstance(optimizer, OptimizerConfig) else None
        optimizer = self.tx = chain_of(optimizer, self.global_batch)  # a config's schedule is set by fit
        self.tokens_per_example = tokens_per_example
        self.flops_per_example = flops_per_example
        self.peak_flops: float | None = None  # looked up when fit starts
        self._planned_k: set[int] = set()  # steps-per-call values of the calls planned so far

        is_builder = callable(model) and not isinstance(model, nnx.Module | Adapted) and framework_of(model) is None
        builder: Callable[[], nnx.Module] | None = model if is_builder else None  # type: ignore[assignment]
        # A builder's model as shapes only: built below, sharded, inside jit, with Flax's eager sharding
        # off (built: nnx.with_partitioning's names kept for the sharding rules). Another framework's model
        # is converted first (xlafit.train.adapter), its trained values written back through its hook.
        adapted = Adapted(nnx.eval_shape(built(builder)), loss_fn) if builder is not None else adapt(model, loss_fn)
        if adapted.check is not None:
            adapted.check(self.strategy, self.config)
        model, loss_fn, self._write_back_hook = adapted.module, adapted.loss_fn, adapted.write_back
        model.train()
        self.trainable = trainable
        train_graphdef, params, model_state = nnx.split(model, trainable, ...)  # type: ignore[misc]  # flax's overloads
        check_trainable(params)
        self._frozen = frozen_filter(trainable, model_state)
        model.eval()
        eval_graphdef = self._eval_graphdef = nnx.graphdef(model)
        model.train()
        self.rollout = rollout
        # Where every array lies, in, out and donated (xlafit.parallel.sharding; trainer.optimizer_offload)
        abstract = abstract_state(params, model_state, optimizer, self.strategy, self.config.optimizer_offload)
        check_train_state(abstract, self.strategy.platform)  # on a CPU: not beyond the memory free
        shardings = state_shardings(abstract)
        build = built(builder) if builder is not None else None
        self._state = initial_state(self.strategy, optimizer, build, params, model_state, shardings, trainable)
        self._make_steps = functools.partial(
            make_steps, train_graphdef, eval_graphdef, loss_fn, strategy=self.strategy, config=self.config,
            global_batch=self.global_batch, state_sharding=shardings, trainable=trainable,
        )  # fmt: skip
        self.train_step, self.eval_step = self._make_steps(optimizer)
        self.base_fingerprint = frozen_fingerprint(self._state, self._frozen)  # once: a host gather
        self._settings = run_settings(self.global_batch, self.data_seed)  # in every checkpoint, checked on resume
        if checkpoint_dir is None and self.run_dir is not None:
            checkpoint_dir = self.run_dir / "checkpoints"
        keep, every = self.config.keep_checkpoints, self.config.keep_every_steps
        self._ckpt = Checkpointer(checkpoint_dir, keep=keep, keep_every=every) if checkpoint_dir is not None else None

    @property
    def state(self) -> TrainState:
        return self._state

    def model(self) -> nnx.Module:
        """The model (in eval mode) on the train state's arrays as they are now: no copy; a
        train step donates them, so use it before the next one."""
        return nnx.merge(self._eval_graphdef, self._state.params, self._state.model_state)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, data: Data, stop: Callable[[], bool] | None = None) -> dict[str, float]:
        """Loss and metrics over every example of ``data``, each counted exactly once.

        The last partial batch is padded to the full batch shape and its padding rows are
        masked out, so the result equals a single-device computation over the whole set.
        ``stop``: asked before each batch; True ends the evaluation early (its result then
        covers the batches before).
        """
        return evaluate_data(self.eval_step, self._state, self.strategy, as_dataset(data), self.eval_global_batch, stop)

    def restore(self, step: int | None = None) -> int:
        """Loads checkpoint ``step`` of the run (default: the newest intact one) into the
        trainer's state, and its values into the model given; returns its step. To score a
        checkpoint: ``trainer.restore(40); trainer.evaluate(data)`` (``fit`` resumes by itself).

        Raises:
            ConfigError: the trainer keeps no checkpoints (no ``run_dir`` or ``checkpoint_dir``).
            CheckpointError: ``step`` is absent or damaged (the intact ones are named), the run
                has no intact checkpoint, or it was trained with another global batch or data
                seed, or on another frozen base.
        """
        if self._ckpt is None:
            raise ConfigError("this Trainer keeps no checkpoints to restore: give it the run's run_dir.")
        self._ckpt.wait()
        self._state, restored = restore(
            self._ckpt, self._state, self._frozen, self.base_fingerprint, self._settings, step
        )
        self._write_back()
        return restored

    # ------------------------------------------------------------------ training

    def batches(self, train: Data, start: int = 0, stop: int | None = None) -> Prefetcher:
        """The train step's inputs for steps ``[start, stop)``, gathered ahead in a thread.

        Yields ``(first_step, k, batches)``: ``k`` global batches stacked on a leading axis
        (``config.steps_per_call``, fewer where an epoch ends), already on the devices.
        ``stop`` defaults to the end of ``config.epochs``. Its ``wait_s`` is the time the
        consumer spent waiting for input.
        """
        train = as_dataset(train)
        order = TrainOrder.for_dataset(train, self.global_batch, self.data_seed)
        stop = self.config.epochs * order.steps_per_epoch if stop is None else stop
        return Prefetcher(self._batches(train, order, start, stop), self.prefetch)

    def _batches(self, data: Dataset, order: TrainOrder, start: int, stop: int) -> Iterator:
        s = self.strategy
        requests = TakeRequests.between(
            order, start, stop, self.config.steps_per_call, s.process_index, s.process_count
        )
        if isinstance(data, StreamedDataset):  # it prepares the batches ahead itself (Grain workers)
            taken: Iterator[Batch] = data.stream(requests)
        else:
            taken = (checked_batch(data.take(idx, epoch=epoch), len(idx)) for idx, epoch in requests)
        for (step, k), batch in zip(requests.calls.tolist(), taken, strict=True):
            stacked = {name: x.reshape(k, -1, *x.shape[1:]) for name, x in batch.items()}  # [k, rows, ...]
            # a rollout's input stays on the host: the batch it makes goes to the devices
            yield step, k, stacked if self.rollout is not None else to_global(s, stacked, leading_axes=1)

    def steps(self, train: Data, start: int, stop: int) -> Generator[Call, None, None]:
        """Runs the train step for steps ``[start, stop)``, yielding after each call.

        The one dispatch loop, used by :meth:`fit` and by the benchmarks alike (they time
        the time between two yields). After dispatching call ``i`` it waits for call
        ``i - 1`` only: the host prepares the next call while the devices run this one,
        and at most two calls are in flight, so no deep queue of programs with collectives
        can starve XLA:CPU's device threads. The state it updates is :attr:`state`.
        """
        batches = self.batches(train, start, stop)
        previous = None
        try:
            for first, k, batch in batches:
                if self.rollout is not None:  # the model as trained so far makes the call's batch
                    batch = to_global(self.strategy, self.rollout(self.model(), first, k, batch), leading_axes=1)
                compile_before = self.train_step.compile_s
                self._state, metrics = self.train_step(self._state, batch)
                compile_s = self.train_step.compile_s - compile_before
                if previous is not None:
                    jax.block_until_ready(previous)  # note: a sync on the previous call, not this one
                previous = metrics
                yield Call(first, k, metrics, compile_s, batches.wait_s)
        finally:
            batches.close()

    def fit(self, train: Data, eval: Data | None = None) -> FitResult:
        """Trains for ``config.epochs`` epochs, evaluating and checkpointing as configured.

        Resumes from the newest intact checkpoint in ``run_dir`` when there is one (and
        ``resume`` is set): the data order is a function of the step, so the resumed run
        sees exactly the batches the uninterrupted one would have. In a multi-process job a
        hang (no call finishing within ``trainer.watchdog_*``) ends the process with exit
        status 75 after writing its stacks (:mod:`xlafit.train.watchdog`).

        Raises:
            Preempted: SIGTERM or SIGINT arrived; a checkpoint of the last finished step
                was written first (a second signal exits at once). Calling ``fit`` again
                (the ``xlafit`` command: running it again; it exits with 75) resumes.
            NonFiniteError: a non-finite loss or gradient under ``nan_policy="stop"``.
        """
        train = as_dataset(train)
        eval = as_dataset(eval) if eval is not None else None
        if eval is not None and len(eval) == 0:
            log.warning("warning: the evaluation set holds no examples: this run trains without evaluation")
            eval = None
        # The guard covers the start-up too (a restore, the eval step's compile): a signal then
        # stops the run before its first step, with no traceback from wherever it landed.
        with handle_signals() as signals:
            loop = self._begin(train, eval)
            try:
                with job_watchdog(self.config, self.strategy) as loop.watchdog:
                    loop.signals = signals
                    self._train(loop, train, eval)
            except BaseException:
                # The first failure is the one to report: a checkpoint still being written, or the
                # report's files, may fail again on the same full disk; they are closed all the same.
                with contextlib.suppress(Exception):
                    self._end(loop)
                raise
        # The model the run ends with is evaluated, where no periodic evaluation took its last step.
        final = None
        if eval is not None and loop.last_eval_step != loop.total and int(self._state.step) == loop.total:
            final = functools.partial(self._final_evaluation, loop, eval)
        self._end(loop, final)
        self._write_back()
        return FitResult(
            state=self._state,
            history=loop.history,
            eval=loop.last_eval,
            train_compiles=self.train_step.compiles,
            eval_compiles=self.eval_step.compiles,
            compile_s=self.train_step.compile_s + self.eval_step.compile_s,
            evaluations=loop.evaluations,
            eval_step=loop.last_eval_step,
        )

    def _begin(self, train: Dataset, eval: Dataset | None) -> Loop:
        """Restores the newest checkpoint, plans the compiles, prints the start-up lines."""
        order = TrainOrder.for_dataset(train, self.global_batch, self.data_seed)
        total = self.config.epochs * order.steps_per_epoch
        stop = min(total, self.config.stop_at_step) if self.config.stop_at_step else total
        scaling = self._schedule(total, order.steps_per_epoch) if self._optimizer_config is not None else None
        ckpt, restored = self._ckpt, None
        latest = ckpt.latest_step() if ckpt is not None else None
        if ckpt is not None and latest is not None and not self.resume:  # a save would meet a step already there
            raise ConfigError(
                f"{ckpt.directory} holds the checkpoints of an earlier run (the newest at step {latest}): "
                "resume=False cannot start over there without writing over them. Give another run_dir (or "
                "checkpoint_dir; the command's --restart moves the earlier run aside), or resume=True to go on from it."
            )
        unfinished: list[int] = []
        if latest is not None:
            restored = self.restore()
            unfinished = [s for s in unfinished_saves(ckpt.directory) if s > restored] if ckpt is not None else []
        elif ckpt is not None and self.resume:
            check_not_all_set_aside(ckpt.directory)
            unfinished = unfinished_saves(ckpt.directory)
        start = int(self._state.step)
        self._planned_k.update(k for _, k in order.calls(start, stop, self.config.steps_per_call))
        limit_compiles(self.train_step, self.eval_step, self.config, len(self._planned_k), train, eval)
        report = RunReport(
            self.run_dir,
            total,
            start,
            self.strategy.process_index == 0,
            evaluates_again=start >= total and eval is not None,
        )
        if scaling is not None:
            report.print(scaling)
        if restored is None and start > 0:  # an earlier fit of this trainer, kept in its memory alone
            report.print(in_memory_start(start, total, order.steps_per_epoch, self.config.epochs))
        if unfinished and ckpt is not None:  # a kill during a save (the first: the steps before it are kept nowhere)
            report.print(unfinished_save(ckpt.directory, unfinished[-1], restored))
        self.peak_flops = announce(
            report, self.strategy, self.config, self._state, restored=restored, order=order, train=train, total=total,
            global_batch=self.global_batch, learning_rate=self.learning_rate,
            flops_per_example=self.flops_per_example, peak=self.peak_flops,
        )  # fmt: skip
        if eval is not None and (start < stop or start >= total):  # steps to train, or the final evaluation
            compile_eval_step(self.eval_step, self._state, self.strategy, eval, self.eval_global_batch)
        loop = Loop(order.steps_per_epoch, total, stop, report, step=start)
        for record in report.earlier:  # the run's history before this resume
            split = record.pop("split", "train")
            (loop.history if split == "train" else loop.evaluations).append(record)
        return loop

    def _schedule(self, total: int, steps_per_epoch: int) -> str:
        """The OptimizerConfig's chain over the run's ``total`` steps, and the steps on it; its
        learning-rate line."""
        assert self._optimizer_config is not None
        plan = make_optimizer(self._optimizer_config, self.global_batch, total, steps_per_epoch)
        self.tx, self.learning_rate = plan.tx, plan.schedule
        self.train_step, self.eval_step = self._make_steps(plan.tx)
        self._settings = run_settings(self.global_batch, self.data_seed, plan.decay_steps)  # checked on resume
        warmup = warmup_steps(self._optimizer_config, steps_per_epoch)  # the words read warmup_epochs as steps
        return schedule_words(replace(self._optimizer_config, warmup_steps=warmup), self.global_batch, plan, total)

    def _train(self, loop: Loop, train: Dataset, eval: Dataset | None) -> None:
        """The calls from ``loop.step`` to ``loop.stop``; again from a checkpoint after a rollback."""
        # A signal during start-up: nothing new to save. In a multi-process job the others
        # must stop too: the loop's first calls carry it (JAX's sync point or the all-gather).
        if loop.signals.received is not None and jax.process_count() == 1:
            where = "before its first step, nothing new to save"
            raise Preempted(loop.step, loop.signals.received, where, hint=IN_MEMORY if self._ckpt is None else None)
        while loop.step < loop.stop:  # more than once only after a rollback
            loop.open_window()
            with contextlib.closing(self.steps(train, loop.step, loop.stop)) as calls:
                try:  # stops at the first call after which the NaN policy rolled back, if any
                    any(self._after_call(loop, call, eval) for call in calls)
                except RewardError as e:  # its batch trained nothing; the steps before it did
                    raise RewardError(f"{e}{self._keep_before_error(loop)}") from e

    def _keep_before_error(self, loop: Loop) -> str:
        """Before a reward error ends the run: the steps trained since the last checkpoint
        logged and saved (in a job of several processes, every process raises it at the same
        call: :class:`~xlafit.train.rollout.Rollout` asks the rewards in process 0 and hands on
        the outcome); says where a rerun goes on. Nothing where the run has no run directory."""
        if self._ckpt is None:
            return ""
        latest = self._ckpt.latest_step()
        if loop.step == (latest or 0):
            return f" A rerun goes on from checkpoint {latest}." if latest else " A rerun starts at step 0."
        if loop.pending and loop.last_call is not None:
            self._log(loop, loop.last_call)
        return f" The steps before it are kept: {self._save_now(loop.step)}; a rerun goes on from there."

    def _after_call(self, loop: Loop, call: Call, eval: Dataset | None) -> bool:
        """Everything that may be due after one call: log (and the NaN policy), a stop on a
        signal, evaluate, checkpoint, in that order. True when the NaN policy rolled back."""
        previous, loop.step = call.first, call.first + call.k
        loop.watchdog.beat(loop.step)  # every call: the watchdog times calls, it has no period
        loop.add(call)
        due = self._due(loop, previous, eval is not None)
        if due.log:
            rollback_to = self._log(loop, call)
            if rollback_to is not None:
                loop.step = rollback_to
                return True
        if due.stop:
            self._stop(loop)
        if due.eval and eval is not None:
            self._evaluate_in_loop(loop, eval)
        if due.save:
            self._save(loop)
        return False

    def _due(self, loop: Loop, previous: int, has_eval: bool) -> Due:
        """What is due now that a call took the run from ``previous`` to ``loop.step``: every
        periodic action asks :func:`itstime`; a stop or a timed checkpoint asks every process."""
        cfg, step = self.config, loop.step
        epoch_end = itstime(step, loop.spe, previous=previous)
        processes = self.strategy.process_count
        stop, minutes_up = loop.signals.requests(processes, cfg.checkpoint_every_minutes, loop.last_save)
        save = self._ckpt is not None and (
            minutes_up or epoch_end or itstime(step, cfg.checkpoint_every_steps, loop.stop, previous=previous)
        )
        # Metrics are flushed at every checkpoint, so no accumulator outlives one.
        log = save or stop or epoch_end or itstime(step, cfg.log_every_steps, loop.stop, previous=previous)
        evaluate = has_eval and epoch_end and itstime(step // loop.spe, cfg.eval_every_epochs)
        return Due(log=log, stop=stop, eval=evaluate, save=save)

    def _stop(self, loop: Loop) -> None:
        """Saves the last finished step and raises :class:`Preempted` (a signal, here or in
        another process of the job)."""
        loop.report.sync()  # a URL run dir: metrics reach the bucket before the checkpoint
        received = loop.signals.received or signal.SIGTERM  # another process's signal stops this one too
        where, hint = self._save_now(loop.step), IN_MEMORY if self._ckpt is None else None
        raise Preempted(loop.step, received, where, sync_point=loop.signals.sync_point, hint=hint)

    def _evaluate_in_loop(self, loop: Loop, eval: Dataset) -> None:
        """Evaluates at an epoch's end and records it; its time counts in no step time."""
        with loop.watchdog.paused():  # not a step: its time is not a hang
            loop.last_eval = self.evaluate(eval)
        loop.last_eval_step = loop.step
        record = {"step": loop.step, "epoch": loop.step // loop.spe, **loop.last_eval}
        loop.evaluations.append(record)
        loop.report.record(record, prefix="eval")
        loop.window_t0 = time.perf_counter()

    def _save(self, loop: Loop) -> None:
        """A checkpoint of ``loop.step``, written in the background; the adapted model's
        original (a Keras model) gets the trained values too."""
        assert self._ckpt is not None  # _due saves only with a checkpointer
        loop.report.sync()  # a URL run dir: metrics reach the bucket before the checkpoint
        self._ckpt.save(loop.step, *checkpointed(self._state, self._frozen, self.base_fingerprint, self._settings))
        self._write_back()
        loop.last_save = time.monotonic()

    def _log(self, loop: Loop, call: Call) -> int | None:
        """Fetches the metrics of the calls since the last log, records their means, and applies
        the NaN policy to any update the step dropped; returns a step to roll back to, or None."""
        # note: device_get is a host-device sync point; only at log and checkpoint steps.
        values = jax.device_get([m for _, m in loop.pending])
        busy = max(time.perf_counter() - loop.window_t0 - loop.window_compile, 1e-9)
        record = progress_record(
            loop.step, loop.spe, loop.pending, values, busy, call.wait_s - loop.window_wait,
            global_batch=self.global_batch, learning_rate=self.learning_rate,
            tokens_per_example=self.tokens_per_example, flops_per_example=self.flops_per_example,
            peak=self.peak_flops, compiles=self.train_step.compiles,
        )  # fmt: skip
        loop.history.append(record)
        loop.report.record(record)
        bad = nonfinite_steps(loop.pending, values)
        loop.open_window(call.wait_s)
        return self._nan_policy(bad, loop.rolled_back, loop.report) if bad else None

    def _end(self, loop: Loop, final: Callable[[], None] | None = None) -> None:
        """Waits for the last checkpoint, prints the compile summary, runs ``final`` (the final
        evaluation: recorded in the report like the others), closes the report (also when the
        checkpoint failed: TensorBoard's writer left open prints tracebacks at exit)."""
        try:
            if self._ckpt is not None:
                self._ckpt.wait()
            if self.train_step.compiles or self.eval_step.compiles:  # none: nothing ran (an error before the first)
                loop.report.print(
                    f"train step compiled {self.train_step.compiles} time(s), eval step "
                    f"{self.eval_step.compiles} time(s); {self.train_step.compile_s + self.eval_step.compile_s:.1f}s "
                    "compiling, excluded from step times"
                )
            note = loop.stop_note(self.config.stop_at_step, saved=self._ckpt is not None)
            if note is not None:
                loop.report.print(note)
            if final is not None:
                final()
        finally:
            loop.report.close()

    def _final_evaluation(self, loop: Loop, eval: Dataset) -> None:
        """The evaluation of the run's last step once its checkpoint is written (a signal during
        it stops the run with that checkpoint kept: :func:`final_evaluation`), recorded as the
        loop's evaluations are."""
        alone = self.strategy.process_count == 1
        loop.last_eval = final_evaluation(self.evaluate, eval, loop.step, alone, self._ckpt)
        loop.last_eval_step = loop.step
        record = {"step": loop.step, "epoch": loop.step // loop.spe, **loop.last_eval}
        loop.evaluations.append(record)
        loop.report.record(record, prefix="eval")

    # ------------------------------------------------------------------ the loop's helpers

    def _save_now(self, step: int) -> str:
        """A synchronous checkpoint before the process exits; says where it went. The model
        given gets the trained values either way."""
        self._write_back()
        if self._ckpt is None:
            return "no run directory, nothing saved"
        self._ckpt.save(step, *checkpointed(self._state, self._frozen, self.base_fingerprint, self._settings))
        self._ckpt.wait()
        return f"checkpoint {step} saved in {self._ckpt.directory}"

    def _write_back(self) -> None:
        """Puts the trained values into the model given (an ``nnx.Module``, or a Keras model or
        torch module this trainer adapted); nothing where a function built the model."""
        if self._write_back_hook is not None:
            self._write_back_hook(self._state.params, self._state.model_state)

    def _nan_policy(
        self, bad: list[tuple[int, dict[str, float]]], rolled_back: set[int], report: RunReport
    ) -> int | None:
        """Applies ``trainer.nan_policy`` to dropped updates; returns a step to go on from."""
        return apply_nan_policy(self.config.nan_policy, bad, rolled_back, report, self._ckpt, self.restore)

    def close(self) -> None:
        """Waits for a checkpoint being written and releases the checkpointer."""
        if self._ckpt is not None:
            self._ckpt.close()
