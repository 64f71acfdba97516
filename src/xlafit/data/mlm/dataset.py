"""The masked-LM dataset: prepared sequences whose batches come masked."""

from __future__ import annotations

import numpy as np

from xlafit.data.dataset import Batch
from xlafit.data.mlm.cache import load_split
from xlafit.data.mlm.masking import MaskingConfig, mask_batch
from xlafit.data.mlm.preparation import tokenizer_sha256
from xlafit.errors import DataError
from xlafit.io.paths import filesystem

_BERT_MASKING = MaskingConfig()  # frozen: one instance serves as every default


class MLMDataset:
    """Fixed-length sequences whose batches come masked (see :func:`mask_batch`).

    Works with :class:`xlafit.Trainer` like an :class:`~xlafit.data.ArrayDataset`: the
    trainer calls ``take(indices, epoch)``.

    Example:
        >>> train = MLMDataset.from_prepared("data/mlm", "train")  # doctest: +SKIP
        >>> batch = train.take(np.arange(8), epoch=0)                 # doctest: +SKIP
    """

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        vocab_size: int,
        masking: MaskingConfig = _BERT_MASKING,
        continuation: np.ndarray | None = None,
    ) -> None:
        self.arrays = arrays
        self.vocab_size = vocab_size
        self.masking = masking
        self.continuation = continuation
        self.seq_len = arrays["input_ids"].shape[1]
        self.location: str | None = None  # the prepared directory or URL, when loaded from one
        self.packing: str | None = None  # how `xlafit data mlm` packed it (sentences, pairs), when prepared
        if masking.whole_word and continuation is None:
            raise ValueError("whole-word masking needs the tokenizer's continuation table.")

    @classmethod
    def from_prepared(cls, url: str, split: str, masking: MaskingConfig = _BERT_MASKING) -> MLMDataset:
        """Loads one split written by :func:`~xlafit.data.mlm.preparation.prepare` (its tokenizer comes along)."""
        arrays, manifest = load_split(url, split)
        _check_tokenizer(url, manifest)
        fs, root = filesystem(url)
        with fs.open(f"{root.rstrip('/')}/tokenizer/vocab.txt", "r", encoding="utf-8") as f:
            vocab = f.read().splitlines()
        continuation = np.array([token.startswith("##") for token in vocab])
        dataset = cls(arrays, manifest["tokenizer"]["vocab_size"], masking, continuation)
        dataset.location = url
        dataset.packing = manifest.get("packing")
        return dataset

    def __len__(self) -> int:
        return len(self.arrays["length"])

    def take(self, indices: np.ndarray, epoch: int = 0) -> Batch:
        a = self.arrays
        return mask_batch(
            a["input_ids"][indices],
            a["token_type_ids"][indices],
            a["length"][indices],
            np.asarray(indices),
            epoch,
            self.masking,
            self.vocab_size,
            self.continuation,
        )


def _check_tokenizer(url: str, manifest: dict) -> None:
    """Refuses a ``tokenizer/`` other than the one the data was prepared with (the manifest's
    SHA-256): its vocabulary would not match the token ids, and a run would copy it."""
    folder = f"{url.rstrip('/')}/tokenizer"
    expected = manifest["tokenizer"].get("sha256")
    if expected is None:  # data prepared before the manifest recorded it
        return
    try:
        found = tokenizer_sha256(folder)
    except FileNotFoundError:
        raise DataError(f"{folder} has no tokenizer.json; restore it, or prepare the data again.") from None
    if found != expected:
        raise DataError(
            f"{folder} differs from the tokenizer the data was prepared with (sha256 {found[:12]}..., the "
            f"manifest's {expected[:12]}...); restore it, or prepare the data again."
        )
