"""Causal-LM data: documents or records -> a Hugging Face tokenizer -> packed rows with segment ids.

Documents come from text files (one document per blank-line-separated block), Parquet files
(one document per row of a text column) or JSON-lines records, local or at a URL (``gs://``
with gcsfs); chat and prompt/completion records (:mod:`xlafit.data.chat`) are rendered with
the model's chat template and carry a ``loss_mask`` on their answers.
Each is tokenized (``<bos>`` before it where the tokenizer puts one before a text and
``<eos>`` after it, as its own files declare them: :func:`special_ids`),
cut into pieces of at most ``seq_len`` tokens, and the pieces are packed first-fit into rows
of ``seq_len`` tokens (:func:`xlafit.data.shapes.pack`): ``segment_ids`` 1, 2, ... per piece
and 0 for padding, ``positions`` restarting at 0 in each piece. The loss
(:func:`next_token_targets`) counts a position only where the next token is in the same
piece, so no prediction crosses a document boundary and padding counts nothing.

Everything happens in host memory when a run starts (seconds for a few hundred MB of text).

Example:
    >>> tok = train_bpe(["corpus.txt"], vocab_size=4000, out="tok/")           # doctest: +SKIP
    >>> train, evaluation = load_packed(["corpus.txt"], tok, seq_len=256)        # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import jax
import numpy as np
from etils import epath
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from xlafit.data.chat import FORMATS, Encoded, detect_format, encode, markers_for, masks_in_rows, read_records
from xlafit.data.files import data_files, kind, splits
from xlafit.data.hashing import hash_uniform
from xlafit.data.rendering import ChatTemplate, end_of_turn, template_for
from xlafit.data.shapes import pack
from xlafit.data.special_tokens import markers, settings
from xlafit.data.text import documents
from xlafit.data.tokenizer import read_tokenizer_json
from xlafit.errors import ConfigError, DataError
from xlafit.io.paths import as_path

ArrayT = TypeVar("ArrayT", np.ndarray, jax.Array)
PROGRESS_EVERY_S = 5.0  # the least time between two lines of load_packed's progress
_BATCH = 10_000  # documents tokenized in one call (tokenizers spreads a call over its threads)
BOS, EOS, PAD = "<s>", "</s>", "<pad>"  # the special tokens of a tokenizer trained here (ids 0, 1, 2)

log = logging.getLogger("xlafit")


def train_bpe(files: Sequence[str], vocab_size: int, out: str | Path) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2's and Llama 3's kind) trained on ``files``, written
    as ``out/tokenizer.json`` and ``out/tokenizer_config.json`` (``AutoTokenizer`` reads
    them). Any text round-trips: unseen characters fall back to bytes. Its ``<s>``, ``</s>``
    and ``<pad>`` (ids 0, 1, 2) are declared in its files as ``bos_token``, ``eos_token`` and
    ``pad_token``, and encoding a text puts ``<s>`` before it, here and in ``transformers``.

    Example:
        >>> tok = train_bpe(["corpus.txt"], vocab_size=4000, out="tok/")  # doctest: +SKIP
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(f) for f in files], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(out) / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


def load_tokenizer(where: str | Path, fix: str | None = None) -> Tokenizer:
    """A Hugging Face ``tokenizer.json``, given as the file or a directory holding it (a model
    directory from the hub, ``xlafit export hf``, or :func:`train_bpe`); local or a URL.

    Raises:
        DataError: there is no ``tokenizer.json`` there, or the file is not one; ``fix`` ends
            the message (default: what to give as ``data.tokenizer``).
    """
    fix = fix or "give data.tokenizer as a model directory's tokenizer.json or the directory holding it."
    return read_tokenizer_json(_tokenizer_path(where, fix), fix)


def tokenizer_json(where: str | Path) -> str:
    """The text of the ``tokenizer.json`` :func:`load_tokenizer` reads, as it is on disk."""
    return _tokenizer_path(where).read_text()


def _tokenizer_path(where: str | Path, fix: str | None = None) -> epath.Path:
    path = as_path(where)
    if not str(path).endswith(".json"):
        path = path / "tokenizer.json"
    if not path.exists():
        raise DataError(
            f"no tokenizer at {path}; "
            + (fix or "give data.tokenizer as a tokenizer.json or a directory holding one (a Hugging Face model "
               "directory has it).")
        )  # fmt: skip
    return path


def special_ids(where: str | Path) -> tuple[int | None, int | None]:
    """``(bos, eos)``: the ids of the document markers of the tokenizer at ``where`` (as
    :func:`load_tokenizer` takes it), from its own files (:mod:`xlafit.data.special_tokens`):
    ``bos`` what ``transformers`` puts before a text it encodes, ``eos`` its ``eos_token``;
    None where it has none.

    Example:
        >>> special_ids("tok/")  # a tokenizer of train_bpe                  # doctest: +SKIP
        (0, 1)

    Raises:
        ConfigError: ``where`` is a loaded tokenizer, not where it lies (its configuration
            files, which name the markers, are not part of it).
    """
    if not isinstance(where, (str, os.PathLike)):  # a tokenizers.Tokenizer, or transformers' tokenizer
        raise ConfigError(
            f"special_ids takes the tokenizer's folder or hub id, not a {type(where).__name__}: its "
            "tokenizer_config.json names the markers. Call special_ids('path/to/model') with what you gave "
            "load_tokenizer."
        )
    return markers(load_tokenizer(where), settings(where))


def stop_ids(folder: str | Path) -> tuple[int, ...]:
    """The tokens that end an answer of a model directory (or a run's ``tokenizer/``): its
    ``eos_token`` (:func:`special_ids`), the end of an assistant turn in its chat template
    (:func:`~xlafit.data.rendering.end_of_turn`, which need not be the ``eos_token``) and
    ``generation_config.json``'s ``eos_token_id``."""
    root = as_path(folder)
    tok = load_tokenizer(root)
    found = {special_ids(root)[1]}
    template = template_for(str(root))
    if template is not None and (end := end_of_turn(template, tok)) is not None:
        found.add(tok.token_to_id(end))
    generation = root / "generation_config.json"
    if generation.exists():
        value = json.loads(generation.read_text()).get("eos_token_id")
        found.update(value if isinstance(value, list) else [value])
    return tuple(sorted(i for i in found if i is not None))


def read_documents(inputs: Sequence[str], text_column: str = "text") -> Iterator[str]:
    """The documents of text files (blank-line-separated blocks) and Parquet files (one per
    row of ``text_column``), in order. ``inputs``: files, directories, globs or URLs."""
    files = data_files(inputs)
    yield from _documents([f for f in files if kind(f) == "text"], [], text_column)
    for name in files:
        if kind(name) == "parquet":
            yield from _documents([], read_records([name]), text_column, name)


def _documents(text_files: list[str], records: list[dict], text_column: str, where: str = "") -> Iterator[str]:
    for doc in documents(text_files, "blank"):
        yield "\n".join(doc)
    if records and text_column not in records[0]:
        raise DataError(
            f"{where} has no column {text_column!r} (it has {', '.join(records[0])}); set data.text_column to the "
            "one holding the text, or data.format if its records are chat or prompt/completion."
        )
    empty = 0
    for number, record in enumerate(records, 1):
        if text_column not in record:  # a record of another format (two datasets in one file): not "empty"
            raise DataError(
                f"{where}, record {number}: it has no {text_column!r} (its keys: {', '.join(record)}), where the "
                "file's first record has one: a file holds records of one format (text, prompt/completion or chat); "
                "put each format in a file of its own, or convert the records to one."
            )
        text = record.get(text_column)
        if text is None or text == "":
            empty += 1
            continue
        if not isinstance(text, str):
            raise DataError(
                f"{where}, record {number}: its {text_column!r} is {text!r:.60} (of type {type(text).__name__}), not "
                "text; "
                "give text there, or name the column that holds it with data.text_column."
            )
        yield text
    if empty:  # a column with missing values: trained without them, and said
        log.warning(
            "warning: %s: %d record%s no text in %r (null or empty): left out",
            where,
            empty,
            " has" if empty == 1 else "s have",
            text_column,
        )


@dataclasses.dataclass
class PackedText:
    """Packed rows of tokens: ``input_ids``, ``segment_ids``, ``positions`` ``[N, seq_len]``.

    A :class:`~xlafit.data.dataset.Dataset` (``len`` and ``take``) the trainer reads.
    """

    arrays: dict[str, np.ndarray]
    vocab_size: int
    documents: int
    source: Source | None = None  # what was read (set on the train split)

    @property
    def seq_len(self) -> int:
        return int(self.arrays["input_ids"].shape[1])

    @property
    def tokens(self) -> int:
        """Real (not padding) tokens."""
        return int((self.arrays["segment_ids"] > 0).sum())

    def __len__(self) -> int:
        return len(self.arrays["input_ids"])

    def take(self, indices: np.ndarray, epoch: int = 0) -> dict[str, np.ndarray]:
        return {name: a[indices] for name, a in self.arrays.items()}


def pieces(ids: list[int], seq_len: int) -> list[list[int]]:
    """A tokenized document cut into pieces of at most ``seq_len`` tokens (a piece of one
    token has nothing to predict and is dropped).

    Example:
        >>> pieces(list(range(7)), 3)
        [[0, 1, 2], [3, 4, 5]]
    """
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i : i + seq_len]) > 1]


