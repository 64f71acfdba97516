"""`xlafit train FILE.py` (src/xlafit/run_file.py): a user's file trained as a recipe is, run as
a user runs it; its bad input refused in one line before anything is written."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import xlafit_cli
from xlafit.cli import main

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "own-model.md"


def guide_file() -> str:
    """The file of the own-model guide's "From the command line", as the page shows it: a
    classifier of 2,048 examples, 16 steps an epoch at global batch 128, evaluated on 512."""
    section = GUIDE.read_text(encoding="utf-8").split("## From the command line")[1]
    return section.split("```python\n")[1].split("```")[0]


MLP_FILE = guide_file()
# The same file with the rate tuned at 64 examples a step, scaled to the run's batch by xlafit.
SCALED_FILE = MLP_FILE.replace(
    "optimizer = optax.adamw(1e-2)",
    "from xlafit.config import OptimizerConfig\noptimizer = OptimizerConfig(learning_rate=1e-2, reference_batch=64)",
)
assert SCALED_FILE != MLP_FILE


def metrics(run_dir, split="train"):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("split", "train") == split]


def test_the_guides_file_trains_on_simulated_devices_and_resumes_from_its_checkpoint(tmp_path):
    (tmp_path / "my_model.py").write_text(MLP_FILE)
    run_dir = tmp_path / "run"
    common = ["train", str(tmp_path / "my_model.py"), "--simulate", "2", "--run-dir", str(run_dir)]
    first = xlafit_cli(*common, "trainer.stop_at_step=8", "cpu.keep_memory=false")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"run directory: {run_dir}" in first.stdout
    assert "devices: 2 x cpu (1 process(es))   per-device batch: 64   global batch: 128" in first.stdout
    assert "steps: 16/epoch x 4 epochs = 64" in first.stdout
    assert "stopped at step 8 of 64" in first.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["8"]
    assert "Traceback" not in first.stderr
    second = xlafit_cli(*common, "trainer.stop_at_step=16")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from checkpoint 8 (epoch 1 of 4)" in second.stdout
    assert [r["step"] for r in metrics(run_dir)] == [8, 16]  # trained on from 8, nothing repeated
    assert all(math.isfinite(r["loss"]) for r in metrics(run_dir))
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [8, 16]
    # the eval set, evaluated at the end of the first epoch, is the run's final report
    (evaluation,) = metrics(run_dir, "eval")
    assert evaluation["step"] == 16 and evaluation["count"] == 512
    assert f"test accuracy: {evaluation['accuracy']:.4f}" in second.stdout
    assert evaluation["accuracy"] > 0.8  # it learns


def test_a_stopped_run_in_a_new_directory_names_it_to_go_on(tmp_path):
    """Without --run-dir the run gets a directory of its own under ./runs, which the same
    command would not find again: the end says how to go on."""
    (tmp_path / "my_model.py").write_text(SCALED_FILE)
    out = xlafit_cli("train", "my_model.py", "--simulate", "1", "trainer.stop_at_step=1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    made = out.stdout.split("run directory: ")[1].split()[0]
    assert made.startswith("runs/my_model-")
    assert f"Run again with --run-dir {made} to go on: the same command would start a new run." in out.stdout
    # an OptimizerConfig in the optimizer's place: scaled from its reference batch to the run's
    assert "learning rate: 0.01 at batch 64 -> peak 0.02 at global batch 128 (linear scaling)" in out.stdout


def test_sigterm_saves_a_checkpoint_exits_75_and_the_same_command_resumes(tmp_path):
    """As a recipe's run: SIGTERM is Preempted after a checkpoint, exit 75, and the same
    command goes on. data.per_device_batch on the command line wins over the file's global_batch."""
    (tmp_path / "mlp.py").write_text(MLP_FILE)
    command = [sys.executable, "-m", "xlafit", "train", str(tmp_path / "mlp.py"), "--simulate", "2"]
    command += ["--run-dir", str(tmp_path / "run"), "data.per_device_batch=8", "trainer.epochs=1000"]
    command += ["trainer.log_every_steps=1"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[train]"):  # training: a signal now stops it after a step
            proc.send_signal(signal.SIGTERM)
            break
    output = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, output[-3000:]
    assert "per-device batch: 8   global batch: 16" in output
    stopped = int(output.split("stopped at step ")[1].split(";")[0])
    assert f"checkpoint {stopped} saved in" in output and "Run the same command again to resume" in output
    again = xlafit_cli(*command[3:], "trainer.stop_at_step=" + str(stopped + 1))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from checkpoint {stopped} " in again.stdout


TORCH_FILE = """
import numpy as np
import optax
import torch
import torch.nn.functional as F

from xlafit.integrations.torch import torch_loss

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
loss_fn = torch_loss(lambda out, b: F.cross_entropy(out, b["y"], reduction="none"))
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype(np.float32)
dataset = {"x": x, "y": (x[:, 0] > 0).astype(np.int64)}
batch = {k: v[:8] for k, v in dataset.items()}
optimizer = optax.adam(0.05)
"""


def test_a_torch_module_file_trains(tmp_path):
    pytest.importorskip("torchax")
    (tmp_path / "net.py").write_text(TORCH_FILE)
    run_dir = tmp_path / "run"
    out = xlafit_cli(
        "train", str(tmp_path / "net.py"), "--simulate", "2", "--run-dir", str(run_dir),
        "data.per_device_batch=8", "trainer.epochs=4", "trainer.log_every_steps=1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "per-device batch: 8   global batch: 16" in out.stdout
    losses = [r["loss"] for r in metrics(run_dir)]
    assert len(losses) == 16 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-4:]) < sum(losses[:4])  # it learns
    assert (run_dir / "checkpoints" / "16").is_dir()


