"""Paths that may be URLs (src/xlafit/io/paths.py): a store without its client library is one
line naming the install, and ``file://`` is a local path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xlafit.errors import StorageError
from xlafit.io.paths import as_path, filesystem, is_url, local, require_store


@pytest.fixture
def without_gcsfs(tmp_path):
    """A PYTHONPATH on which `import gcsfs` fails, as on a machine where it is not installed."""
    (tmp_path / "gcsfs").mkdir()
    (tmp_path / "gcsfs" / "__init__.py").write_text("raise ImportError('No module named gcsfs')\n")
    return str(tmp_path)


def test_file_urls_are_local_paths(tmp_path):
    url = f"file://{tmp_path}/run"
    assert local(url) == f"{tmp_path}/run" and not is_url(url)
    (as_path(url)).mkdir()
    assert (tmp_path / "run").is_dir()
    assert filesystem(url)[1] == f"{tmp_path}/run"


def test_an_unknown_store_is_one_line():
    with pytest.raises(StorageError, match=r"no storage is known for nosuch://; use a local path, file://, gs://"):
        require_store("nosuch://bucket/run")


def test_a_store_fsspec_knows_but_a_run_cannot_use_is_one_line():
    """hdfs:// passed fsspec's check, then etils' paths raised KeyError: 'hdfs://'."""
    with pytest.raises(
        StorageError, match=r"hdfs:// cannot hold a run's directory .* use a local path, file:// or gs://"
    ):
        as_path("hdfs://nn/run")


@pytest.mark.parametrize(
    "command",
    [
        ["train", "mnist", "--simulate", "2", "--run-dir", "gs://my-bucket/runs/mnist"],
        ["data", "images", "--input", "{images}", "--out", "gs://my-bucket/images"],
    ],
)
def test_gs_without_gcsfs_is_one_line_naming_the_install(command, without_gcsfs, tmp_path):
    from PIL import Image

    for name in ("a", "b"):  # two classes: one is refused before the --out is looked at
        (tmp_path / "images" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "images" / name / "one.png")
    argv = [c.format(images=tmp_path / "images") for c in command]
    env = {"PYTHONPATH": without_gcsfs, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "xlafit", *argv], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"xlafit: error: {argv[-1]}: gs:// needs a client library that is not installed: pip install 'xlafit[gcs]'."
    ]


def test_a_path_from_the_home_directory_is_read_there(tmp_path, monkeypatch, strategy8):
    """``~`` left unexpanded by the shell (quoted, `key=~/x`, a YAML value) is the home
    directory for every local path a run reads or writes; a URL keeps its text."""
    from xlafit.data import clm
    from xlafit.io import hub
    from xlafit.recipes import load_config, preset_path
    from xlafit.run import resolve

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus.txt").write_text("one document\n\nand another one\n" * 20)
    clm.train_bpe([str(tmp_path / "corpus.txt")], 100, tmp_path / "tok")
    assert as_path("~/run") == as_path(tmp_path / "run") and local("gs://b/~x") == "gs://b/~x"
    assert filesystem("~/corpus.txt")[1] == str(tmp_path / "corpus.txt")
    assert clm.load_tokenizer("~/tok").get_vocab_size() == clm.load_tokenizer(tmp_path / "tok").get_vocab_size()
    assert hub.resolve("~/tok", what="data.tokenizer") == str(tmp_path / "tok")
    assert preset_path("llm", "~/preset.yaml") == tmp_path / "preset.yaml"
    run_dir = resolve(load_config("mnist", ["run.run_dir=~/x/run"]), strategy8, 1000)[1].run_dir
    assert str(run_dir) == str(tmp_path / "x" / "run")


