"""Data: in-memory datasets, per-process batching, device prefetch, and MNIST readers."""

from xlafit.data.loader import ArrayDataset, Prefetcher, TrainOrder, eval_batches, to_global

__all__ = ["ArrayDataset", "Prefetcher", "TrainOrder", "eval_batches", "to_global"]
