"""Causal-LM data: documents -> a Hugging Face tokenizer -> packed rows with segment ids.

Documents come from text files (one document per blank-line-separated block) or Parquet
files (one document per row of a text column), local or at a URL (``gs://`` with gcsfs).
Each is tokenized (``<bos>`` before and ``<eos>`` after it when the tokenizer has them),
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import jax
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from xlafit.data.hashing import hash_uniform
from xlafit.data.shapes import pack
from xlafit.data.text import documents
from xlafit.errors import DataError
from xlafit.io.paths import as_path, filesystem

ArrayT = TypeVar("ArrayT", np.ndarray, jax.Array)
BOS, EOS, PAD = "<s>", "</s>", "<pad>"  # the special tokens of a tokenizer trained here (ids 0, 1, 2)
# Names other tokenizers give their document markers (Llama 3, Llama 2 / Mistral, GPT-2, BERT).
BOS_NAMES = ("<|begin_of_text|>", "<s>", "[CLS]")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "[SEP]")


def train_bpe(files: Sequence[str], vocab_size: int, out: str | Path) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2's and Llama 3's kind) trained on ``files``, written
    as ``out/tokenizer.json`` (``transformers.PreTrainedTokenizerFast(tokenizer_file=...)``
    and ``AutoTokenizer`` read it). Any text round-trips: unseen characters fall back to bytes.

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
    Path(out).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(out) / "tokenizer.json"))
    return tok


def load_tokenizer(where: str | Path) -> Tokenizer:
    """A Hugging Face ``tokenizer.json``, given as the file or a directory holding it (a model
    directory from the hub, ``xlafit export hf``, or :func:`train_bpe`); local or a URL.

    Raises:
        DataError: there is no ``tokenizer.json`` there.
    """
    return Tokenizer.from_str(tokenizer_json(where))


def tokenizer_json(where: str | Path) -> str:
    """The text of the ``tokenizer.json`` :func:`load_tokenizer` reads, as it is on disk."""
    path = as_path(where)
    if not str(path).endswith(".json"):
        path = path / "tokenizer.json"
    if not path.exists():
        raise DataError(
            f"no tokenizer at {path}; give data.tokenizer as a tokenizer.json or a directory holding one "
            "(a Hugging Face model directory has it)."
        )
    return path.read_text()


def special_ids(tok: Tokenizer) -> tuple[int | None, int | None]:
    """``(bos, eos)``: the ids of the tokenizer's document markers, None where it has none."""
    find = lambda names: next((i for n in names if (i := tok.token_to_id(n)) is not None), None)  # noqa: E731
    return find(BOS_NAMES), find(EOS_NAMES)


def read_documents(inputs: Sequence[str], text_column: str = "text") -> Iterator[str]:
    """The documents of text files (blank-line-separated blocks) and Parquet files (one per
    row of ``text_column``), in order. ``inputs``: files, directories, globs or URLs."""
    files = data_files(inputs)
    parquet = [f for f in files if f.endswith(".parquet")]
    text = [f for f in files if not f.endswith(".parquet")]
    for doc in documents(text, "blank"):
        yield "\n".join(doc)
    for name in parquet:
        import pyarrow.parquet as pq

        fs, path = filesystem(name)
        with fs.open(path, "rb") as f:
            table = pq.read_table(f)
        if text_column not in table.column_names:
            raise DataError(
                f"{name} has no column {text_column!r} (it has {', '.join(table.column_names)}); "
                "set data.text_column to the one holding the text."
            )
        yield from (t for t in table.column(text_column).to_pylist() if t)


