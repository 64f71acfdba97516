"""``xlafit data show DIR`` of prepared data: what ``xlafit data images`` and ``xlafit data
mlm`` wrote, in words: its splits, classes or documents, and its first examples as stored.

Only the manifest, the labels of every shard (a column of each, not the images) and the first
shard of each split are read: a prepared ImageNet in a bucket is described without its 140 GB.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from xlafit.data import images, mlm, shards
from xlafit.data.shards import reading
from xlafit.io.paths import filesystem, is_url

MANIFEST = images.MANIFEST  # mlm.MANIFEST is the same name


def kind(url: str) -> str | None:
    """``"images"`` or ``"mlm"`` where ``url`` is a directory ``xlafit data images`` or
    ``xlafit data mlm`` prepared (its manifest's format), else None (a file of records, a
    folder of text files)."""
    if not is_url(url) and not (Path(url) / MANIFEST).is_file():
        return None
    with reading(url, "the prepared data"):
        fs, root = filesystem(url)
        if not fs.isfile(f"{root}/{MANIFEST}"):
            return None
        try:
            found = json.loads(fs.cat_file(f"{root}/{MANIFEST}")).get("format", "")
        except (ValueError, AttributeError):  # not JSON, or not an object: the reader of its kind says so
            return None
    name = str(found)
    return "images" if name.startswith("xlafit-images") else "mlm" if name.startswith("xlafit-mlm") else None


def describe(url: str, examples: int, found: str) -> Iterator[str]:
    """The lines ``xlafit data show`` prints for prepared data at ``url`` of :func:`kind`
    ``found``: the manifest in words, then the first ``examples`` of the training split as stored.

    Raises:
        DataError: the manifest or a shard read is damaged or missing (named, with the fix).
    """
    if found == "images":
        yield from _images(url, examples)
    else:
        yield from _mlm(url, examples)


def _counted(n: int, unit: str) -> str:
    """``1 shard``, ``2,048 images``, ``3 classes``."""
    return f"{n:,} {unit}" + ("" if n == 1 else "es" if unit.endswith("s") else "s")


def _first(n: int, unit: str) -> str:
    """``the first training image``, ``the first 3 training images``."""
    return f"the first {unit}" if n == 1 else f"the first {_counted(n, unit)}"


def _images(url: str, examples: int) -> Iterator[str]:
    import pyarrow.parquet as pq

    fs, root, manifest = images.read_manifest(url)
    classes: list[str] = manifest["classes"]
    channels = "greyscale" if manifest["channels"] == 1 else f"{manifest['channels']} channels"
    yield (
        f"{url}: images prepared by `xlafit data images` from {manifest.get('input', 'an image folder')}; "
        f"{_counted(len(classes), 'class')} (labels 0-{len(classes) - 1} in this order), {channels}"
    )
    for split, info in manifest["splits"].items():
        labels: Counter[int] = Counter()
        with reading(url, "the prepared image data"):
            for shard in info["shards"]:
                with fs.open(f"{root}/{shard['path']}", "rb") as f:
                    labels.update(pq.read_table(f, columns=["label"]).column("label").to_pylist())
        line = f"  {split}: {_counted(info['examples'], 'image')} in {_counted(len(info['shards']), 'shard')}"
        if labels:
            line += "; by class: " + ", ".join(f"{classes[k]} {labels[k]:,}" for k in sorted(labels))
            absent = [name for k, name in enumerate(classes) if k not in labels]
            if absent:
                line += f"; none of {', '.join(absent)}"
        skipped = info.get("skipped", [])
        if skipped:
            shown = ", ".join(f"{s['file']} ({s['error']})" for s in skipped[:3])
            line += f"; {len(skipped)} left out, not decodable: {shown}" + (" ..." if len(skipped) > 3 else "")
        yield line
    ignored = manifest.get("ignored", [])
    if ignored:
        yield f"  not images, left out: {', '.join(ignored[:5])}" + (" ..." if len(ignored) > 5 else "")
    train = manifest["splits"]["train"]["shards"]
    if not train or examples <= 0:
        return
    table = shards.read_shard(fs, root, train[0], "image", rows="examples").slice(0, examples)
    yield f"\n{_first(table.num_rows, 'training image')} as stored (a run resizes, crops and normalises them):"
    rows = zip(*(table.column(c).to_pylist() for c in ("image", "label", "file")), strict=True)
    for i, (data, label, file) in enumerate(rows, 1):
        yield f"  {i}. {file}: label {label} ({classes[label]}), {_image_words(data)}"


def _image_words(data: bytes) -> str:
    """``64x48 RGB JPEG, 2,345 bytes``: an encoded image as Pillow reads it."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return f"{image.width}x{image.height} {image.mode} {image.format}, {len(data):,} bytes"


def _mlm(url: str, examples: int) -> Iterator[str]:
    from tokenizers import Tokenizer

    fs, root, manifest = mlm.read_manifest(url)
    t = manifest["seq_len"]
    inputs = manifest.get("inputs", [])
    boundary = {"blank": "a blank line", "line": "each line", "file": "each file"}.get(
        manifest.get("doc_boundary", ""), str(manifest.get("doc_boundary"))
    )
    yield (
        f"{url}: MLM sequences prepared by `xlafit data mlm` from {_counted(len(inputs), 'file')}"
        + (f" ({_counted(manifest['lines'], 'line')})" if "lines" in manifest else "")
        + f"; documents end at {boundary}; packed as {manifest.get('packing', 'sentences')} into {t} tokens; "
        f"tokenizer {url.rstrip('/')}/{manifest['tokenizer']['path']} ({manifest['tokenizer']['vocab_size']:,} tokens)"
    )
    for split, info in manifest["splits"].items():
        n, tokens = info["sequences"], info["tokens"]
        padding = 1 - tokens / (n * t) if n else 0.0
        yield (
            f"  {split}: {_counted(info['documents'], 'document')} -> {_counted(n, 'sequence')}, "
            f"{_counted(tokens, 'token')} ({padding:.1%} padding) in {_counted(len(info['shards']), 'shard')}"
        )
    train = manifest["splits"]["train"]["shards"]
    if not train or examples <= 0:
        return
    with reading(url, "the prepared MLM data"):
        tok = Tokenizer.from_str(fs.cat_file(f"{root}/{manifest['tokenizer']['path']}/tokenizer.json").decode())
    table = shards.read_shard(fs, root, train[0], "MLM", rows="sequences").slice(0, examples)
    yield (
        f"\n{_first(table.num_rows, 'training sequence')} as stored, special tokens shown "
        "(a run masks data.mask_prob of their tokens anew each time it reads them):"
    )
    rows = zip(*(table.column(c).to_pylist() for c in ("input_ids", "token_type_ids", "length")), strict=True)
    for i, (ids, types, length) in enumerate(rows, 1):
        second = f", the second segment from token {types.index(1)}" if 1 in types[:length] else ""
        yield f"--- sequence {i}: {length} of {t} tokens{second}"
        yield tok.decode(ids[:length], skip_special_tokens=False)
