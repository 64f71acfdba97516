"""The llm recipe's preference objectives (model.objective=dpo, simpo, orpo): settings refused
before any data is read, a pulse of each objective, DPO's two references, and kill -9 during
a DPO run resumed to the uninterrupted run's metrics bit for bit."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import xlafit
from helpers import long_form
from xlafit.data import chat_demo
from xlafit.errors import ConfigError
from xlafit.recipes import get_recipe

XLAFIT = [sys.executable, "-m", "xlafit"]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    """48 arithmetic pairs (conversations) and the chat demo's tokenizer."""
    path = tmp_path_factory.mktemp("prefs") / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_demo.preference_pairs(48, seed=5)))
    return str(path)


def overrides(pairs_file, run_dir, *extra):
    return [
        f"data.data_dir={pairs_file}",
        f"data.tokenizer={chat_demo.demo_files()[2]}",
        f"run.run_dir={run_dir}",
        *("data.seq_len=40", "data.global_batch=8", "data.eval_global_batch=8", "data.eval_fraction=0.2"),
        *("trainer.epochs=1", "trainer.log_every_steps=1"),
        *extra,
    ]


def test_dpo_on_full_fine_tuning_without_a_reference_names_the_options():
    with pytest.raises(ConfigError) as e:
        get_recipe("llm").validate(xlafit.load_config("llm", ["model.objective=dpo", "data.demo=preference"]))
    message = str(e.value)
    assert "\n" not in message
    for option in ("lora.rank=16", "model.preference.reference=precomputed", "model.objective=simpo or orpo"):
        assert option in message


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["model.objective=dpo", "lora.rank=4"], r"trains on preference pairs: give them as --data-dir"),
        (["data.demo=preference"], r"preference pairs train a preference objective: set model.objective=dpo"),
        (["model.objective=orpo", "data.demo=preference", "model.preference.beta=0"], r"beta=0 must be positive"),
    ],
)
def test_preference_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        get_recipe("llm").validate(xlafit.load_config("llm", settings))


@pytest.mark.parametrize(
    "settings",
    [
        ["model.objective=dpo", "lora.rank=4"],  # the reference: the base with the adapters off
        ["model.objective=dpo", "model.preference.reference=precomputed"],  # full fine-tuning
        ["model.objective=dpo", "lora.rank=4", "model.preference.reference=precomputed"],
        ["model.objective=simpo", "model.preference.beta=2.0", "lora.rank=4"],
        ["model.objective=orpo"],
    ],
    ids=["dpo-lora", "dpo-precomputed", "dpo-lora-precomputed", "simpo", "orpo"],
)
def test_pulse(tmp_path, pairs_file, settings, capsys):
    """Each objective trains and evaluates; DPO starts where the policy is its reference
    (loss log 2, rewards 0), either reference. The final line counts pairs (the fourth walk:
    it said rows, for 9 pairs of 18 rows)."""
    result = xlafit.train_and_evaluate(xlafit.load_config("llm", overrides(pairs_file, tmp_path, *settings)))
    final = [line for line in capsys.readouterr().out.splitlines() if line.startswith("test")]
    assert final and final[-1].endswith(f"({result.eval['count']} pairs)"), final
    first = result.history[0]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert name in first and name in result.eval
    if "model.objective=dpo" in settings:
        assert first["step"] == 1
        assert abs(first["loss"] - math.log(2)) < 1e-6
        assert abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/margins"]) < 1e-6
        assert result.history[-1]["loss"] != first["loss"]
    if "model.objective=dpo" in settings and "lora.rank=4" in settings:
        # With LoRA the policy is its reference exactly, the precomputed one too (the tenth walk: a
        # precomputed reference's rounding gave rewards of 4e-7 and an accuracy of 0.5 at step 1).
        assert (first["rewards/chosen"], first["rewards/rejected"], first["rewards/accuracies"]) == (0.0, 0.0, 0.0)
    if "model.objective=orpo" in settings:
        assert "nll_loss" in first and "log_odds_ratio" in first
    assert np.isfinite(result.eval["loss"])
    # What the run trained on, for `xlafit generate` (the tenth walk: a SimPO run on text pairs was
    # said to have trained on prompt/completion records).
    assert json.loads((tmp_path / "data_format.json").read_text())["records"] == "preference pairs"
    if "model.objective=simpo" in settings:
        from xlafit.generator import Generator

        assert Generator.load(str(tmp_path)).trained_records == "preference pairs"


