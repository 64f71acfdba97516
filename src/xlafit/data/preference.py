"""Preference data: pairs of a chosen and a rejected completion of one prompt, in TRL's
formats, as rows for the objectives of :mod:`xlafit.train.preference`.

A record is one JSON line (``*.jsonl``) or Parquet row (local, ``gs://`` or ``hf://``, as
:func:`xlafit.data.clm.data_files` reads them) in one of TRL's layouts:

- text: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``: the prompt and each
  completion one after the other (``<bos>`` before, ``<eos>`` after where the tokenizer has
  them), as prompt/completion records are read;
- conversations: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``,
  rendered with the chat template; or without ``prompt`` (TRL's implicit prompt), the
  messages that ``chosen`` and ``rejected`` share at their start are the prompt.

Each pair becomes two rows of ``seq_len`` tokens, the chosen one first, padded at the end
(``segment_ids`` 1 on the tokens, 0 on the padding); ``loss_mask`` marks the completion's
tokens (an assistant turn's end-of-turn token included, the prompt and the generation prompt
before the answer excluded): the objectives compare the completions' log-probabilities only.

Example:
    >>> records = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}]
    >>> check_pair(records[0], "prefs.jsonl, record 1")
    'text'
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from xlafit.data.chat import Encoded, check_one_kind, encode, messages_of, read_records
from xlafit.data.clm import PAD
from xlafit.data.files import splits
from xlafit.data.hashing import hash_uniform
from xlafit.data.rendering import ChatTemplate, missing_template
from xlafit.errors import DataError

__all__ = [
    "PAIR_FORMAT",
    "PreferencePairs",
    "PreferenceSource",
    "check_pair",
    "encode_pair",
    "load_pairs",
    "other_turns",
    "summary",
]

PAIR_FORMAT = "preference"
_LAYOUTS = (
    'TRL\'s layouts: {"prompt": text, "chosen": text, "rejected": text}, or conversations: {"prompt": [messages], '
    '"chosen": [messages], "rejected": [messages]} (prompt optional: the messages both begin with)'
)


@dataclasses.dataclass(frozen=True)
class PreferenceSource:
    """What :func:`load_pairs` read: pairs per split, as text or conversations, and what was
    cut at ``seq_len``."""

    format: str  # "chat" (conversations) or "prompt_completion" (text): how a prompt is asked
    records: dict[str, int]
    truncated: int = 0  # rows longer than seq_len, cut at it (their completions keep their starts)
    alike: int = 0  # pairs left out: the cut at seq_len removed all that told chosen from rejected
    spans_boundary: int = 0  # pairs with a token across the prompt's end in a row (text pairs)
    other_turns: int = 0  # conversation pairs whose completions hold another role's turns (not compared)
    first_other_turns: str = ""  # the file and record of the first


@dataclasses.dataclass
class PreferencePairs:
    """Pairs of rows: ``input_ids``, ``segment_ids``, ``positions``, ``loss_mask``
    ``[N, 2, seq_len]`` (chosen, rejected), and with a precomputed reference ``ref_logps``
    ``[N, 2]``. A :class:`~xlafit.data.dataset.Dataset` (``len`` and ``take``)."""

    arrays: dict[str, np.ndarray]
    vocab_size: int
    documents: int  # pairs
    source: PreferenceSource | None = None

    @property
    def seq_len(self) -> int:
        return int(self.arrays["input_ids"].shape[-1])

    @property
    def tokens(self) -> int:
        """Real (not padding) tokens, both rows of every pair."""
        return int((self.arrays["segment_ids"] > 0).sum())

    def __len__(self) -> int:
        return len(self.arrays["input_ids"])

    def take(self, indices: np.ndarray, epoch: int = 0) -> dict[str, np.ndarray]:
        return {name: a[indices] for name, a in self.arrays.items()}


def _kind(value: Any) -> str:
    """``text``, ``chat`` (a list of messages) or ``?``."""
    if isinstance(value, str):
        return "text"
    return "chat" if isinstance(value, list) and all(isinstance(m, dict) for m in value) else "?"


def check_pair(record: dict[str, Any], where: str) -> str:
    """The layout of one preference record, ``text`` or ``chat``, checked.

    Raises:
        DataError: a field missing or of the wrong kind, the three not all text or all
            conversations, or chosen equal to rejected; each with its fix.
    """
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise DataError(
            f"{where} has no {' and no '.join(repr(k) for k in missing)} (its keys: {', '.join(record) or 'none'}); a "
            f"preference record needs both, in one of {_LAYOUTS}."
        )
    fields = [k for k in ("prompt", "chosen", "rejected") if k in record]
    kinds = {k: _kind(record[k]) for k in fields}
    if "?" in kinds.values() or len(set(kinds.values())) > 1:
        shown = ", ".join(f"{k}: {type(record[k]).__name__}" for k in fields)
        if kinds == {"prompt": "text", "chosen": "chat", "rejected": "chat"} and _begins_with(record, record["prompt"]):
            raise DataError(
                f"{where} has a text prompt and conversations that begin with it ({shown}): leave 'prompt' out (TRL's "
                "implicit prompt: the messages chosen and rejected begin with are the prompt)."
            )
        raise DataError(
            f"{where} mixes kinds of field ({shown}); give all of them as text, or all as conversations (lists of "
            '{"role", "content"} messages; a prompt that chosen and rejected begin with already: leave it out).'
        )
    kind = next(iter(kinds.values()))
    if kind == "chat" and "prompt" in record and record["prompt"] and _begins_with(record, record["prompt"][-1]):
        raise DataError(
            f"{where}: chosen and rejected begin with the prompt's last message again, so the model would be asked it "
            "twice; leave 'prompt' out (they hold the whole conversation: TRL's implicit prompt), or that message out "
            "of chosen and rejected."
        )
    if kind == "text" and "prompt" not in record:
        raise DataError(
            f'{where} has text completions but no "prompt"; give the prompt as its own field (TRL\'s explicit '
            "prompt), or the pair as conversations whose shared first messages are the prompt."
        )
    if record["chosen"] == record["rejected"]:
        raise DataError(
            f"{where}: its chosen and rejected completions are the same ({json.dumps(record['chosen'])[:80]}): the "
            "pair prefers nothing, and its loss is the same whatever the model does; remove it or correct its rejected "
            "completion."
        )
    return kind


def _begins_with(record: dict[str, Any], first: Any) -> bool:
    """Whether both conversations of ``record`` begin with ``first``: a message, or a text
    as a message's content."""

    def opens(messages: Any) -> bool:
        head = messages[0] if isinstance(messages, list) and messages else None
        return isinstance(head, dict) and (head == first or (isinstance(first, str) and head.get("content") == first))

    return opens(record["chosen"]) and opens(record["rejected"])


