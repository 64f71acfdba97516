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

Example:
    >>> template = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}")
    >>> template.render([{"role": "user", "content": "hi"}])
    '<user>hi</>'
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import numpy as np
from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from xlafit.data import templates
from xlafit.data.files import records_of_array
from xlafit.data.shards import parquet_table
from xlafit.errors import DataError
from xlafit.io.paths import as_path, filesystem

__all__ = [
    "check_one_kind",
    "FORMATS",
    "ROLES",
    "TEMPLATE_FILE",
    "ChatTemplate",
    "Encoded",
    "describe",
    "detect_format",
    "encode",
    "end_of_turn",
    "messages_of",
    "read_records",
    "template_for",
]

FORMATS = ("text", "chat", "prompt_completion")
# The roles chat templates know (OpenAI's and Hugging Face's; Llama 3's ipython for tool results).
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
TEMPLATE_FILE = "chat_template.jinja"  # where a model directory (and a run's tokenizer/) keeps its template
# Marks around a {% generation %} block's output while rendering (private-use characters no
# text contains), removed after: the block's span in the rendered text.
_OPEN, _CLOSE = "\ue000", "\ue001"


class _Generation(Extension):
    """``{% generation %} ... {% endgeneration %}``: what the model generates (Hugging Face's
    ``AssistantTracker``), rendered between marks."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        return _OPEN + caller() + _CLOSE


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """A chat template compiled as Hugging Face compiles one: jinja2's immutable sandbox
    (a downloaded template cannot reach Python), ``trim_blocks`` and ``lstrip_blocks``,
    ``loopcontrols``, the ``tojson`` filter, ``raise_exception`` and ``strftime_now``.

    Args:
        source: the template's text.
        tokens: the special tokens it may name (``bos_token``, ``eos_token``, ...).
        name: what messages call it.
        shipped: the xlafit training template it is (:mod:`xlafit.data.templates`), if one.
        official: the tokenizer's own template it stands in for while training (the one the
            model is asked with, kept for generation and export), if it does.
    """

    def __init__(
        self,
        source: str,
        tokens: dict[str, str] | None = None,
        name: str = "the chat template",
        *,
        shipped: templates.Shipped | None = None,
        official: ChatTemplate | None = None,
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise DataError(
                f"{name} does not parse (line {e.lineno}: {e.message}); fix it, or give another as data.chat_template."
            ) from None
        except TemplateError as e:
            raise DataError(f"{name} does not parse ({e}); fix it, or give another as data.chat_template.") from None
        self.name = name
        self.source = source
        self.shipped = shipped
        self.official = official
        self.tokens = dict(tokens or {})
        self.marks_generation = "{% generation %}" in source or "{%- generation %}" in source

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False, **context: Any) -> str:
        """The conversation as text (marks of generation blocks removed); ``context``: what
        else the template reads, as ``apply_chat_template``'s keywords (``tools``, a record's
        ``chat_template_kwargs``: :func:`template_context`)."""
        return self._render(messages, add_generation_prompt, context).replace(_OPEN, "").replace(_CLOSE, "")

    def adds_generation_prompt(self) -> bool:
        """Whether rendering with ``add_generation_prompt`` adds the assistant's turn header: a
        template without that branch leaves the header in each answer, trained with it."""
        asked = [_PROBE[0]]
        return self.render(asked, add_generation_prompt=True) != self.render(asked)

    def _render(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, context: dict[str, Any] | None = None
    ) -> str:
        try:
            text = self._template.render(
                **(context or {}), messages=list(messages), add_generation_prompt=add_generation_prompt, **self.tokens
            )
        except TemplateError as e:
            raise DataError(f"{self.name} refuses a conversation: {e}") from None
        except Exception as e:  # the template's own Python: `message['content'] + ...` on a null or a list
            strings = all(isinstance(m.get("content"), str) for m in messages if isinstance(m, dict))
            raise DataError(
                f"{self.name} cannot render a conversation ({type(e).__name__}: {str(e)[:200]}); "
                + (
                    "fix the template, or give another as data.chat_template."
                    if strings
                    else "a template that joins text expects every message's content to be a string: give it as "
                    "text, or use a template that handles null content or lists of parts (data.chat_template)."
                )
            ) from None
        lists = [m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)]
        parts = [p for content in lists for p in content]
        if any(repr(p) in text for p in parts):  # `{{ content }}` prints a list as Python's repr
            raise DataError(
                f"{self.name} prints a message's content as it is, so a list of parts would train as Python text "
                f"({repr(parts[0])[:60]}...): give each message's content as a string, or use a template that handles "
                "lists of parts (data.chat_template)."
            )
        return text

    def answer_spans(self, messages: Sequence[dict[str, Any]], **context: Any) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendered conversation and the character spans of its
        assistant turns (what the loss counts); ``context`` as :meth:`render`'s."""
        if self.marks_generation:
            marked = self._render(messages, False, context)
            spans, text, at = [], [], 0
            for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
                if piece == _OPEN:
                    start = at
                elif piece == _CLOSE:
                    spans.append((start, at))
                else:
                    text.append(piece)
                    at += len(piece)
            return "".join(text), spans
        full = self.render(messages, **context)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, **context)
            upto = self.render(messages[: i + 1], **context)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise DataError(
                    f"{self.name} renders a conversation differently from its beginning, so its assistant turns "
                    f"cannot be found; xlafit's training templates render their families' conversations with the "
                    f"answers marked ({templates.choices()}); for another, give a template with "
                    "{% generation %} blocks around the answers (data.chat_template=FILE), or data.loss_on=all."
                )
            spans.append((len(before), len(upto)))
        return full, spans


