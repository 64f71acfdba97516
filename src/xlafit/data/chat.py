"""Chat and instruction data for causal-LM fine-tuning: records -> the model's chat template
-> tokens with a loss mask on the answers -> packed rows.

A record is one JSON line (``*.jsonl``) or one Parquet row, in one of three formats:

- ``chat``: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}``,
  rendered with the tokenizer's chat template (``tokenizer_config.json``'s ``chat_template``
  or a ``chat_template.jinja`` beside it, or ``data.chat_template``) in jinja2's sandbox, as
  Hugging Face's ``apply_chat_template`` renders it (the same token ids);
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``: the two texts one after the
  other (``<bos>`` before, ``<eos>`` after where the tokenizer has them);
- ``text``: ``{"text": ...}``: a document, as plain-text files are read.

The loss (``loss_on="assistant"``, the default) counts the assistant turns' tokens only,
their end-of-turn token included and the generation prompt before them (``<|im_start|>
assistant``) excluded; for a prompt and completion, the completion's. A template that marks
what the model generates (``{% generation %}`` blocks) is followed exactly; otherwise each
assistant turn is what rendering the conversation up to it adds to rendering the
conversation before it with the generation prompt. ``loss_on="all"`` counts every token.

The chat template itself, rendered as transformers renders it, is
:mod:`xlafit.data.rendering`'s.

Example:
    >>> from tokenizers import models, pre_tokenizers
    >>> tok = Tokenizer(models.WordLevel({"hi": 0, "there": 1}, unk_token="hi"))
    >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> encoded = encode({"prompt": "hi", "completion": " there"}, "prompt_completion", tok, None)
    >>> encoded.ids, encoded.mask
    ([0, 1], [0, 1])
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from xlafit.data.files import records_of_array
from xlafit.data.rendering import ChatTemplate, missing_template
from xlafit.data.shards import parquet_table
from xlafit.errors import DataError
from xlafit.io.paths import filesystem

__all__ = [
    "FORMATS",
    "ROLES",
    "Encoded",
    "check_one_kind",
    "detect_format",
    "encode",
    "markers_for",
    "messages_of",
    "read_records",
    "template_context",
]

FORMATS = ("text", "chat", "prompt_completion")
# The roles chat templates know (OpenAI's and Hugging Face's; Llama 3's ipython for tool results).
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def read_records(files: Sequence[str]) -> list[dict[str, Any]]:
    """The records of JSON-lines (``.jsonl``, ``.ndjson``, ``.json``) and Parquet files, in
    order; a ``.json`` file may hold one JSON array of records instead.

    Raises:
        DataError: a line that is not a JSON object (its file and line named), a file that is
            not UTF-8 text, or a ``.parquet`` file that is not Parquet.
    """
    out: list[dict[str, Any]] = []
    for name in files:
        fs, path = filesystem(name)
        if name.endswith(".parquet"):
            # The bytes first, then Arrow: given a Python file, Arrow's I/O threads call back into
            # Python, and one still reading when an error ends the process aborts it (SIGABRT).
            with fs.open(path, "rb") as f:
                data = f.read()
            try:
                out += parquet_table(data).to_pylist()
            except Exception as e:  # pyarrow raises its own types for what is not Parquet
                raise DataError(
                    f"{name} is not a Parquet file ({e}); give Parquet files, or name the file for what it holds "
                    "(.jsonl for JSON lines, .txt for text)."
                ) from None
            continue
        with fs.open(path, "rb") as f:
            lines = f.read()
        try:
            text = lines.decode("utf-8-sig")  # a byte-order mark (an editor on Windows writes one) is no text
        except UnicodeDecodeError as e:
            line = lines[: e.start].count(b"\n") + 1
            raise DataError(
                f"{name}:{line} is not UTF-8 text (byte {e.start}); convert the file with iconv first."
            ) from None
        if name.endswith(".json") and text.lstrip().startswith("["):  # one array of records (to_json(lines=False))
            out += records_of_array(name, text)
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{name}:{number} is not JSON ({e.msg}); give one JSON object per line.") from None
            if not isinstance(record, dict):
                raise DataError(f"{name}:{number} is a JSON {type(record).__name__}, not an object.")
            out.append(record)
    return out


def check_one_kind(first: dict[str, str], kind: str, where: str, what: str) -> None:
    """Refuses a record of another kind (``text`` or ``chat``) than the records before it,
    naming both records; ``first`` holds where each kind was first seen (updated here).

    Raises:
        DataError: ``what`` (the records, as the message names them) mix text and conversations.
    """
    first.setdefault(kind, where)
    other = next((k for k in ("text", "chat") if k != kind and k in first), None)
    if other is not None:
        said = {"text": "text", "chat": "a conversation"}
        raise DataError(
            f"{where} is {said[kind]}, and {first[other]} was {said[other]}: the {what} mix text and conversations; "
            "give one kind per run."
        )


def detect_format(records: Sequence[dict[str, Any]], where: str, text_column: str = "text") -> str:
    """``chat``, ``prompt_completion`` or ``text`` (a ``text_column`` field), from the first
    record's keys.

    Raises:
        DataError: the keys fit none of them (named, with the three layouts).
    """
    if not records:
        raise DataError(f"{where} holds no records.")
    keys = set(records[0])
    if "messages" in keys or "conversations" in keys:  # conversations: ShareGPT's layout (messages_of)
        return "chat"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if text_column in keys:
        return "text"
    if {"chosen", "rejected"} <= keys:
        raise DataError(
            f"{where} holds preference pairs (chosen, rejected), which train with a preference objective: add "
            "model.objective=dpo (or simpo, orpo); see docs/guides/preference.md."
        )
    if "prompt" in keys and "completion" not in keys:
        raise DataError(
            f"{where} holds prompts without completions ({', '.join(sorted(keys))}): prompts train with rewards, "
            "model.objective=grpo model.grpo.rewards=FILE.py:FUNCTION (docs/guides/grpo.md); for supervised "
            'tuning give each record a "completion".'
        )
    raise DataError(
        f"{where} has no column {text_column!r} (it has {', '.join(sorted(keys))}) and its records are neither chat "
        '({"messages": [{"role", "content"}, ...]}) nor prompt_completion ({"prompt", "completion"}); set '
        "data.text_column to the one holding the text, or data.format."
    )


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One record's token ids and the loss mask over them (1: the loss counts predicting it)."""

    ids: list[int]
    mask: list[int]
    # a prompt/completion record whose prompt's own ids are not where the whole's start (a token
    # spans the prompt's end): its answer starts where they part, with the end of the prompt
    spans_boundary: bool = False
    templated: bool = False  # rendered in the chat template (a conversation)


