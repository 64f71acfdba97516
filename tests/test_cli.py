"""The command line, run as a user runs it: in a fresh process."""

import json
import os
import re
import subprocess
import sys

import pytest


def run(*args, env=None, timeout=600):
    env = {**os.environ, **(env or {})}
    env.pop("XLA_FLAGS", None)  # the CLI must make its own devices
    return subprocess.run(
        [sys.executable, "-m", "xlafit", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_devices_simulate():
    out = run("devices", "--simulate", "8")
    assert out.returncode == 0, out.stderr
    assert "platform: cpu" in out.stdout
    assert out.stdout.count("\n   ") >= 8  # one row per device
    assert "mesh: {'data': 8}" in out.stdout


def test_devices_simulate_from_environment():
    out = run("devices", env={"XLAFIT_SIMULATE_DEVICES": "4"})
    assert out.returncode == 0, out.stderr
    assert "mesh: {'data': 4}" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trainer.epoch=3"], "unknown config key trainer.epoch. Valid keys here: trainer.epochs"),
        (["optimizer.learning_rate=-1"], "must be positive"),
        (["data.global_batch=100"], "does not divide evenly over 8 devices"),
        (["--data-dir", "/nonexistent"], "is not a directory"),
        (["run.xla_cpu_ynn_fusion=dot,bogus"], "unknown YNNPACK fusion type 'bogus' (run.xla_cpu_ynn_fusion)"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    out = run("train", "mnist", "--simulate", "8", "--run-dir", str(tmp_path), *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_cpu_library_flags_follow_the_recipe_and_yield_to_the_user():
    code = "import os, xlafit; xlafit.connect({}); print(os.environ.get('XLA_FLAGS', ''))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    flags = lambda call, **extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code.format(call)], env={**env, **extra}, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert flags("") == "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce"
    assert flags("ynn_fusion='dot'") == "--xla_cpu_experimental_ynn_fusion_type=dot"
    assert flags("cpu_fast_paths=False") == ""
    mine = "--xla_cpu_experimental_ynn_fusion_type=eltwise"
    assert flags("ynn_fusion='dot'", XLA_FLAGS=mine) == mine
    from xlafit.recipes import load_config

    assert load_config("bert").run.xla_cpu_ynn_fusion == "dot"
    assert load_config("mnist").run.xla_cpu_ynn_fusion == "dot,eltwise,reduce"


def test_config_prints_resolved_yaml():
    out = run("config", "mnist", "trainer.epochs=2")
    assert out.returncode == 0, out.stderr
    assert "epochs: 2" in out.stdout and "global_batch: 128" in out.stdout


def test_train_pulse_and_resume(tmp_path):
    """Two steps, then two more from the checkpoint: the whole CLI path, twice. The second
    process loads the train step from JAX's persistent compilation cache."""
    common = ["train", "mnist", "--simulate", "8", "--run-dir", str(tmp_path), "trainer.log_every_steps=1"]
    cache = {"XLAFIT_CACHE": str(tmp_path / "cache")}
    first = run(*common, "trainer.stop_at_step=2", env=cache)
    assert first.returncode == 0, first.stderr
    assert "per-device batch: 16   global batch: 128" in first.stdout
    assert "peak 0.002 at global batch 128" in first.stdout
    assert "train step compiled 1 time(s)" in first.stdout
    second = run(*common, "trainer.stop_at_step=4", env=cache)
    assert second.returncode == 0, second.stderr
    assert "resumed from checkpoint 2 " in second.stdout
    compiling = [float(re.search(r"([0-9.]+)s compiling", out.stdout).group(1)) for out in (first, second)]
    assert any((tmp_path / "cache" / "jax").iterdir())
    assert compiling[1] < 0.5 * compiling[0], compiling  # loaded, not compiled again
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (tmp_path / "config.yaml").exists()