def data_files(inputs: Sequence[str]) -> list[str]:
    """The files named by ``inputs``: files, globs, or directories (their ``*.txt`` and
    ``*.parquet``), local or URLs.

    Raises:
        DataError: an input matches no file.
    """
    files: list[str] = []
    for pattern in inputs:
        fs, path = filesystem(pattern)
        if any(c in path for c in "*?["):
            found = sorted(fs.glob(path))
        elif fs.isdir(path):
            found = sorted(f for ext in ("txt", "parquet") for f in fs.glob(f"{path.rstrip('/')}/*.{ext}"))
        else:
            found = [path]
        found = [f for f in found if fs.exists(f) and fs.isfile(f)]
        if not found:
            raise DataError(
                f"no input file matches {pattern}; give text or Parquet files, globs, or directories of "
                "*.txt and *.parquet files."
            )
        files += [fs.unstrip_protocol(f) if "://" in pattern else f for f in found]
    return files


@dataclasses.dataclass
class PackedText:
    """Packed rows of tokens: ``input_ids``, ``segment_ids``, ``positions`` ``[N, seq_len]``.

    A :class:`~xlafit.data.dataset.Dataset` (``len`` and ``take``) the trainer reads.
    """

    arrays: dict[str, np.ndarray]
    vocab_size: int
    documents: int

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


def load_packed(
    inputs: Sequence[str],
    tok: Tokenizer,
    *,
    seq_len: int,
    eval_fraction: float = 0.1,
    seed: int = 0,
    text_column: str = "text",
) -> tuple[PackedText, PackedText]:
    """(train, eval) packed rows of the documents of ``inputs``; each document goes to eval
    with probability ``eval_fraction`` (a hash of its index and ``seed``).

    Raises:
        DataError: no text, or no document left for training.
    """
    if seq_len < 2:
        raise DataError(f"data.seq_len={seq_len} leaves nothing to predict; use 256, 1024 or more.")
    bos, eos = special_ids(tok)
    split: dict[str, list[list[int]]] = {"train": [], "eval": []}
    counts = {"train": 0, "eval": 0}
    docs = list(read_documents(inputs, text_column))
    encoded = tok.encode_batch(docs, add_special_tokens=False)
    draws = hash_uniform(np.array([seed]), np.arange(len(docs)), 11) if docs else np.zeros(0)
    for e, draw in zip(encoded, draws, strict=True):
        ids = ([bos] if bos is not None else []) + e.ids + ([eos] if eos is not None else [])
        name = "eval" if draw < eval_fraction else "train"
        counts[name] += 1
        split[name] += pieces(ids, seq_len)
    if not split["train"]:
        raise DataError(
            f"no text to train on in {', '.join(map(str, inputs))} ({len(docs)} documents); give text files "
            "(documents separated by blank lines) or Parquet files with a text column."
        )
    pad = tok.token_to_id(PAD) or 0
    vocab = tok.get_vocab_size()
    out = []
    for name in ("train", "eval"):
        packed = pack(split[name], seq_len, pad_id=pad) if split[name] else _empty(seq_len)
        arrays = {k: packed[k] for k in ("input_ids", "segment_ids", "positions")}
        out.append(PackedText(arrays, vocab, counts[name]))
    return out[0], out[1]


def _empty(seq_len: int) -> dict[str, np.ndarray]:
    return {k: np.zeros((0, seq_len), np.int32) for k in ("input_ids", "segment_ids", "positions")}


def next_token_targets(input_ids: ArrayT, segment_ids: ArrayT) -> tuple[ArrayT, ArrayT]:
    """``(targets, weights)`` ``[B, T - 1]`` of a packed batch: position ``t`` predicts token
    ``t + 1``, weighted 1 only when both are real tokens of the same piece.

    Works on NumPy and JAX arrays alike.

    Example:
        >>> t, w = next_token_targets(np.array([[5, 6, 7, 8, 0]]), np.array([[1, 1, 2, 2, 0]]))
        >>> t.tolist(), w.tolist()
        ([[6, 7, 8, 0]], [[1.0, 0.0, 1.0, 0.0]])
    """
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, :-1] > 0)
    return input_ids[:, 1:], same.astype(np.float32)
