"""Images for the trainer: batches decoded and augmented by Grain worker processes.

:class:`ImageDataset` is a :class:`~xlafit.data.dataset.StreamedDataset`. The trainer hands
it the whole run's requests (``(indices, epoch)`` per train-step call, a pure function of
``(seed, step)``: :class:`~xlafit.data.loader.TakeRequests`), and a Grain pipeline turns
them into batches::

    grain.MapDataset.source(requests)     # request i: the examples of call i and their epoch
        .map(decode_batch)                # Pillow/libjpeg-turbo decode + crop + flip, per example
        .to_iter_dataset(...)
        .mp_prefetch(num_workers=W)       # worker w prepares calls w, w + W, ...; Grain interleaves them in order

Each batch is a pure function of its request, so any worker count (and ``take`` in the
main process, used for evaluation and with ``workers=0``) gives the same bytes, and a
resumed run, whose requests start at its step, continues the same sequence. Images leave
the workers as ``uint8``: a quarter of float32's bytes through the pipe and onto the
device, where the recipe normalises them.

A damaged image is named by file: ``on_corrupt="skip"`` takes the next example in its
place (deterministic, so worker counts still agree) and counts it in :attr:`skipped`;
``"stop"`` raises a :class:`DataError`. In evaluation (``Augment(train=False)``) the
stand-in is masked out instead of counted twice: evaluation batches carry ``valid``
(float32, 0.0 for a stand-in), which :func:`~xlafit.data.loader.eval_batches` folds into its
mask. A worker never dies of it: every exception of a
batch comes back to the main process as that batch's result and is raised there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from xlafit.data.dataset import Batch
from xlafit.data.hashing import hash_uniform
from xlafit.data.images.cache import ImageSplit, load_split
from xlafit.data.images.transforms import Augment
from xlafit.errors import DataError

log = logging.getLogger("xlafit")

OnCorrupt = Literal["skip", "stop"]
_MAX_SUBSTITUTES = 64  # consecutive unreadable images before a "skip" run gives up


class ImageDataset:
    """Encoded images + labels, decoded and augmented per ``(seed, epoch, index)``.

    Args:
        split: the encoded images (:func:`xlafit.data.images.load_split`).
        augment: what each image becomes (train or eval transform, size, seed).
        workers: Grain worker processes for training batches (0: decode in the trainer's
            prefetch thread).
        on_corrupt: ``skip`` (the next example instead, counted) or ``stop``.
        buffer: batches each worker prepares ahead.
        classes: the class names, label 0 first.

    Example:
        >>> train = ImageDataset.from_prepared("data/images", "train", Augment(224), workers=8)  # doctest: +SKIP
        >>> train.take(np.arange(4), epoch=0)["image"].shape                                      # doctest: +SKIP
        (4, 224, 224, 3)
    """

    def __init__(
        self,
        split: ImageSplit,
        augment: Augment,
        *,
        workers: int = 0,
        on_corrupt: OnCorrupt = "skip",
        buffer: int = 2,
        classes: Sequence[str] = (),
    ) -> None:
        if workers < 0:
            raise DataError(f"data.workers={workers} must be 0 (decode in the main process) or more.")
        self.split, self.augment, self.workers, self.on_corrupt, self.buffer = (
            split,
            augment,
            workers,
            on_corrupt,
            buffer,
        )
        self.classes = list(classes)  # class names, label 0 first
        self.skipped: dict[str, str] = {}  # file -> why it could not be decoded (main process)

    @classmethod
    def from_prepared(cls, url: str, split: str, augment: Augment, **kwargs) -> ImageDataset:
        """The ``split`` of data ``xlafit data images`` wrote at ``url`` (checksums checked once)."""
        images, manifest = load_split(url, split)
        return cls(images, augment, classes=manifest["classes"], **kwargs)

    def __len__(self) -> int:
        return len(self.split)

    def take(self, indices: np.ndarray, epoch: int = 0) -> Batch:
        """``{"image": uint8 [n, S, S, C], "label": int32 [n]}``, decoded in this process
        (and ``"valid"``, float32 [n], in evaluation: see the module docstring)."""
        batch = _decode_batch(self.split, self.augment, self.on_corrupt, indices, epoch)
        return self._unwrap(batch)

    def stream(self, requests: Sequence[tuple[np.ndarray, int]]) -> Iterator[Batch]:
        """``take(*requests[i])`` for each ``i``, prepared ahead by :attr:`workers` Grain processes."""
        if self.workers == 0:
            for indices, epoch in requests:
                yield self.take(indices, epoch)
            return
        import grain
        from absl import flags

        if not flags.FLAGS.is_parsed():  # Grain reads absl flags; a program without absl.app never parses them
            flags.FLAGS.mark_as_parsed()
        ds = grain.MapDataset.source(requests).map(_DecodeRequest(self.split, self.augment, self.on_corrupt))
        # One thread per worker: the processes are the unit of parallelism (and of the
        # images/s the pipeline reaches); a shallow buffer bounds memory.
        read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=1)
        options = grain.MultiprocessingOptions(num_workers=self.workers, per_worker_buffer_size=self.buffer)
        prefetch = ds.to_iter_dataset(read).mp_prefetch(options, worker_init_fn=_ExitWithParent(os.getpid()))
        iterator = iter(prefetch)
        try:
            for batch in iterator:
                yield {name: _out_of_shared_memory(x) for name, x in self._unwrap(batch).items()}
        finally:
            iterator.close()  # stops the worker processes now, not at GC

    def _unwrap(self, batch: dict) -> Batch:
        if "error" in batch:
            raise DataError(batch["error"])
        for name, why in batch.pop("skipped"):
            if name not in self.skipped:
                self.skipped[name] = why
                log.warning(
                    "skipping %s: it cannot be decoded (%s); the next example takes its place (%d image(s) skipped)",
                    name,
                    why,
                    len(self.skipped),
                )
        return batch


@dataclasses.dataclass(frozen=True)
class _ExitWithParent:
    """Grain's ``worker_init_fn`` (a class, so it pickles into spawned workers): the worker
    ends when the training process is gone.

    Grain's workers outlive a parent killed with ``kill -9`` (preemption, the OOM killer, a
    scheduler): on this machine killed runs left idle workers holding 3 GB. A daemon thread
    in each worker polls the parent's pid once a second.
    """

    parent: int

    def __call__(self, worker_index: int, worker_count: int) -> None:
        def watch() -> None:
            while os.getppid() == self.parent:
                time.sleep(1.0)
            os._exit(0)  # note: nothing to clean up; the process that would read our output is gone

        threading.Thread(target=watch, name="xlafit-exit-with-parent", daemon=True).start()


def _out_of_shared_memory(x: Any) -> Any:
    """A copy of an array Grain passed through shared memory, whose segment is unlinked now.

    Grain unlinks a segment when its array is collected, in a background thread: the device
    transfer may alias host memory on CPU, and segments still queued when the process exits
    are reported as leaked. A copy costs ~5 ms for 256 ImageNet images.
    """
    if not isinstance(x, np.ndarray):
        return x
    copy = np.array(x)
    shm = getattr(x, "shm", None)
    if shm is not None and getattr(x, "_unlink_on_del", False):
        shm.unlink()  # the name goes now; the mapping lives until the array is collected
        x._unlink_on_del = False  # type: ignore[attr-defined]  # Grain's flag: do not unlink again
    return copy


class _DecodeRequest:
    """Grain's map function: one request -> one batch (run in a worker process)."""

    def __init__(self, split: ImageSplit, augment: Augment, on_corrupt: OnCorrupt) -> None:
        self.split, self.augment, self.on_corrupt = split, augment, on_corrupt

    def __call__(self, request: tuple[np.ndarray, int]) -> dict:
        indices, epoch = request
        try:
            return _decode_batch(self.split, self.augment, self.on_corrupt, indices, epoch)
        except Exception as e:  # the batch's result: raised in the main process, naming the cause
            message = str(e) if isinstance(e, DataError) else f"decoding a batch failed: {type(e).__name__}: {e}"
            return {"error": message}


