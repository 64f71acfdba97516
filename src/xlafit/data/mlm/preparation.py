"""Text -> masked-LM sequences: Parquet shards of ``seq_len`` tokens plus ``manifest.json``.

:func:`prepare` streams text through a tokenizer and packs it into sequences of exactly
``seq_len`` tokens, written to a local path or any fsspec URL (``gs://`` with gcsfs,
``memory://`` in tests). Two packings:

- ``sentences`` (RoBERTa's FULL-SENTENCES, the default): ``[CLS] line line ... [SEP]``,
  lines taken in order and across documents (a ``[SEP]`` marks each document's end), so
  almost no position is padding;
- ``pairs`` (original BERT, without next-sentence prediction): ``[CLS] A [SEP] B [SEP]``,
  A and B consecutive text of one document split at a random line, ``token_type_ids`` 0
  for A and 1 for B.

:func:`read_manifest` opens what :func:`prepare` wrote.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import fsspec
import numpy as np
from tqdm import tqdm

from xlafit.data import shards
from xlafit.data.hashing import hash_uniform
from xlafit.data.shards import output_dir, writing
from xlafit.data.text import DocBoundary, documents, total_bytes
from xlafit.data.tokenizer import CLS, SEP, load_tokenizer
from xlafit.errors import DataError
from xlafit.io.paths import as_path, files_under, is_url

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MANIFEST = "manifest.json"
FORMAT = "xlafit-mlm-v1"
Packing = Literal["sentences", "pairs"]


@dataclasses.dataclass
class _Packer:
    """Turns tokenized documents into ``(ids, token_types)`` rows of ``seq_len`` tokens."""

    seq_len: int
    packing: Packing
    rng: np.random.Generator
    _ids: list[int] = dataclasses.field(default_factory=list)

    def add_document(self, lines: list[list[int]]) -> Iterator[tuple[list[int], list[int]]]:
        if self.packing == "sentences":
            yield from self._add_sentences(lines)
        else:
            yield from self._add_pairs(lines)

    def _add_sentences(self, lines: list[list[int]]) -> Iterator[tuple[list[int], list[int]]]:
        budget = self.seq_len - 2
        for line in lines:
            self._ids.extend(line)
            while len(self._ids) >= budget:
                body, self._ids = self._ids[:budget], self._ids[budget:]
                yield [CLS, *body, SEP], [0] * self.seq_len
        if self._ids:
            self._ids.append(SEP)  # the document ends here
            if len(self._ids) >= budget:
                body, self._ids = self._ids[:budget], self._ids[budget:]
                yield [CLS, *body, SEP], [0] * self.seq_len

    def flush(self) -> Iterator[tuple[list[int], list[int]]]:
        if self.packing == "sentences" and self._ids:
            body = self._ids[: self.seq_len - 2]
            if body[-1] == SEP:
                body = body[:-1]
            yield [CLS, *body, SEP], [0] * (len(body) + 2)
        self._ids = []

    def _add_pairs(self, lines: list[list[int]]) -> Iterator[tuple[list[int], list[int]]]:
        budget = self.seq_len - 3
        # a line longer than a sequence becomes several, so truncation below stays short
        lines = [line[i : i + budget] for line in lines for i in range(0, len(line), budget)]
        chunk: list[list[int]] = []
        for i, line in enumerate(lines):
            chunk.append(line)
            if sum(map(len, chunk)) >= budget or i == len(lines) - 1:
                if len(chunk) >= 2 or i < len(lines) - 1 or len(chunk[0]) >= 2:
                    yield self._pair(chunk, budget)
                chunk = []

    def _pair(self, chunk: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
        if len(chunk) >= 2:
            cut = int(self.rng.integers(1, len(chunk)))
            a, b = sum(chunk[:cut], []), sum(chunk[cut:], [])
        else:  # one long line: split it in the middle of its tokens
            tokens = chunk[0]
            cut = int(self.rng.integers(1, len(tokens))) if len(tokens) > 1 else 1
            a, b = tokens[:cut], tokens[cut:]
        while len(a) + len(b) > budget:  # BERT's truncate_seq_pair: trim the longer, from a random end
            longer = a if len(a) > len(b) else b
            del longer[0 if self.rng.random() < 0.5 else -1]
        ids = [CLS, *a, SEP, *b, SEP]
        return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)


class _ShardWriter:
    """Buffers rows and writes ``{split}-{n:05d}.parquet`` shards of ``shard_size`` rows."""

    def __init__(
        self, fs: fsspec.AbstractFileSystem, root: str, split: str, seq_len: int, shard_size: int, out: str, tag: str
    ):
        self.fs, self.root, self.split, self.seq_len, self.shard_size = fs, root, split, seq_len, shard_size
        self.tag = tag  # shards.shard_tag's: the names stay off an earlier manifest's
        self.out = out  # the URL as the user wrote it, for messages
        self.rows: list[tuple[list[int], list[int]]] = []
        self.shards: list[dict] = []

    def add(self, ids: list[int], types: list[int]) -> None:
        self.rows.append((ids, types))
        if len(self.rows) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        n, t = len(self.rows), self.seq_len
        ids = np.zeros((n, t), np.int32)
        types = np.zeros((n, t), np.int8)
        lengths = np.zeros(n, np.int32)
        for i, (row_ids, row_types) in enumerate(self.rows):
            ids[i, : len(row_ids)] = row_ids
            types[i, : len(row_types)] = row_types
            lengths[i] = len(row_ids)
        table = pa.table(
            {
                "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), t),
                "token_type_ids": pa.FixedSizeListArray.from_arrays(pa.array(types.ravel()), t),
                "length": pa.array(lengths),
            }
        )
        name = shards.shard_name(self.split, len(self.shards), self.tag)
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, compression="zstd")
        data = buffer.getvalue().to_pybytes()
        with writing(self.out, "the MLM shards"), self.fs.open(f"{self.root}/{name}", "wb") as f:
            f.write(data)
        digest = hashlib.sha256(data).hexdigest()
        self.shards.append({"path": name, "sequences": n, "tokens": int(lengths.sum()), "sha256": digest})
        self.rows = []


def prepare(
    tokenizer_dir: str | Path,
    files: Sequence[str],
    out: str,
    *,
    seq_len: int = 128,
    packing: Packing = "sentences",
    doc_boundary: DocBoundary = "blank",
    eval_fraction: float = 0.05,
    seed: int = 0,
    shard_size: int = 65536,
    batch_lines: int = 2000,
    show_progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Tokenizes ``files`` and writes MLM sequences as Parquet shards + ``manifest.json``.

    Memory stays bounded by ``shard_size`` rows and one document; a multi-GB corpus streams.
    The same inputs, tokenizer and seed give the same shards. Each document goes to the
    evaluation split with probability ``eval_fraction`` (a hash of its index and the seed).

    Args:
        tokenizer_dir: a directory or URL from ``xlafit tokenizer train``; copied to ``out/tokenizer``.
        files: UTF-8 text files or URLs.
        out: a local directory or fsspec URL.
        seq_len: tokens per sequence, ``[CLS]`` and ``[SEP]`` included.
        overwrite: replace data prepared in ``out`` before; without it they are refused. The
            earlier data stays usable until the new manifest replaces its own: a preparation
            that fails or is interrupted loses nothing (:func:`xlafit.data.shards.earlier_preparation`).

    Returns:
        The manifest (also written to ``out/manifest.json``).

    Example:
        >>> prepare("tok/", ["corpus.txt"], "gs://bucket/mlm", seq_len=128)  # doctest: +SKIP
    """
    if seq_len < 8:
        raise DataError(f"--seq-len {seq_len} is too short for [CLS] text [SEP]; use 64, 128 or 512.")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"--eval-fraction {eval_fraction} must lie in [0, 1).")
    if shard_size < 1:
        raise DataError(f"--shard-size {shard_size} must be at least 1.")
    tok = load_tokenizer(tokenizer_dir)
    fs, root = output_dir(out, "the MLM shards")
    earlier = shards.earlier_preparation(fs, root, out, MANIFEST, "MLM data", "the MLM shards", overwrite, FORMAT)
    tag = shards.shard_tag(earlier, MANIFEST, fs, root)
    writers = {s: _ShardWriter(fs, root, s, seq_len, shard_size, str(out), tag) for s in ("train", "eval")}
    with shards.discarded_on_failure(fs, root, tag):
        documents_per_split, lines = _tokenize(
            tok, files, writers, packing, doc_boundary, seed, eval_fraction, batch_lines, show_progress
        )
        if not writers["train"].shards:
            names = ", ".join(map(str, files[:3])) + (", ..." if len(files) > 3 else "")
            raise DataError(
                f"--input {names}: no text to train on ({lines} non-empty lines, none of them in the train split); "
                "give files with one sentence or paragraph per line (no manifest was written)."
            )
        # last, beside the manifest: the earlier data keeps its tokenizer until its shards are replaced
        with writing(out, "the MLM shards"):
            _copy_tokenizer(tokenizer_dir, fs, f"{root}/tokenizer")
    manifest = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seq_len": seq_len,
        "packing": packing,
        "doc_boundary": doc_boundary,
        "seed": seed,
        "eval_fraction": eval_fraction,
        "inputs": list(files),
        "lines": lines,
        "tokenizer": {
            "path": "tokenizer",
            "vocab_size": tok.get_vocab_size(),
            "sha256": tokenizer_sha256(tokenizer_dir),
        },
        "splits": {split: _split_record(w.shards, documents_per_split[split]) for split, w in writers.items()},
    }
    shards.publish(fs, root, out, "the MLM shards", MANIFEST, manifest, earlier)
    return manifest