@dataclasses.dataclass(frozen=True)
class Source:
    """What :func:`load_packed` read: records (or documents) per split, in which format, and
    what the loss counts."""

    format: str
    records: dict[str, int]
    truncated: int = 0
    answer_share: float = 1.0  # of the real tokens, the share the loss counts
    # records left out: no token of theirs within seq_len counts for the loss (an answer cut
    # off, or none), where they would only add a row's zero to the mean over rows
    without_loss: int = 0
    spans_boundary: int = 0  # prompt/completion records with a token across the prompt's end
    unanswered: int = 0  # of without_loss, those with no answer at all (a conversation with no assistant turn)
    eval_from: str = ""  # where evaluation files come from, in words (:class:`xlafit.data.files.Splits`)
    templated: bool = False  # conversations rendered in the chat template (chat or conversational prompt/completion)


def load_packed(
    inputs: Sequence[str],
    tok: Tokenizer,
    *,
    seq_len: int,
    eval_fraction: float = 0.1,
    seed: int = 0,
    text_column: str = "text",
    fmt: str = "auto",
    template: ChatTemplate | None = None,
    loss_on: str = "assistant",
    markers: tuple[int | None, int | None] = (None, None),
    progress: Callable[[str], None] | None = None,
    eval_inputs: Sequence[str] = (),
) -> tuple[PackedText, PackedText]:
    """(train, eval) packed rows of the documents or records of ``inputs``; each goes to eval
    with probability ``eval_fraction`` (a hash of its index and ``seed``), unless the
    evaluation has files of its own: ``eval_inputs``, or the test or validation split of a
    folder named for splits (:func:`xlafit.data.files.splits`), which take its place.

    Text (``fmt="text"``: text files, a Parquet text column, ``{"text"}`` records) is cut into
    pieces of ``seq_len``; a chat or prompt/completion record (:mod:`xlafit.data.chat`) is one
    sequence, its end cut off past ``seq_len``, with a ``loss_mask`` (1 where the loss counts
    the token; ``loss_on`` "assistant" or "all"). ``fmt="auto"``: from each file's records.
    ``markers``: the ``(bos, eos)`` ids put before and after each document and
    prompt/completion record (:func:`special_ids` reads them from the tokenizer's files;
    None: none). ``progress`` gets a line every :data:`PROGRESS_EVERY_S` seconds while the inputs are
    tokenized (files and records done of all).

    Raises:
        DataError: no text, an unknown format, or no document left for training.
    """
    if seq_len < 2:
        raise DataError(f"data.seq_len={seq_len} leaves nothing to predict; use 256, 1024 or more.")
    _check_options(fmt, loss_on)
    found = splits(inputs, eval_inputs)
    files = found.train
    read = functools.partial(
        encode_files, tok=tok, fmt=fmt, text_column=text_column, template=template, loss_on=loss_on,
        markers=markers, progress=progress,
    )  # fmt: skip
    encoded, fmt_found = read(files)
    names, held = _split_names(encoded, fmt_found, found.eval, read, eval_fraction, seed)
    encoded += held
    split: dict[str, list[Encoded]] = {"train": [], "eval": []}
    counts = {"train": 0, "eval": 0}
    truncated = answers_cut = longest = without_loss = spans_boundary = unanswered = 0
    # A record none of whose tokens within seq_len counts for the loss is left out (told in the
    # summary), unless no training record would be left: the errors below say why.
    counting = [fmt_found == "text" or loss_on == "all" or any(e.mask[:seq_len]) for e in encoded]
    leave_out = any(c and name == "train" for c, name in zip(counting, names, strict=True))
    for e, name, counts_for_loss in zip(encoded, names, counting, strict=True):
        if fmt_found != "text" and len(e.ids) > 1:
            truncated += len(e.ids) > seq_len
            answers_cut += name == "train" and any(e.mask) and not any(e.mask[:seq_len])
            longest = max(longest, len(e.ids))
        if leave_out and not counts_for_loss:
            without_loss += 1
            unanswered += not any(e.mask)
            continue
        counts[name] += 1
        spans_boundary += e.spans_boundary
        split[name] += sequences(e, fmt_found, seq_len)
    if not split["train"] and fmt_found == "chat" and (unanswered := _without_answers(files)):
        raise DataError(
            f"no text to train on in {', '.join(map(str, inputs))}: {unanswered} of its {len(encoded)} conversations "
            "have no assistant turn, and the chat template renders them as at most one token; give conversations "
            'with an assistant turn (the loss is on its answers), or the text as text records ({"text": ...}).'
        )
    if not split["train"]:
        raise DataError(
            f"no text to train on in {', '.join(map(str, inputs))} ({len(encoded)} documents or records); give text "
            "files (documents separated by blank lines), Parquet files with a text column, or JSON-lines records."
        )
    pad = tok.token_to_id(PAD) or 0
    vocab = tok.get_vocab_size()
    out = []
    for name in ("train", "eval"):
        arrays = _pack(split[name], seq_len, pad, with_mask=fmt_found != "text")
        out.append(PackedText(arrays, vocab, counts[name]))
    masked = [x for e in split["train"] for x in e.mask]
    share = sum(masked) / max(len(masked), 1)
    if not share:
        _refuse_no_loss(inputs, files, len(encoded), fmt_found, loss_on, (seq_len, answers_cut, longest))
    out[0].source = Source(
        fmt_found, counts, truncated, share, without_loss, spans_boundary, eval_from=found.said, unanswered=unanswered,
        templated=any(e.templated for e in encoded),
    )  # fmt: skip
    return out[0], out[1]