def template_for(tokenizer_dir: str | None, given: str | None = None, *, training: bool = False) -> ChatTemplate | None:
    """The chat template of a model directory (``chat_template.jinja``, or
    ``tokenizer_config.json``'s ``chat_template``: a string, or a list of named templates of
    which ``default`` is taken), or ``given`` (``data.chat_template``: the name of one of
    xlafit's training templates, or a file); the special tokens from ``tokenizer_config.json``.
    None: the directory has none.

    ``training``: a directory's template that is the official one of a family xlafit ships a
    training template for (:func:`xlafit.data.templates.recognise`) gives that training
    template, with the official one as its ``official``; ``given`` always wins.
    """
    config: dict[str, Any] = {}
    folder = as_path(tokenizer_dir) if tokenizer_dir else None
    if folder is not None and str(folder).endswith(".json"):
        folder = folder.parent
    if folder is not None and (folder / "tokenizer_config.json").exists():
        config = json.loads((folder / "tokenizer_config.json").read_text())
    tokens = {}
    for key, value in config.items():
        if key.endswith("_token") and value is not None:
            tokens[key] = value["content"] if isinstance(value, dict) else str(value)
    if given:
        shipped = templates.by_name(given)
        if shipped is not None:
            return ChatTemplate(templates.source(shipped), tokens, _shipped_name(shipped), shipped=shipped)
        path = as_path(given)
        if not path.exists():
            raise DataError(f"data.chat_template={given}: no such file; give a Jinja template file.")
        return ChatTemplate(path.read_text(), tokens, f"the chat template in {given} (data.chat_template)")
    own: ChatTemplate | None = None
    if folder is not None and (folder / TEMPLATE_FILE).exists():
        name = f"the chat template in {folder / TEMPLATE_FILE}"
        own = ChatTemplate((folder / TEMPLATE_FILE).read_text(), tokens, name)
    else:
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source}
            source = named.get("default") or next(iter(named.values()), None)
        where = (
            f"the chat template of {folder / 'tokenizer_config.json'}" if folder is not None else "the chat template"
        )
        own = ChatTemplate(source, tokens, where) if source else None
    shipped = templates.recognise(own.source) if training and own is not None else None
    if own is None or shipped is None:
        return own
    trained = ChatTemplate(templates.source(shipped), tokens, _shipped_name(shipped), shipped=shipped, official=own)
    return trained if _asks_alike(own, trained) else own


