"""Static shapes without pain: padding, length buckets, sequence packing, a bucket planner.

XLA compiles one program per input shape (rule 3 of the TPU guides): variable-length data
fed as is recompiles at every new length, and padding everything to the longest example
wastes most of the compute. The middle ground is a few fixed shapes:

- :func:`pad_batch` pads to a multiple of k (or a fixed length), with an attention mask;
- :func:`bucket_batches` groups examples by length into a fixed set of boundaries, one
  compiled program per boundary, every batch full-sized (padding rows carry mask 0);
- :func:`pack` puts several sequences into one row (first fit), with segment ids so that
  attention never crosses a segment and positions that restart at every segment;
- :func:`plan_buckets` chooses the boundaries: the exact minimum of padded tokens for a
  length histogram and a compile budget of K shapes (dynamic programming, not a heuristic);
  :func:`compare_plans` sets it beside pad-to-max and pad-to-a-multiple of 32 or 64.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from xlafit.errors import DataError


@overload
def round_up(n: int, k: int) -> int: ...
@overload
def round_up(n: np.ndarray, k: int) -> np.ndarray: ...
def round_up(n: int | np.ndarray, k: int) -> int | np.ndarray:
    """``n`` rounded up to a multiple of ``k``.

    Example:
        >>> round_up(70, 32), round_up(64, 32)
        (96, 64)
    """
    return -(-n // k) * k


def pad_batch(
    sequences: Sequence[Sequence[int]], *, multiple: int | None = None, length: int | None = None, pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Right-pads token sequences into ``input_ids`` and ``attention_mask`` ``[B, T]``.

    ``T`` is ``length`` when given (longer sequences are an error, not silently cut), else
    the longest sequence rounded up to ``multiple``.

    Example:
        >>> pad_batch([[5, 6, 7], [8]], multiple=4)["attention_mask"].tolist()
        [[1, 1, 1, 0], [1, 0, 0, 0]]
    """
    longest = max((len(s) for s in sequences), default=0)
    if length is None:
        length = round_up(max(longest, 1), multiple or 1)
    elif longest > length:
        raise DataError(f"a sequence of {longest} tokens does not fit length {length}; truncate it or pad longer.")
    ids = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def bucket_of(length: int | np.ndarray, boundaries: Sequence[int]) -> int | np.ndarray:
    """The smallest boundary that holds ``length``.

    Raises:
        DataError: ``length`` exceeds the largest boundary.
    """
    b = np.asarray(sorted(boundaries))
    idx = np.searchsorted(b, length, side="left")
    if np.any(idx >= len(b)):
        raise DataError(
            f"length {np.max(length)} exceeds the largest bucket {b[-1]}; add a bucket or truncate the data."
        )
    return b[idx] if np.ndim(length) else int(b[idx])


