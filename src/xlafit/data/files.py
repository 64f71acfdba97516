"""The data files a run reads: what ``data.data_dir`` names, what each file is read as (from
its extension), and the train and evaluation splits of a folder named as the ``datasets``
library names them (``train-00000-of-00001.parquet``, ``test.jsonl``, ``validation_*.json``).

Example:
    >>> kind("data/train.ndjson"), kind("corpus.txt")
    ('records', 'text')
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from xlafit.errors import DataError
from xlafit.io import hub
from xlafit.io.paths import describe_error, filesystem, is_url, reading

log = logging.getLogger("xlafit")

TEXT_FILES = (".txt",)  # documents separated by blank lines
RECORD_FILES = (".jsonl", ".ndjson", ".json")  # JSON lines (a .json may hold one array of records instead)
PARQUET_FILES = (".parquet",)
READ = (*TEXT_FILES, *RECORD_FILES, *PARQUET_FILES)
# what datasets' save_to_disk writes beside its .arrow shards: no records
_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")
# extensions users bring, each with what to do instead
_FIXES = {
    (".csv", ".tsv"): "convert it to JSON lines or Parquet (datasets: load_dataset('csv', ...).to_json('x.jsonl'))",
    (".gz", ".zst", ".bz2", ".xz", ".zip", ".tar"): "decompress it first",
    (".arrow",): "it is a datasets save_to_disk shard: write the dataset with to_parquet or to_json instead",
}
# datasets.data_files.SPLIT_KEYWORDS: a word of a file's name (between -._, space and digits)
_SPLITS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
           "test": ("test", "testing", "eval", "evaluation")}  # fmt: skip
_WORD = "(?:^|[-._ 0-9]){}(?:[-._ 0-9]|$)"


def kind(name: str) -> str:
    """``text``, ``records`` (JSON lines, or a JSON array) or ``parquet``: how ``name`` is read.

    Raises:
        DataError: an extension not read (a CSV, a compressed file, ...), with what to do.
    """
    lower = name.lower()
    if lower.endswith(TEXT_FILES):
        return "text"
    if lower.endswith(RECORD_FILES):
        return "records"
    if lower.endswith(PARQUET_FILES):
        return "parquet"
    fix = next((f for exts, f in _FIXES.items() if lower.endswith(exts)), None)
    raise DataError(
        f"{name}: not a file type xlafit reads ({', '.join(READ)}); "
        + (f"{fix}." if fix else "give text as .txt, records as .jsonl or .parquet (rename the file if it is one).")
    )


def data_files(inputs: Sequence[str]) -> list[str]:
    """The files named by ``inputs``: files, globs, or directories (their ``*.txt``,
    ``*.jsonl``, ``*.ndjson``, ``*.json`` and ``*.parquet``), local or URLs;
    ``hf://datasets/org/name/path`` through the Hugging Face cache
    (:func:`xlafit.io.hub.dataset_path`).

    Raises:
        DataError: an input matches no file, or names one of a type not read (:func:`kind`).
        ConfigError: a Hugging Face path that cannot be read (gated, unknown, offline).
    """
    return [f for given in inputs for f in _files_of(given)[0]]


def _files_of(given: str) -> tuple[list[str], bool]:
    """The files ``given`` names, and whether it is a folder (its listing)."""
    pattern = hub.dataset_path(given, "data.data_dir") if given.startswith("hf://") else given
    try:
        found, others, folder = _matching(pattern)
    except Exception as e:  # a bucket that cannot be reached or read: gcsfs's own error is a long traceback
        if not is_url(pattern):
            raise
        raise DataError(f"cannot read {pattern}: {describe_error(pattern, e)}") from None
    for name in found:
        kind(name)
    if found and others:  # a CSV beside the JSON lines, say: left out, and said
        try:
            kind(others[0])
        except DataError as e:
            log.warning(
                "warning: %s: %d file%s of a type not read left out, the first %s", given, len(others),
                "" if len(others) == 1 else "s", str(e),
            )  # fmt: skip
    if found:
        return found, folder
    deeper = _deeper_data(pattern)
    if deeper is None and others:  # a folder of CSV files, say: why none is read, and what to do
        kind(others[0])
    where = ""
    if deeper is not None:
        sub, ext = deeper
        inner = f"{given.rstrip('/')}/{sub}"
        where = (
            f" ({given} holds none itself, but {inner} does: give that folder, or a glob as "
            f"'{given.rstrip('/')}/**/*{ext}'; a folder is read one level deep)"
        )
    raise DataError(
        f"no input file matches {given}{where}; give text, JSON-lines or Parquet files, globs, or directories of "
        f"{', '.join('*' + e for e in READ)} files."
    )


def _listed(names: list[str]) -> list[str]:
    """The data files of a folder's listing (not datasets' metadata beside them)."""
    return [f for f in names if f.lower().endswith(READ) and f.rsplit("/", 1)[-1] not in _METADATA]


def _deeper_data(pattern: str) -> tuple[str, str] | None:
    """``(folder, extension)``: a folder under ``pattern`` (a directory with no data file of
    its own; the folder relative to it) that holds data files, for the message that names it;
    None where there is none, or it is no directory."""
    try:
        fs, path = filesystem(pattern)
        if not fs.isdir(path):
            return None
        root = path.rstrip("/")
        found = sorted(_listed(fs.glob(f"{root}/**")))
        if found:
            first = found[0]
            return first.rsplit("/", 1)[0][len(root) :].lstrip("/"), "." + first.rsplit(".", 1)[-1]
    except Exception:  # only a hint: the error itself stands
        return None
    return None


def _matching(pattern: str) -> tuple[list[str], list[str], bool]:
    """The files ``pattern`` names, (for a directory) the files beside them not read, and
    whether it is a directory."""
    fs, path = filesystem(pattern)
    others: list[str] = []
    folder = False
    if any(c in path for c in "*?["):
        found = sorted(fs.glob(path))
    elif folder := fs.isdir(path):
        everything = sorted(f for f in fs.ls(path, detail=False) if fs.isfile(f))
        found = _listed(everything)
        fixable = tuple(e for exts in _FIXES for e in exts)
        others = [f for f in everything if f.lower().endswith(fixable)]
    else:
        found = [path]
    named = [fs.unstrip_protocol(f) if "://" in pattern else f for f in found if fs.exists(f) and fs.isfile(f)]
    return named, others, folder


def split_of(name: str) -> str | None:
    """The split a file's name names as ``datasets`` reads it (``train``, ``validation`` or
    ``test``), or None.

    Example:
        >>> split_of("data/train-00000-of-00001.parquet"), split_of("dev.jsonl"), split_of("trainer.txt")
        ('train', 'validation', None)
    """
    base = name.rsplit("/", 1)[-1].lower()
    for split, words in _SPLITS.items():
        if any(re.search(_WORD.format(w), base) for w in words):
            return split
    return None


@dataclasses.dataclass(frozen=True)
class Splits:
    """The files a run trains on, those it evaluates on (None: a share of the training files,
    ``data.eval_fraction``), and in words where the evaluation files come from ("" where
    nothing but ``data.eval_fraction`` decides)."""

    train: list[str]
    eval: list[str] | None = None
    said: str = ""


def splits(inputs: Sequence[str], eval_inputs: Sequence[str] = ()) -> Splits:
    """The training and evaluation files of ``inputs`` and ``eval_inputs`` (``data.data_dir``
    and ``data.eval_data_dir``): a folder whose files are named for splits (:func:`split_of`)
    trains on its ``train`` files and evaluates on its ``validation`` files, else its
    ``test`` files (the other is not read); files or globs named one by one are read as given.

    Raises:
        DataError: a split folder with files named for no split, or no ``train`` files; a file
            both trained and evaluated on.
    """
    train: list[str] = []
    held: dict[str, list[str]] = {}
    folders = []
    for given in inputs:
        found, folder = _files_of(given)
        by_split = {name: split_of(name) for name in found}
        if folder and any(s in ("validation", "test") for s in by_split.values()):
            loose = [n for n, s in by_split.items() if s is None]
            if loose or "train" not in by_split.values():
                what = f"{loose[0]} is named for no split" if loose else "none is named for the train split"
                raise DataError(
                    f"{given} holds files named for evaluation splits (test, validation), and {what}; name its files "
                    "train-*, validation-* or test-* (as datasets does), or give the files to train on one by one "
                    "(data.eval_data_dir names those to evaluate on)."
                )
            train += [n for n, s in by_split.items() if s == "train"]
            for name, split in by_split.items():
                if split in ("validation", "test"):
                    held.setdefault(split, []).append(name)
            folders.append(given)
        else:
            train += found
    evaluation = data_files(eval_inputs) if eval_inputs else None
    said = ""
    if evaluation is not None:
        said = f"eval: data.eval_data_dir ({_count(evaluation)}), in place of data.eval_fraction"
        if held:
            said += f"; the {' and '.join(sorted(held))} files of {', '.join(folders)} are not read"
    elif held:
        chosen = "validation" if "validation" in held else "test"
        evaluation = held[chosen]
        other = "test" if chosen == "validation" else "validation"
        said = (
            f"eval: the {chosen} split of {', '.join(folders)} ({_count(evaluation)}), in place of "
            f"data.eval_fraction; training on its train split ({_count(train)})"
            + (f"; its {other} split is not read" if other in held else "")
        )
    if evaluation is not None and (both := sorted(set(train) & set(evaluation))):
        raise DataError(
            f"{both[0]} is both trained and evaluated on; give data.eval_data_dir files that data.data_dir does not "
            "name."
        )
    return Splits(train, evaluation, said)


# A run's record of the data files it read (:func:`fingerprint`), beside its checkpoints.
FINGERPRINT_FILE = "data_files.json"
# Its key for the settings that named a hub dataset, each at the commit the run read
# (:func:`xlafit.io.hub.pinned`): said when the hub moves on, never compared (the hashes are).
PINNED = "hub_revisions"


def fingerprint(found: Splits) -> dict[str, list[str]]:
    """The sha256 of each file a run trains on (``train``) and of those it evaluates on
    (``eval``; the training files' where a share of their records is held out), in the order
    read: what an llm run keeps of its data (:data:`FINGERPRINT_FILE`), so that a file edited
    in place (a record fixed or added, which moves every later row and the held-out share) is
    seen when the run resumes or is scored. Names are left out: moved data is the same data.

    A local file is read once a process while its size and modification time stay as they
    were (a resume compares the hashes, then keeps them).

    Raises:
        DataError: a file cannot be read (a URL's: named with the cause).
    """
    train = [_digest(name) for name in found.train]
    return {"train": train, "eval": train if found.eval is None else [_digest(name) for name in found.eval]}


def moved_on(before: dict[str, Any], now: dict[str, Any]) -> str:
    """Where a run's data came from a hub dataset that has moved on since (another commit on
    its branch), a sentence naming the settings that read what the run read; else "".

    Example:
        >>> moved_on({PINNED: {"data.data_dir": "hf://datasets/o/n@c1/d"}}, {PINNED: {"data.data_dir": "hf://datasets/o/n@c2/d"}})
        '; the hub dataset moved on since the run read it: data.data_dir=hf://datasets/o/n@c1/d reads what it read'
    """
    was, is_now = before.get(PINNED, {}), now.get(PINNED, {})
    moved = [f"{setting}={url}" for setting, url in was.items() if setting in is_now and is_now[setting] != url]
    if not moved:
        return ""
    verb = "reads" if len(moved) == 1 else "read"
    return f"; the hub dataset moved on since the run read it: {' and '.join(moved)} {verb} what it read"


def _digest(name: str) -> str:
    if is_url(name):
        return _sha256(name)
    stat = os.stat(name)
    return _local_sha256(name, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1024)
def _local_sha256(name: str, size: int, mtime_ns: int) -> str:
    """A local file's sha256, for as long as its size and modification time say it is unchanged."""
    return _sha256(name)


def _sha256(name: str) -> str:
    with reading(name, DataError), filesystem(name)[0].open(name, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _count(files: list[str]) -> str:
    return files[0] if len(files) == 1 else f"{len(files)} files"


def records_of_array(name: str, text: str) -> list[dict[str, Any]]:
    """The records of a ``.json`` file holding one JSON array of them (what ``datasets``'
    ``to_json(lines=False)`` writes).

    Raises:
        DataError: the text is not JSON, or an element is not an object.
    """
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{name}:{e.lineno} is not JSON ({e.msg}); give one JSON array of records.") from None
    for number, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise DataError(f"{name}, record {number} is a JSON {type(record).__name__}, not an object.")
    return list(records)