def env():
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONUNBUFFERED": "1"}


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    timing = ("examples_per_sec", "tokens_per_sec", "mfu", "step_time_s", "input_wait_s", "compiles", "time")
    return [{k: v for k, v in json.loads(line).items() if k not in timing} for line in lines]


def test_a_dpo_run_stopped_and_resumed_logs_the_uninterrupted_metrics(tmp_path, pairs_file, capsys):
    """A DPO run stopped mid-way (a checkpoint at every step), then run again, logs the same
    numbers, bit for bit, as the run that was never stopped (trainer.stop_at_step keeps the
    schedule), its last evaluation included. Its reference log-probabilities are computed
    before training: a resume must not take them from the policy it has trained since. (LoRA's
    reference, the base with the adapters off, resumes with the adapters: test_llm_recipe.py.)"""
    settings = [
        "model.objective=dpo", "model.preference.reference=precomputed",
        "trainer.checkpoint_every_steps=1", "trainer.epochs=2",
    ]  # fmt: skip
    run = lambda run_dir, *stop: xlafit.train_and_evaluate(  # noqa: E731
        xlafit.load_config("llm", overrides(pairs_file, run_dir, *settings, *stop))
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run(whole)
    last = max(r["step"] for r in records(whole) if r["split"] == "train")
    run(cut, "trainer.stop_at_step=3")
    assert max(r["step"] for r in records(cut) if r["split"] == "train") == 3 < last
    capsys.readouterr()
    run(cut)
    assert "resumed from checkpoint 3 " in capsys.readouterr().out

    def by_step(run_dir):  # the last record of each (split, step): a resumed step is logged again
        return {(r["split"], r["step"]): r for r in records(run_dir)}

    assert by_step(cut) == by_step(whole)


@long_form(40, "test_a_dpo_run_stopped_and_resumed_logs_the_uninterrupted_metrics and test_preemption's kill -9 loop")
def test_kill_9_during_a_dpo_run_resumes_to_the_uninterrupted_metrics(tmp_path, pairs_file):
    """A LoRA DPO run killed while training, then run again, logs the same numbers, bit for
    bit, as the run that was never interrupted (its last evaluation included)."""
    settings = [
        "model.objective=dpo",
        "lora.rank=4",
        "trainer.checkpoint_every_steps=1",
        "trainer.epochs=2",
        "trainer.invariant_chunks=null",
    ]
    cmd = lambda run_dir: [*XLAFIT, "train", "llm", "--simulate", "1", *overrides(pairs_file, run_dir, *settings)]  # noqa: E731
    whole = tmp_path / "whole"
    out = subprocess.run(cmd(whole), capture_output=True, text=True, env=env())
    assert out.returncode == 0, out.stderr[-3000:]

    cut = tmp_path / "cut"
    proc = subprocess.Popen(cmd(cut), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    assert proc.stdout is not None
    for line in proc.stdout:  # killed just after its third step is logged: mid-run, mid-save
        if line.startswith("[train] step 3 "):
            break
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    steps = [r["step"] for r in records(cut) if r["split"] == "train"]
    assert steps and max(steps) < max(r["step"] for r in records(whole) if r["split"] == "train")
    again = subprocess.run(cmd(cut), capture_output=True, text=True, env=env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint" in again.stdout

    def by_step(run_dir):  # the last record of each (split, step): a resumed step is logged again
        return {(r["split"], r["step"]): r for r in records(run_dir)}

    assert by_step(cut) == by_step(whole)