def _tokenize(
    tok: Tokenizer,
    files: Sequence[str],
    writers: dict[str, _ShardWriter],
    packing: Packing,
    doc_boundary: DocBoundary,
    seed: int,
    eval_fraction: float,
    batch_lines: int,
    show_progress: bool,
) -> tuple[dict[str, int], int]:
    """Tokenizes ``files`` into ``writers``' shards: ``(documents per split, non-empty lines)``."""
    rng = np.random.default_rng(seed)
    packers = {s: _Packer(writers[s].seq_len, packing, rng) for s in ("train", "eval")}
    documents_per_split = {"train": 0, "eval": 0}
    lines = 0
    bar = tqdm(total=total_bytes(files), unit="B", unit_scale=True, desc="tokenizing", disable=not show_progress)
    for index, doc in enumerate(documents(files, doc_boundary)):
        split = "eval" if _split_draw(seed, index) < eval_fraction else "train"
        documents_per_split[split] += 1
        lines += len(doc)
        encoded: list[list[int]] = []
        for start in range(0, len(doc), batch_lines):
            encoded += [e.ids for e in tok.encode_batch(doc[start : start + batch_lines], add_special_tokens=False)]
        for ids, types in packers[split].add_document([e for e in encoded if e]):
            writers[split].add(ids, types)
        bar.update(sum(len(line.encode()) + 1 for line in doc))
    bar.close()
    for split in ("train", "eval"):
        for ids, types in packers[split].flush():
            writers[split].add(ids, types)
        writers[split].flush()
    return documents_per_split, lines