def _shipped_name(shipped: templates.Shipped) -> str:
    return f"xlafit's training template for {shipped.family} (data.chat_template={shipped.name})"


def _asks_alike(official: ChatTemplate, trained: ChatTemplate) -> bool:
    """Whether ``trained`` renders a question, with and without a system prompt, and a one-turn
    exchange as ``official`` does: the recognised template is the official one in what it
    renders too (a copy whose lines differ only in indentation could render otherwise)."""
    system = {"role": "system", "content": "A probe's system prompt."}
    cases = (([system, _PROBE[0]], True), ([_PROBE[0]], True), (list(_PROBE), False))
    try:
        return all(official.render(m, add_generation_prompt=g) == trained.render(m, add_generation_prompt=g)
                   for m, g in cases)  # fmt: skip
    except DataError:
        return False


def describe(template: ChatTemplate | None) -> str:
    """One line: which chat template a run renders its conversations with, and why where it is
    not the tokenizer's own.

    Example:
        >>> source = "{{ messages }}{% if add_generation_prompt %}assistant:{% endif %}"
        >>> describe(ChatTemplate(source, name="the chat template of tok/tokenizer_config.json"))
        'chat template: the chat template of tok/tokenizer_config.json'
    """
    if template is None:
        return "chat template: none"
    header = ""
    if not template.marks_generation and not template.adds_generation_prompt():
        header = (
            " (warning: it renders no generation prompt, so each answer's turn header is trained with the answer; "
            "give a template with an add_generation_prompt branch or {% generation %} blocks as data.chat_template)"
        )
    if template.official is not None and template.shipped is not None:
        return (
            f"chat template: {template.name}, in place of {template.official.name} ({template.shipped.why}); "
            f"generation and export keep the official one{header}"
        )
    return f"chat template: {template.name}{header}"


# A conversation rendered to find where an assistant turn ends (the answer: text no template alters).
_PROBE_ANSWER = "The probe's answer."
_PROBE = ({"role": "user", "content": "A probe's question?"}, {"role": "assistant", "content": _PROBE_ANSWER})


def end_of_turn(template: ChatTemplate, tok: Tokenizer) -> str | None:
    """The special token that closes an assistant turn in ``template`` (``<|im_end|>`` in
    ChatML, ``<|eot_id|>`` in Llama 3's): the first of the tokenizer's special tokens after an
    answer's text in a rendered conversation. None: the template ends a turn with no special
    token (or renders no conversation of one question and one answer).

    Example:
        >>> from tokenizers import models
        >>> ends = ChatTemplate("{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")
        >>> tok = Tokenizer(models.WordLevel({"<|end|>": 0, "[UNK]": 1}, unk_token="[UNK]"))
        >>> _ = tok.add_special_tokens(["<|end|>"])
        >>> end_of_turn(ends, tok)
        '<|end|>'
    """
    try:
        text = template.render(list(_PROBE))
    except DataError:
        return None
    at = text.rfind(_PROBE_ANSWER)
    if at < 0:
        return None
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    after = tok.encode(text[at + len(_PROBE_ANSWER) :], add_special_tokens=False).tokens
    return next((t for t in after if t in specials), None)


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
            return Encoded(list(encoding.ids), [1] * len(encoding.ids))
        text, spans = template.answer_spans(messages_of(record), **context)
        encoding = tok.encode(text, add_special_tokens=False)
        inside = [any(s <= start < e for s, e in spans) for start, _ in encoding.offsets]
        return Encoded(list(encoding.ids), [int(x) for x in inside])
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


def missing_template(what: str) -> str:
    """The refusal of ``what`` (``chat records``) where no chat template is at hand, with the
    templates xlafit ships (:mod:`xlafit.data.templates`)."""
    return (
        f"{what} need a chat template, and the tokenizer's directory has none (tokenizer_config.json's chat_template "
        f"or chat_template.jinja): give one as data.chat_template, a Jinja file or one xlafit ships "
        f"({templates.choices()})"
    )


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
    return Encoded(ids, mask, shared < len(prompt_ids))


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
                "leave its turn out of the loss (the loss is on the assistant's turns)."
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
