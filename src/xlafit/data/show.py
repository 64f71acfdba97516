"""What training sees of a few documents or records: their text as the model reads it, the
tokens the loss trains on marked (``xlafit data show``), as users of TRL check its masks.

A record is encoded as :func:`xlafit.data.clm.load_packed` encodes it, cut as it cuts it
(:func:`~xlafit.data.clm.sequences`), and a token is trained where
:func:`~xlafit.data.clm.next_token_targets` weighs predicting it: the loss the llm recipe
computes. Trained text is shown between :data:`OPEN` and :data:`CLOSE`, or in colour on a
terminal.

Example:
    >>> render([("<s>Q: 3 + 4? A: ", False), ("7</s>", True)], color=False)
    '<s>Q: 3 + 4? A: ⟦7</s>⟧'
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tokenizers import Tokenizer

from xlafit.data.chat import Encoded
from xlafit.data.clm import next_token_targets, sequences

__all__ = ["CLOSE", "OPEN", "Shown", "render", "runs", "shown", "trained_tokens"]

OPEN, CLOSE = "⟦", "⟧"  # around trained text where there is no colour (characters text rarely holds)
_TRAINED, _RESET = "\033[1;32m", "\033[0m"  # bold green on a terminal


@dataclasses.dataclass(frozen=True)
class Shown:
    """One document or record: its tokens, which of them the loss trains on, and its text in
    runs of ``(text, trained)``."""

    ids: list[int]
    trained: list[bool]
    runs: list[tuple[str, bool]]


def trained_tokens(encoded: Encoded, fmt: str, seq_len: int) -> list[bool]:
    """Per token of ``encoded``, whether the loss counts predicting it: the weights of
    :func:`~xlafit.data.clm.next_token_targets` on each sequence training takes of it (the
    first token of each is never predicted; tokens cut off train nothing)."""
    out = [False] * len(encoded.ids)
    at = 0  # the sequences are consecutive slices of the record (pieces of a document, or its head)
    for seq in sequences(encoded, fmt, seq_len):
        ids = np.array([seq.ids])
        _, weights = next_token_targets(ids, np.ones_like(ids), np.array([seq.mask]))
        for i, w in enumerate(weights[0]):
            out[at + i + 1] = bool(w)
        at += len(seq.ids)
    return out


def runs(tok: Tokenizer, ids: list[int], trained: list[bool]) -> list[tuple[str, bool]]:
    """The text of ``ids`` (special tokens shown) in runs of tokens trained alike: each run
    the text decoding adds to the text before it, so that the runs join into the whole."""
    out: list[tuple[str, bool]] = []
    done, start = "", 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and trained[end] == trained[start]:
            continue
        text = tok.decode(ids[:end], skip_special_tokens=False)
        piece = text[len(done) :] if text.startswith(done) else tok.decode(ids[start:end], skip_special_tokens=False)
        out.append((piece, trained[start]))
        done, start = text, end
    return out


def shown(tok: Tokenizer, encoded: Encoded, fmt: str, seq_len: int) -> Shown:
    """``encoded`` (a record as training encodes it) as :class:`Shown`."""
    trained = trained_tokens(encoded, fmt, seq_len)
    return Shown(encoded.ids, trained, runs(tok, encoded.ids, trained))


def render(pieces: list[tuple[str, bool]], color: bool) -> str:
    """Runs of ``(text, trained)`` as one text: trained runs in colour, or between marks."""
    before, after = (_TRAINED, _RESET) if color else (OPEN, CLOSE)
    return "".join(f"{before}{text}{after}" if trained else text for text, trained in pieces)
