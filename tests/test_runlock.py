"""One training per run directory: a second `xlafit train` there is refused naming the first's
host and process; the lock outlives no process (kill -9 included); a gs:// lock that its holder
stopped renewing is taken over, saying so."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from xlafit import runlock
from xlafit.data import mnist
from xlafit.errors import BUSY, RunDirBusy
from xlafit.io.paths import as_path
from xlafit.runlock import LOCK, hold_run_dir

XLAFIT = [sys.executable, "-m", "xlafit"]


@pytest.fixture(scope="module")
def idx_dir(tmp_path_factory):
    """512 training and 128 test digits as IDX files."""
    directory = tmp_path_factory.mktemp("idx")
    raw = mnist.load_embedded()
    for split, prefix, n in (("train", "train", 512), ("test", "t10k", 128)):
        images = np.round((raw[split]["image"][:n, :, :, 0] * mnist.STD + mnist.MEAN) * 255).astype(np.uint8)
        mnist.write_idx(directory / f"{prefix}-images-idx3-ubyte", images)
        mnist.write_idx(directory / f"{prefix}-labels-idx1-ubyte", raw[split]["label"][:n].astype(np.uint8))
    return directory


def train_cmd(run_dir, idx_dir, *extra):
    return [
        *XLAFIT,
        *("train", "mnist", "--simulate", "1", "--data-dir", str(idx_dir), "--run-dir", str(run_dir)),
        *("data.global_batch=64", "data.eval_global_batch=128", "trainer.invariant_chunks=null"),
        *("trainer.epochs=200", "trainer.log_every_steps=1", "trainer.checkpoint_every_steps=2"),
        *extra,
    ]


def env():
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONUNBUFFERED": "1"}


def test_a_second_train_in_the_run_dir_is_refused_naming_the_first_and_kill_9_frees_it(tmp_path, idx_dir):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        train_cmd(run_dir, idx_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env()
    )
    lines, training = [], threading.Event()

    def read():
        for line in first.stdout:
            lines.append(line)
            if line.startswith("[train]") and "step 3 " in line:
                training.set()
        training.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert training.wait(timeout=180) and first.poll() is None, "".join(lines)[-3000:]
        second = subprocess.run(train_cmd(run_dir, idx_dir), capture_output=True, text=True, env=env(), timeout=180)
        assert second.returncode == BUSY, second.stderr[-3000:]
        error = second.stderr.strip().splitlines()
        assert len(error) == 1, second.stderr  # one line, no traceback
        assert f"in use by process {first.pid} on {socket.gethostname()}" in error[0]
        assert "train mnist" in error[0]  # the first's command
        assert "[train]" not in second.stdout
        assert first.poll() is None  # the first trains on, its checkpoints untouched
        held = json.loads((run_dir / LOCK).read_text())
        assert held["pid"] == first.pid and held["host"] == socket.gethostname()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # The kernel released the dead process's lock: the same command takes the run over.
    third = subprocess.run(
        train_cmd(run_dir, idx_dir, "trainer.stop_at_step=1"), capture_output=True, text=True, env=env(), timeout=180
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resumed from checkpoint" in third.stdout
    assert json.loads((run_dir / LOCK).read_text())["pid"] != first.pid  # the third run held it


def test_restart_moves_the_run_aside_and_the_lock_stays(tmp_path):
    from xlafit.rundir import move_aside

    run = as_path(tmp_path / "run")
    (run / "checkpoints" / "5").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with hold_run_dir(run):
        move_aside(run, run / "checkpoints")
        assert sorted(p.name for p in run.iterdir()) == [LOCK]
        with pytest.raises(RunDirBusy):  # still held while the new run starts
            with hold_run_dir(run):
                pass
    with hold_run_dir(run):  # released at the end of the block
        pass


def test_a_gs_lock_refuses_a_second_run_and_a_lapsed_one_is_taken_over(gcs, monkeypatch):
    run = f"{gcs.bucket}/runs/a"
    first = runlock._UrlLock(as_path(run))
    assert first.acquire() == []
    with pytest.raises(RunDirBusy) as refused:
        with hold_run_dir(as_path(run)):
            pass
    assert f"in use by process {os.getpid()} on {socket.gethostname()}" in str(refused.value)
    # The first holder dies without releasing: its renewals stop, the lease runs out.
    first._stop.set()
    monkeypatch.setattr(runlock, "LEASE_S", 0.0)
    with hold_run_dir(as_path(run)) as lines:
        assert len(lines) == 1 and lines[0].startswith(f"took over the lock of {run} from process {os.getpid()}")
        assert "ended without releasing it" in lines[0]
        monkeypatch.setattr(runlock, "LEASE_S", 300.0)
        with pytest.raises(RunDirBusy):  # the new holder's lock is live
            with hold_run_dir(as_path(run)):
                pass
    assert not as_path(f"{run}/{LOCK}").exists()  # released at the end


def test_a_gs_lock_is_renewed_by_its_holder(gcs, monkeypatch):
    run = as_path(f"{gcs.bucket}/runs/b")
    lock = runlock._UrlLock(run)
    lock.acquire()
    try:
        before = lock.generation
        lock._renew()
        assert lock.generation != before
        holder, generation, age = lock._read()
        assert generation == lock.generation and holder["pid"] == os.getpid() and age < 60
    finally:
        lock.release()
