"""Masked-LM data: fixed-length sequences on disk, masks drawn on the fly.

:func:`prepare` streams text through a tokenizer and packs it into sequences of exactly
``seq_len`` tokens, written as Parquet shards plus ``manifest.json`` to a local path or any
fsspec URL (``gs://`` with gcsfs, ``memory://`` in tests). Two packings:

- ``sentences`` (RoBERTa's FULL-SENTENCES, the default): ``[CLS] line line ... [SEP]``,
  lines taken in order and across documents (a ``[SEP]`` marks each document's end), so
  almost no position is padding;
- ``pairs`` (original BERT, without next-sentence prediction): ``[CLS] A [SEP] B [SEP]``,
  A and B consecutive text of one document split at a random line, ``token_type_ids`` 0
  for A and 1 for B.

:class:`MLMDataset` holds the sequences and masks them when a batch is taken: 15% of the
real tokens (at most ``max_predictions``), of which 80% become ``[MASK]``, 10% a random
token and 10% stay, optionally whole words at a time. The masks are a pure function of
``(seed, epoch, example index)``, through a counter-based hash, so every epoch has new
masks, a resumed run sees the same ones, and the device count does not change them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import fsspec
import numpy as np
from tqdm import tqdm

from xlafit.cache import cache_dir
from xlafit.data.loader import Batch, DataError
from xlafit.data.text import DocBoundary, documents, total_bytes
from xlafit.data.tokenizer import SPECIAL_TOKENS, load_tokenizer

MANIFEST = "manifest.json"
FORMAT = "xlafit-mlm-v1"
Packing = Literal["sentences", "pairs"]
PAD, UNK, CLS, SEP, MASK = range(len(SPECIAL_TOKENS))
log = logging.getLogger("xlafit")


# --------------------------------------------------------------------------- preparation


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

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, split: str, seq_len: int, shard_size: int):
        self.fs, self.root, self.split, self.seq_len, self.shard_size = fs, root, split, seq_len, shard_size
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
        name = f"{self.split}-{len(self.shards):05d}.parquet"
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, compression="zstd")
        data = buffer.getvalue().to_pybytes()
        with self.fs.open(f"{self.root}/{name}", "wb") as f:
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
) -> dict:
    """Tokenizes ``files`` and writes MLM sequences as Parquet shards + ``manifest.json``.

    Memory stays bounded by ``shard_size`` rows and one document; a multi-GB corpus streams.
    The same inputs, tokenizer and seed give the same shards. Each document goes to the
    evaluation split with probability ``eval_fraction`` (a hash of its index and the seed).

    Args:
        tokenizer_dir: a directory from ``xlafit tokenizer train``; copied to ``out/tokenizer``.
        files: UTF-8 text files or URLs.
        out: a local directory or fsspec URL.
        seq_len: tokens per sequence, ``[CLS]`` and ``[SEP]`` included.

    Returns:
        The manifest (also written to ``out/manifest.json``).
    """
    if seq_len < 8:
        raise DataError(f"--seq-len {seq_len} is too short for [CLS] text [SEP]; use 64, 128 or 512.")
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"--eval-fraction {eval_fraction} must lie in [0, 1).")
    tok = load_tokenizer(tokenizer_dir)
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    _copy_tokenizer(tokenizer_dir, fs, f"{root}/tokenizer")
    rng = np.random.default_rng(seed)
    writers = {s: _ShardWriter(fs, root, s, seq_len, shard_size) for s in ("train", "eval")}
    packers = {s: _Packer(seq_len, packing, rng) for s in ("train", "eval")}
    counts = {"documents": {"train": 0, "eval": 0}, "lines": 0}
    bar = tqdm(total=total_bytes(files), unit="B", unit_scale=True, desc="tokenizing", disable=not show_progress)
    for index, doc in enumerate(documents(files, doc_boundary)):
        split = "eval" if _hash_uniform(seed, index) < eval_fraction else "train"
        counts["documents"][split] += 1
        counts["lines"] += len(doc)
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
    tokenizer_json = Path(tokenizer_dir) / "tokenizer.json"
    manifest = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seq_len": seq_len,
        "packing": packing,
        "doc_boundary": doc_boundary,
        "seed": seed,
        "eval_fraction": eval_fraction,
        "inputs": list(files),
        "lines": counts["lines"],
        "tokenizer": {
            "path": "tokenizer",
            "vocab_size": tok.get_vocab_size(),
            "sha256": hashlib.sha256(tokenizer_json.read_bytes()).hexdigest(),
        },
        "splits": {
            split: {
                "documents": counts["documents"][split],
                "sequences": sum(s["sequences"] for s in w.shards),
                "tokens": sum(s["tokens"] for s in w.shards),
                "shards": w.shards,
            }
            for split, w in writers.items()
        },
    }
    with fs.open(f"{root}/{MANIFEST}", "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def _copy_tokenizer(tokenizer_dir: str | Path, fs: fsspec.AbstractFileSystem, dest: str) -> None:
    fs.makedirs(dest, exist_ok=True)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            with fs.open(f"{dest}/{f.name}", "wb") as out:
                out.write(f.read_bytes())


# --------------------------------------------------------------------------- loading


def read_manifest(url: str) -> tuple[fsspec.AbstractFileSystem, str, dict]:
    fs, root = fsspec.core.url_to_fs(url)
    path = f"{root.rstrip('/')}/{MANIFEST}"
    if not fs.exists(path):
        raise DataError(f"{url} has no {MANIFEST}; prepare the data with `xlafit data mlm --out {url}`.")
    with fs.open(path, "r") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise DataError(f"{url}/{MANIFEST} is not an xlafit MLM manifest ({FORMAT}).")
    return fs, root.rstrip("/"), manifest


def load_split(url: str, split: str, *, memory_map: bool = True) -> tuple[dict[str, np.ndarray], dict]:
    """``{"input_ids" [N, T], "token_type_ids" [N, T] int8, "length" [N]}`` of one split; ids
    are uint16 when the vocabulary fits (BERT's 30k-32k do), else int32.

    With ``memory_map`` (the default) the split is decoded once into uncompressed ``.npy``
    files in the user cache (``$XLAFIT_CACHE/mlm``, 3 bytes a token) and opened memory-mapped:
    a corpus larger than the host's memory trains, the operating system keeps the pages a
    run touches, and later runs (and other processes on the host) open the same files
    without decoding. The cache is keyed by the URL and the manifest, whose shard checksums
    pin the content; preparing the data again makes a new one and drops the old. Where the
    cache cannot be written (read-only, too little disk), the split is read into memory.

    Every shard is checked against the manifest (row count, and sha256 where the manifest
    has one): a truncated or changed copy fails here, naming the shard, rather than
    training on other data.
    """
    fs, root, manifest = read_manifest(url)
    info, t = manifest["splits"][split], manifest["seq_len"]
    n = info["sequences"]
    if sum(shard["sequences"] for shard in info["shards"]) != n:
        raise DataError(
            f"{url}/{MANIFEST}: the {split} shards do not add up to its {n} sequences; prepare the data again."
        )
    ids_dtype = np.uint16 if manifest["tokenizer"]["vocab_size"] <= 2**16 else np.int32  # half of int32's memory
    layout = {"input_ids": ((n, t), ids_dtype), "token_type_ids": ((n, t), np.int8), "length": ((n,), np.int32)}
    where = _split_cache(fs.unstrip_protocol(root), split, manifest)  # one key for data/x, ./data/x, file://...
    if memory_map and not (where / _COMPLETE).exists():
        memory_map = _build_split_cache(fs, root, manifest, split, layout, where)
    if memory_map:
        return {name: np.load(where / f"{name}.npy", mmap_mode="r") for name in layout}, manifest
    arrays = {name: np.empty(shape, dtype) for name, (shape, dtype) in layout.items()}
    row = 0
    for chunk in _decode_shards(fs, root, manifest, split):
        rows = len(chunk["length"])
        for name, a in arrays.items():
            a[row : row + rows] = chunk[name]
        row += rows
    return arrays, manifest


_COMPLETE = "complete"


def _split_cache(url: str, split: str, manifest: dict) -> Path:
    """``$XLAFIT_CACHE/mlm/<url hash>-<split>-<manifest hash>``; ``url`` with its protocol."""
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]  # noqa: E731
    return cache_dir() / "mlm" / f"{digest(url)}-{split}-{digest(json.dumps(manifest, sort_keys=True))}"


def _build_split_cache(fs, root: str, manifest: dict, split: str, layout: dict, where: Path) -> bool:
    """Decodes the shards into ``.npy`` files beside ``where``, renames them into place
    (atomic: a process that finds ``where`` finds it whole) and removes older versions.
    False, with a warning, where the cache has no room."""
    size = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in layout.values())
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(where.parent).free
        if free < size + 2**30:  # keep a GiB for everything else
            raise OSError(f"{size / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free")
        tmp = Path(tempfile.mkdtemp(prefix=f"{where.name}.", suffix=".tmp", dir=where.parent))
    except OSError as e:
        log.warning("cannot cache the %s split in %s (%s); reading it into memory.", split, where.parent, e)
        return False
    log.info("decoding the %s split (%.1f MB) into %s, once", split, size / 1e6, where)
    try:
        with contextlib.ExitStack() as stack:
            files = {name: stack.enter_context(open(tmp / f"{name}.npy", "wb")) for name in layout}
            for name, (shape, dtype) in layout.items():
                header = {
                    "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                    "fortran_order": False,
                    "shape": shape,
                }
                np.lib.format.write_array_header_1_0(files[name], header)
            for chunk in _decode_shards(fs, root, manifest, split):
                for name, (_, dtype) in layout.items():
                    files[name].write(np.ascontiguousarray(chunk[name], dtype).tobytes())
        (tmp / _COMPLETE).touch()
        try:
            tmp.rename(where)
        except OSError:  # another process on this host finished first
            if not (where / _COMPLETE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prefix = where.name.rsplit("-", 1)[0] + "-"
    for old in where.parent.glob(prefix + "*"):
        if old != where and not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)  # a run that has it memory-mapped keeps reading it
    for stale in where.parent.glob("*.tmp"):  # left by a process killed while decoding
        with contextlib.suppress(OSError):  # another process may be removing it too
            if time.time() - stale.stat().st_mtime > 24 * 3600:
                shutil.rmtree(stale, ignore_errors=True)
    return True


def _decode_shards(fs, root: str, manifest: dict, split: str) -> Iterator[dict[str, np.ndarray]]:
    """The arrays of each shard in turn, checked against the manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = manifest["seq_len"]
    shards = manifest["splits"][split]["shards"]
    for shard in tqdm(shards, desc=f"decoding {split}", unit="shard", disable=len(shards) < 4 or None):
        path = f"{root}/{shard['path']}"
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:
            raise DataError(f"shard {path} listed in the manifest is missing; prepare the data again.") from None
        if "sha256" in shard and hashlib.sha256(data).hexdigest() != shard["sha256"]:
            raise DataError(
                f"shard {path} is damaged or was changed: its sha256 differs from the manifest's; "
                "prepare the data again."
            )
        try:
            table = pq.read_table(pa.BufferReader(data))
        except Exception as e:  # pyarrow raises its own types for damaged files
            raise DataError(f"shard {path} cannot be read ({e}); prepare the data again.") from None
        if table.num_rows != shard["sequences"]:
            raise DataError(f"shard {path} holds {table.num_rows} sequences, the manifest says {shard['sequences']}.")
        chunk = {
            n: table.column(n).combine_chunks().flatten().to_numpy().reshape(-1, t)
            for n in ("input_ids", "token_type_ids")
        }
        chunk["length"] = table.column("length").to_numpy()
        yield chunk
        del table, chunk
        pa.default_memory_pool().release_unused()  # else Arrow's allocator keeps every shard's pages


# --------------------------------------------------------------------------- masking


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scrambles every bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def hash_uniform(*keys: np.ndarray | int) -> np.ndarray:
    """Uniform floats in [0, 1) from integer keys (broadcast), the same on every machine.

    Example:
        >>> hash_uniform(0, 1, np.arange(3)).shape
        (3,)
    """
    h = np.zeros((), np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps around, by design
        for key in keys:
            h = _mix(h + np.asarray(key, np.uint64) + np.uint64(0x9E3779B97F4A7C15))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _hash_uniform(seed: int, index: int) -> float:
    return float(hash_uniform(np.array([seed]), np.array([index]), 7)[0])


@dataclasses.dataclass(frozen=True)
class MaskingConfig:
    """BERT's masking: ``mask_prob`` of the real tokens, at most ``max_predictions``."""

    mask_prob: float = 0.15
    max_predictions: int = 20
    whole_word: bool = False
    seed: int = 0


def mask_batch(
    ids: np.ndarray,
    types: np.ndarray,
    lengths: np.ndarray,
    examples: np.ndarray,
    epoch: int,
    cfg: MaskingConfig,
    vocab_size: int,
    continuation: np.ndarray | None = None,
) -> Batch:
    """Masks a batch of sequences; vectorised over the batch (no Python loop per row).

    Args:
        ids: token ids ``[B, T]``, right-padded.
        types: token type ids ``[B, T]``.
        lengths: real tokens per row ``[B]``.
        examples: each row's index in the dataset ``[B]``: with ``epoch`` and the seed it
            decides the row's mask.
        continuation: ``[vocab]`` bool, True for ``##`` pieces (whole-word masking).

    Returns:
        ``input_ids`` (masked), ``attention_mask``, ``token_type_ids``, and per row
        ``masked_positions``, ``masked_ids`` (the original tokens) and ``masked_weights``
        (1.0 for a prediction, 0.0 for padding), each ``[B, max_predictions]``.
    """
    b, t = ids.shape
    p = cfg.max_predictions
    pos = np.arange(t)[None, :]
    real = pos < lengths[:, None]
    candidate = real & (ids != CLS) & (ids != SEP) & (ids != PAD)
    budget = np.minimum(p, np.maximum(1, np.rint(candidate.sum(1) * cfg.mask_prob))).astype(np.int64)
    budget = np.where(candidate.any(1), budget, 0)
    ex = examples[:, None].astype(np.uint64)
    if cfg.whole_word and continuation is not None:
        starts = candidate & ~continuation[ids]
        word = np.cumsum(starts, axis=1)  # pieces share their word's number
    else:
        word = np.broadcast_to(pos, (b, t))
    score = np.where(candidate, hash_uniform(cfg.seed, epoch, ex, word, 0), 2.0)
    order = np.argsort(score, axis=1, kind="stable")  # a word's pieces are adjacent in it
    word_sorted = np.take_along_axis(word, order, 1)
    cand_sorted = np.take_along_axis(candidate, order, 1)
    count = np.arange(1, t + 1)[None, :]
    is_end = np.ones((b, t), bool)
    is_end[:, :-1] = word_sorted[:, 1:] != word_sorted[:, :-1]
    # tokens taken once this token's whole word is in: the count at the word's last piece
    at_end = np.minimum.accumulate(np.where(is_end, count, t + 1)[:, ::-1], axis=1)[:, ::-1]
    chosen_sorted = cand_sorted & (at_end <= budget[:, None])
    chosen_pos = np.sort(np.where(chosen_sorted, order, t), axis=1)[:, :p]  # ascending, t = none
    if chosen_pos.shape[1] < p:
        chosen_pos = np.pad(chosen_pos, ((0, 0), (0, p - chosen_pos.shape[1])), constant_values=t)
    weights = (chosen_pos < t).astype(np.float32)
    positions = np.where(chosen_pos < t, chosen_pos, 0).astype(np.int32)
    originals = np.take_along_axis(ids, positions, 1) * (weights > 0)

    # 80% [MASK], 10% a random non-special token, 10% unchanged
    action = hash_uniform(cfg.seed, epoch, ex, positions, 1)
    n_special = len(SPECIAL_TOKENS)
    random_ids = n_special + hash_uniform(cfg.seed, epoch, ex, positions, 2) * (vocab_size - n_special)
    replacement = np.where(action < 0.8, MASK, np.where(action < 0.9, random_ids.astype(np.int64), originals))
    masked = ids.copy()
    rows = np.broadcast_to(np.arange(b)[:, None], positions.shape)
    sel = weights > 0
    masked[rows[sel], positions[sel]] = replacement[sel]
    return {
        "input_ids": masked.astype(np.int32),
        "attention_mask": real.astype(np.int32),
        "token_type_ids": types.astype(np.int32),
        "masked_positions": positions,
        "masked_ids": originals.astype(np.int32),
        "masked_weights": weights,
    }


class MLMDataset:
    """Fixed-length sequences whose batches come masked (see :func:`mask_batch`).

    Works with :class:`xlafit.Trainer` like an :class:`~xlafit.data.ArrayDataset`: the
    trainer calls ``take(indices, epoch)``.

    Example:
        >>> train = MLMDataset.from_prepared("data/mlm", "train")  # doctest: +SKIP
        >>> batch = train.take(np.arange(8), epoch=0)                 # doctest: +SKIP
    """

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        vocab_size: int,
        masking: MaskingConfig = MaskingConfig(),
        continuation: np.ndarray | None = None,
    ) -> None:
        self.arrays = arrays
        self.vocab_size = vocab_size
        self.masking = masking
        self.continuation = continuation
        self.seq_len = arrays["input_ids"].shape[1]
        self.location: str | None = None  # the prepared directory or URL, when loaded from one
        if masking.whole_word and continuation is None:
            raise ValueError("whole-word masking needs the tokenizer's continuation table.")

    @classmethod
    def from_prepared(cls, url: str, split: str, masking: MaskingConfig = MaskingConfig()) -> MLMDataset:
        """Loads one split written by :func:`prepare` (its tokenizer comes along)."""
        arrays, manifest = load_split(url, split)
        fs, root, _ = read_manifest(url)
        with fs.open(f"{root}/tokenizer/vocab.txt", "r", encoding="utf-8") as f:
            vocab = f.read().splitlines()
        continuation = np.array([token.startswith("##") for token in vocab])
        dataset = cls(arrays, manifest["tokenizer"]["vocab_size"], masking, continuation)
        dataset.location = url
        return dataset

    def __len__(self) -> int:
        return len(self.arrays["length"])

    @property
    def num_tokens(self) -> int:
        return int(self.arrays["length"].sum())

    def take(self, indices: np.ndarray, epoch: int = 0) -> Batch:
        a = self.arrays
        return mask_batch(
            a["input_ids"][indices],
            a["token_type_ids"][indices],
            a["length"][indices],
            np.asarray(indices),
            epoch,
            self.masking,
            self.vocab_size,
            self.continuation,
        )