def encode(
    record: dict[str, Any],
    fmt: str,
    tok: Tokenizer,
    template: ChatTemplate | None,
    *,
    loss_on: str = "assistant",
    bos: int | None = None,
    eos: int | None = None,
    text_key: str = "text",
) -> Encoded:
    """One record as token ids and loss mask (see the module docstring)."""
    if fmt == "chat":
        if template is None:
            raise DataError(
                f"{missing_template('chat records')}; or, where the records hold a text column too, train on that "
                "text as it is with data.format=text."
            )
        context = template_context(record)
        if loss_on == "all":  # every token counts: the answers need not be found
            encoding = tok.encode(template.render(messages_of(record), **context), add_special_tokens=False)
            return Encoded(list(encoding.ids), [1] * len(encoding.ids), templated=True)
        text, spans = template.answer_spans(messages_of(record), **context)
        encoding = tok.encode(text, add_special_tokens=False)
        inside = [any(s <= start < e for s, e in spans) for start, _ in encoding.offsets]
        return Encoded(list(encoding.ids), [int(x) for x in inside], templated=True)
    if fmt == "prompt_completion" and _conversational(record):
        return _conversation_completion(record, tok, template, loss_on)
    if fmt == "prompt_completion":
        # The two texts encoded as one, as TRL does: a tokenizer that marks a word's start
        # ("▁It") would put one more before a completion encoded alone. The answer starts where
        # the prompt's own ids and the whole's part (a token can span the boundary).
        prompt_text = _text(record, "prompt")
        prompt = tok.encode(prompt_text, add_special_tokens=False).ids
        whole = tok.encode(prompt_text + _text(record, "completion"), add_special_tokens=False).ids
        shared = next((i for i, (a, b) in enumerate(zip(prompt, whole, strict=False)) if a != b), len(prompt))
        head, tail = markers_for(whole, bos, eos)
        ids = head + whole + tail
        answer = [0] * (len(head) + shared) + [1] * (len(whole) - shared + len(tail))
        return Encoded(ids, [1] * len(ids) if loss_on == "all" else answer, shared < len(prompt))
    ids = tok.encode(_text(record, text_key), add_special_tokens=False).ids
    head, tail = markers_for(ids, bos, eos)
    return Encoded(head + ids + tail, [1] * (len(head) + len(ids) + len(tail)))


def markers_for(ids: list[int], bos: int | None, eos: int | None) -> tuple[list[int], list[int]]:
    """The BOS before and the EOS after a document's ``ids``, each where the text does not
    hold it already: TRL appends the EOS only to a text that does not end with it, and a chat
    rendered to text ahead starts with its BOS. A marker twice would be trained as one more
    target (the model taught to end twice).

    Example:
        >>> markers_for([5, 6, 2], bos=1, eos=2), markers_for([1, 5, 6], bos=1, eos=2)
        (([1], []), ([], [2]))
    """
    head = [bos] if bos is not None and ids[:1] != [bos] else []
    tail = [eos] if eos is not None and ids[-1:] != [eos] else []
    return head, tail