def bucket_batches(
    sequences: Sequence[Sequence[int]],
    boundaries: Sequence[int],
    batch_size: int,
    *,
    pad_id: int = 0,
    seed: int | None = 0,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches of ``batch_size`` rows, each padded to its bucket's boundary.

    Only ``len(boundaries)`` shapes ever reach the device. A bucket's last batch is
    filled with padding rows whose ``example_mask`` is 0 (nothing dropped, nothing counted
    twice). With ``seed``, examples are shuffled within buckets and the batches of all
    buckets are interleaved at random; None keeps the input order.

    Yields:
        ``input_ids``, ``attention_mask`` ``[batch_size, boundary]`` and ``example_mask``
        ``[batch_size]`` (float32) and ``index`` (each row's example, -1 for padding).
    """
    lengths = np.array([len(s) for s in sequences])
    buckets = bucket_of(lengths, boundaries) if len(lengths) else np.zeros(0, int)
    rng = np.random.default_rng(seed) if seed is not None else None
    plan: list[tuple[int, np.ndarray]] = []
    for boundary in sorted(set(boundaries)):
        members = np.flatnonzero(buckets == boundary)
        if rng is not None:
            members = rng.permutation(members)
        for start in range(0, len(members), batch_size):
            plan.append((boundary, members[start : start + batch_size]))
    if rng is not None:
        plan = [plan[i] for i in rng.permutation(len(plan))]
    for boundary, idx in plan:
        rows = [sequences[i] for i in idx] + [[]] * (batch_size - len(idx))
        batch = pad_batch(rows, length=boundary, pad_id=pad_id)
        batch["example_mask"] = (np.arange(batch_size) < len(idx)).astype(np.float32)
        batch["index"] = np.concatenate([idx, np.full(batch_size - len(idx), -1)]).astype(np.int64)
        yield batch


def pack(sequences: Sequence[Sequence[int]], seq_len: int, *, pad_id: int = 0) -> dict[str, np.ndarray]:
    """First-fit packing of sequences into rows of ``seq_len`` tokens.

    Each sequence goes into the first row with room for it (a new row when none has).
    Feed ``segment_ids`` and ``positions`` to the model (BERT: ``segment_ids=``,
    ``position_ids=``) so attention stays inside each segment and positions restart: a
    packed row then computes what its sequences would compute one by one (tested).

    Returns:
        ``input_ids``, ``segment_ids`` (1, 2, ... per sequence in the row, 0 for padding),
        ``positions`` ``[rows, seq_len]``, and ``placement`` ``[n, 2]``: each input
        sequence's (row, start).

    Raises:
        DataError: a sequence is longer than ``seq_len``.
    """
    free: list[int] = []  # room left per row
    placement = np.zeros((len(sequences), 2), np.int64)
    for i, s in enumerate(sequences):
        if len(s) > seq_len:
            raise DataError(f"sequence {i} has {len(s)} tokens, more than seq_len={seq_len}; split or truncate it.")
        row = next((r for r, room in enumerate(free) if room >= len(s)), None)
        if row is None:
            free.append(seq_len)
            row = len(free) - 1
        placement[i] = row, seq_len - free[row]
        free[row] -= len(s)
    ids = np.full((len(free), seq_len), pad_id, np.int32)
    segments = np.zeros((len(free), seq_len), np.int32)
    positions = np.zeros((len(free), seq_len), np.int32)
    count = np.zeros(len(free), np.int32)
    for s, (row, start) in zip(sequences, placement, strict=True):
        count[row] += 1
        ids[row, start : start + len(s)] = s
        segments[row, start : start + len(s)] = count[row]
        positions[row, start : start + len(s)] = np.arange(len(s))
    return {"input_ids": ids, "segment_ids": segments, "positions": positions, "placement": placement}


# --------------------------------------------------------------------------- planning


def padded_tokens(lengths: np.ndarray, boundaries: Sequence[int]) -> int:
    """Padding positions when every length is padded to its bucket's boundary."""
    lengths = np.asarray(lengths)
    return int(np.sum(bucket_of(lengths, boundaries) - lengths)) if len(lengths) else 0


def plan_buckets(lengths: Sequence[int] | np.ndarray, max_shapes: int, multiple: int = 1) -> list[int]:
    """The at most ``max_shapes`` boundaries that minimise padded tokens, exactly.

    An optimal boundary always sits at some length present in the data (rounded up to
    ``multiple`` when boundaries must be multiples, e.g. 8 for TPU tiles), and the largest
    must hold the longest example; over those candidates a dynamic program finds the
    minimum: ``best[k][j]`` = least padding for the candidates up to ``j`` with ``k``
    buckets, the last ending at ``j``. Cost O(K m^2) for m distinct candidates.

    Example:
        >>> plan_buckets([10, 11, 12, 50, 51], max_shapes=2)
        [12, 51]
    """
    lengths = np.asarray(lengths, np.int64)
    if max_shapes < 1:
        raise ValueError("max_shapes must be at least 1.")
    if len(lengths) == 0:
        return []
    rounded = round_up(lengths, multiple)
    cand, inverse = np.unique(rounded, return_inverse=True)
    m = len(cand)
    counts = np.bincount(inverse, minlength=m).astype(np.int64)
    sums = np.bincount(inverse, weights=lengths, minlength=m)
    c = np.concatenate([[0], np.cumsum(counts)])  # prefix sums: c[j + 1] = examples in candidates 0..j
    s = np.concatenate([[0.0], np.cumsum(sums)])
    k_max = min(max_shapes, m)
    # cost[i, j]: padding when candidates i..j share boundary cand[j] (inf where i > j)
    i, j = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
    cost = np.where(i <= j, cand[j] * (c[j + 1] - c[i]) - (s[j + 1] - s[i]), np.inf)
    best = np.full((k_max + 1, m), np.inf)
    back = np.zeros((k_max + 1, m), np.int64)
    best[1] = cost[0]
    for k in range(2, k_max + 1):
        # the previous bucket ends at p < j; this one covers p + 1 .. j
        total = best[k - 1][:, None] + np.vstack([cost[1:], np.full((1, m), np.inf)])
        back[k] = np.argmin(total, axis=0)
        best[k] = total[back[k], np.arange(m)]
    k = int(np.argmin(best[1:, m - 1])) + 1  # fewer buckets when more cannot help
    bounds: list[int] = []
    last = m - 1  # the candidate where the current bucket ends, walking back
    while k >= 1:
        bounds.append(int(cand[last]))
        last, k = int(back[k, last]), k - 1
    return sorted(bounds)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One way to shape the data: its boundaries and what it costs."""

    name: str
    boundaries: list[int]
    padded_tokens: int
    real_tokens: int

    @property
    def shapes(self) -> int:
        return len(self.boundaries)

    @property
    def waste(self) -> float:
        """Padding as a share of all computed positions."""
        return self.padded_tokens / max(self.padded_tokens + self.real_tokens, 1)


def compare_plans(lengths: Sequence[int] | np.ndarray, max_shapes: int | None = None) -> list[Plan]:
    """Pad-to-max, pad-to-multiple-of-32 and -64, and the planner's buckets.

    The planner gets each multiple's shape count (so it is compared at the same number of
    compiles), and ``max_shapes`` if given.
    """
    lengths = np.asarray(lengths, np.int64)
    real = int(lengths.sum())
    longest = int(lengths.max())
    plans = [Plan("pad to max", [longest], padded_tokens(lengths, [longest]), real)]
    budgets = set() if max_shapes is None else {max_shapes}
    for k in (32, 64):
        bounds = sorted({int(b) for b in np.unique(round_up(lengths, k))})
        plans.append(Plan(f"multiple of {k}", bounds, padded_tokens(lengths, bounds), real))
        budgets.add(len(bounds))
    for budget in sorted(budgets):
        bounds = plan_buckets(lengths, budget)
        plans.append(Plan(f"planned, {budget} shapes", bounds, padded_tokens(lengths, bounds), real))
    return plans


def format_plans(plans: list[Plan]) -> str:
    rows = [f"{'plan':<22} {'shapes':>6} {'padded tokens':>14} {'waste':>7}  boundaries"]
    for p in plans:
        shown = ", ".join(map(str, p.boundaries[:12])) + (" ..." if len(p.boundaries) > 12 else "")
        rows.append(f"{p.name:<22} {p.shapes:>6} {p.padded_tokens:>14,} {p.waste:>7.1%}  {shown}")
    return "\n".join(rows)


class BucketedDataset:
    """Variable-length sequences for :class:`xlafit.Trainer`, served in length buckets.

    Each training batch holds examples of one bucket only (``epoch_batches``: shuffled
    within buckets, then batches in random order, a bucket's incomplete last batch left
    for another epoch's shuffle), padded to that bucket's boundary, so a run compiles one
    program per boundary and no more. Use ``trainer.steps_per_call=1``: stacked batches
    would share the largest of their buckets.

    Args:
        sequences: token id sequences.
        boundaries: bucket lengths, e.g. from :func:`plan_buckets`.
        extra: per-example arrays (labels) served alongside.

    Example:
        >>> ds = BucketedDataset([[5, 6], [7, 8, 9, 10, 11]], boundaries=[4, 8])
        >>> ds.take(np.array([0]))["input_ids"].shape
        (1, 4)
    """

    def __init__(
        self,
        sequences: Sequence[Sequence[int]],
        boundaries: Sequence[int],
        extra: dict[str, np.ndarray] | None = None,
        pad_id: int = 0,
    ) -> None:
        self.boundaries = sorted(set(int(b) for b in boundaries))
        self.lengths = np.array([len(s) for s in sequences], np.int64)
        self.bucket = np.searchsorted(self.boundaries, bucket_of(self.lengths, self.boundaries))
        padded = pad_batch(sequences, length=self.boundaries[-1], pad_id=pad_id)
        self.ids, self.mask = padded["input_ids"], padded["attention_mask"]
        self.extra = {k: np.asarray(v) for k, v in (extra or {}).items()}
        self._plans: dict[tuple[int, int, int], np.ndarray] = {}

    @property
    def num_shapes(self) -> int:
        return len(self.boundaries)

    def __len__(self) -> int:
        return len(self.lengths)

    def epoch_batches(self, global_batch: int, seed: int, epoch: int) -> np.ndarray:
        """``[steps, global_batch]`` example indices of one epoch; the same number of steps
        every epoch (full batches per bucket do not depend on the shuffle)."""
        key = (global_batch, seed, epoch)
        if key not in self._plans:
            rng = np.random.default_rng([seed, epoch])
            batches = []
            for b in range(len(self.boundaries)):
                members = rng.permutation(np.flatnonzero(self.bucket == b))
                full = len(members) // global_batch * global_batch
                batches += list(members[:full].reshape(-1, global_batch))
            if not batches:
                raise DataError(f"no bucket holds a full batch of {global_batch} examples; lower the batch size.")
            if len(self._plans) >= 4:  # the epochs in flight: the prefetcher's and the trainer's
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = np.stack(batches)[rng.permutation(len(batches))]
        return self._plans[key]

    def take(self, indices: np.ndarray, epoch: int = 0) -> dict[str, np.ndarray]:
        width = self.boundaries[int(self.bucket[indices].max())]
        out = {"input_ids": self.ids[indices, :width], "attention_mask": self.mask[indices, :width]}
        out.update({k: v[indices] for k, v in self.extra.items()})
        return out
