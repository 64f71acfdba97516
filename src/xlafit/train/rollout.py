"""GRPO's rollout: the train step's batch made from a batch of prompts by the model being
trained, in the trainer's dispatch loop (:meth:`xlafit.Trainer.steps`), before the step.

For one call of the train step (``n = num_iterations`` steps on one generation batch) it
takes the call's prompts (:class:`xlafit.data.prompts.PromptSet`: ``G`` rows each),
samples a completion for each row with the KV-cache generator on the trained weights as
they are (:func:`xlafit.models.generation.generate`: the same arrays, on the run's mesh, no
copy; the rows split over its batch axes as the train step's are, each device generating its
own), scores the completions with the reward functions (:mod:`xlafit.train.rewards`),
computes the advantages and each row's loss weight (:mod:`xlafit.train.grpo`), and where
needed the per-token log-probabilities of the policy as it generated (``n > 1``) and of the
reference (``β > 0``: the model with its LoRA adapters off). The sampler's seed is a
function of ``(data.seed, step)``: a resumed run draws what the uninterrupted one drew.

In a job of several processes every process takes part in the whole generation batch (its
prompts gathered from each process's rows), the reward functions are asked in process 0
alone, which hands their values on, and each process keeps its rows of the train batch.

Example:
    >>> sampler_seed(0, 12) == sampler_seed(0, 12) != sampler_seed(0, 13)
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from xlafit.data.prompts import PromptSet
from xlafit.errors import ConfigError, RewardError
from xlafit.models.generation import Sampling, generate, generation_program
from xlafit.models.lora import adapters_off, has_adapters
from xlafit.parallel.sharding import row_shards, rows_layout, rows_sharding, to_host
from xlafit.train import grpo
from xlafit.train.losses import TokenLogps, whole_token_logps
from xlafit.train.rewards import Reward, TrainerState, check_arguments, score

__all__ = ["GENERATION", "Rollout", "sampler_seed"]

GENERATION = "rollout generation"  # the name of the program that generates (Rollout.programs)


def place_rows(x: np.ndarray, state: Any) -> jax.Array:
    """``x [B, ...]`` on the devices, its rows split as the train step splits a batch over the
    mesh ``state`` lies on (:func:`xlafit.parallel.sharding.rows_layout`); where they do not
    divide over it, or there is no mesh, on the default device."""
    layout = rows_layout(state)
    if layout is None or len(x) % row_shards(layout):
        return jnp.asarray(x)
    return jax.make_array_from_callback(x.shape, rows_sharding(layout, x.ndim), lambda i: x[i])


def _all_processes(local: np.ndarray) -> tuple[np.ndarray, slice]:
    """The rows of every process's ``local`` in the global batch's order (each process holds
    one block of it, in process order: :func:`xlafit.data.loader.to_global`), and this
    process's slice of them; in one process, ``local`` and all of it."""
    if jax.process_count() == 1:
        return local, slice(None)
    start = jax.process_index() * len(local)
    return np.asarray(multihost_utils.process_allgather(local, tiled=True)), slice(start, start + len(local))


def sampler_seed(seed: int, step: int) -> int:
    """The sampler's seed at ``step`` (a uint32), a pure function of ``(seed, step)``."""
    return int(np.random.SeedSequence([seed, step, 0x6770]).generate_state(1)[0])


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "reference", "token_logps"))
def _logps(
    graphdef: Any,
    state: Any,
    rows: dict[str, jax.Array],
    temperature: float,
    reference: bool,
    token_logps: TokenLogps = whole_token_logps,
) -> jax.Array:
    """Per-token log-probabilities ``[R, T - 1]`` of the completions in ``rows`` (from
    ``token_logps``): the model's, or with ``reference`` its base's (LoRA adapters off; read
    while tracing)."""
    model = nnx.merge(graphdef, state)
    with adapters_off() if reference else contextlib.nullcontext():
        return token_logps(model, rows, temperature)


