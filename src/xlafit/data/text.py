"""Plain-text corpora: input files, documents, and the Korean texts shipped with konlpy.

Input format (BERT's ``create_pretraining_data.py``): one sentence or paragraph per line;
documents are separated by blank lines (``doc_boundary="blank"``) or are whole files
(``doc_boundary="file"``). Files are read line by line, so a corpus never has to fit in
memory; paths may be local or any fsspec URL.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import fsspec

from xlafit.errors import DataError
from xlafit.io.paths import filesystem

DocBoundary = Literal["blank", "file"]


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files named by ``patterns``: paths, globs, directories (their ``*.txt``) or URLs.

    Raises:
        DataError: a pattern matches nothing.
    """
    files: list[str] = []
    for pattern in patterns:
        if "://" in pattern:
            fs, path = filesystem(pattern)
            if any(c in path for c in "*?["):
                found = sorted(fs.glob(path))
            else:  # a directory URL: its *.txt, as a local directory
                found = sorted(fs.glob(f"{path.rstrip('/')}/*.txt")) if fs.isdir(path) else [path]
            files += [fs.unstrip_protocol(f) for f in found if fs.isfile(f)]
            if not found or not fs.exists(found[0]):
                raise DataError(f"no input file matches {pattern}.")
            continue
        pattern = os.path.expanduser(pattern)
        p = Path(pattern)
        if p.is_dir():
            matched = sorted(str(f) for f in p.glob("*.txt"))
        else:
            matched = sorted(glob.glob(pattern))
        if not matched:
            raise DataError(f"no input file matches {pattern!r}; give text files, globs or directories of *.txt.")
        files += matched
    return files


def read_lines(files: Sequence[str]) -> Iterator[tuple[int, str]]:
    """``(file_index, line)`` for every line of ``files``, stripped, blank lines included."""
    for i, name in enumerate(files):
        try:
            with fsspec.open(name, "r", encoding="utf-8") as f:
                for line in f:
                    yield i, line.strip()
        except UnicodeDecodeError:
            where = _undecodable(name)
            raise DataError(f"{name}:{where} is not UTF-8 text; convert the file with iconv first.") from None
        except FileNotFoundError:
            raise DataError(f"input file {name} does not exist.") from None


def _undecodable(name: str) -> str:
    """``line N (byte B)``: where ``name`` is first not UTF-8, read again (only an error needs
    it: the decoder's offset counts from the chunk it was decoding, not the file's start)."""
    offset = 0
    with fsspec.open(name, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{number} (byte {offset + e.start})"
            offset += len(line)
    return "?"


def documents(files: Sequence[str], doc_boundary: DocBoundary = "blank") -> Iterator[list[str]]:
    """Documents, each a list of its non-empty lines."""
    doc: list[str] = []
    current = 0
    for file_index, line in read_lines(files):
        if file_index != current or (doc_boundary == "blank" and not line):
            if doc:
                yield doc
            doc, current = [], file_index
        if line:
            doc.append(line)
    if doc:
        yield doc


def total_bytes(files: Sequence[str]) -> int:
    """Sum of the files' sizes, for progress bars (0 where a size is unknown)."""
    size = 0
    for name in files:
        fs, path = filesystem(name)
        size += fs.size(path) or 0
    return size


def korean_demo_files() -> list[str]:
    """The Korean texts of the ``konlpy`` wheel: the constitution (kolaw) and ten bills
    (kobill), about 140 kB. konlpy is located, not imported (importing it needs Java).

    Raises:
        DataError: konlpy is not installed.
    """
    spec = importlib.util.find_spec("konlpy")
    if spec is None or spec.origin is None:
        raise DataError(
            "the Korean demo corpus comes from the konlpy wheel, which is not installed: "
            "pip install --no-deps konlpy==0.6.0 (its Java dependencies are not needed), or set data.data_dir."
        )
    root = Path(spec.origin).parent / "data" / "corpus"
    files = sorted(str(p) for sub in ("kolaw", "kobill") for p in (root / sub).glob("*.txt"))
    if not files:
        raise DataError(f"no corpus files under {root}; reinstall konlpy.")
    return files
