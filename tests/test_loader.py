import numpy as np
import pytest

from xlafit.data import ArrayDataset, TrainOrder, eval_batches


def test_each_epoch_is_a_new_permutation():
    order = TrainOrder(num_examples=40, global_batch=8, seed=3)
    assert order.steps_per_epoch == 5
    epochs = [np.concatenate([order.global_indices(e * 5 + b) for b in range(5)]) for e in range(3)]
    for seen in epochs:
        assert sorted(seen.tolist()) == list(range(40))
    assert not np.array_equal(epochs[0], epochs[1])
    # A pure function of (seed, step): asking again gives the same batch.
    np.testing.assert_array_equal(order.global_indices(7), TrainOrder(40, 8, 3).global_indices(7))
    assert not np.array_equal(order.global_indices(7), TrainOrder(40, 8, 4).global_indices(7))


def test_process_slices_tile_the_global_batch():
    order = TrainOrder(num_examples=100, global_batch=16, seed=0)
    for step in (0, 5, 17):
        parts = [order.local_indices(step, p, 4) for p in range(4)]
        np.testing.assert_array_equal(np.concatenate(parts), order.global_indices(step))


def test_partial_last_batch_is_dropped_in_training_only():
    order = TrainOrder(num_examples=50, global_batch=16, seed=0)
    assert order.steps_per_epoch == 3
    ds = ArrayDataset({"x": np.arange(50)})
    seen = []
    for batch, mask in eval_batches(ds, 16):
        assert batch["x"].shape == (16,)
        seen.extend(batch["x"][mask > 0].tolist())
    assert seen == list(range(50))


def test_eval_across_processes_counts_each_example_once():
    ds = ArrayDataset({"x": np.arange(37)})
    seen = []
    for p in range(2):
        for batch, mask in eval_batches(ds, 8, process_index=p, process_count=2):
            assert batch["x"].shape == (4,)
            seen.extend(batch["x"][mask > 0].tolist())
    assert sorted(seen) == list(range(37))


def test_dataset_smaller_than_a_batch():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TrainOrder(num_examples=10, global_batch=16, seed=0)


def test_mismatched_arrays():
    with pytest.raises(ValueError, match="same number of examples"):
        ArrayDataset({"x": np.zeros(3), "y": np.zeros(4)})


def test_prefetcher_keeps_order_and_reraises():
    from xlafit.data import Prefetcher

    def items():
        yield from range(5)
        raise OSError("disk gone")

    prefetched = Prefetcher(items(), size=2)
    assert [next(prefetched) for _ in range(5)] == list(range(5))
    with pytest.raises(OSError, match="disk gone"):
        next(prefetched)
    prefetched.close()


def test_text_or_objects_in_the_data_are_refused_by_name():
    """A string array (even one the loss never reads) failed inside JAX ("Dtype <U1 is not a
    valid JAX array type"), far from the data."""
    from xlafit.errors import DataError

    with pytest.raises(DataError, match=r"the data's 'note' holds <U1 values \(text\): the devices take numbers"):
        ArrayDataset({"x": np.zeros((4, 2)), "note": np.array(["a"] * 4)})
    with pytest.raises(DataError, match=r"'meta' holds object values \(Python objects\)"):
        ArrayDataset({"x": np.zeros((2, 2)), "meta": np.array([{}, {}], dtype=object)})


def test_what_a_datasets_take_returns_is_checked():
    """A Dataset whose take() returned a list, or 5 rows for 32 indices, trained on without a
    word or failed in the step with "'list' object has no attribute 'items'"."""
    from xlafit.data.dataset import checked_batch
    from xlafit.errors import DataError

    class FewRows:
        def __len__(self):
            return 64

        def take(self, indices, epoch=0):
            return {"x": np.zeros((5, 2), np.float32)}

    with pytest.raises(DataError, match=r"returned 'x' as shape \(5, 2\) for 8 indices; it must return one row"):
        list(eval_batches(FewRows(), 8))
    with pytest.raises(DataError, match=r"Dataset.take returned a list; it must return a dict of arrays"):
        checked_batch([np.zeros(3)], 3)
    assert checked_batch({"x": np.zeros((3, 2))}, 3)["x"].shape == (3, 2)