def other_turns(record: dict[str, Any], kind: str) -> bool:
    """Whether a conversation pair's completions hold turns other than the assistant's (a
    user's reply between two answers): only the assistant's are compared."""
    if kind != "chat":
        return False
    _, chosen, rejected = _split_prompt(record)
    return any(m.get("role") != "assistant" for m in chosen + rejected)


def _split_prompt(record: dict[str, Any]) -> tuple[list[dict], list[dict], list[dict]]:
    """``(prompt, chosen, rejected)`` messages; an implicit prompt is the messages the two
    conversations begin with."""
    chosen, rejected = list(record["chosen"]), list(record["rejected"])
    if "prompt" in record:
        return list(record["prompt"]), chosen, rejected
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _encode_turns(prompt: list[dict], completion: list[dict], template: ChatTemplate, tok: Tokenizer) -> Encoded:
    """The conversation ``prompt + completion`` as tokens, the mask on the completion's
    assistant turns only (not those of the prompt's history)."""
    messages = messages_of({"messages": prompt + completion})
    text, spans = template.answer_spans(messages)
    asked = len(template.render(messages[: len(prompt)], add_generation_prompt=True)) if prompt else 0
    spans = [(s, e) for s, e in spans if s >= asked]
    encoding = tok.encode(text, add_special_tokens=False)
    mask = [int(any(s <= start < e for s, e in spans)) for start, _ in encoding.offsets]
    return Encoded(list(encoding.ids), mask)