def _refuse_no_loss(
    inputs: Sequence[str], files: list[str], records: int, fmt: str, loss_on: str, cut: tuple[int, int, int]
) -> None:
    """Why no token of the training records counts for the loss, and what to do: ``cut`` is
    ``(seq_len, the training records with an answer cut before it, the longest record)``.

    Raises:
        DataError: always.
    """
    where, (seq_len, answers_cut, longest) = ", ".join(map(str, inputs)), cut
    if answers_cut:
        raise DataError(
            f"no token of {where} counts for the loss: every training record with an answer ({answers_cut}) is cut at "
            f"data.seq_len={seq_len} before its answer begins; raise data.seq_len (the longest record has {longest} "
            "tokens)."
        )
    if fmt == "chat" and (unanswered := _without_answers(files)):
        raise DataError(
            f"no token of {where} counts for the loss: {unanswered} of its {records} conversations have no assistant "
            f"turn, and with data.loss_on={loss_on} the loss is on the assistant's answers; give conversations with "
            "an assistant turn, or set data.loss_on=all to train on every token."
        )
    raise DataError(
        f"no token of {where} counts for the loss: with data.loss_on={loss_on} the loss is on the answers (assistant "
        "turns, completions), and no training record has one; check the records' roles, or set data.loss_on=all."
    )


