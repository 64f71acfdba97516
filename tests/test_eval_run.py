"""Scoring a run's checkpoints without training (``xlafit eval``, ``Trainer.restore``): each
checkpoint's score equals what the run itself evaluated at that step, on its own split and on
a file given as its evaluation data; nothing in the run is written; wrong asks are named."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

import xlafit
from helpers import cnn_trainer, write_mnist_idx
from xlafit.checkpoint import Checkpointer
from xlafit.cli.entry import main
from xlafit.data import chat_demo, mnist
from xlafit.errors import CheckpointError, ConfigError
from xlafit.recipes import llm, load_config
from xlafit.recipes import mnist as mnist_recipe
from xlafit.run_eval import evaluate_run

XLAFIT = [sys.executable, "-m", "xlafit"]


def _evaluations(run_dir):
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r.get("split") == "eval"]


def _same(score, record):
    """A score against the run's own evaluation record: the same numbers."""
    assert score.step == record["step"]
    for key, value in score.metrics.items():
        assert record[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_a_trainer_restores_an_earlier_checkpoint_and_scores_it_as_the_run_did(strategy8, tmp_path):
    splits = mnist.load_embedded()
    train = {k: v[:256] for k, v in splits["train"].items()}
    test = {k: v[:100] for k, v in splits["test"].items()}
    run = cnn_trainer(strategy8, tmp_path / "run", epochs=2, log_every_steps=2)
    result = run.fit(train, eval=test)
    run.close()
    first, last = result.evaluations  # one an epoch, each beside its epoch's checkpoint

    model = xlafit.models.MnistCNN(rngs=nnx.Rngs(params=7, dropout=1))  # other values than the run's
    again = xlafit.Trainer(model, mnist_recipe.loss_fn, run.tx, strategy=strategy8, global_batch=64,
                           run_dir=tmp_path / "run")  # fmt: skip
    assert again.restore(first["step"]) == first["step"]
    scored = again.evaluate(test)
    assert scored == {k: v for k, v in first.items() if k in scored}
    trained = np.asarray(again.state.params["conv1"]["kernel"])
    assert np.array_equal(np.asarray(model.conv1.kernel[...]), trained)  # the values reach the model given
    assert again.restore() == last["step"]  # the newest by default
    with pytest.raises(CheckpointError, match=r"no checkpoint 3 in .*; there are: \[4, 8\]"):
        again.restore(3)
    again.close()
    with pytest.raises(ConfigError, match="keeps no checkpoints to restore"):
        xlafit.Trainer(model, mnist_recipe.loss_fn, run.tx, strategy=strategy8, global_batch=64).restore()


def _files(root):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_the_command_scores_every_checkpoint_as_the_run_evaluated_it_and_writes_nothing(
    tmp_path, capsys, monkeypatch, caplog
):
    """An mnist run, then ``xlafit eval RUN --step all`` as a user runs it (a process of its
    own, the suite's XLA_FLAGS removed): each checkpoint's score is the run's own evaluation
    at its step; the run directory is left as it was; a wrong step or setting is named."""
    run, digits = tmp_path / "run", write_mnist_idx(tmp_path, train=512, test=128)
    settings = [f"run.run_dir={run}", f"data.data_dir={digits}", "trainer.epochs=2", "data.global_batch=128"]
    xlafit.train_and_evaluate(load_config("mnist", settings))
    before = _files(run)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
        "XLAFIT_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    command = [*XLAFIT, "eval", str(run), "--step", "all", "--json", "--simulate", "8"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    scores = [json.loads(line) for line in done.stdout.splitlines()]
    evaluations = _evaluations(run)
    assert [s["step"] for s in scores] == [e["step"] for e in evaluations] == [4, 8]
    for score, record in zip(scores, evaluations, strict=True):
        assert {k: score[k] for k in ("accuracy", "loss", "count")} == pytest.approx(
            {k: record[k] for k in ("accuracy", "loss", "count")}, rel=1e-6
        )
    assert "evaluating step 4 of" in done.stderr
    assert _files(run) == before  # nothing written, moved or left behind
    (tmp_path / "more").mkdir()
    more = write_mnist_idx(tmp_path / "more", train=64, test=200)  # another data directory: its test split
    (other,) = evaluate_run(str(run), data=str(more))
    assert other.step == 8 and other.metrics["count"] == 200
    capsys.readouterr()
    assert main(["eval", str(run), "--step", "4,9"]) == 2
    assert "checkpoint 9 of" in (err := capsys.readouterr().err) and "does not exist; the checkpoints: [4, 8]" in err
    # Only the checkpoints that may be scored are verified (their files hashed): the newest one here.
    verified = []
    verify = Checkpointer.verify
    monkeypatch.setattr(Checkpointer, "verify", lambda self, step: verified.append(step) or verify(self, step))
    assert evaluate_run(str(run))[0].step == 8 and set(verified) == {8}
    # The newest damaged: the newest intact one is scored, and nothing is moved aside.
    largest = max((p for p in (run / "checkpoints" / "8").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    damaged = bytearray(largest.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    largest.write_bytes(bytes(damaged))
    before = _files(run)
    caplog.clear()
    assert evaluate_run(str(run))[0].step == 4 and _files(run) == before
    # said (the twenty-seventh walk: an older step was scored as "the newest" without a word)
    assert re.search(r"warning: checkpoint\(s\) 8 \(corrupt: .*\) of .* cannot be scored; scoring step 4, the newest "
                     "intact one", caplog.text)  # fmt: skip
    caplog.clear()
    assert [score.step for score in evaluate_run(str(run), steps="all")] == [4]
    assert re.search(r"checkpoint\(s\) 8 \(corrupt: .*\) of .* cannot be scored; not scored", caplog.text)
    capsys.readouterr()
    assert main(["eval", str(run), "--step", "8"]) == 2
    assert re.search(r"checkpoint 8 of .* is corrupt: .*; the checkpoints: \[4, 8\]", capsys.readouterr().err)
    assert main(["eval", str(run), "model.dropout1=0.1"]) == 2
    assert "model.dropout1: xlafit eval scores the run as it trained" in capsys.readouterr().err
    # the walk: data.data_dir scored a tenth of a file as "its evaluation split"; run.run_dir and
    # trainer.epochs changed nothing, unsaid
    assert main(["eval", str(run), f"data.data_dir={more}", "run.run_dir=other", "trainer.epochs=3"]) == 2
    said = capsys.readouterr().err
    assert "data.data_dir, run.run_dir, trainer.epochs: not an evaluation setting; xlafit eval takes" in said
    assert "The data to score is --data PATH" in said
    assert main(["eval", str(tmp_path / "cache")]) == 2
    assert "is not a run directory: it has no config.yaml" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nowhere")]) == 2  # the walk: "not a run directory: it has no config.yaml"
    assert f"{tmp_path / 'nowhere'} does not exist; give a run directory" in capsys.readouterr().err
    assert main(["eval", str(run), "--step", "last"]) == 2
    assert "--step 'last': expected whole numbers separated by commas" in capsys.readouterr().err


def _chat(pairs):
    turn = lambda a, b: [  # noqa: E731
        {"role": "user", "content": f"What is {a} plus {b}?"},
        {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
    ]
    return "".join(json.dumps({"messages": turn(a, b)}) + "\n" for a, b in pairs)


def test_a_lora_chat_run_scored_on_a_file_equals_its_own_evaluation_of_that_file(tmp_path, capsys, caplog):
    """A LoRA run on chat records evaluated ``data.eval_data_dir=held.jsonl`` as it trained;
    ``evaluate_run(RUN, data=held.jsonl)`` reads the file as the run encoded its data (the
    demo's tokenizer and template, the loss on the answers) and gives the same numbers."""
    (tmp_path / "train.jsonl").write_text(_chat([(a, b) for a in range(8) for b in range(8)]))
    (tmp_path / "held.jsonl").write_text(_chat([(a, 9) for a in range(10, 22)]))
    run, tokenizer = tmp_path / "run", tmp_path / "tokenizer"
    shutil.copytree(chat_demo.demo_files()[2], tokenizer)
    settings = [
        f"run.run_dir={run}", f"data.data_dir={tmp_path / 'train.jsonl'}",
        f"data.eval_data_dir={tmp_path / 'held.jsonl'}",
        f"data.tokenizer={tokenizer}", "data.seq_len=48", "data.global_batch=16", "lora.rank=4",
        "trainer.epochs=2", "trainer.eval_every_epochs=1", "optimizer.learning_rate=0.01",
    ]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", settings))
    capsys.readouterr()
    (first, last) = _evaluations(run)
    # the walk: eval rendered the data with the tokenizer folder's template as it is now, not as the
    # run trained with it (kept in the run's tokenizer/, as generate reads it)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("'<|im_start|>' + message['role']", "message['role']")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    scores = xlafit.evaluate_run(str(run), data=str(tmp_path / "held.jsonl"), steps="all")  # the public name
    _same(scores[0], first)
    _same(scores[1], last)
    said = capsys.readouterr().err
    assert "evaluation data: 12 chat records" in said and "loss on the answers" in said and "eval:" not in said
    assert scores[1].line("held.jsonl", "rows").startswith(f"step {last['step']} on held.jsonl: loss=")
    # the twenty-seventh walk: text given to a chat run was scored as text without a word
    (tmp_path / "held.txt").write_text("\n\n".join(f"{a} plus 9 is {a + 9}." for a in range(10, 22)))
    caplog.clear()
    evaluate_run(str(run), data=str(tmp_path / "held.txt"))
    assert f"warning: {run} trained on chat records; {tmp_path / 'held.txt'} holds text, scored as text" in caplog.text
    caplog.clear()
    long = [m for a in range(6) for m in json.loads(_chat([(a, 9)]))["messages"]]  # past data.seq_len=48
    (tmp_path / "long.jsonl").write_text(json.dumps({"messages": long}) + "\n" + _chat([(3, 4)]))
    capsys.readouterr()
    evaluate_run(str(run), data=str(tmp_path / "long.jsonl"))
    assert "warning" not in caplog.text  # chat records: the run's format
    said = capsys.readouterr().err  # the walk: "raise data.seq_len", which eval refuses
    assert "records longer than data.seq_len=48 are cut at it; their ends are not scored (the run's length" in said
    # a folder named for its splits scored its train file alone, as the folder's score: its evaluation split now
    (tmp_path / "splits").mkdir()
    (tmp_path / "splits" / "train.jsonl").write_text((tmp_path / "long.jsonl").read_text())
    (tmp_path / "splits" / "validation.jsonl").write_text((tmp_path / "held.jsonl").read_text())
    (folder,) = evaluate_run(str(run), data=str(tmp_path / "splits"))
    assert "is a folder of splits: scoring its evaluation split (validation.jsonl)" in capsys.readouterr().err
    assert folder.metrics == scores[1].metrics  # held.jsonl's, at the same (newest) step
    # a step asked for twice is scored once; the JSON line has the perplexity the text line prints
    step = last["step"]
    assert main(["eval", str(run), "--data", str(tmp_path / "held.jsonl"), "--step", f"{step},{step}", "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["perplexity"] == pytest.approx(math.exp(scores[1].metrics["loss"]), rel=1e-6)


def test_a_dpo_run_scored_on_pairs_reports_its_rewards_as_it_evaluated_them(tmp_path):
    pairs = chat_demo.preference_pairs(40, seed=5)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs[:32]))
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs[32:]))
    run = tmp_path / "run"
    settings = [
        f"run.run_dir={run}", f"data.data_dir={tmp_path / 'train.jsonl'}",
        f"data.eval_data_dir={tmp_path / 'held.jsonl'}",
        f"data.tokenizer={chat_demo.demo_files()[2]}", "data.seq_len=40", "data.global_batch=8", "lora.rank=4",
        "model.objective=dpo", "trainer.epochs=1",
    ]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", settings))
    (record,) = _evaluations(run)
    (score,) = evaluate_run(str(run), data=str(tmp_path / "held.jsonl"))
    assert {"rewards/accuracies", "rewards/margins", "rewards/chosen"} <= set(score.metrics)
    _same(score, record)


def test_a_grpo_run_has_no_loss_to_score_records_with_and_says_what_does():
    cfg = load_config("llm", ["model.objective=grpo", "data.demo=grpo"])
    with pytest.raises(ConfigError, match=r"GRPO run .* `xlafit generate RUN --prompts-file FILE --json`"):
        llm.eval_data(cfg, "prompts.jsonl")


def test_a_run_on_the_demos_tokenizer_is_scored_on_a_file(tmp_path):
    """A run that named no tokenizer (the chat demo's, found from data.demo) is scored on a
    file: the file is read with that tokenizer, not refused for want of data.tokenizer."""
    (tmp_path / "held.jsonl").write_text(_chat([(a, 9) for a in range(10, 16)]))
    run = tmp_path / "run"
    settings = [f"run.run_dir={run}", "data.demo=chat", "data.seq_len=48", "trainer.stop_at_step=1"]
    xlafit.train_and_evaluate(load_config("llm", [*settings, "trainer.eval_every_epochs=100"]))
    (score,) = evaluate_run(str(run), data=str(tmp_path / "held.jsonl"))
    assert score.step == 1 and score.metrics["count"] >= 1 and 0 < score.metrics["loss"] < 20