def encode_pair(
    record: dict[str, Any],
    kind: str,
    tok: Tokenizer,
    template: ChatTemplate | None,
    *,
    bos: int | None = None,
    eos: int | None = None,
) -> tuple[Encoded, Encoded]:
    """``(chosen, rejected)``: each completion after the prompt, as token ids and the mask of
    the completion's tokens."""
    if kind == "text":
        good, bad = (
            encode(
                {"prompt": record["prompt"], "completion": record[k]}, "prompt_completion", tok, None, bos=bos, eos=eos
            )
            for k in ("chosen", "rejected")
        )
        return good, bad
    if template is None:
        raise DataError(f"{missing_template('preference conversations')}.")
    prompt, chosen, rejected = _split_prompt(record)
    pair = _encode_turns(prompt, chosen, template, tok), _encode_turns(prompt, rejected, template, tok)
    for side, row in zip(("chosen", "rejected"), pair, strict=True):
        if not any(row.mask):
            raise DataError(
                f"its {side} completion has no assistant turn after the prompt (it is empty, or holds the prompt "
                "alone): the pair would compare nothing; give chosen and rejected an answer each."
            )
    return pair


def load_pairs(
    inputs: Sequence[str],
    tok: Tokenizer,
    template: ChatTemplate | None,
    *,
    seq_len: int,
    eval_fraction: float = 0.1,
    seed: int = 0,
    markers: tuple[int | None, int | None] = (None, None),
    progress: Callable[[str], None] | None = None,
    eval_inputs: Sequence[str] = (),
) -> tuple[PreferencePairs, PreferencePairs]:
    """(train, eval) pairs of the preference records of ``inputs`` (files, globs, directories
    or URLs of JSON lines or Parquet); each record goes to eval with probability
    ``eval_fraction`` (a hash of its index and ``seed``). ``markers``: the tokenizer's
    ``(bos, eos)`` (:func:`xlafit.data.clm.special_ids`), around text pairs' rows. The
    evaluation's own files (``eval_inputs``, or a split folder's test or validation files:
    :func:`xlafit.data.files.splits`) take the place of ``eval_fraction``, and ``progress`` is
    told so.

    Raises:
        DataError: a record that is no preference pair (:func:`check_pair`), records mixing
            text and conversations, a pair whose completions ``seq_len`` cuts off entirely,
            or no pair left to train on.
    """
    bos, eos = markers
    encoded: list[tuple[Encoded, Encoded]] = []
    wheres: list[str] = []  # each pair's file and record, for the messages below
    kinds: set[str] = set()
    first: dict[str, str] = {}  # where the first record of each kind was, and of other turns
    others = 0
    found = splits(inputs, eval_inputs)
    held = set(found.eval or ())
    for name in [*found.train, *(found.eval or [])]:
        records = read_records([name])
        for number, record in enumerate(records, 1):
            where = f"{name}, record {number}"
            kind = check_pair(record, where)
            check_one_kind(first, kind, where, "preference records")
            kinds.add(kind)
            if other_turns(record, kind):
                others += 1
                first.setdefault("other turns", where)
            try:
                encoded.append(encode_pair(record, kind, tok, template, bos=bos, eos=eos))
                wheres.append(where)
            except DataError as e:
                raise DataError(f"{where}: {e}") from None
        if progress is not None:
            progress(f"read {len(records):,} preference records from {name}")
    if not encoded:
        raise DataError(f"no preference records in {', '.join(map(str, inputs))}; give records in one of {_LAYOUTS}.")
    draws = hash_uniform(np.array([seed]), np.arange(len(encoded)), 13)
    to_eval = [bool(draw < eval_fraction) for draw in draws]
    if found.eval is not None:  # every training file's pair trains, every evaluation file's evaluates
        to_eval = [where.rsplit(", record ", 1)[0] in held for where in wheres]
        if progress is not None:
            progress(found.said)
    split: dict[str, list[tuple[Encoded, Encoded]]] = {"train": [], "eval": []}
    truncated = alike = 0
    spans = sum(any(row.spans_boundary for row in pair) for pair in encoded)
    for where, pair, evaluates in zip(wheres, encoded, to_eval, strict=True):
        for row in pair:
            truncated += len(row.ids) > seq_len
            if not any(row.mask[:seq_len]):
                raise DataError(
                    f"{where}: the pair has a completion that data.seq_len={seq_len} cuts off entirely (its "
                    f"rows have {len(pair[0].ids)} and {len(pair[1].ids)} tokens): the pair would compare nothing; "
                    "raise data.seq_len or shorten its prompt."
                )
        if pair[0].ids[:seq_len] == pair[1].ids[:seq_len]:  # prefers nothing within seq_len: no signal
            alike += 1
            continue
        split["eval" if evaluates else "train"].append(pair)
    if alike == len(encoded):
        raise DataError(
            f"every preference pair is the same in its chosen and rejected rows within data.seq_len={seq_len}: the "
            "cut removes what tells them apart; raise data.seq_len."
        )
    if not split["train"]:
        raise DataError(
            f"all {len(encoded) - alike} preference records were drawn for evaluation "
            f"(data.eval_fraction={eval_fraction}); give more records or a smaller data.eval_fraction."
        )
    pad = tok.token_to_id(PAD) or 0
    fmt = "chat" if kinds == {"chat"} else "prompt_completion"
    counts = {k: len(v) for k, v in split.items()}
    out = [PreferencePairs(_rows(split[k], seq_len, pad), tok.get_vocab_size(), counts[k]) for k in ("train", "eval")]
    out[0].source = PreferenceSource(fmt, counts, truncated, alike, spans, others, first.get("other turns", ""))
    return out[0], out[1]


