"""BERT's masking, drawn per batch from a counter-based hash.

:func:`mask_batch` picks 15% of the real tokens (at most ``max_predictions``), of which 80%
become ``[MASK]``, 10% a random token and 10% stay, optionally whole words at a time. The
masks are a pure function of ``(seed, epoch, example index)`` through :func:`hash_uniform`,
so every epoch has new masks, a resumed run sees the same ones, and the device count does
not change them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xlafit.data.dataset import Batch
from xlafit.data.hashing import hash_uniform
from xlafit.data.tokenizer import CLS, MASK, PAD, SEP, SPECIAL_TOKENS


@dataclasses.dataclass(frozen=True)
class MaskingConfig:
    """BERT's masking: ``mask_prob`` of the real tokens, at most ``max_predictions``."""

    mask_prob: float = 0.15
    max_predictions: int = 20
    whole_word: bool = False
    seed: int = 0


def mask_batch(
    ids: np.ndarray,
    types: np.ndarray,
    lengths: np.ndarray,
    examples: np.ndarray,
    epoch: int,
    cfg: MaskingConfig,
    vocab_size: int,
    continuation: np.ndarray | None = None,
) -> Batch:
    """Masks a batch of sequences; vectorised over the batch (no Python loop per row).

    Args:
        ids: token ids ``[B, T]``, right-padded.
        types: token type ids ``[B, T]``.
        lengths: real tokens per row ``[B]``.
        examples: each row's index in the dataset ``[B]``: with ``epoch`` and the seed it
            decides the row's mask.
        continuation: ``[vocab]`` bool, True for ``##`` pieces (whole-word masking).

    Returns:
        ``input_ids`` (masked), ``attention_mask``, ``token_type_ids``, and per row
        ``masked_positions``, ``masked_ids`` (the original tokens) and ``masked_weights``
        (1.0 for a prediction, 0.0 for padding), each ``[B, max_predictions]``.

    Example:
        >>> ids = np.array([[CLS, 7, 8, 9, SEP, PAD]])
        >>> batch = mask_batch(ids, np.zeros_like(ids), np.array([5]), np.array([0]), 0, MaskingConfig(), 100)
        >>> batch["masked_weights"].shape, int(batch["masked_weights"].sum())
        ((1, 20), 1)
    """
    b, t = ids.shape
    p = cfg.max_predictions
    pos = np.arange(t)[None, :]
    real = pos < lengths[:, None]
    candidate = real & (ids != CLS) & (ids != SEP) & (ids != PAD)
    budget = np.minimum(p, np.maximum(1, np.rint(candidate.sum(1) * cfg.mask_prob))).astype(np.int64)
    budget = np.where(candidate.any(1), budget, 0)
    ex = examples[:, None].astype(np.uint64)
    if cfg.whole_word and continuation is not None:
        starts = candidate & ~continuation[ids]
        word = np.cumsum(starts, axis=1)  # pieces share their word's number
    else:
        word = np.broadcast_to(pos, (b, t))
    score = np.where(candidate, hash_uniform(cfg.seed, epoch, ex, word, 0), 2.0)
    order = np.argsort(score, axis=1, kind="stable")  # a word's pieces are adjacent in it
    word_sorted = np.take_along_axis(word, order, 1)
    cand_sorted = np.take_along_axis(candidate, order, 1)
    count = np.arange(1, t + 1)[None, :]
    is_end = np.ones((b, t), bool)
    is_end[:, :-1] = word_sorted[:, 1:] != word_sorted[:, :-1]
    # tokens taken once this token's whole word is in: the count at the word's last piece
    at_end = np.minimum.accumulate(np.where(is_end, count, t + 1)[:, ::-1], axis=1)[:, ::-1]
    chosen_sorted = cand_sorted & (at_end <= budget[:, None])
    chosen_pos = np.sort(np.where(chosen_sorted, order, t), axis=1)[:, :p]  # ascending, t = none
    if chosen_pos.shape[1] < p:
        chosen_pos = np.pad(chosen_pos, ((0, 0), (0, p - chosen_pos.shape[1])), constant_values=t)
    weights = (chosen_pos < t).astype(np.float32)
    positions = np.where(chosen_pos < t, chosen_pos, 0).astype(np.int32)
    originals = np.take_along_axis(ids, positions, 1) * (weights > 0)

    # 80% [MASK], 10% a random non-special token, 10% unchanged
    action = hash_uniform(cfg.seed, epoch, ex, positions, 1)
    n_special = len(SPECIAL_TOKENS)
    random_ids = n_special + hash_uniform(cfg.seed, epoch, ex, positions, 2) * (vocab_size - n_special)
    replacement = np.where(action < 0.8, MASK, np.where(action < 0.9, random_ids.astype(np.int64), originals))
    masked = ids.copy()
    rows = np.broadcast_to(np.arange(b)[:, None], positions.shape)
    sel = weights > 0
    masked[rows[sel], positions[sel]] = replacement[sel]
    return {
        "input_ids": masked.astype(np.int32),
        "attention_mask": real.astype(np.int32),
        "token_type_ids": types.astype(np.int32),
        "masked_positions": positions,
        "masked_ids": originals.astype(np.int32),
        "masked_weights": weights,
    }
