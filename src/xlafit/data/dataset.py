"""What the trainer asks of a data set: the :class:`Dataset` protocol, and arrays as one.

The training side needs only a length and ``take(indices, epoch)``: the data order (which
examples form each step's batch) is the trainer's, a pure function of ``(seed, step)``, so
a data set is a random-access table, not an iterator. ``epoch`` lets a data set change its
examples per epoch (masked LM draws new masks: :class:`xlafit.data.mlm.MLMDataset`).
A data set that plans its own batches (length buckets:
:class:`xlafit.data.shapes.BucketedDataset`) is a :class:`PlannedDataset`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from xlafit.errors import DataError

Batch = dict[str, np.ndarray]


@runtime_checkable
class Dataset(Protocol):
    """Examples by index: what :class:`xlafit.Trainer` trains and evaluates on."""

    def __len__(self) -> int: ...

    def take(self, indices: np.ndarray, epoch: int = 0) -> Batch:
        """The examples at ``indices`` as a dict of arrays with ``len(indices)`` rows."""
        ...


@runtime_checkable
class PlannedDataset(Dataset, Protocol):
    """A :class:`Dataset` that chooses which examples share a batch (one input shape each)."""

    @property
    def num_shapes(self) -> int:
        """Distinct input shapes its batches have: one compiled program each."""
        ...

    def epoch_batches(self, global_batch: int, seed: int, epoch: int) -> np.ndarray:
        """``[steps, global_batch]`` example indices of every batch of ``epoch``."""
        ...


@runtime_checkable
class StreamedDataset(Dataset, Protocol):
    """A :class:`Dataset` that prepares training batches ahead, in other processes.

    The trainer hands it every ``take`` request of a run up front (``requests[i]`` is the
    ``(indices, epoch)`` of call ``i``: :class:`xlafit.data.loader.TakeRequests`, random
    access and picklable), and it yields ``take(*requests[i])`` in order. Images do this:
    Grain worker processes decode and augment while the devices train
    (:class:`xlafit.data.images.ImageDataset`).
    """

    def stream(self, requests: Sequence[tuple[np.ndarray, int]]) -> Iterator[Batch]:
        """``take(indices, epoch)`` of each request, in order."""
        ...


def num_shapes(dataset: Dataset | None) -> int:
    """The input shapes ``dataset``'s batches take: its own count if it plans batches, else 1."""
    return dataset.num_shapes if isinstance(dataset, PlannedDataset) else 1


class ArrayDataset:
    """Examples held as NumPy arrays that share their leading (example) axis.

    Example:
        >>> ds = ArrayDataset({"x": np.zeros((10, 3)), "y": np.arange(10)})
        >>> len(ds), ds.take(np.array([2, 5]))["y"].tolist()
        (10, [2, 5])
    """

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        if not arrays:
            raise DataError("a dataset needs at least one array.")
        lengths = {name: len(a) for name, a in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"every array of a dataset must have the same number of examples, got {lengths}.")
        self.arrays = {name: np.asarray(a) for name, a in arrays.items()}
        for name, a in self.arrays.items():
            _check_numeric(name, a)
        self._len = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._len

    def take(self, indices: np.ndarray, epoch: int = 0) -> Batch:
        """The examples at ``indices``; arrays are the same every epoch."""
        return {name: a[indices] for name, a in self.arrays.items()}


def _check_numeric(name: str, a: np.ndarray) -> None:
    """Refuses an array the devices cannot take: strings, Python objects."""
    if a.dtype.kind in "USO":  # text, bytes, Python objects (bfloat16 and the like are kind "V": kept)
        raise DataError(
            f"the data's {name!r} holds {a.dtype} values ({'Python objects' if a.dtype.kind == 'O' else 'text'}): "
            "the devices take numbers only; encode it (token ids, class indices) or leave it out of the data."
        )


def checked_batch(batch: object, rows: int) -> Batch:
    """What a :class:`Dataset`'s ``take`` returned, refused unless it is a dict of numeric
    arrays with one row per index asked (``rows``): a list, or a batch of other rows, failed
    later inside the step, far from the dataset that made it."""
    if not isinstance(batch, Mapping):
        raise DataError(
            f"Dataset.take returned a {type(batch).__name__}; it must return a dict of arrays (name -> array with "
            "one row per index)."
        )
    for name, x in batch.items():
        shape = getattr(x, "shape", None)
        if not shape or shape[0] != rows:
            got = f"shape {tuple(shape)}" if shape is not None else f"a {type(x).__name__}"
            raise DataError(
                f"Dataset.take returned {name!r} as {got} for {rows} indices; it must return one row per index."
            )
        _check_numeric(name, x if hasattr(x, "dtype") else np.asarray(x))
    return dict(batch)


def as_dataset(data: Dataset | Mapping[str, np.ndarray]) -> Dataset:
    """``data`` itself when it is a :class:`Dataset`, a dict of arrays wrapped in :class:`ArrayDataset`.

    Example:
        >>> len(as_dataset({"x": np.zeros(4)}))
        4
        >>> as_dataset([1, 2])
        Traceback (most recent call last):
        ...
        xlafit.errors.DataError: training or evaluation data must be a dict of NumPy arrays ...
    """
    if isinstance(data, Dataset):
        return data
    if isinstance(data, Mapping):
        return ArrayDataset(data)
    raise DataError(
        f"training or evaluation data must be a dict of NumPy arrays with one row per example "
        f"(e.g. {{'image': images, 'label': labels}}) or a Dataset (len() and take(indices, epoch)), "
        f"got a {type(data).__name__}."
    )
