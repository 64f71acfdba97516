"""Data: the Dataset protocol, per-process batching, device prefetch, and readers."""

from xlafit.data.dataset import ArrayDataset, Dataset, PlannedDataset, StreamedDataset, as_dataset
from xlafit.data.loader import Prefetcher, TakeRequests, TrainOrder, eval_batches, to_global
from xlafit.errors import DataError

__all__ = [
    "ArrayDataset",
    "DataError",
    "Dataset",
    "PlannedDataset",
    "Prefetcher",
    "StreamedDataset",
    "TakeRequests",
    "TrainOrder",
    "as_dataset",
    "eval_batches",
    "to_global",
]