def _split_names(
    encoded: list[Encoded],
    fmt: str,
    eval_files: list[str] | None,
    read: Callable[[list[str]], tuple[list[Encoded], str]],
    eval_fraction: float,
    seed: int,
) -> tuple[list[str], list[Encoded]]:
    """Each record's split (``train`` or ``eval``), and the evaluation files' records: a share
    ``eval_fraction`` of ``encoded`` (a hash of its index and ``seed``), or where the
    evaluation has files of its own, every record of ``encoded`` trains and theirs evaluate."""
    if eval_files is None:
        draws = hash_uniform(np.array([seed]), np.arange(len(encoded)), 11) if encoded else np.zeros(0)
        return ["eval" if draw < eval_fraction else "train" for draw in draws], []
    held, fmt_held = read(eval_files)
    if held and fmt_held != fmt:
        raise DataError(
            f"the evaluation files hold {fmt_held} records and the training files {fmt}; give both in one format."
        )
    return ["train"] * len(encoded) + ["eval"] * len(held), held


def sequences(encoded: Encoded, fmt: str, seq_len: int) -> list[Encoded]:
    """What training takes of one encoded document or record: a document cut into pieces
    (:func:`pieces`), a record cut off at ``seq_len``; nothing of a single token."""
    if fmt == "text":
        return [Encoded(p, [1] * len(p)) for p in pieces(encoded.ids, seq_len)]
    return [Encoded(encoded.ids[:seq_len], encoded.mask[:seq_len])] if len(encoded.ids) > 1 else []