def _split_record(written: list[dict], documents: int) -> dict:
    """A split's entry in the manifest: its documents, sequences, tokens and shards."""
    return {
        "documents": documents,
        "sequences": sum(s["sequences"] for s in written),
        "tokens": sum(s["tokens"] for s in written),
        "shards": written,
    }


def _split_draw(seed: int, index: int) -> float:
    """A document's uniform draw in [0, 1) for the train/eval split (stream 7 of the hash)."""
    return float(hash_uniform(np.array([seed]), np.array([index]), 7)[0])


def tokenizer_sha256(tokenizer_dir: str | Path) -> str:
    """The SHA-256 of a tokenizer directory's ``tokenizer.json`` (a path or URL): what the
    manifest records, so that a run can tell the tokenizer the data was prepared with."""
    return hashlib.sha256((as_path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()


def _copy_tokenizer(tokenizer_dir: str | Path, fs: fsspec.AbstractFileSystem, dest: str) -> None:
    fs.makedirs(dest, exist_ok=True)
    for name, f in files_under(as_path(tokenizer_dir)).items():  # a local directory or a URL
        if "/" not in name:
            with fs.open(f"{dest}/{name}", "wb") as out:
                out.write(f.read_bytes())


def read_manifest(url: str) -> tuple[fsspec.AbstractFileSystem, str, dict]:
    """The filesystem, root path (no trailing ``/``) and manifest of data :func:`prepare` wrote.

    Raises:
        DataError: ``url`` holds no manifest, a damaged one or not one of this format, or
            cannot be read (:func:`xlafit.data.shards.read_manifest`).

    Example:
        >>> fs, root, manifest = read_manifest("data/mlm")  # doctest: +SKIP
        >>> manifest["seq_len"]                              # doctest: +SKIP
        128
    """
    prepare = "xlafit data mlm --tokenizer TOK --input TEXT"
    folder = Path(url)
    if not is_url(url) and folder.is_file():
        raise DataError(
            f"{url} is a file, not a directory of prepared MLM data; prepare its text with "
            f"`xlafit data mlm --tokenizer TOK --input {url} --out NEWDIR` and point the run at NEWDIR."
        )
    texts = sorted(p.name for p in folder.glob("*.txt")) if not is_url(url) and folder.is_dir() else []
    if texts and not (folder / MANIFEST).exists():
        shown = ", ".join(texts[:3]) + (", ..." if len(texts) > 3 else "")
        raise DataError(
            f"{url} holds text files ({shown}), not prepared MLM data; prepare them with "
            f"`xlafit data mlm --tokenizer TOK --input {url} --out NEWDIR` and point the run at NEWDIR."
        )
    required = ("seq_len", "splits", "tokenizer")
    return shards.read_manifest(url, MANIFEST, FORMAT, "MLM", prepare, required)
