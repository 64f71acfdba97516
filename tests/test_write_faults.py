"""A run whose files cannot be written: a full disk (a small tmpfs, really full) and a read-only
run directory, at the start, at a resume and mid-run. Each is one line naming the file and the
fix, exit 74 (STORAGE: the same command resumes once it is fixed), no traceback, no file left
empty; and the words after a fault say what happened (a checkpoint whose checksums could not be
written, a signal during the final evaluation, an unreadable checkpoint's TensorStore spec)."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from helpers import cnn_trainer
from xlafit import errors
from xlafit.checkpoint import SEAL, Checkpointer
from xlafit.data import mnist
from xlafit.errors import STORAGE, CheckpointWriteError, Preempted, WriteError
from xlafit.recipes import load_config
from xlafit.rundir import make_run_dir, start_run_dir
from xlafit.train.report import RunReport

XLAFIT = [sys.executable, "-m", "xlafit"]


class Disk:
    """A tmpfs of ``size`` at ``path`` (root only): :meth:`fill` takes its last free byte,
    :meth:`read_only` remounts it read-only."""

    def __init__(self, path, size):
        self.path = path
        path.mkdir()
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (root and mount rights needed): {out.stderr.decode().strip()}")

    def fill(self):
        try:
            with open(self.path / ".filler", "ab") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC

    def read_only(self):
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def remove(self):
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def disk(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real full or read-only disk needs a tmpfs, which only root can mount")
    made = Disk(tmp_path / "disk", "160m")  # three MNIST checkpoints and their run
    yield made
    made.remove()


@pytest.fixture(scope="module")
def idx_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("idx")
    raw = mnist.load_embedded()
    for split, prefix, n in (("train", "train", 256), ("test", "t10k", 64)):
        images = np.round((raw[split]["image"][:n, :, :, 0] * mnist.STD + mnist.MEAN) * 255).astype(np.uint8)
        mnist.write_idx(directory / f"{prefix}-images-idx3-ubyte", images)
        mnist.write_idx(directory / f"{prefix}-labels-idx1-ubyte", raw[split]["label"][:n].astype(np.uint8))
    return directory


def train(run_dir, idx_dir, *extra):
    cmd = [*XLAFIT, "train", "mnist", "--simulate", "1", "--data-dir", str(idx_dir), "--run-dir", str(run_dir)]
    cmd += ["data.global_batch=64", "data.eval_global_batch=64", "trainer.invariant_chunks=null", "trainer.epochs=2"]
    environment = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([*cmd, *extra], capture_output=True, text=True, env=environment, timeout=300)


def test_a_resume_on_a_full_disk_is_one_line_exit_74_and_config_yaml_stays_whole(disk, idx_dir):
    """It was OSError [Errno 28]'s traceback, exit 1 (from metrics.jsonl's rewrite or from
    config.yaml, which was left empty)."""
    run_dir = disk.path / "run"
    first = train(run_dir, idx_dir, "trainer.stop_at_step=3")
    assert first.returncode == 0, first.stderr[-3000:]
    config = (run_dir / "config.yaml").read_text()
    disk.fill()
    out = train(run_dir, idx_dir)
    assert out.returncode == STORAGE, out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    error = out.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"xlafit: error: cannot write {run_dir}/"), out.stderr
    assert "No space left on device. Free disk space, then run the same command again to resume." in error[0]
    assert (run_dir / "config.yaml").read_text() == config  # whole, not emptied
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_config_yaml_on_a_full_disk_keeps_the_earlier_one(disk):
    run_dir = disk.path / "run"
    cfg = load_config("mnist", [f"run.run_dir={run_dir}"])
    start_run_dir(run_dir, cfg)
    before = (run_dir / "config.yaml").read_text()
    disk.fill()
    with pytest.raises(WriteError, match=r"cannot write .*config\.yaml: No space left on device\. Free disk space"):
        start_run_dir(run_dir, cfg)
    assert (run_dir / "config.yaml").read_text() == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]


def test_metrics_rewrite_and_append_on_a_full_disk_name_metrics_jsonl(disk):
    run_dir = disk.path / "run"
    run_dir.mkdir()
    records = [json.dumps({"split": "train", "step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(records) * 30)  # past one page: the rewrite needs new ones
    disk.fill()
    with pytest.raises(WriteError, match=r"cannot write .*metrics\.jsonl: No space left on device"):
        RunReport(run_dir, total_steps=10, start_step=1)  # drops steps 2 and 3: a rewrite
    assert (run_dir / "metrics.jsonl").read_text() == "".join(records) * 30  # untouched
    assert not (run_dir / "metrics.jsonl.tmp").exists()
    (disk.path / ".filler").unlink()
    report = RunReport(run_dir, total_steps=10_000, start_step=3)
    disk.fill()
    with pytest.raises(WriteError, match=r"cannot write .*metrics\.jsonl: No space left on device\. Free disk space"):
        for step in range(4, 10_000):  # appends fill the file's last page, then it needs another
            report.record({"step": step, "loss": 0.5, "note": "x" * 200})
    with pytest.raises(WriteError, match=r"metrics\.jsonl"):  # what was left to write: named again, not a traceback
        report.close()


def test_a_read_only_run_directory_at_resume_says_to_make_it_writable(disk):
    """It said "Choose another --run-dir", which abandons the run."""
    run_dir = disk.path / "run"
    cfg = load_config("mnist", [f"run.run_dir={run_dir}"])
    start_run_dir(run_dir, cfg)
    disk.read_only()
    with pytest.raises(WriteError) as refused:
        make_run_dir(run_dir, cfg)
    assert "is not writable" in str(refused.value) and "make it writable" in str(refused.value)
    assert "another --run-dir" not in str(refused.value) and refused.value.exit_code == STORAGE
    # A finished run needs no writes: the message says what reads it as it is, not only "resume".
    assert "`xlafit generate`, `inspect` and `export` read it" in str(refused.value)


def test_a_failure_writing_metrics_is_named_as_such_and_tensorboard_is_closed(disk, strategy1, tmp_path):
    """A full disk first hit by metrics.jsonl or TensorBoard was reported as a checkpoint that failed (or as
    OSError's traceback), and TensorBoard's writer, left open, printed tracebacks at exit."""
    import optax
    from flax import nnx

    import xlafit
    from xlafit.config import TrainerConfig
    from xlafit.recipes import mnist as mnist_recipe

    train_data = {k: v[:256] for k, v in mnist.load_embedded()["train"].items()}

    def trainer(stop_at_step):
        return xlafit.Trainer(
            xlafit.models.MnistCNN(rngs=nnx.Rngs(params=0, dropout=1)),
            mnist_recipe.loss_fn,
            optax.adam(1e-3),
            strategy=strategy1,
            global_batch=64,
            config=TrainerConfig(epochs=100, stop_at_step=stop_at_step, log_every_steps=1, checkpoint_every_steps=4),
            run_dir=disk.path / "run",  # metrics and TensorBoard on the full disk
            checkpoint_dir=tmp_path / "checkpoints",  # checkpoints where there is room
        )

    first = trainer(4)
    first.fit(train_data)
    first.close()
    disk.fill()
    resumed = trainer(None)
    with pytest.raises(WriteError) as failed:
        resumed.fit(train_data)
    resumed.close()
    message = str(failed.value)
    run = disk.path / "run"
    assert any(
        f"cannot write {run / name}: No space left on device" in message for name in ("metrics.jsonl", "tensorboard")
    )
    assert "checkpoint" not in message
    writers = [t for t in threading.enumerate() if type(t).__name__ == "_EventLoggerThread" and t.is_alive()]
    assert writers == []  # closed before the error left fit


def test_a_checkpoint_whose_checksums_cannot_be_written_is_named_as_written(disk):
    """It said "writing checkpoint 1 failed; no earlier checkpoint exists" of a checkpoint
    that was complete (and which the next run resumed from). The seal is written right after
    the commit, so the window is the seal's own write: a checkpoint committed and not sealed
    when the disk filled (its seal removed here) is the one the error reports."""
    ckpt = Checkpointer(disk.path / "checkpoints", async_save=False)
    ckpt.save(1, {"w": np.arange(1000.0)})
    ckpt.wait()
    (disk.path / "checkpoints" / "1" / SEAL).unlink()  # committed, its seal never written
    disk.fill()
    failed = ckpt._failed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    message = str(failed)
    assert isinstance(failed, CheckpointWriteError)
    assert f"checkpoint 1 in {disk.path / 'checkpoints'} was written, but not its checksums ({SEAL})" in message
    assert "a resume loads checkpoint 1" in message and "no earlier checkpoint" not in message
    assert "Free disk space" in message and failed.exit_code == STORAGE
    (disk.path / ".filler").unlink()
    assert ckpt.restore({"w": np.zeros(1000)})[1] == 1
    ckpt.close()


class SignalOnFinalEvaluation:
    """Evaluation data that sends this process SIGTERM when the final evaluation takes its
    second batch (the first ``take`` is the eval step's compile, before training)."""

    def __init__(self, arrays):
        self.arrays, self.takes = arrays, 0

    def __len__(self):
        return len(self.arrays["label"])

    def take(self, idx, epoch=0):
        self.takes += 1
        if self.takes == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return {k: v[idx] for k, v in self.arrays.items()}


def test_sigterm_during_the_final_evaluation_stops_with_75_and_a_rerun_evaluates(strategy1, tmp_path):
    """It exited 0 after its message promised a checkpoint."""
    data = mnist.load_embedded()
    train_data = {k: v[:128] for k, v in data["train"].items()}
    test = SignalOnFinalEvaluation({k: v[:256] for k, v in data["test"].items()})
    trainer = cnn_trainer(strategy1, tmp_path, epochs=1, eval_every_epochs=100)
    with pytest.raises(Preempted) as stopped:
        trainer.fit(train_data, eval=test)
    trainer.close()
    assert stopped.value.exit_code == errors.PREEMPTED
    assert "SIGTERM received: stopped at step 2; the final evaluation did not finish; the training is done: " in str(
        stopped.value
    )
    assert f"checkpoint 2 in {tmp_path / 'checkpoints'} holds its last step" in str(stopped.value)
    again = cnn_trainer(strategy1, tmp_path, epochs=1, eval_every_epochs=100)
    result = again.fit(train_data, eval={k: v[:256] for k, v in data["test"].items()})
    again.close()
    assert result.eval["count"] == 256 and int(result.state.step) == 2


def test_inspect_of_an_unreadable_checkpoint_leaves_out_the_tensorstore_spec(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints")
    ckpt.save(1, {"params": {"w": np.arange(4096, dtype=np.float32)}})
    ckpt.wait()
    ckpt.close()
    (tmp_path / "checkpoints" / "1" / SEAL).unlink()  # unsealed: only reading it tells
    data = [p for p in (tmp_path / "checkpoints" / "1" / "default").rglob("*") if p.is_file()]
    os.truncate(max(data, key=os.path.getsize), 10)
    environment = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([*XLAFIT, "inspect", str(tmp_path)], capture_output=True, text=True, env=environment)
    assert "checkpoint 1 is unreadable (ValueError: " in out.stderr + out.stdout
    assert "tensorstore_spec" not in out.stderr + out.stdout
    assert max(len(line) for line in (out.stderr + out.stdout).splitlines()) < 600