def _rows(pairs: list[tuple[Encoded, Encoded]], seq_len: int, pad: int) -> dict[str, np.ndarray]:
    """Pairs as ``[N, 2, seq_len]`` arrays, each row cut at ``seq_len`` and padded at its end."""
    shape = (len(pairs), 2, seq_len)
    ids = np.full(shape, pad, np.int32)
    segments = np.zeros(shape, np.int32)
    mask = np.zeros(shape, np.int8)
    for i, pair in enumerate(pairs):
        for j, row in enumerate(pair):
            n = min(len(row.ids), seq_len)
            ids[i, j, :n] = row.ids[:n]
            segments[i, j, :n] = 1
            mask[i, j, :n] = row.mask[:n]
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape).copy()
    return {"input_ids": ids, "segment_ids": segments, "positions": positions, "loss_mask": mask}


def summary(
    train: PreferencePairs, evaluation: PreferencePairs, eval_fraction: float = 0.0, evaluating: bool = False
) -> str:
    """What a preference run trains on, in a line or two; where ``eval_fraction`` (the run's
    ``data.eval_fraction``) drew no pair, that it evaluates nothing. ``evaluating``: ``train``
    is data read to be evaluated alone (``xlafit eval``)."""
    source = train.source
    kind = "conversations" if source is not None and source.format == "chat" else "text"
    rows = train.arrays["loss_mask"]
    share = float(rows.sum()) / max(train.tokens, 1)
    lines = [
        f"{'evaluation data' if evaluating else 'data'}: {train.documents} preference pairs ({kind}) -> {len(train)} "
        f"pairs of rows of {train.seq_len} tokens"
        + ("" if evaluating else f"; eval: {evaluation.documents} pair{'' if evaluation.documents == 1 else 's'}"),
        f"  the objective compares the completions: {share:.0%} of the tokens",
    ]
    if source is not None and source.truncated:
        fix = (
            "their ends are not scored (the run's length, which its checkpoints mean)"
            if evaluating
            else "raise data.seq_len to keep their ends"
        )
        lines.append(f"  {source.truncated} rows longer than data.seq_len={train.seq_len} are cut at it; {fix}")
    if not evaluation.documents and eval_fraction > 0 and not evaluating:
        lines.append(
            f"  no evaluation: none of the {train.documents} pair{'' if train.documents == 1 else 's'} was drawn for "
            f"it at data.eval_fraction={eval_fraction} (no eval metrics will be reported); give more pairs or a larger "
            "data.eval_fraction, or data.eval_fraction=0 to train without one"
        )
    if source is not None and source.spans_boundary:
        lines.append(
            f"  {source.spans_boundary} pairs have a token across the prompt's end: each completion starts where the "
            "prompt alone and the whole encode apart (as TRL's DPOTrainer does), so the end of the prompt is compared "
            "too; a prompt that ends with a space or newline keeps the two apart in most tokenizers"
        )
    if source is not None and source.other_turns:
        lines.append(
            f"  {source.other_turns} pairs hold another role's turns inside chosen or rejected (the first: "
            f"{source.first_other_turns}): only their assistant turns are compared (TRL's DPOTrainer compares every "
            "token after the prompt); put the turns before the answers in the prompt to have them asked"
        )
    if source is not None and source.alike:
        lines.append(
            f"  {source.alike} pairs are left out: within data.seq_len={train.seq_len} their chosen and rejected rows "
            "are the same (the cut removes their difference, and they would prefer nothing); raise data.seq_len to "
            "keep them"
        )
    return "\n".join(lines)
