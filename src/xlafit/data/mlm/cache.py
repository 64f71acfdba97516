"""Prepared splits -> arrays: shards decoded once into memory-mapped ``.npy`` files.

:func:`load_split` checks every shard against the manifest and returns the split's arrays,
memory-mapped from the user cache (``$XLAFIT_CACHE/mlm``) or, where that cannot be written,
read into memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
from tqdm import tqdm

from xlafit.data.mlm.preparation import MANIFEST, read_manifest
from xlafit.data.shards import read_shard
from xlafit.errors import DataError
from xlafit.io.cache import COMPLETE, cache_dir, publish

log = logging.getLogger("xlafit")


# name -> (shape, dtype) of a split's arrays
_Layout = dict[str, tuple[tuple[int, ...], type[np.generic]]]


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

    Returns:
        The arrays and the manifest.

    Example:
        >>> arrays, manifest = load_split("data/mlm", "train")  # doctest: +SKIP
        >>> arrays["input_ids"].shape                            # doctest: +SKIP
        (208733, 128)
    """
    fs, root, manifest = read_manifest(url)
    info, t = manifest["splits"][split], manifest["seq_len"]
    n = info["sequences"]
    if sum(shard["sequences"] for shard in info["shards"]) != n:
        raise DataError(
            f"{url}/{MANIFEST}: the {split} shards do not add up to its {n} sequences; prepare the data again."
        )
    ids_dtype = np.uint16 if manifest["tokenizer"]["vocab_size"] <= 2**16 else np.int32  # half of int32's memory
    layout: _Layout = {
        "input_ids": ((n, t), ids_dtype),
        "token_type_ids": ((n, t), np.int8),
        "length": ((n,), np.int32),
    }
    where = _split_cache(fs.unstrip_protocol(root), split, manifest)  # one key for data/x, ./data/x, file://...
    if memory_map and not (where / COMPLETE).exists():
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


def _split_cache(url: str, split: str, manifest: dict) -> Path:
    """``$XLAFIT_CACHE/mlm/<url hash>-<split>-<manifest hash>``; ``url`` with its protocol."""
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]  # noqa: E731
    return cache_dir() / "mlm" / f"{digest(url)}-{split}-{digest(json.dumps(manifest, sort_keys=True))}"


def _build_split_cache(
    fs: fsspec.AbstractFileSystem, root: str, manifest: dict, split: str, layout: _Layout, where: Path
) -> bool:
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
        # Plain writes, not np.lib.format.open_memmap: that maps a sparse file, and a store
        # into it on a full disk kills the process with SIGBUS instead of raising OSError.
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
        publish(tmp, where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def _decode_shards(
    fs: fsspec.AbstractFileSystem, root: str, manifest: dict, split: str
) -> Iterator[dict[str, np.ndarray]]:
    """The arrays of each shard in turn, checked against the manifest."""
    import pyarrow as pa

    t = manifest["seq_len"]
    shards = manifest["splits"][split]["shards"]
    for shard in tqdm(shards, desc=f"decoding {split}", unit="shard", disable=len(shards) < 4 or None):
        table = read_shard(fs, root, shard, "MLM", rows="sequences")
        held = table.schema.field("input_ids").type.list_size
        if held != t:  # the shard's checksum holds: the manifest was changed
            raise DataError(
                f"shard {root}/{shard['path']} holds sequences of {held} tokens, not the manifest's seq_len={t}: "
                f"the manifest was changed since the data was prepared; prepare the data again."
            )
        chunk = {
            n: table.column(n).combine_chunks().flatten().to_numpy().reshape(-1, t)
            for n in ("input_ids", "token_type_ids")
        }
        chunk["length"] = table.column("length").to_numpy()
        yield chunk
        del table, chunk
        pa.default_memory_pool().release_unused()  # else Arrow's allocator keeps every shard's pages