@pytest.mark.parametrize(
    ("change", "args", "message"),
    [
        (("dataset", "examples"), [], "defines no dataset, and training needs one: add `dataset = {'x': x"),
        (
            ("optimizer = ", "opt = "),
            [],
            "defines no optimizer, and training needs one: add a line such as `optimizer = optax.adamw(1e-3)`",
        ),
        (
            ("global_batch = 128", ""),
            [],
            "no batch size: give data.global_batch=N (the examples of one optimizer step over all devices) or "
            "data.per_device_batch=N on the command line, or define global_batch = N in",
        ),
        (None, ["trainer.epoch=2"], "unknown config key trainer.epoch. Valid keys here: trainer.epochs, "),
        (
            None,
            ["model.width=4"],
            "unknown override model.*: a file's training takes mesh.*, trainer.*, run.*, cpu.* and data.per_device_"
            "batch or data.global_batch overrides (the file defines its model, data and optimizer). Valid keys: ",
        ),
        (None, ["--data-dir", "data"], "--data-dir data: the data directory of a recipe; "),
    ],
)
def test_bad_input_is_one_line_with_the_fix_and_nothing_trained(tmp_path, capsys, change, args, message):
    source = MLP_FILE if change is None else MLP_FILE.replace(*change)
    (tmp_path / "mlp.py").write_text(source)
    run_dir = tmp_path / "run"
    assert main(["train", str(tmp_path / "mlp.py"), "--run-dir", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err  # one line
    assert not run_dir.exists()


def test_a_file_that_does_not_exist_is_named_and_a_name_that_is_no_recipe_keeps_its_error(tmp_path, capsys):
    assert main(["train", str(tmp_path / "my_model.py")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'my_model.py'} does not exist: xlafit train takes a recipe's name or the path of" in err
    assert main(["train", "my_model"]) == 2
    assert "unknown recipe 'my_model'; available: mnist, bert, resnet, llm." in capsys.readouterr().err


def test_check_takes_the_guides_file_and_one_whose_dataset_is_a_dataset(tmp_path):
    """`xlafit check` on a training file: a training set (a dict of arrays, an xlafit Dataset)
    has no per-example lengths, so the step is checked and rule 3 left alone; a Dataset was
    iterated as a list of examples."""
    from xlafit.check import check_file

    (tmp_path / "my_model.py").write_text(MLP_FILE)
    assert check_file(tmp_path / "my_model.py").ok
    (tmp_path / "scaled.py").write_text(SCALED_FILE)
    assert check_file(tmp_path / "scaled.py", tpu="v4-8").ok  # an OptimizerConfig compiles as its chain
    source = MLP_FILE + "from xlafit.data.dataset import ArrayDataset\ndataset = ArrayDataset(dataset)\n"
    (tmp_path / "mlp.py").write_text(source)
    report = check_file(tmp_path / "mlp.py")
    assert report.ok and report.traced