@dataclasses.dataclass
class Rollout:
    """Makes each call's train batch from its prompts (the module docstring).

    Attributes:
        prompts: the data (its token ids, columns, tokenizer and stop tokens).
        objective: GRPO's settings.
        rewards: the reward functions, with their names.
        reward_weights: one weight per function (default 1 each).
        iterations: the steps each generation batch trains (``num_iterations``).
        top_p, top_k: the sampler's nucleus and top-k (1.0 and 0: the whole distribution).
        seed: the run's data seed, from which each step's sampler seed derives.
        token_logps: how the log-probabilities of the rows' tokens are computed (the loss's:
            :func:`xlafit.train.grpo.loss_fn`).
        epochs: the run's (``trainer.epochs``): the rewards' ``trainer_state`` counts its steps.
    """

    prompts: PromptSet
    objective: grpo.GrpoObjective
    rewards: list[Reward]
    reward_weights: np.ndarray | None = None
    iterations: int = 1
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    token_logps: TokenLogps = whole_token_logps
    epochs: int = 1

    def __post_init__(self) -> None:
        weights = np.ones(len(self.rewards), np.float32) if self.reward_weights is None else self.reward_weights
        self.reward_weights = np.asarray(weights, np.float32)
        if len(self.reward_weights) != len(self.rewards):
            raise ConfigError(
                f"model.grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.rewards)} reward "
                "functions; give one weight per function (or none: 1 each)."
            )
        check_arguments(self.rewards, list(self.prompts.columns))

    def __call__(self, model: Any, step: int, k: int, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The train batch ``[k, B, ...]`` of a call of ``k`` steps from ``step`` whose data
        is ``batch`` (``prompt_index [k, B]``; the ``k`` steps share one generation batch)."""
        rows = self.generation_batch(model, step, batch["prompt_index"][0])
        return {name: np.broadcast_to(x[None], (k, *x.shape)).copy() for name, x in rows.items()}

    def generation_batch(self, model: Any, step: int, prompt_index: np.ndarray) -> dict[str, np.ndarray]:
        """The rows ``[B, ...]`` of one generation batch: ``prompt_index [B]`` (each prompt's
        ``G`` rows adjacent) answered, scored and weighted."""
        o, data = self.objective, self.prompts
        everyone, mine = _all_processes(np.asarray(prompt_index))
        index = [int(i) for i in everyone]
        sampling = Sampling(o.temperature, self.top_k, self.top_p, seed=sampler_seed(self.seed, step))
        start = time.perf_counter()
        completions = generate(
            model, [data.ids[i] for i in index], o.max_completion_length, sampling, data.stop_ids, data.pad_id,
            prompt_length=data.prompt_length,
        )  # fmt: skip
        rollout_s = time.perf_counter() - start  # generate fetches the tokens: the loop has ended
        rows = self._rows(index, completions)
        lengths = np.array([len(c) for c in completions], np.float32)
        state = self.state_at(step, len(index))
        values = self._scored(index, completions, state)
        assert self.reward_weights is not None
        adv, stats = grpo.advantages(values, self.reward_weights, data.group, o.scale_rewards)
        rows["advantages"] = adv
        rows["weights"] = grpo.row_weights(lengths, o.loss_type, o.max_completion_length, int(lengths.sum()))
        self._add_logps(model, rows)
        rows |= self._logged(values, stats, lengths, completions, rollout_s)
        return {name: x[mine] for name, x in rows.items()}

    def _scored(self, index: list[int], completions: list[list[int]], state: TrainerState) -> np.ndarray:
        """The reward functions' values ``[B, F]`` for the generation batch: asked in one
        process (process 0 of a job of several, which hands them to the others), so that each
        function is called once per completion, as in one process."""
        args = (self.rewards, self._reward_inputs(index, completions), index, self.prompts.group, state)
        if jax.process_count() == 1:
            return score(*args)
        values, failed = np.zeros((len(index), len(self.rewards)), np.float32), None
        if jax.process_index() == 0:
            try:
                values = score(*args)
            except RewardError as e:
                failed = e
        ok, values = multihost_utils.broadcast_one_to_all((np.int32(failed is None), values))
        if failed is not None:
            raise failed
        if not ok:
            raise RewardError(
                "a reward function failed in process 0, where the rollout asks them; its message is in process 0's "
                "output: fix the function (or that record) and run again."
            )
        return np.asarray(values, np.float32)

    def state_at(self, step: int, rows: int) -> TrainerState:
        """The rewards' ``trainer_state`` for the generation batch of ``step`` (counted from 0)
        of ``rows`` completions: an epoch's steps are the data's (:meth:`PromptSet.epoch_batches`)."""
        per_epoch = len(self.prompts.prompts) // (rows // self.prompts.group) * self.iterations
        return TrainerState(global_step=step, max_steps=self.epochs * per_epoch, epoch=step / per_epoch)

    @property
    def width(self) -> int:
        """A train row's tokens: the longest prompt plus a whole completion."""
        return self.prompts.prompt_length + self.objective.max_completion_length

    def example(self) -> dict[str, jax.ShapeDtypeStruct]:
        """One row of the train batch that :meth:`generation_batch` makes, as shapes (no batch
        axis): what ``xlafit check --tpu`` compiles the train step for."""
        t = self.width
        out = {
            "input_ids": jax.ShapeDtypeStruct((t,), np.int32),
            "segment_ids": jax.ShapeDtypeStruct((t,), np.int32),
            "positions": jax.ShapeDtypeStruct((t,), np.int32),
            "loss_mask": jax.ShapeDtypeStruct((t,), np.int8),
            "advantages": jax.ShapeDtypeStruct((), np.float32),
            "weights": jax.ShapeDtypeStruct((), np.float32),
        }
        if self.iterations > 1:
            out["old_logps"] = jax.ShapeDtypeStruct((t - 1,), np.float32)
        if self.objective.beta:
            out["ref_logps"] = jax.ShapeDtypeStruct((t - 1,), np.float32)
        names = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                 "completions/clipped_ratio", "rollout_tokens_per_sec"]  # fmt: skip
        for name, _ in self.rewards:
            names += [f"rewards/{name}/mean", f"rewards/{name}/std"]
        return out | {f"{grpo.LOGGED}{n}": jax.ShapeDtypeStruct((), np.float32) for n in names}

    @property
    def decode_loop(self) -> tuple[str, int]:
        """The program that generates, by name, and its decode loop's trips: the tokens after
        the one the prefill gives, each a step of the loop whether or not its row has stopped."""
        return GENERATION, self.objective.max_completion_length - 1

    def programs(self, model: Any, rows: int) -> list[tuple[str, Any]]:
        """The rollout's own programs for a generation batch of ``rows`` completions, traced on
        ``model`` as its state lies (arrays, or ``ShapeDtypeStruct``s with shardings: ``xlafit
        check --tpu``): ``[(name, traced)]``, the generation (its cache holds every row's prompt
        and completion), and where the run needs them the log-probabilities of the rows."""
        o, data = self.objective, self.prompts
        sampling = Sampling(o.temperature, self.top_k, self.top_p)
        out = [(
            GENERATION,
            generation_program(model, rows, data.prompt_length, o.max_completion_length, sampling,
                               len(set(data.stop_ids))),
        )]  # fmt: skip
        if self.iterations > 1 or o.beta:
            graphdef, state = nnx.split(model)
            layout = rows_layout(state)
            shape = (rows, self.width)

            def row(dtype: Any) -> jax.ShapeDtypeStruct:
                sharding = rows_sharding(layout, 2) if layout is not None and rows % row_shards(layout) == 0 else None
                return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

            device_rows = {k: row(np.int8 if k == "loss_mask" else np.int32) for k in grpo.ROW_KEYS}
            reference = bool(o.beta) and self.iterations == 1
            out.append(
                (
                    "rollout log-probabilities",
                    _logps.trace(graphdef, state, device_rows, o.temperature, reference, self.token_logps),
                )
            )
        return out

    def _rows(self, index: list[int], completions: list[list[int]]) -> dict[str, np.ndarray]:
        """Prompt then completion per row, padded at the end to prompt length + max completion."""
        data = self.prompts
        width = self.width
        b = len(index)
        ids = np.full((b, width), data.pad_id, np.int32)
        segments = np.zeros((b, width), np.int32)
        mask = np.zeros((b, width), np.int8)
        for r, (i, completion) in enumerate(zip(index, completions, strict=True)):
            prompt = data.ids[i]
            p, c = len(prompt), len(completion)
            ids[r, :p], ids[r, p : p + c] = prompt, completion
            segments[r, : p + c] = 1
            mask[r, p : p + c] = 1
        positions = np.broadcast_to(np.arange(width, dtype=np.int32), (b, width)).copy()
        return {"input_ids": ids, "segment_ids": segments, "positions": positions, "loss_mask": mask}

    def _reward_inputs(self, index: list[int], completions: list[list[int]]) -> dict[str, list[Any]]:
        """What the reward functions are called with (TRL's keywords), one item per completion."""
        data = self.prompts
        texts = data.tokenizer.decode_batch(completions, skip_special_tokens=True)
        if data.conversational:
            answered: list[Any] = [[{"role": "assistant", "content": t}] for t in texts]
        else:
            answered = list(texts)
        kwargs: dict[str, list[Any]] = {
            "prompts": [data.prompts[i] for i in index],
            "completions": answered,
            "completion_ids": [list(c) for c in completions],
        }
        for name, values in data.columns.items():
            kwargs[name] = [values[i] for i in index]
        return kwargs

    def _add_logps(self, model: Any, rows: dict[str, np.ndarray]) -> None:
        """The policy's log-probabilities as it generated (``num_iterations > 1``) and the
        reference's (``β > 0``), ``[B, T - 1]`` float32, into ``rows``."""
        need_old, need_ref = self.iterations > 1, bool(self.objective.beta)
        if not (need_old or need_ref):
            return
        graphdef, state = nnx.split(model)
        device_rows = {k: place_rows(rows[k], state) for k in grpo.ROW_KEYS}
        t = self.objective.temperature
        if need_old:
            rows["old_logps"] = to_host(_logps(graphdef, state, device_rows, t, False, self.token_logps))
        if need_ref:
            if not has_adapters(model):
                raise ConfigError(
                    "model.grpo.beta > 0 compares the policy with a reference (the model before tuning), and this "
                    "model has no LoRA adapters to turn off for one; set lora.rank=16 (or another rank), or "
                    "model.grpo.beta=0."
                )
            rows["ref_logps"] = to_host(_logps(graphdef, state, device_rows, t, True, self.token_logps))

    def _logged(
        self,
        values: np.ndarray,
        stats: dict[str, np.ndarray],
        lengths: np.ndarray,
        completions: list[list[int]],
        rollout_s: float,
    ) -> dict[str, np.ndarray]:
        """The rollout's statistics as ``log/NAME`` columns ``[B]`` (TRL's names): per row where
        the batch mean is the statistic, the same in every row where it is a spread or a rate."""
        b = len(lengths)

        def constant(x: float) -> np.ndarray:
            return np.full(b, x, np.float32)

        stops = set(self.prompts.stop_ids)
        truncated = np.array([not c or c[-1] not in stops for c in completions], np.float32)
        out = {
            "log/reward": stats["reward"],
            "log/reward_std": constant(float(stats["reward"].std(ddof=1))),
            "log/frac_reward_zero_std": stats["zero_std"],
            "log/completions/mean_length": lengths,
            "log/completions/clipped_ratio": truncated,
            "log/rollout_tokens_per_sec": constant(float(lengths.sum()) / max(rollout_s, 1e-9)),
        }
        for column, (name, _) in enumerate(self.rewards):
            out[f"log/rewards/{name}/mean"] = values[:, column]
            out[f"log/rewards/{name}/std"] = constant(float(values[:, column].std(ddof=1)))
        return {k: np.asarray(v, np.float32) for k, v in out.items()}
