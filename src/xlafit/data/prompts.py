"""Prompts for reinforcement learning with rewards (GRPO, :mod:`xlafit.train.grpo`): TRL's
prompt-only layout, and the batches of groups a generation step takes.

A record is one JSON line (``*.jsonl``) or Parquet row (local, ``gs://`` or ``hf://``) with a
``prompt``: a text, asked as it is (after ``<bos>`` where the tokenizer has one), or a
conversation (a list of ``{"role", "content"}`` messages), rendered with the chat template
and its generation prompt, as TRL does. Every other field is a column handed to the reward
functions (``answer``, ``solution``, ...), one value per completion.

The data set is indexed by completion: example ``i`` is prompt ``i // (G n)`` (``G``
completions of each prompt, the generation batch trained ``n`` times). Its batches
(:meth:`PromptSet.epoch_batches`) hold each prompt's ``G`` rows side by side, and each
generation batch for ``n`` steps in a row, so that a train-step call of ``n`` steps is one
generation batch; the order is a permutation of the prompts per ``(seed, epoch)``.

Example:
    >>> check_prompt({"prompt": "2+2=", "answer": "4"}, "prompts.jsonl, record 1")
    'text'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from xlafit.data.chat import check_one_kind, read_records
from xlafit.data.clm import PAD
from xlafit.data.files import splits
from xlafit.data.rendering import ChatTemplate
from xlafit.errors import ConfigError, DataError

__all__ = ["PROMPT_FORMAT", "PromptSet", "check_prompt", "check_room", "encode_prompt", "load_prompts"]

PROMPT_FORMAT = "prompt"
_LAYOUT = '{"prompt": text} or {"prompt": [{"role": "user", "content": ...}]}, with any other fields for the rewards'


@dataclasses.dataclass(frozen=True)
class PromptSource:
    """What :func:`load_prompts` read: its format (``chat``: conversations; ``prompt_completion``:
    text) and the records."""

    format: str
    records: int


@dataclasses.dataclass
class PromptSet:
    """Prompts as the rollout asks them, and the batch plan of a GRPO run.

    Attributes:
        prompts: each record's ``prompt`` as given (a text or messages): what reward functions get.
        ids: its token ids as generation starts from them.
        columns: the records' other fields, by name, one value per prompt.
        tokenizer: the tokenizer the ids are of (completions are decoded with it).
        stop_ids: the tokens that end a completion (the end of a turn, of a text).
        group: ``G``, the completions of each prompt.
        iterations: the steps each generation batch trains (``num_iterations``).
        vocab_size: the tokenizer's.
        source: the format and the record count.
    """

    prompts: list[Any]
    ids: list[list[int]]
    columns: dict[str, list[Any]]
    tokenizer: Tokenizer
    stop_ids: tuple[int, ...]
    group: int = 8
    iterations: int = 1
    vocab_size: int = 0
    source: PromptSource | None = None

    @property
    def conversational(self) -> bool:
        return bool(self.prompts) and not isinstance(self.prompts[0], str)

    @property
    def prompt_length(self) -> int:
        """The longest prompt's tokens: generation pads every batch to it (one program)."""
        return max(len(p) for p in self.ids)

    @property
    def seq_len(self) -> int:
        """The prompt length (a completion's tokens come on top: the rollout's rows)."""
        return self.prompt_length

    @property
    def pad_id(self) -> int:
        return self.tokenizer.token_to_id(PAD) or 0

    def __len__(self) -> int:
        return len(self.prompts) * self.group * self.iterations

    def take(self, indices: np.ndarray, epoch: int = 0) -> dict[str, np.ndarray]:
        """``prompt_index`` ``[len(indices)]``: the prompt each completion answers."""
        return {"prompt_index": (np.asarray(indices) // (self.group * self.iterations)).astype(np.int32)}

    @property
    def num_shapes(self) -> int:
        return 1

    def prompts_per_step(self, global_batch: int) -> int:
        """The prompts of a global batch of ``global_batch`` completions.

        Raises:
            ConfigError: ``G`` does not divide the batch, or there are fewer prompts than a batch holds.
        """
        if global_batch % self.group:
            fits = [b for b in range(self.group, 4 * global_batch + 1, self.group)][:3]
            raise ConfigError(
                f"the global batch of {global_batch} completions is not a whole number of groups of "
                f"model.grpo.num_generations={self.group}; set data.global_batch to a multiple of it "
                f"({', '.join(map(str, fits))}, ...) or another num_generations that divides {global_batch}."
            )
        per_step = global_batch // self.group
        if per_step > len(self.prompts):
            raise ConfigError(
                f"a global batch of {global_batch} completions asks {per_step} prompts, and the data holds "
                f"{len(self.prompts)}; give more prompts or a smaller data.global_batch."
            )
        return per_step

    def epoch_batches(self, global_batch: int, seed: int, epoch: int) -> np.ndarray:
        """``[steps, global_batch]`` indices of ``epoch``: a permutation of the prompts per
        ``(seed, epoch)``, each prompt's ``G`` rows adjacent, each batch ``n`` steps in a row."""
        per_step = self.prompts_per_step(global_batch)
        order = np.random.default_rng([seed, epoch]).permutation(len(self.prompts))
        steps = len(self.prompts) // per_step
        prompts = order[: steps * per_step].reshape(steps, per_step)
        span = self.group * self.iterations
        rows = (prompts[:, :, None] * span + np.arange(self.group)[None, None, :]).reshape(steps, global_batch)
        return np.repeat(rows, self.iterations, axis=0)


def check_prompt(record: dict[str, Any], where: str) -> str:
    """``text`` or ``chat``: the kind of a prompt record.

    Raises:
        DataError: no ``prompt``, or one that is neither a text nor a list of messages, or
            that is empty (a conversation: empty but for its system prompt).
    """
    prompt = record.get("prompt")
    if prompt is None:
        raise DataError(f"{where} has no 'prompt' (it has {', '.join(sorted(record)) or 'nothing'}); give {_LAYOUT}.")
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where} has an empty prompt; give it a text to answer.")
        return "text"
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        if not any(m.get("content") for m in prompt if m["role"] != "system"):
            raise DataError(f"{where} has no message to answer (only a system prompt, or empty messages); give it one.")
        return "chat"
    raise DataError(f"{where}: 'prompt' is a {type(prompt).__name__} of the wrong shape; give {_LAYOUT}.")


def check_room(ids: Sequence[int], room: tuple[int, int], where: str) -> None:
    """Refuses a prompt of ``ids`` that leaves no room for a completion of ``room[1]`` tokens
    in a context of ``room[0]``, naming the record (``where``), its length, the limit and the fixes.

    Raises:
        DataError: the prompt is too long.
    """
    context, completion = room
    limit = context - completion
    if len(ids) <= limit:
        return
    if limit < 1:  # no prompt fits: the setting is the problem, not this record
        raise DataError(
            f"model.grpo.max_completion_length={completion} leaves no room for a prompt in the model's context of "
            f"{context} positions; give model.grpo.max_completion_length={max(context - len(ids), 1)} or less."
        )
    raise DataError(
        f"{where}: its prompt has {len(ids)} tokens, more than the {max(limit, 0)} a prompt may have (the model's "
        f"context of {context} positions less model.grpo.max_completion_length={completion}); shorten that prompt "
        "(or leave the record out), lower model.grpo.max_completion_length, or use a model with a longer context."
    )


def encode_prompt(
    prompt: Any, kind: str, tok: Tokenizer, template: ChatTemplate | None, bos: int | None = None
) -> list[int]:
    """A prompt's token ids: a conversation rendered with ``template`` and its generation
    prompt; a text after ``bos`` (as :class:`xlafit.generator.Generator` asks it)."""
    if kind == "chat":
        if template is None:
            raise DataError(
                "the prompts are conversations and the tokenizer has no chat template; give data.chat_template, "
                "or the prompts as text."
            )
        text = template.render(list(prompt), add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False).ids)
    return ([bos] if bos is not None else []) + list(tok.encode(prompt, add_special_tokens=False).ids)


