import re

import numpy as np
import pytest

from xlafit.data import mnist


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_idx_round_trip(tmp_path, suffix, dtype):
    array = (np.arange(2 * 3 * 4) - 5).astype(dtype).reshape(2, 3, 4)
    if dtype == np.uint8:
        array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / f"a-idx3-ubyte{suffix}"
    mnist.write_idx(path, array)
    back = mnist.read_idx(path)
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_idx_header_is_the_standard_one(tmp_path):
    path = tmp_path / "labels-idx1-ubyte"
    mnist.write_idx(path, np.array([7, 2, 1], dtype=np.uint8))
    assert path.read_bytes() == b"\x00\x00\x08\x01\x00\x00\x00\x03\x07\x02\x01"


def test_truncated_idx_is_named(tmp_path):
    path = tmp_path / "t-idx3-ubyte"
    mnist.write_idx(path, np.zeros((4, 28, 28), np.uint8))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(mnist.DataError, match=rf"{path}.*record 3 of 4 is the first incomplete one.*truncated"):
        mnist.read_idx(path)


def test_not_idx(tmp_path):
    path = tmp_path / "x-idx1-ubyte"
    path.write_bytes(b"hello world")
    with pytest.raises(mnist.DataError, match="not an IDX file"):
        mnist.read_idx(path)


def test_wrong_magic_is_named_not_called_truncated(tmp_path):
    """Issue 21: 1,000 labels behind an images' magic number (00 00 08 03) were read as shape
    (1000, 0, 0) and reported "truncated"; the bytes are all there, the magic number is wrong."""
    mnist.write_idx(tmp_path / "ok-idx1-ubyte", np.zeros(1000, np.uint8))
    raw = (tmp_path / "ok-idx1-ubyte").read_bytes()
    wrong = b"\x00\x00\x08\x03" + raw[4:]
    for name, why in [
        ("train-labels-idx1-ubyte", r"\(3 dimensions, but its name says idx1\)"),
        ("labels.bin", r"\(so shape \(1000, 0, 0\), 0 bytes, yet 992 follow\)"),
    ]:
        (tmp_path / name).write_bytes(wrong)
        message = re.escape(f"{tmp_path / name} is not an IDX file: it starts with 00 00 08 03 ") + why
        with pytest.raises(mnist.DataError, match=message) as e:
            mnist.read_idx(tmp_path / name)
        assert "00 00 08 01 labels" in str(e.value) and "truncated" not in str(e.value)


def _write_mnist_dir(root, n_train=20, n_test=10):
    rng = np.random.default_rng(0)
    for (images, labels), n in zip(mnist.IDX_FILES.values(), (n_train, n_test), strict=True):
        mnist.write_idx(root / (images + ".gz"), rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        mnist.write_idx(root / labels, rng.integers(0, 10, n).astype(np.uint8))


def test_load_idx_dir(tmp_path):
    _write_mnist_dir(tmp_path)
    splits = mnist.load_idx_dir(tmp_path)
    assert splits["train"]["image"].shape == (20, 28, 28, 1)
    assert splits["test"]["label"].shape == (10,)
    raw = mnist.read_idx(tmp_path / "train-images-idx3-ubyte.gz")
    np.testing.assert_allclose(splits["train"]["image"][..., 0], (raw / 255.0 - mnist.MEAN) / mnist.STD, rtol=1e-6)


def test_bad_label_names_the_file_and_record(tmp_path):
    _write_mnist_dir(tmp_path)
    labels = mnist.read_idx(tmp_path / "train-labels-idx1-ubyte")
    labels[7] = 200
    mnist.write_idx(tmp_path / "train-labels-idx1-ubyte", labels)
    with pytest.raises(mnist.DataError, match=r"train-labels-idx1-ubyte: record 7 has label 200, outside 0-9"):
        mnist.load_idx_dir(tmp_path)


def test_missing_idx_file_names_the_fix(tmp_path):
    _write_mnist_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(mnist.DataError, match="no t10k-labels-idx1-ubyte.*Omit --data-dir"):
        mnist.load_idx_dir(tmp_path)


def test_corrupt_gzip(tmp_path):
    _write_mnist_dir(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(mnist.DataError, match="gzip data is corrupt"):
        mnist.load_idx_dir(tmp_path)


def test_embedded_split():
    splits = mnist.load_embedded()
    train, test = splits["train"], splits["test"]
    assert train["image"].shape == (4000, 28, 28, 1) and test["image"].shape == (1000, 28, 28, 1)
    assert np.bincount(train["label"]).tolist() == [400] * 10
    assert np.bincount(test["label"]).tolist() == [100] * 10
    # Deterministic: the same split every time, and no image in both.
    again = mnist.load_embedded()
    np.testing.assert_array_equal(again["test"]["image"], test["image"])
    train_rows = {row.tobytes() for row in train["image"]}
    assert sum(row.tobytes() in train_rows for row in test["image"]) < 5  # MNIST has a few duplicates
