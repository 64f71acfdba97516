"""The hang watchdog (xlafit.train.watchdog): its clock in-process, and a real 2-process job
in which one process stalls while the other waits for it in a collective."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from xlafit import errors
from xlafit.config import TrainerConfig, validate_watchdog
from xlafit.errors import ConfigError
from xlafit.train.watchdog import STALL_ENV, Watchdog

# A tiny job for `xlafit launch`: a linear model on random data, thousands of short steps.
JOB = """
import sys

import numpy as np
import optax
from flax import nnx

import xlafit
from xlafit.config import TrainerConfig


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


run_dir, floor_s = sys.argv[1], float(sys.argv[2])
strategy = xlafit.connect()
rng = np.random.default_rng(0)
data = {"x": rng.normal(size=(40_000, 4)).astype(np.float32), "y": rng.integers(0, 4, 40_000).astype(np.int32)}
trainer = xlafit.Trainer(
    nnx.Linear(4, 4, rngs=nnx.Rngs(0)),
    loss_fn,
    optax.sgd(0.1),
    strategy=strategy,
    global_batch=8,
    config=TrainerConfig(epochs=1, log_every_steps=50, watchdog_floor_s=floor_s),
    run_dir=run_dir,
)
try:
    trainer.fit(data)
except xlafit.Preempted as e:
    print(e, flush=True)
    sys.exit(xlafit.errors.PREEMPTED)
finally:
    trainer.close()
"""


class TinyJob:
    """``xlafit launch`` of :data:`JOB` as 2 processes of 1 CPU device; process 0's output
    and the launcher's go to ``out.txt``, process 1's to ``logs/process-1.log``."""

    def __init__(self, tmp_path, floor_s, **env):
        (tmp_path / "job.py").write_text(JOB)
        self.out, self.log1 = tmp_path / "out.txt", tmp_path / "logs" / "process-1.log"
        self.run_dir = tmp_path / "run"
        cmd = [sys.executable, "-m", "xlafit", "launch", "--processes", "2", "--devices-per-process", "1"]
        cmd += ["--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(tmp_path / "job.py")]
        cmd += [str(self.run_dir), str(floor_s)]
        environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONUNBUFFERED": "1"} | env
        with open(self.out, "w") as out:
            # its own session, so that kill() ends the launcher and the processes it started
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ, start_new_session=True)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def wait_for(self, pattern, path=None, timeout=120):
        """Polls the output (or ``path``) until ``pattern`` appears; returns the match."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = (path or self.out).read_text() if (path or self.out).exists() else ""
            if m := re.search(pattern, text):
                return m
            assert self.proc.poll() is None, f"the job ended first:\n{self.output()[-3000:]}"
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n{self.output()[-3000:]}")

    def pid(self, process):
        return int(self.wait_for(rf"process {process} \(pid (\d+)\)").group(1))

    def output(self, process=0):
        path = self.out if process == 0 else self.log1
        return path.read_text() if path.exists() else ""


def test_watchdog_fires_after_the_floor_and_names_the_step():
    hangs = []
    with Watchdog(factor=20, floor_s=0.5, on_hang=hangs.append) as watchdog:
        watchdog.beat(step=1)
        for step in range(2, 6):
            time.sleep(0.01)
            watchdog.beat(step=step)
        stalled = time.monotonic()
        while not hangs and time.monotonic() - stalled < 5:
            time.sleep(0.01)
    fired = time.monotonic() - stalled
    assert 0.5 <= fired < 1.5, fired  # the floor: 20 x ~0.01s is less
    assert hangs[0].startswith("no call of the train step finished for ")
    assert "after step 5;" in hangs[0] and "trainer.watchdog_floor_s=0.5" in hangs[0]


def test_the_limit_follows_the_median_call_time():
    with Watchdog(factor=5, floor_s=0.01, on_hang=lambda _: None) as watchdog:
        assert watchdog.limit() == 0.01  # no call timed yet
        watchdog.beat(step=1)
        for step in range(2, 5):
            time.sleep(0.1)
            watchdog.beat(step=step)
        # three intervals of at least 0.1s each (a busy machine sleeps longer, never shorter)
        assert 0.5 <= watchdog.limit() < 2.0


def test_no_clock_before_the_first_call_nor_while_paused():
    hangs = []
    with Watchdog(factor=20, floor_s=0.2, on_hang=hangs.append) as watchdog:
        time.sleep(0.5)  # the first call compiles: not timed
        watchdog.beat(step=1)
        with watchdog.paused():  # an evaluation
            time.sleep(0.5)
        time.sleep(0.05)
        assert hangs == []
        time.sleep(0.6)  # then no call finishes
    assert len(hangs) == 1


def test_watchdog_settings_are_validated():
    validate_watchdog(TrainerConfig(watchdog_factor=0))  # off
    with pytest.raises(ConfigError, match="watchdog_factor=0.5 would take an ordinary step for a hang"):
        validate_watchdog(TrainerConfig(watchdog_factor=0.5))
    with pytest.raises(ConfigError, match="watchdog_floor_s=-1.0 must be zero or more"):
        validate_watchdog(TrainerConfig(watchdog_floor_s=-1.0))


FLOOR_S = 3.0


def test_a_stalled_peer_ends_the_job_with_stacks_from_both_and_75(tmp_path):
    """Process 1 stops after step 30 (alive, sleeping); process 0 waits for it in the next
    collective. Both watchdogs fire after the floor (20 x a ~10 ms call is less), each
    writes its stacks, and the job exits with 75 within the limit."""
    job = TinyJob(tmp_path, FLOOR_S, **{STALL_ENV: "1:30"})
    try:
        job.wait_for(r"process 1 stalls after step 30", path=job.log1)
        stalled = time.monotonic()
        # The launcher reports the first process that ended (it polls every 0.2s)
        job.wait_for(r"xlafit launch: process \d exited with code 75", timeout=60)
        elapsed = time.monotonic() - stalled
        rc = job.proc.wait(timeout=60)
    finally:
        job.kill()
    print(f"the job ended {elapsed:.1f}s after the stall (floor {FLOOR_S}s)")
    out0, out1 = job.output(0), job.output(1)
    assert rc == errors.PREEMPTED, out0[-3000:] + out1[-3000:]
    # Each process is gone by the limit (3s after its last call): measured 2.9-3.0s from the
    # stall to the launcher's report, which adds up to its 0.2s poll and the test's 0.05s.
    assert elapsed < FLOOR_S + 0.25, f"the job took {elapsed:.1f}s after the stall"
    for process, out in ((0, out0), (1, out1)):
        assert re.search(r"hang watchdog: no call of the train step finished for \d+\.\ds after step 3\d", out)
        assert f"This is process {process};" in out
        assert "Current thread" in out and "most recent call first" in out
    # Each log shows where its main thread was: the stalled one in the test hook, the one
    # that waits inside the trainer's per-call collective (or the train step's).
    assert re.search(r'watchdog\.py", line \d+ in beat', out1)
    assert re.search(r"in (requests|steps)\n", out0)