@pytest.mark.parametrize(
    "name, problem",
    [
        ("my-bucket", ""),
        ("a_b", ""),
        ("runs.example.com", ""),
        ("a" * 63, ""),
        ("wb", "it has 2 characters, a name has 3 to 63"),
        ("a" * 64, "it has 64 characters, a name has 3 to 63"),
        ("YOUR-BUCKET", "it has uppercase letters"),
        ("my bucket", "it has ' '"),
        ("-bucket", "starts and ends with a letter or a digit"),
        ("bucket.", "starts and ends with a letter or a digit"),
        ("a..b", "a part between dots has 0 characters"),
        ("a" * 64 + ".com", "a part between dots has 64 characters"),
        ("a." * 111 + "bb", "it has 224 characters, a name with dots has at most 222"),
        ("192.168.5.4", "cannot be an IP address"),
        ("goog-runs", "cannot start with 'goog'"),
        ("my-google-runs", "contain 'google'"),
    ],
)
def test_bucket_names_follow_cloud_storage_rules(name, problem):
    from xlafit.io.paths import bucket_name_problem

    got = bucket_name_problem(name)
    assert problem in got and (got == "") == (problem == ""), got


def test_an_invalid_bucket_name_is_refused_before_anything_runs(capsys):
    """`--run-dir gs://wb/run` passed every check (a server that takes any name answered
    them), trained, and died at the first checkpoint in a page of TensorStore's traceback
    ("Invalid GCS bucket name"). The name is refused when the config is read, by the first
    access to the URL and by the bucket check, with no server involved; a missing bucket's
    message suggests no `gcloud` command for a name that cannot be created."""
    from xlafit.checkpoint import Checkpointer
    from xlafit.cli import main
    from xlafit.io.paths import check_bucket, describe_error, reach

    assert main(["train", "mnist", "--simulate", "1", "--run-dir", "gs://wb/run", "trainer.stop_at_step=1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        'xlafit: error: run.run_dir=gs://wb/run: "wb" is not a valid Cloud Storage bucket name (it has 2 '
        "characters, a name has 3 to 63). Put the name of a bucket you created in the URL, or create one with a "
        "valid name (https://cloud.google.com/storage/docs/buckets#naming)."
    ]
    with pytest.raises(StorageError, match='--run-dir gs://wb/run: "wb" is not a valid Cloud Storage bucket name'):
        check_bucket("gs://wb/run", "--run-dir")
    with pytest.raises(StorageError, match='gs://YOUR-BUCKET/data: "YOUR-BUCKET" is not a valid'):
        reach("gs://YOUR-BUCKET/data")
    with pytest.raises(StorageError, match='"wb" is not a valid Cloud Storage bucket name'):
        Checkpointer("gs://wb/run/checkpoints")
    why = describe_error("gs://YOUR-BUCKET/run", FileNotFoundError("gs://YOUR-BUCKET/run"))
    assert why.startswith('"YOUR-BUCKET" is not a valid Cloud Storage bucket name') and "gcloud" not in why


def test_a_url_with_a_slash_missing_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """`--run-dir gs:/my-bucket/run` (one slash) was a relative local path to pathlib: the run
    trained into ./gs:/my-bucket/run with no word, then tensorboardX's own URL check ended it in
    a traceback that asked for google-cloud-storage. It is refused when the config is read,
    naming the URL it likely means; any other path that reaches the store helpers is too."""
    from xlafit.cli import main
    from xlafit.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    assert main(["train", "mnist", "--simulate", "1", "--run-dir", "gs:/my-bucket/run", "trainer.stop_at_step=1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "xlafit: error: run.run_dir=gs:/my-bucket/run: gs:/ is not a URL: a URL has two slashes after its scheme "
        "(gs://my-bucket/run)."
    ]
    assert list(tmp_path.iterdir()) == []  # nothing written, no ./gs: folder
    with pytest.raises(ConfigError, match=r"^gs:my-bucket/data: gs: is not a URL: .*\(gs://my-bucket/data\)\.$"):
        as_path("gs:my-bucket/data")
    assert local("runs/gs:/x") == "runs/gs:/x" and local("file:/tmp/x") == "file:/tmp/x"  # not a store's typo
