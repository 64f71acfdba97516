"""What training sees of a few documents or records: their text as the model reads it, the
tokens the loss trains on marked (``xlafit data show``), as users of TRL check its masks.

A record is encoded as :func:`xlafit.data.clm.load_packed` encodes it, cut as it cuts it
(:func:`~xlafit.data.clm.sequences`), and a token is trained where
:func:`~xlafit.data.clm.next_token_targets` weighs predicting it: the loss the llm recipe
computes. Trained text is shown between :data:`OPEN` and :data:`CLOSE`, or in colour on a
terminal; where ``data.seq_len`` cuts a record, :data:`CUT` marks the place (the text after it
is not trained on).

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

__all__ = ["CLOSE", "CUT", "OPEN", "Shown", "render", "runs", "shown", "trained_tokens"]

OPEN, CLOSE = "⟦", "⟧"  # around trained text where there is no colour (characters text rarely holds)
CUT = "✂"  # where data.seq_len cuts a record
_TRAINED, _RESET = "\033[1;32m", "\033[0m"  # bold green on a terminal


@dataclasses.dataclass(frozen=True)
class Shown:
    """One document or record: its tokens, which of them the loss trains on, its text in runs
    of ``(text, trained)``, and ``cut``, the first run that ``data.seq_len`` cuts off (None:
    the record is whole)."""

    ids: list[int]
    trained: list[bool]
    runs: list[tuple[str, bool]]
    cut: int | None = None


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


def runs(tok: Tokenizer, ids: list[int], trained: list[bool], cut: int | None = None) -> list[tuple[str, bool]]:
    """The text of ``ids`` (special tokens shown) in runs of tokens trained alike: each run
    the text decoding adds to the text before it, so that the runs join into the whole. A run
    ends at token ``cut`` too, where one is given."""
    out: list[tuple[str, bool]] = []
    done, start = "", 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and trained[end] == trained[start] and end != cut:
            continue
        text = tok.decode(ids[:end], skip_special_tokens=False)
        piece = text[len(done) :] if text.startswith(done) else tok.decode(ids[start:end], skip_special_tokens=False)
        out.append((piece, trained[start]))
        done, start = text, end
    return out


def shown(tok: Tokenizer, encoded: Encoded, fmt: str, seq_len: int) -> Shown:
    """``encoded`` (a record as training encodes it) as :class:`Shown`; a record (not a
    document, which packing splits rather than cuts) longer than ``seq_len`` is cut there."""
    trained = trained_tokens(encoded, fmt, seq_len)
    cut = seq_len if fmt != "text" and len(encoded.ids) > seq_len else None
    pieces = runs(tok, encoded.ids, trained, cut)
    if cut is None:
        return Shown(encoded.ids, trained, pieces)
    kept = len(tok.decode(encoded.ids[:cut], skip_special_tokens=False))
    lengths = np.cumsum([len(text) for text, _ in pieces])
    return Shown(encoded.ids, trained, pieces, cut=int(np.searchsorted(lengths, kept, side="right")))


def render(pieces: list[tuple[str, bool]], color: bool, cut: int | None = None) -> str:
    """Runs of ``(text, trained)`` as one text: trained runs in colour, or between marks;
    :data:`CUT` before run ``cut``, where one is given.

    Example:
        >>> render([("<s>Q: 3 + 4? A: ", False), ("7", True), ("</s>", False)], color=False, cut=2)
        '<s>Q: 3 + 4? A: ⟦7⟧✂</s>'
    """
    before, after = (_TRAINED, _RESET) if color else (OPEN, CLOSE)
    return "".join(
        (CUT if i == cut else "") + (f"{before}{text}{after}" if trained else text)
        for i, (text, trained) in enumerate(pieces)
    )
