"""Reading prepared data back (xlafit.data.shards): every failure is a DataError that names
the file and says to prepare the data again, for the MLM and the image formats alike."""

import hashlib

import pytest

from xlafit.data import images, mlm
from xlafit.data.shards import read_shard
from xlafit.errors import DataError

READERS = [
    (mlm.read_manifest, "xlafit data mlm --tokenizer TOK --input TEXT --out"),
    (images.read_manifest, "xlafit data images --input DIR --out"),
]


@pytest.mark.parametrize(("read", "command"), READERS)
@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "has no manifest.json; prepare the data with"),
        ('{"format": ', r"manifest.json is damaged \(Expecting value"),
        ("[1, 2]", "is not an xlafit (MLM|image) manifest"),
        ('{"format": "xlafit-mlm-v1"}', "holds MLM shards of `xlafit data mlm`, not image data|lacks seq_len, splits"),
    ],
)
def test_a_missing_or_damaged_manifest_is_named_with_the_command_that_prepares_it(tmp_path, read, command, text, says):
    """mlm.read_manifest raised json's JSONDecodeError or a KeyError later for these."""
    if text is not None:
        (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(DataError, match=says) as e:
        read(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "prepare the data" in str(e.value)
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


@pytest.mark.parametrize("marker", ["config.yaml", "checkpoints"])
def test_an_out_that_is_a_run_directory_is_refused(tmp_path, korean_tokenizer, marker):
    """Preparing into a run directory wrote shards among its files and replaced its tokenizer/
    (the run could no longer be exported)."""
    from test_images import write_folder
    from xlafit.data.text import korean_demo_files

    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "vocab.txt").write_text("the run's")
    (run / marker).mkdir() if marker == "checkpoints" else (run / marker).write_text("recipe: bert\n")
    says = rf"--out {run} is a run directory of `xlafit train` \(it holds {marker}\); give a new directory"
    with pytest.raises(DataError, match=says):
        mlm.prepare(korean_tokenizer, korean_demo_files(), str(run), show_progress=False)
    with pytest.raises(DataError, match=says):
        images.prepare(write_folder(tmp_path / "in"), str(run), workers=1)
    assert sorted(p.name for p in run.iterdir()) == sorted([marker, "tokenizer"])
    assert (run / "tokenizer" / "vocab.txt").read_text() == "the run's"


def test_data_of_another_kind_text_files_or_a_file_are_named_with_a_command_that_works(tmp_path, korean_tokenizer):
    """`train bert --data-dir` on image shards, a folder of text or a text file advised
    `xlafit data mlm --out THAT` (refused, or without --tokenizer/--input); `data images --out`
    on MLM shards said it held prepared images."""
    from test_images import write_folder
    from xlafit.data.text import korean_demo_files

    pictures, text = tmp_path / "pictures", tmp_path / "mlm"
    images.prepare(write_folder(tmp_path / "in", classes=("cat", "dog"), per_class=2), str(pictures), workers=1)
    mlm.prepare(korean_tokenizer, korean_demo_files(), str(text), seq_len=32, show_progress=False)
    with pytest.raises(DataError, match=rf"{pictures} holds image shards of `xlafit data images`, not MLM data;") as e:
        mlm.read_manifest(str(pictures))
    assert "`xlafit data mlm --tokenizer TOK --input TEXT --out NEWDIR`" in str(e.value)
    with pytest.raises(DataError, match=rf"{text} holds MLM shards of `xlafit data mlm`, not image data;"):
        images.read_manifest(str(text))
    for out, prepare in ((text, images.prepare), (pictures, mlm.prepare)):
        args = (tmp_path / "in",) if prepare is images.prepare else (korean_tokenizer, korean_demo_files())
        with pytest.raises(DataError, match=rf"--out {out} holds (MLM|image) shards of .*; give a new directory"):
            prepare(*args, str(out), overwrite=True)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    fix = rf"`xlafit data mlm --tokenizer TOK --input {corpus}(/a.txt)? --out NEWDIR` and point the run at NEWDIR"
    with pytest.raises(DataError, match=rf"{corpus} holds text files \(a.txt\), not prepared MLM data; .*{fix}"):
        mlm.read_manifest(str(corpus))
    with pytest.raises(DataError, match=rf"{corpus}/a.txt is a file, not a directory of prepared MLM data; .*{fix}"):
        mlm.read_manifest(str(corpus / "a.txt"))
