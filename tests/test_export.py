"""Export to Hugging Face, through the whole command-line pipeline on the Korean texts."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import hf_logits, xlafit_cli
from xlafit.cli import main
from xlafit.data.text import korean_demo_files
from xlafit.hf import bert as bert_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_cli_tokenizer_data_train_export(tmp_path, capsys):
    """The whole pipeline through the command line, on the Korean texts, then Hugging Face."""
    files = korean_demo_files()
    out = xlafit_cli("tokenizer", "train", "--input", *files, "--vocab-size", "1500", "--out", str(tmp_path / "tok"))
    assert out.returncode == 0, out.stderr
    assert "unknown-token rate" in out.stdout and "tokens/word" in out.stdout
    out = xlafit_cli(
        "data",
        "mlm",
        "--tokenizer",
        str(tmp_path / "tok"),
        "--input",
        *files,
        "--seq-len",
        "64",
        "--out",
        str(tmp_path / "mlm"),
        "--eval-fraction",
        "0.1",
    )
    assert out.returncode == 0, out.stderr
    assert "train:" in out.stdout and "eval:" in out.stdout
    run_dir = tmp_path / "run"
    out = xlafit_cli(
        "train",
        "bert",
        "--simulate",
        "1",  # the pipeline, not the split over devices (test_bert_recipe.py trains a prepared directory on 8)
        "--data-dir",
        str(tmp_path / "mlm"),
        "--run-dir",
        str(run_dir),
        "data.seq_len=64",
        "trainer.epochs=1",
        "data.global_batch=64",  # an epoch of few steps: the pipeline, not the learning
        "trainer.steps_per_call=1",  # one train step compiled (the preset's 3 compiles the 7 steps twice: 3 and 1)
    )
    assert out.returncode == 0, out.stderr
    assert "masked-token accuracy:" in out.stdout and "tokens_per_sec=" in out.stdout and "mfu=" in out.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 for r in records if r["split"] == "train")
    out = xlafit_cli("export", "hf", str(run_dir), "--out", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    # the exported model: same logits in PyTorch as the checkpoint in xlafit
    model = bert_hf.from_hf(tmp_path / "hf")
    model.eval()
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    enc = auto(["대한민국 헌법 제1조", "국회의원 선거"], padding=True, return_tensors="np")
    ours = np.asarray(
        model(jnp.asarray(enc["input_ids"]), jnp.asarray(enc["attention_mask"]), jnp.asarray(enc["token_type_ids"]))
    )
    theirs = hf_logits(tmp_path / "hf", enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    # in this process: the command's refusal comes before any work
    assert main(["export", "hf", str(tmp_path / "mlm"), "--out", str(tmp_path / "x")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_an_out_that_is_a_file_is_refused_in_one_line(tmp_path):
    from xlafit.errors import ConfigError
    from xlafit.export import export_hf

    (tmp_path / "notes.txt").write_text("not a directory")
    with pytest.raises(ConfigError) as e:
        export_hf(tmp_path / "run", tmp_path / "notes.txt")
    assert str(e.value) == (
        f"--out {tmp_path / 'notes.txt'} is a file; give a directory to write the export to (a new one, or a folder)."
    )


def test_a_corrupt_newest_checkpoint_is_named_once_with_the_one_used(tmp_path, capsys):
    """Tester's report: `export` and `generate` went on from checkpoint 2 past a corrupt 3
    without a word. One line names it and the checkpoint used; --step 3 is refused with what
    is wrong with it and the intact ones."""
    from xlafit.checkpoint import Checkpointer
    from xlafit.errors import CheckpointError
    from xlafit.export import checkpoint_arrays
    from xlafit.recipes import load_config

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5)
    for step in (1, 2, 3):
        ckpt.save(step, {"params": {"w": np.full(64, step, np.float32)}})
    ckpt.wait()
    ckpt.close()
    data = (tmp_path / "checkpoints" / "3" / "default").rglob("*")
    biggest = max((p for p in data if p.is_file()), key=os.path.getsize)
    biggest.write_bytes(biggest.read_bytes()[:-1])
    cfg = load_config("llm", [f"run.run_dir={tmp_path}"])
    capsys.readouterr()
    arrays, step, _ = checkpoint_arrays(cfg, tmp_path, None)
    assert step == 2 and arrays["params"]["w"][0] == 2
    name = biggest.relative_to(tmp_path / "checkpoints" / "3")
    assert capsys.readouterr().err == (
        f"warning: checkpoint 3 is corrupt: {name} does not match its checksum; using checkpoint 2\n"
    )
    with pytest.raises(CheckpointError) as e:
        checkpoint_arrays(cfg, tmp_path, 3)
    assert str(e.value) == (
        f"checkpoint 3 in {tmp_path / 'checkpoints'} is corrupt: {name} does not match its checksum; intact: [1, 2]."
    )


def test_a_first_save_underway_is_seen_so_generate_waits_for_it(tmp_path):
    """A step's folder, or Orbax's temporary one, before the checkpoint is listed: export and
    generate wait for it (a notebook asks a model that has just started training)."""
    from xlafit.export import _first_save_underway

    assert not _first_save_underway(tmp_path / "none") and not _first_save_underway(tmp_path)
    (tmp_path / "notes").mkdir()
    assert not _first_save_underway(tmp_path)
    (tmp_path / "1.orbax-checkpoint-tmp-1765000000").mkdir()
    assert _first_save_underway(tmp_path)
    assert not _first_save_underway("gs://bucket/run/checkpoints")  # a bucket is not listed


def test_an_export_of_a_directory_that_does_not_exist_says_so(tmp_path):
    """The twenty-third walk: a mistyped run directory was "not a run directory (no config.yaml)"."""
    from xlafit.errors import ConfigError
    from xlafit.export import export_hf

    with pytest.raises(ConfigError, match="nothere: no such run directory"):
        export_hf(tmp_path / "nothere", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_lora_run_on_a_bfloat16_base_exports_its_merged_model_in_bfloat16(tmp_path, capsys):
    """The twenty-third walk: a LoRA run on a bfloat16 base (lora.base_dtype=bfloat16) was
    merged and written in float32, twice the files of its base's precision. It is written in
    bfloat16, as PEFT merges into a base loaded in bfloat16, and the command says so."""
    from safetensors.numpy import load_file

    import xlafit
    from xlafit.export import export_hf
    from xlafit.hf import llama as llama_hf
    from xlafit.hf.peft import load_peft_adapter
    from xlafit.recipes import load_config

    run = tmp_path / "run"
    settings = [
        f"run.run_dir={run}", "data.demo=arithmetic", "data.seq_len=32", "lora.rank=4", "lora.base_dtype=bfloat16",
        "trainer.stop_at_step=2", "trainer.eval_every_epochs=100", "optimizer.learning_rate=0.01",
    ]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", settings))
    capsys.readouterr()
    export_hf(run, tmp_path / "hf")
    assert "the merged model is written in bfloat16" in capsys.readouterr().out
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert {str(w.dtype) for w in weights.values()} == {"bfloat16"}
    ids = jnp.asarray([[0, 5, 17, 42, 99, 7, 20, 12]])
    adapted = load_peft_adapter(llama_hf.from_hf(tmp_path / "hf" / "base"), tmp_path / "hf" / "adapter")(ids)
    merged = llama_hf.from_hf(tmp_path / "hf")(ids)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(adapted), atol=3e-2)
