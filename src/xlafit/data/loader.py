"""Fixed-shape batches for every process, and their transfer to the devices ahead of time.

Data order is a pure function of ``(seed, step)``: epoch ``e`` visits the examples in the
order of a NumPy permutation drawn from ``(seed, e)``, and the
global batch of step ``s`` is a fixed slice of that order. Each process reads only its own
``global_batch / process_count`` rows of each global batch, and the global ``jax.Array``
is assembled from the process-local pieces with ``jax.make_array_from_process_local_data``.
Resuming at step ``s`` therefore replays nothing and skips nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np

from xlafit.data.dataset import Batch, Dataset, PlannedDataset, StreamedDataset, checked_batch
from xlafit.parallel.mesh import Strategy


@dataclasses.dataclass(frozen=True)
class TrainOrder:
    """Which examples form the global batch of each step.

    Args:
        num_examples: size of the training set.
        global_batch: examples per optimizer step, over all processes.
        seed: shuffle seed.
    """

    num_examples: int
    global_batch: int
    seed: int
    # A dataset's own batch plan, ``plan(epoch) -> [steps, global_batch]`` indices (length
    # buckets: :class:`xlafit.data.shapes.BucketedDataset`); default: a permutation per epoch.
    plan: Callable[[int], np.ndarray] | None = None

    @classmethod
    def for_dataset(cls, dataset: Dataset, global_batch: int, seed: int) -> TrainOrder:
        """The dataset's own plan when it is a :class:`PlannedDataset`, else a permutation per epoch."""
        plan = None
        if isinstance(dataset, PlannedDataset):
            plan = functools.partial(dataset.epoch_batches, global_batch, seed)
        return cls(len(dataset), global_batch, seed, plan)

    def __post_init__(self) -> None:
        if self.num_examples < self.global_batch:
            raise ValueError(
                f"the training set has {self.num_examples} examples, fewer than one global batch of "
                f"{self.global_batch}; use a smaller global batch (data.global_batch or data.per_device_batch; "
                "Trainer(global_batch=...) or Trainer(per_device_batch=...) in Python)."
            )

    @functools.cached_property
    def steps_per_epoch(self) -> int:
        # The last partial batch of each epoch is dropped (the shuffle differs per epoch,
        # so no example is always left out); evaluation never drops anything.
        if self.plan is not None:
            return len(self.plan(0))
        return self.num_examples // self.global_batch

    def global_indices(self, step: int) -> np.ndarray:
        epoch, within = divmod(step, self.steps_per_epoch)
        if self.plan is not None:
            return self.plan(epoch)[within]
        order = _epoch_order(self.num_examples, self.seed, epoch)
        return order[within * self.global_batch : (within + 1) * self.global_batch]

    def calls(self, start: int, stop: int, steps_per_call: int) -> Iterator[tuple[int, int]]:
        """``(first_step, k)`` of each train-step call for steps ``[start, stop)``: ``k`` is
        ``steps_per_call``, fewer where an epoch ends (a call never crosses one, so
        evaluation and checkpoints fall between calls) or at ``stop``."""
        step = start
        while step < stop:
            k = min(steps_per_call, self.steps_per_epoch - step % self.steps_per_epoch, stop - step)
            yield step, k
            step += k

    def local_indices(self, step: int, process_index: int, process_count: int) -> np.ndarray:
        rows = self.global_batch // process_count
        return self.global_indices(step)[process_index * rows : (process_index + 1) * rows]


