"""Chat templates, compiled and rendered as Hugging Face's ``apply_chat_template`` renders
them (jinja2's immutable sandbox: a downloaded template cannot reach Python), and where a
run's template comes from: ``data.chat_template``, the tokenizer's own, or the training
template xlafit ships for its family (:mod:`xlafit.data.templates`).

Example:
    >>> template = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}")
    >>> template.render([{"role": "user", "content": "hi"}])
    '<user>hi</>'
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from xlafit.data import templates
from xlafit.errors import DataError
from xlafit.io.paths import as_path

__all__ = ["TEMPLATE_FILE", "ChatTemplate", "describe", "end_of_turn", "missing_template", "template_for"]

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


def missing_template(what: str) -> str:
    """The refusal of ``what`` (``chat records``) where no chat template is at hand, with the
    templates xlafit ships (:mod:`xlafit.data.templates`)."""
    return (
        f"{what} need a chat template, and the tokenizer's directory has none (tokenizer_config.json's chat_template "
        f"or chat_template.jinja): give one as data.chat_template, a Jinja file or one xlafit ships "
        f"({templates.choices()})"
    )
