"""Reading a Hugging Face directory's files as data: ``config.json`` and its kin as JSON,
weights as safetensors (never a pickle). A damaged or truncated file (an interrupted
download, a copy cut short) is refused with its path and the fix, as an
:class:`~xlafit.errors.HFFormatError`, instead of the parser's own exception."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from xlafit.errors import HFFormatError

_FIX = "download or export it again"


def read_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; a file that is not one names itself and where it breaks."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise HFFormatError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); {_FIX}.") from None
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); {_FIX}.") from None
    if not isinstance(value, dict):
        raise HFFormatError(f"{path} holds a JSON {type(value).__name__}, not an object; {_FIX}.")
    return value


@contextmanager
def open_safetensors(path: str | Path) -> Iterator[Any]:
    """``safetensors.safe_open(path, framework="numpy")``, a damaged file named as such."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="numpy")
    except SafetensorError as e:
        raise HFFormatError(f"{path} is damaged ({e}); {_FIX}.") from None
    with handle as f:
        yield f


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, by name (see :func:`open_safetensors`)."""
    from safetensors import SafetensorError

    with open_safetensors(path) as f:
        try:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        except SafetensorError as e:
            raise HFFormatError(f"{path} is damaged ({e}); {_FIX}.") from None


# safetensors' dtype names -> NumPy's (those xlafit reads without safetensors' own reader)
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_tensor(path: str | Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file, read into a new array with plain file reads.

    safetensors' own reader maps the file into memory and copies out of the mapping, so while
    a tensor is read the process holds it twice (the mapped pages count in its resident
    memory); this reads it once. A dtype not listed here goes through safetensors' reader.

    Raises:
        HFFormatError: the file is damaged or truncated, or has no tensor ``name``.
    """
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            info = header[name]
            if info["dtype"] not in _DTYPES:
                with open_safetensors(path) as handle:
                    return handle.get_tensor(name)
            begin, end = info["data_offsets"]
            dtype, shape = np.dtype(_DTYPES[info["dtype"]]), tuple(info["shape"])
            if end - begin != dtype.itemsize * int(np.prod(shape)):
                raise ValueError(f"{name} holds {end - begin} bytes for shape {shape}")
            data = bytearray(end - begin)  # the array's own memory: one copy of the tensor
            f.seek(8 + size + begin)
            if f.readinto(data) != len(data):
                raise ValueError(f"{name} is cut short")
            return np.frombuffer(data, dtype).reshape(shape)
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise HFFormatError(f"{path} is damaged ({e}); {_FIX}.") from None