def template_context(record: dict[str, Any]) -> dict[str, Any]:
    """What a chat record gives its template beside the messages, as TRL's ``SFTTrainer``
    passes it to ``apply_chat_template``: its ``tools`` (the functions the model may call,
    which templates render into the system turn) and its ``chat_template_kwargs``.

    Example:
        >>> template_context({"messages": [], "tools": [{"type": "function"}], "chat_template_kwargs": {"x": 1}})
        {'x': 1, 'tools': [{'type': 'function'}]}
    """
    extra = record.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise DataError(
            f"a record's chat_template_kwargs is {extra!r:.60}, not a mapping of names to values; give a JSON object."
        )
    tools = record.get("tools")
    return {**extra, "tools": tools} if tools else dict(extra)


def _conversational(record: dict[str, Any]) -> bool:
    """A prompt/completion record whose prompt and completion are messages (TRL's
    conversational prompt-completion)."""
    return all(
        isinstance(record.get(k), list) and all(isinstance(m, dict) and "role" in m for m in record[k])
        for k in ("prompt", "completion")
    )


def _conversation_completion(
    record: dict[str, Any], tok: Tokenizer, template: ChatTemplate | None, loss_on: str
) -> Encoded:
    """A conversational prompt/completion record as TRL's SFTTrainer encodes it: the prompt in
    the chat template with its generation prompt, then the whole conversation; the loss on
    what the completion adds (from where the two part)."""
    if template is None:
        raise DataError(f"{missing_template('conversational prompt/completion records')}.")
    prompt = messages_of({"messages": record["prompt"]})
    whole = messages_of({"messages": [*prompt, *record["completion"]]})
    context = template_context(record)
    prompt_ids = tok.encode(template.render(prompt, True, **context), add_special_tokens=False).ids
    ids = list(tok.encode(template.render(whole, False, **context), add_special_tokens=False).ids)
    shared = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids, strict=False)) if a != b), len(prompt_ids))
    mask = [1] * len(ids) if loss_on == "all" else [0] * shared + [1] * (len(ids) - shared)
    return Encoded(ids, mask, shared < len(prompt_ids), templated=True)


# ShareGPT's speakers, as chat roles (its "system", "tool" and the like are chat roles already).
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


def messages_of(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat record's ``messages``, checked: each a dict with a known role and content a
    chat template takes. ShareGPT's layout (``conversations`` of ``{"from", "value"}``, the
    roles ``human`` and ``gpt``) is read as TRL's ``maybe_convert_to_chatml`` reads it, its
    roles as the user's and the assistant's.

    Raises:
        DataError: what is wrong with them, and the layout they need.
    """
    messages = record.get("messages", record.get("conversations"))
    if isinstance(messages, list) and all(isinstance(m, dict) and "from" in m and "role" not in m for m in messages):
        messages = [_from_sharegpt(m) for m in messages]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        if "messages" not in record:
            got = f"it has none (its keys are {', '.join(record)})"
        else:
            got = f"got {json.dumps(messages)[:120]}"
        raise DataError(f'a chat record\'s messages must be a list of {{"role": ..., "content": ...}}; {got}')
    if not messages:
        raise DataError("a chat record's messages are an empty list: it holds no conversation; remove the record.")
    for message in messages:
        if message["role"] not in ROLES:
            raise DataError(
                f"a chat message's role {message['role']!r} is not one of {', '.join(ROLES)}: a misspelt role would "
                "not be rendered as the template renders that turn (and in training its turn would be left out of the "
                "loss, which is on the assistant's turns); correct it."
            )
        _check_content(message)
    return messages


def _from_sharegpt(message: dict[str, Any]) -> dict[str, Any]:
    """A ShareGPT message (``{"from": "human", "value": ...}``) as a chat message."""
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}
    role = SHAREGPT_ROLES.get(message["from"], message["from"])
    return {"role": role, "content": message.get("value"), **rest}


def _check_content(message: dict[str, Any]) -> None:
    """A message's ``content`` as chat templates take it (``apply_chat_template`` passes it
    unchanged): text; a list of text parts (``[{"type": "text", "text": ...}]``, for a
    template that iterates them); null only in a turn that calls tools (``tool_calls``)."""
    content = message.get("content")
    if isinstance(content, str):
        return
    if content is None and message.get("tool_calls"):
        return
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return
    got = "no content" if "content" not in message else f"content {json.dumps(content)[:120]}"
    raise DataError(
        f"a message of role {message['role']!r} has {got}; give its content as text, or a list of text parts "
        '([{"type": "text", "text": ...}]); null only in a turn with tool_calls.'
    )


def _text(record: dict[str, Any], key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        keys = ", ".join(record)
        got = f"it has none (its keys are {keys})" if key not in record else f"got {json.dumps(value)[:120]}"
        if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
            got += " (messages: a conversational record gives its prompt and its completion both as messages)"
        raise DataError(f"a record's {key!r} must be text; {got}")
    return value


def masks_in_rows(masks: Iterable[Sequence[int]], placement: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Per-token masks laid out as :func:`xlafit.data.shapes.pack` placed their sequences."""
    out = np.zeros(shape, np.int8)
    for mask, (row, start) in zip(masks, placement, strict=True):
        out[row, start : start + len(mask)] = mask
    return out