def _decode_batch(split: ImageSplit, augment: Augment, on_corrupt: OnCorrupt, indices: np.ndarray, epoch: int) -> dict:
    size, channels = augment.image_size, augment.channels
    images = np.empty((len(indices), size, size, channels), np.uint8)
    labels = np.empty(len(indices), np.int32)
    valid = np.ones(len(indices), np.float32)
    skipped: list[tuple[str, str]] = []
    for row, index in enumerate(np.asarray(indices).tolist()):
        source = index
        for _ in range(_MAX_SUBSTITUTES):
            try:
                images[row] = augment(split.encoded(source), epoch, source)
                break
            except Exception as e:  # Pillow and simplejpeg raise many types for damaged data
                why = f"{type(e).__name__}: {e}"
                if on_corrupt == "stop":
                    raise DataError(
                        f"image {split.file(source)} (example {source}) cannot be decoded ({why}); prepare the data "
                        "again, or set data.on_corrupt=skip to train on without it."
                    ) from None
                skipped.append((split.file(source), why))
                source = (source + 1) % len(split)
                valid[row] = 0.0
        else:
            raise DataError(
                f"{_MAX_SUBSTITUTES} consecutive images from example {index} cannot be decoded; "
                "the data is damaged: prepare it again (xlafit data images)."
            )
        labels[row] = split.labels[source]
    batch = {"image": images, "label": labels, "skipped": skipped}
    if not augment.train:  # a stand-in is evaluated once already, as itself
        batch["valid"] = valid
    return batch


class SyntheticImages:
    """ImageNet-shaped examples with no decoding: for benchmarks and ``xlafit check --tpu``.

    Example ``i`` is one of 16 fixed random images (drawn from ``seed``) with label
    ``hash(seed, i) % num_classes``: the pipeline costs a copy, so a benchmark measures the
    model.

    Example:
        >>> ds = SyntheticImages(1000, image_size=8)
        >>> batch = ds.take(np.arange(4))
        >>> batch["image"].shape, batch["image"].dtype, len(ds)
        ((4, 8, 8, 3), dtype('uint8'), 1000)
    """

    def __init__(
        self, num_examples: int, image_size: int = 224, channels: int = 3, num_classes: int = 1000, seed: int = 0
    ):
        self.num_examples, self.num_classes, self.seed = num_examples, num_classes, seed
        rng = np.random.default_rng(seed)
        self.bank = rng.integers(0, 256, (16, image_size, image_size, channels), dtype=np.uint8)

    def __len__(self) -> int:
        return self.num_examples

    def take(self, indices: np.ndarray, epoch: int = 0) -> Batch:
        indices = np.asarray(indices)
        labels = (hash_uniform(self.seed, indices) * self.num_classes).astype(np.int32)
        return {"image": self.bank[indices % len(self.bank)], "label": labels}
