"""Hub ids (xlafit.io.hub): read from a Hugging Face cache laid out as the hub writes it, with
no network; what goes wrong is one line naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from flax import nnx

from xlafit.data import clm
from xlafit.errors import ConfigError
from xlafit.hf import llama as llama_hf
from xlafit.io import hub
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(home, repo, files, kind="models", commit=COMMIT):
    """``$HF_HOME/hub/models--org--name`` (or ``datasets--org--name``) with ``refs/main`` and
    ``snapshots/<commit>/``: what ``hf download`` leaves (the blobs are links to files in
    ``blobs/``; copies read the same). Another commit of the same repository is main's next."""
    root = home / "hub" / f"{kind}--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    for name, source in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(source.read_bytes())
    return snapshot


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """A tiny Llama saved as transformers saves one, and its tokenizer, in a hub cache."""
    work = tmp_path_factory.mktemp("hub")
    (work / "text.txt").write_text("\n\n".join(f"document {i}: the quick brown fox jumps" for i in range(40)))
    tok = clm.train_bpe([str(work / "text.txt")], 200, work / "model")
    config = LlamaConfig(
        num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64,
        vocab_size=tok.get_vocab_size(), max_position_embeddings=128,
    )  # fmt: skip
    llama_hf.save_hf(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), work / "model")
    files = {p.name: p for p in (work / "model").iterdir() if p.is_file()}
    home = work / "hf-home"
    lay_out_cache(home, "tiny-org/tiny-llama", files)
    lay_out_cache(home, "tiny-org/fox-text", {"data/train.txt": work / "text.txt"}, kind="datasets")
    return home, work


def _env(home, cache):
    keep = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "HF_TOKEN")}
    return keep | {
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "XLAFIT_CACHE": str(cache),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }


def test_a_hub_id_trains_on_hub_data_from_the_cache_with_no_network(hub_home, tmp_path):
    home, work = hub_home
    run = subprocess.run(
        [sys.executable, "-m", "xlafit", "train", "llm", "--run-dir", str(tmp_path / "run"),
         "model.init_from_hf=tiny-org/tiny-llama", "--data-dir=hf://datasets/tiny-org/fox-text/data", "data.seq_len=32",
         "trainer.epochs=1", "data.global_batch=8"],
        capture_output=True, text=True, env=_env(home, tmp_path / "cache"), timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()  # the hub model's own tokenizer
    saved = (tmp_path / "run" / "tokenizer" / "tokenizer.json").read_text()
    assert json.loads(saved) == json.loads((work / "model" / "tokenizer.json").read_text())


def test_a_hub_dataset_that_moved_on_is_named_on_resume_with_the_revision_the_run_read(hub_home, tmp_path):
    """A run on hf://datasets/org/name (its main branch) keeps the commit it read; once main
    moves to a commit with other text, the resume is refused naming the setting that reads the
    run's commit, and that setting resumes it."""
    home, work = hub_home
    moved = work / "moved.txt"
    moved.write_text((work / "text.txt").read_text().replace("document 7:", "document seven:"))
    lay_out_cache(home, "tiny-org/moving-text", {"data/train.txt": work / "text.txt"}, kind="datasets")
    run_dir = tmp_path / "run"

    def train(data, *more):
        return subprocess.run(
            [sys.executable, "-m", "xlafit", "train", "llm", "--run-dir", str(run_dir), f"--data-dir={data}",
             f"data.tokenizer={work / 'model'}", "data.seq_len=32", "data.global_batch=8", "model.preset=custom",
             "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=64",
             "optimizer.decay_steps=100", *more],
            capture_output=True, text=True, env=_env(home, tmp_path / "cache"), timeout=600,
        )  # fmt: skip

    first = train("hf://datasets/tiny-org/moving-text/data", "trainer.stop_at_step=2")
    assert first.returncode == 0, first.stderr[-3000:]
    pinned = f"hf://datasets/tiny-org/moving-text@{COMMIT}/data"
    assert json.loads((run_dir / "data_files.json").read_text())["hub_revisions"] == {"data.data_dir": pinned}

    later = "fedcba9876543210fedcba9876543210fedcba98"
    lay_out_cache(home, "tiny-org/moving-text", {"data/train.txt": moved}, kind="datasets", commit=later)
    refused = train("hf://datasets/tiny-org/moving-text/data", "trainer.stop_at_step=3")
    assert refused.returncode == 2, refused.stderr[-3000:]
    (error,) = [line for line in refused.stderr.splitlines() if line.startswith("xlafit: error")]
    assert "its data_files.json differs from this run's data files" in error
    assert f"the hub dataset moved on since the run read it: data.data_dir={pinned} reads what it read." in error

    resumed = train(pinned, "trainer.stop_at_step=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 3 and steps.count(3) >= 1


def test_a_hub_id_missing_from_the_cache_offline_says_so_in_one_line(hub_home, tmp_path):
    home, work = hub_home
    run = subprocess.run(
        [sys.executable, "-m", "xlafit", "train", "llm", "--run-dir", str(tmp_path / "run"),
         "model.init_from_hf=meta-llama/Llama-3.2-1B", f"--data-dir={work / 'text.txt'}"],
        capture_output=True, text=True, env=_env(home, tmp_path / "cache"), timeout=600,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("xlafit: error")]
    assert len(errors) == 1 and "Traceback" not in run.stderr
    assert "model.init_from_hf=meta-llama/Llama-3.2-1B is not in the Hugging Face cache" in errors[0]
    assert "hf download meta-llama/Llama-3.2-1B" in errors[0]


def test_a_hub_models_positions_are_checked_before_the_run_directory_is_written(hub_home, tmp_path):
    """data.seq_len beyond a hub checkpoint's max_position_embeddings (128 here) trained on
    without a word; a local directory's was refused already (test_llm_recipe)."""
    home, work = hub_home
    run = subprocess.run(
        [sys.executable, "-m", "xlafit", "train", "llm", "--run-dir", str(tmp_path / "run"),
         "model.init_from_hf=tiny-org/tiny-llama", f"--data-dir={work / 'text.txt'}", "data.seq_len=256"],
        capture_output=True, text=True, env=_env(home, tmp_path / "cache"), timeout=600,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-3000:]
    assert "data.seq_len=256 is longer than model.init_from_hf=tiny-org/tiny-llama's max_position_embeddings=128" in (
        run.stderr
    )
    assert not (tmp_path / "run").exists()


def test_hub_data_paths_read_the_cache_and_say_what_is_missing(hub_home, tmp_path):
    home, work = hub_home
    script = (
        "import sys\n"
        "from xlafit.data import clm\n"
        "from xlafit.errors import XlafitError\n"
        "for url in sys.argv[1:]:\n"
        "    try:\n"
        "        print([f.split('/snapshots/')[-1] for f in clm.data_files([url])])\n"
        "    except XlafitError as e:\n"
        "        print('error:', e)\n"
    )
    urls = [
        "hf://datasets/tiny-org/fox-text/data/train.txt",
        "hf://datasets/tiny-org/fox-text/data/*.txt",
        "hf://datasets/tiny-org/fox-text@main/data",
        "hf://datasets/other-org/chats/train.jsonl",
        "hf://tiny-org/fox-text",
        "hf://datasets/other-org/chats@v2/train.jsonl",  # the sixth walk: the download named no revision
        "hf://datasets/tiny-org/fox-text",  # the sixth walk: its files are under data/, and it named the cache path
    ]
    run = subprocess.run([sys.executable, "-c", script, *urls], capture_output=True, text=True,
                         env=_env(home, tmp_path / "cache"), timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[:3] == [f"['{COMMIT}/data/train.txt']"] * 3  # a file, a glob, a folder at a revision
    assert "hf download other-org/chats --repo-type dataset" in lines[3] and "not in the Hugging Face cache" in lines[3]
    assert "hf://datasets/org/name/path" in lines[4]
    assert "hf download other-org/chats --repo-type dataset --revision v2" in lines[5]
    assert lines[6].startswith(
        "error: no input file matches hf://datasets/tiny-org/fox-text (hf://datasets/tiny-org/fox-text holds none "
        "itself, but hf://datasets/tiny-org/fox-text/data does: give that folder"
    ), lines[6]


def test_the_hubs_refusals_name_the_fix(monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    class Response:  # what the hub's errors carry; no request is made
        status_code, headers, request, url = 403, {}, None, "https://huggingface.co"

    for error, message in (
        (
            errors.GatedRepoError("gated", response=Response()),
            "is gated: accept its license at https://huggingface.co/",
        ),
        (errors.RepositoryNotFoundError("no", response=Response()), "the Hugging Face hub has no such model"),
    ):

        def refuse(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
        with pytest.raises(ConfigError, match=message):
            hub.resolve("some-org/some-model")


def test_local_paths_and_urls_are_not_hub_ids(tmp_path):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    assert hub.resolve(str(tmp_path / "org" / "model")) == str(tmp_path / "org" / "model")
    assert not hub.is_hub_id("gs://bucket/model") and not hub.is_hub_id("./model") and hub.is_hub_id("a/b")


def test_local_paths_that_are_missing_or_runs_are_named_before_the_tokenizer(tmp_path, monkeypatch):
    """``~/x``, ``/abs/x`` and ``runs/new`` beside a ``runs/`` folder are local paths, never hub
    ids: missing, they say so; an xlafit run directory says to export it first. The llm recipe
    checks them before it looks for a tokenizer."""
    from xlafit.generator import Generator
    from xlafit.recipes import llm, load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "base" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "base" / "config.yaml").write_text("recipe: llm\n")
    assert not hub.is_hub_id("runs/pc-hf") and hub.is_local("runs/pc-hf") and hub.is_hub_id("org/pc-hf")

    def refusal(name, data_dir="text.txt"):
        cfg = load_config("llm", [f"model.init_from_hf={name}", f"data.data_dir={data_dir}"])
        with pytest.raises(ConfigError) as e:
            llm.validate(cfg)
        return str(e.value)

    for name in ("~/no-such-xlafit-model", str(tmp_path / "x" / "nope"), "runs/pc-hf"):
        assert refusal(name) == (
            f"model.init_from_hf={name}: no such file or directory; give the path of a Hugging Face model "
            "directory, or a hub id org/name."
        )
    assert "is an xlafit run directory, not a Hugging Face one; export it first (xlafit export hf runs/base" in (
        refusal("runs/base")
    )
    with pytest.raises(ConfigError, match="runs/nonexistent: no such directory; give an llm run directory"):
        Generator.load("runs/nonexistent")