def _without_answers(files: list[str]) -> int:
    """How many chat records of ``files`` have no assistant turn (read again: only an error needs it)."""
    records = [r for f in files if kind(f) != "text" for r in read_records([f])]
    return sum(
        not any(isinstance(m, dict) and m.get("role") == "assistant" for m in r.get("messages") or [])
        for r in records
        if "messages" in r
    )


class _Progress:
    """Calls ``report`` with a line at most every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, report: Callable[[str], None] | None) -> None:
        self.report, self.last = report, time.monotonic()

    def __call__(self, what: str, done: int, total: int, unit: str) -> None:
        # time.monotonic per record: tens of nanoseconds against the microseconds of encoding one
        if self.report is None or time.monotonic() - self.last < PROGRESS_EVERY_S:
            return
        self.last = time.monotonic()
        self.report(f"tokenizing {what}: {done:,} of {total:,} {unit}")


def encode_files(
    files: list[str],
    tok: Tokenizer,
    fmt: str = "auto",
    text_column: str = "text",
    template: ChatTemplate | None = None,
    loss_on: str = "assistant",
    markers: tuple[int | None, int | None] = (None, None),
    progress: Callable[[str], None] | None = None,
    limit: int | None = None,
) -> tuple[list[Encoded], str]:
    """Every document or record of ``files`` (:func:`data_files`) encoded as :func:`load_packed`
    trains on it (before cutting, :func:`sequences`), and the one format they share;
    ``limit``: the first this many only.

    Raises:
        DataError: an unknown format or ``loss_on``, a record that cannot be encoded (its file
            and number named), or formats mixed.
    """
    _check_options(fmt, loss_on)
    bos, eos = markers
    texts = [f for f in files if kind(f) == "text"]
    found: dict[str, str] = {"text": texts[0]} if texts else {}  # each format found, and a file of it
    out = []
    tick = _Progress(progress)

    def documents_encoded(docs: list[str], what: str) -> list[Encoded]:
        encoded = []
        for start in range(0, len(docs), _BATCH):  # a batch at a time: a line between batches
            chunk = _with_markers(tok, docs[start : start + _BATCH], bos, eos)
            encoded += [Encoded(ids, [1] * len(ids)) for ids in chunk]
            tick(what, start + len(chunk), len(docs), "documents")
        return encoded

    if texts:
        what = texts[0] if len(texts) == 1 else f"{len(texts)} text files"
        out += documents_encoded(list(_documents(texts, [], text_column))[:limit], what)
    for index, name in enumerate(files, 1):
        if name in texts or (limit is not None and len(out) >= limit):
            continue
        records = read_records([name])
        if not records:
            continue
        this = fmt if fmt != "auto" else detect_format(records, name, text_column)
        found.setdefault(this, name)
        what = f"{name} (file {index} of {len(files)})"
        left = None if limit is None else limit - len(out)
        if this == "text":
            out += documents_encoded(list(_documents([], records, text_column, name))[:left], what)
            continue
        for number, record in enumerate(records[:left], 1):
            try:
                out.append(encode(record, this, tok, template, loss_on=loss_on, bos=bos, eos=eos))
            except DataError as e:
                raise DataError(f"{name}, record {number} (read as {this}): {e}") from None
            tick(what, number, len(records), "records")
    if len(found) > 1:
        which = ", ".join(f"{name} is {kind}" for kind, name in sorted(found.items()))
        raise DataError(
            f"the inputs mix formats ({which}); give one kind of data per run: the files of one format, or records "
            "converted to it."
        )
    return out, next(iter(found), "text")


def _check_options(fmt: str, loss_on: str) -> None:
    if fmt not in ("auto", *FORMATS):
        raise DataError(f"data.format={fmt!r}: one of auto, {', '.join(FORMATS)}.")
    if loss_on not in ("assistant", "all"):
        raise DataError(f"data.loss_on={loss_on!r}: assistant (the answers only) or all.")


def _with_markers(tok: Tokenizer, docs: list[str], bos: int | None, eos: int | None) -> list[list[int]]:
    encoded = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    return [(marks := markers_for(ids, bos, eos))[0] + ids + marks[1] for ids in encoded]


def _pack(sequences: list[Encoded], seq_len: int, pad: int, with_mask: bool) -> dict[str, np.ndarray]:
    if not sequences:
        return _empty(seq_len, with_mask)
    packed = pack([e.ids for e in sequences], seq_len, pad_id=pad)
    arrays = {k: packed[k] for k in ("input_ids", "segment_ids", "positions")}
    if with_mask:
        arrays["loss_mask"] = masks_in_rows((e.mask for e in sequences), packed["placement"], packed["input_ids"].shape)
    return arrays


def _empty(seq_len: int, with_mask: bool = False) -> dict[str, np.ndarray]:
    out = {k: np.zeros((0, seq_len), np.int32) for k in ("input_ids", "segment_ids", "positions")}
    if with_mask:
        out["loss_mask"] = np.zeros((0, seq_len), np.int8)
    return out


def next_token_targets(
    input_ids: ArrayT, segment_ids: ArrayT, loss_mask: ArrayT | None = None
) -> tuple[ArrayT, ArrayT]:
    """``(targets, weights)`` ``[B, T - 1]`` of a packed batch: position ``t`` predicts token
    ``t + 1``, weighted 1 only when both are real tokens of the same piece and, with a
    ``loss_mask``, the loss counts token ``t + 1`` (an answer's, not the prompt's).

    Works on NumPy and JAX arrays alike.

    Example:
        >>> t, w = next_token_targets(np.array([[5, 6, 7, 8, 0]]), np.array([[1, 1, 2, 2, 0]]))
        >>> t.tolist(), w.tolist()
        ([[6, 7, 8, 0]], [[1.0, 0.0, 1.0, 0.0]])
        >>> next_token_targets(np.array([[5, 6, 7, 8]]), np.array([[1, 1, 1, 1]]), np.array([[0, 0, 1, 1]]))[1].tolist()
        [[0.0, 1.0, 1.0]]
    """
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, :-1] > 0)
    if loss_mask is not None:
        same = same & (loss_mask[:, 1:] > 0)
    return input_ids[:, 1:], same.astype(np.float32)
