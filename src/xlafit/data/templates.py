"""xlafit's training chat templates: for the families whose official template cannot give
answer-only loss masks, a template that renders what the model generates inside
``{% generation %}`` blocks (as TRL ships ``trl/chat_templates/*_training.jinja``).

- ``qwen3``: Qwen3's official template drops the ``<think>`` reasoning of assistant turns
  before the last question, and renders an empty ``<think>`` block only in the last turn, so a
  turn renders differently once another follows it. The training template renders every
  assistant turn as the official one renders the last: each answer is trained on the tokens
  the model generates for it at inference.
- ``mistral-v0.3``: Mistral v0.3's official template puts the system prompt into the user turn
  only when that turn is the last message, so a conversation that ends with the answer loses
  it. The training template puts it into the last user turn, as the model is asked at
  inference.

Llama 3.x, Qwen2/2.5 and Gemma 2/3's official templates render a conversation as it grows (each
turn the same once another follows), so each answer is found without a training template.

A tokenizer whose own template is one of the official ones (:func:`recognise`: its text, each
line stripped and blank lines dropped, hashed) trains with the shipped template in its place;
``data.chat_template=NAME`` picks one by name.

Example:
    >>> [t.name for t in SHIPPED]
    ['qwen3', 'mistral-v0.3']
    >>> recognise("{{ messages }}") is None
    True
"""

from __future__ import annotations

import dataclasses
import hashlib
from importlib import resources

__all__ = ["SHIPPED", "Shipped", "by_name", "choices", "digest", "recognise", "source"]


@dataclasses.dataclass(frozen=True)
class Shipped:
    """One training template: its name (``data.chat_template=NAME``), the family it is for, why
    the official template cannot be trained with as it is, and the digests (:func:`digest`) of
    the official templates it stands in for."""

    name: str
    family: str
    why: str
    official: tuple[str, ...]


SHIPPED = (
    Shipped(
        "qwen3",
        "Qwen3",
        "the official one drops earlier turns' reasoning",
        # Qwen/Qwen3-0.6B ... Qwen3-235B-A22B's tokenizer_config.json (one template for the family)
        ("014dfdff0f8aa940c245a99a23c172fc0eb2961c1702e88b5cb6ef403f7504f8",),
    ),
    Shipped(
        "mistral-v0.3",
        "Mistral v0.3",
        "the official one moves the system prompt into the last message, or drops it",
        # mistralai/Mistral-7B-Instruct-v0.3's tokenizer_config.json (Mistral's "v3" template)
        ("732cb55a37bfbfad46ce49325479afa0800e6cd8e0b0563ea5810847079384c3",),
    ),
)


def digest(text: str) -> str:
    """A template's fingerprint: sha256 of its lines, each stripped, blank ones dropped
    (indentation and line endings differ between copies of one template; what a line says
    does not)."""
    lines = [line.strip() for line in text.splitlines()]
    return hashlib.sha256("\n".join(line for line in lines if line).encode()).hexdigest()


def recognise(text: str) -> Shipped | None:
    """The shipped template that stands in for the official template ``text``, or None."""
    fingerprint = digest(text)
    return next((t for t in SHIPPED if fingerprint in t.official), None)


def by_name(name: str) -> Shipped | None:
    """The shipped template called ``name`` (``qwen3``), or None."""
    return next((t for t in SHIPPED if t.name == name), None)


def source(shipped: Shipped) -> str:
    """The text of a shipped training template (package data: ``chat_templates/NAME.jinja``)."""
    return (resources.files(__package__) / "chat_templates" / f"{shipped.name}.jinja").read_text(encoding="utf-8")


def choices() -> str:
    """The shipped templates as a user picks them: ``data.chat_template=qwen3 for Qwen3, ...``."""
    return ", ".join(f"data.chat_template={t.name} for {t.family}" for t in SHIPPED)