@dataclasses.dataclass(frozen=True)
class TakeRequests(Sequence[tuple[np.ndarray, int]]):
    """What ``take`` is asked for at each train-step call of ``[start, stop)``: ``(indices, epoch)``
    by position, this process's rows only.

    A random-access, picklable sequence: a :class:`~xlafit.data.dataset.StreamedDataset`
    gets it whole and prepares batches ahead in other processes (Grain's workers each
    compute the requests of their own slice), with no message per batch.

    Example:
        >>> order = TrainOrder(num_examples=10, global_batch=4, seed=0)
        >>> requests = TakeRequests.between(order, 0, 3, steps_per_call=1)
        >>> len(requests), requests[2][1], len(requests[2][0])
        (3, 1, 4)
    """

    order: TrainOrder
    calls: np.ndarray  # [n, 2]: (first step, k) of each call
    process_index: int = 0
    process_count: int = 1

    @classmethod
    def between(
        cls,
        order: TrainOrder,
        start: int,
        stop: int,
        steps_per_call: int,
        process_index: int = 0,
        process_count: int = 1,
    ) -> TakeRequests:
        calls = np.array(list(order.calls(start, stop, steps_per_call)), np.int64).reshape(-1, 2)
        return cls(order, calls, process_index, process_count)

    def __len__(self) -> int:
        return len(self.calls)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:  # type: ignore[override]  # no slices
        step, k = (int(v) for v in self.calls[i])
        pi, pc = self.process_index, self.process_count
        # One gather for the k batches (a copy of k x rows examples); the caller views it [k, rows, ...].
        idx = np.concatenate([self.order.local_indices(step + j, pi, pc) for j in range(k)])
        return idx, step // self.order.steps_per_epoch  # a call never crosses an epoch


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    # A permutation per (seed, epoch), drawn whole: ~1 ms for 60,000 examples. (Grain's
    # random-access index shuffle was tried first: 6 us per index from Python, 0.36 s per
    # MNIST epoch, which left an H100 waiting for input most of the time.)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    order.flags.writeable = False
    return order


def eval_batches(
    dataset: Dataset, global_batch: int, process_index: int = 0, process_count: int = 1
) -> Iterator[tuple[Batch, np.ndarray]]:
    """This process's rows of each evaluation batch, in order, with a validity mask.

    The last batch is padded (with copies of example 0) to the full shape so that it does
    not compile a new program, and its padding rows get mask 0: every example counts exactly
    once. A dataset may mark rows it could not produce with a ``"valid"`` column (float32,
    0.0: an image that could not be decoded), which is taken out of the batch and folded into
    the mask.

    Yields:
        ``(batch, mask)``: arrays with ``global_batch / process_count`` rows; ``mask`` is
        float32 1.0 for real examples and 0.0 for padding.
    """
    rows = global_batch // process_count
    n = len(dataset)
    requests, masks = [], []
    for start in range(0, n, global_batch):
        idx = np.arange(start + process_index * rows, start + (process_index + 1) * rows)
        masks.append((idx < n).astype(np.float32))
        requests.append((np.where(idx < n, idx, 0), 0))
    if isinstance(dataset, StreamedDataset):  # prepared ahead in its worker processes
        batches = dataset.stream(requests)
    else:
        batches = (checked_batch(dataset.take(idx), len(idx)) for idx, _ in requests)
    for batch, mask in zip(batches, masks, strict=True):
        valid = batch.pop("valid", None)
        yield batch, mask if valid is None else mask * valid


def to_global(strategy: Strategy, local: Batch | np.ndarray, leading_axes: int = 0):
    """Assembles global arrays from this process's rows, split along ``data``.

    ``leading_axes`` axes come before the example axis (1 for stacked ``steps_per_call``
    batches).
    """
    sharding = strategy.batch_sharding(leading_axes)

    def put(x: np.ndarray) -> jax.Array:
        shape = list(x.shape)
        shape[leading_axes] *= strategy.process_count
        return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

    return jax.tree.map(put, local)


class Prefetcher:
    """Runs an iterator in a background thread, ``size`` items ahead of the consumer.

    Used to gather batches and copy them to the devices while the current step runs (the
    job of PyTorch/XLA's ``ParallelLoader``). ``wait_s`` accumulates the time the consumer
    spent blocked on the next item: the input-wait share of a run.
    """

    _DONE = object()

    def __init__(self, iterator: Iterator, size: int = 2) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max(size, 1))
        self._stop = threading.Event()
        self.wait_s = 0.0
        self._thread = threading.Thread(target=self._run, args=(iterator,), daemon=True, name="xlafit-prefetch")
        self._thread.start()

    def _run(self, iterator: Iterator) -> None:
        try:
            for item in iterator:
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(self._DONE)
        except BaseException as e:  # surfaced in the consumer thread
            self._queue.put(e)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        t0 = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - t0
        if item is self._DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.1)
