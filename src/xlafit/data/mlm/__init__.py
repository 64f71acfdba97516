"""Masked-LM data: fixed-length sequences on disk, masks drawn on the fly.

- :mod:`~xlafit.data.mlm.preparation`: text -> Parquet shards + ``manifest.json``
  (:func:`prepare`, :func:`read_manifest`);
- :mod:`~xlafit.data.mlm.cache`: a prepared split -> arrays, memory-mapped from the user
  cache (:func:`load_split`);
- :mod:`~xlafit.data.mlm.masking`: BERT's masking as a pure function of
  ``(seed, epoch, example index)`` (:func:`mask_batch`, :class:`MaskingConfig`);
- :mod:`~xlafit.data.mlm.dataset`: :class:`MLMDataset`, what the trainer takes batches from.

Example:
    >>> prepare("tok/", ["corpus.txt"], "data/mlm", seq_len=128)  # doctest: +SKIP
    >>> train = MLMDataset.from_prepared("data/mlm", "train")      # doctest: +SKIP
"""

from xlafit.data.mlm.cache import load_split
from xlafit.data.mlm.dataset import MLMDataset
from xlafit.data.mlm.masking import MaskingConfig, hash_uniform, mask_batch
from xlafit.data.mlm.preparation import FORMAT, MANIFEST, Packing, prepare, read_manifest
from xlafit.data.tokenizer import CLS, MASK, PAD, SEP, UNK

__all__ = [
    "CLS",
    "FORMAT",
    "MANIFEST",
    "MASK",
    "PAD",
    "SEP",
    "UNK",
    "MLMDataset",
    "MaskingConfig",
    "Packing",
    "hash_uniform",
    "load_split",
    "mask_batch",
    "prepare",
    "read_manifest",
]
