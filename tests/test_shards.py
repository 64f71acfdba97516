"""Reading prepared data back (xlafit.data.shards): every failure is a DataError that names
the file and says to prepare the data again, for the MLM and the image formats alike."""

import hashlib

import pytest

from xlafit.data import images, mlm
from xlafit.data.shards import read_shard
from xlafit.errors import DataError

READERS = [(mlm.read_manifest, "xlafit data mlm --out"), (images.read_manifest, "xlafit data images --input DIR")]


@pytest.mark.parametrize(("read", "command"), READERS)
@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "has no manifest.json; prepare the data with"),
        ('{"format": ', r"manifest.json is damaged \(Expecting value"),
        ("[1, 2]", "is not an xlafit (MLM|image) manifest"),
        ('{"format": "xlafit-mlm-v1"}', "is not an xlafit image manifest|lacks seq_len, splits, tokenizer"),
    ],
)
def test_a_missing_or_damaged_manifest_is_named_with_the_command_that_prepares_it(tmp_path, read, command, text, says):
    """mlm.read_manifest raised json's JSONDecodeError or a KeyError later for these."""
    if text is not None:
        (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(DataError, match=says) as e:
        read(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "prepare the data" in str(e.value)
    if text is None or "Expecting" in says:
        assert command in str(e.value)


def test_a_shard_that_is_missing_changed_or_not_parquet_is_named(tmp_path):
    import fsspec

    fs = fsspec.filesystem("file")
    (tmp_path / "train-00000.parquet").write_bytes(b"not parquet")
    digest = hashlib.sha256(b"not parquet").hexdigest()
    with pytest.raises(DataError, match="train-00000.parquet cannot be read"):
        read_shard(fs, str(tmp_path), {"path": "train-00000.parquet", "sha256": digest, "rows": 1}, "MLM", "rows")
    with pytest.raises(DataError, match="train-00000.parquet is damaged or was changed"):
        read_shard(fs, str(tmp_path), {"path": "train-00000.parquet", "sha256": "0" * 64, "rows": 1}, "MLM", "rows")
    with pytest.raises(DataError, match="train-00001.parquet listed in the manifest is missing"):
        read_shard(fs, str(tmp_path), {"path": "train-00001.parquet", "rows": 1}, "MLM", "rows")