def load_prompts(
    inputs: Sequence[str],
    tok: Tokenizer,
    template: ChatTemplate | None,
    stop_ids: tuple[int, ...],
    *,
    group: int,
    iterations: int = 1,
    bos: int | None = None,
    progress: Callable[[str], None] | None = None,
    room: tuple[int, int] | None = None,
) -> PromptSet:
    """The prompt records of ``inputs`` (files, globs, directories or URLs of JSON lines or
    Parquet), encoded.

    ``room``: ``(context, max_completion_length)``, the model's positions and the tokens a
    completion may take: a prompt longer than their difference is refused as it is read
    (every batch is padded to the longest prompt plus a completion: the generation's cache
    and the train step's rows).

    Raises:
        DataError: a record without a prompt (:func:`check_prompt`), one longer than ``room``
            leaves, records mixing text and conversations, or none at all.
    """
    prompts: list[Any] = []
    ids: list[list[int]] = []
    rows: list[dict[str, Any]] = []
    kinds: set[str] = set()
    first: dict[str, str] = {}  # where the first record of each kind was
    found = splits(inputs)
    if found.eval and progress is not None:  # a split folder: its train files, as a run with evaluation reads them
        held = "its evaluation file is" if len(found.eval) == 1 else f"its {len(found.eval)} evaluation files are"
        progress(f"reading the train split of {', '.join(inputs)}: {held} not read")
    for name in found.train:
        records = read_records([name])
        for number, record in enumerate(records, 1):
            where = f"{name}, record {number}"
            kind = check_prompt(record, where)
            check_one_kind(first, kind, where, "prompt records")
            kinds.add(kind)
            try:
                ids.append(encode_prompt(record["prompt"], kind, tok, template, bos))
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
            if room is not None:
                check_room(ids[-1], room, where)
            prompts.append(record["prompt"])
            rows.append({k: v for k, v in record.items() if k != "prompt"})
        if progress is not None:
            progress(f"read {len(records):,} prompts from {name}")
    if not prompts:
        raise DataError(f"no prompt records in {', '.join(map(str, inputs))}; give {_LAYOUT}.")
    names = sorted({k for r in rows for k in r})
    columns = {k: [r.get(k) for r in rows] for k in names}
    fmt = "chat" if kinds == {"chat"} else "prompt_completion"
    source = PromptSource(fmt, len(prompts))
    return PromptSet(prompts, ids, columns, tok, stop_ids, group, iterations, tok.get_vocab_size(), source)
