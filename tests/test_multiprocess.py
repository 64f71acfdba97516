"""Real multi-process jobs on this machine: `xlafit launch` with gloo collectives.

Each test starts fresh processes; together they take about two and a half minutes on 2 cores.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import long_form, write_mnist_idx
from xlafit.checkpoint import Checkpointer
from xlafit.parallel.launch import free_port
from xlafit.recipes import get_recipe, load_config
from xlafit.train.optim import make_optimizer

XLAFIT = [sys.executable, "-m", "xlafit"]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return env


def launch(tmp_path, processes, devices, *train_args, timeout=600):
    cmd = [*XLAFIT, "launch", "--processes", str(processes), "--devices-per-process", str(devices)]
    cmd += ["--log-dir", str(tmp_path / "logs"), "--", *XLAFIT, "train", "mnist", *train_args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)


def single(devices, *train_args):
    cmd = [*XLAFIT, "train", "mnist", "--simulate", str(devices), *train_args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)


def params_at(run_dir, step, strategy):
    """The parameters of checkpoint ``step`` of ``run_dir``, restored onto ``strategy``."""
    import xlafit

    cfg = load_config("mnist")
    recipe = get_recipe("mnist")
    tx = make_optimizer(cfg.optimizer, 128, 248).tx  # the recipe's optimizer state structure
    trainer = xlafit.Trainer(recipe.build_model(cfg), recipe.loss_fn, tx, strategy=strategy, global_batch=128)
    ckpt = Checkpointer(run_dir / "checkpoints")
    restored, _ = ckpt.restore(trainer.state, step=step)
    ckpt.close()
    return jax.device_get(nnx.to_pure_dict(restored.params))


def assert_same(a, b, tol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        rel = np.linalg.norm(x - y) / np.linalg.norm(y)
        assert rel <= tol, f"{jax.tree_util.keystr(path)}: relative difference {rel:.2e}"


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == "train"]


COMMON = ["trainer.log_every_steps=1"]


def evals(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == "eval"}


def test_two_processes_train_evaluate_and_checkpoint_as_one_does(tmp_path, strategy8):
    """1 process x 8 devices is the reference: 2 processes x 4 devices train the first epoch
    (2 steps) to the same losses and parameters, bit for bit (the preset's
    trainer.invariant_chunks: gathers are exact; the sums happen in one fixed order); the
    epoch's evaluation of 488 test digits in batches of 256 counts every digit once (each
    process evaluates its half of every batch, the last one, 232 digits, padded and masked);
    and 1 process resumes the 2-process checkpoint to the reference's end. One 2-process job
    serves all three: each job of this file starts, imports and compiles anew, and each
    step costs about a CPU-second on 8 simulated devices, so the epochs are short.
    (The way back, 1 process to 2, restores through the same Orbax path onto the other layout;
    test_preemption's elastic restore covers 8 -> 4 -> 2 -> 1 and back in-process.)"""
    data = tmp_path / "idx"
    data.mkdir()
    write_mnist_idx(data, train=256, test=488)  # 2 steps an epoch; 2 eval batches
    args = ["--data-dir", str(data), "trainer.epochs=2", *COMMON]  # a checkpoint at each epoch's end
    reference, run = tmp_path / "ref", tmp_path / "run"
    ref = single(8, "--run-dir", str(reference), *args)
    assert ref.returncode == 0, ref.stderr
    assert [s for s, _ in losses(reference)] == list(range(1, 5)) and sorted(evals(reference)) == [2, 4]

    out = launch(tmp_path, 2, 4, "--run-dir", str(run), *args, "trainer.stop_at_step=2")
    assert out.returncode == 0, out.stderr
    assert "devices: 8 x cpu (2 process(es))" in out.stdout
    assert (tmp_path / "logs" / "process-1.log").exists()
    assert losses(run) == losses(reference)[:2]
    assert_same(params_at(run, 2, strategy8), params_at(reference, 2, strategy8), 0)
    (got,) = evals(run).values()
    want = evals(reference)[2]
    assert got["step"] == 2 and got["count"] == want["count"] == 488
    assert got["accuracy"] == want["accuracy"]
    acc = re.search(r"^test accuracy: ([0-9.]+)$", out.stdout, re.M).group(1)
    assert acc == f"{want['accuracy']:.4f}"

    # 2 processes to step 2, then 1 process on to 4: equals the uninterrupted 1-process run
    out = single(8, "--run-dir", str(run), *args)
    assert out.returncode == 0 and "resumed from checkpoint 2 " in out.stdout, out.stderr
    assert losses(run) == losses(reference)
    assert_same(params_at(run, 4, strategy8), params_at(reference, 4, strategy8), 0)


@long_form(
    34,
    covered_by="test_sharding.py's layout and checkpoint-layout tests (the layouts, in one process) and "
    "test_two_processes_train_evaluate_and_checkpoint_as_one_does (two processes)",
)
def test_fsdp_and_tensor_parallel_over_two_processes_train_as_data_parallelism(tmp_path, strategy8):
    """2 processes x 4 devices as FSDP 4 x TP 2 (each process holds half the FSDP shards of
    every parameter, a tensor group never leaves a process): the same parameters as 1
    process x 8 devices of pure data parallelism, to float rounding (XLA's collectives sum
    in a layout-dependent order; the preset's invariant_chunks is for pure DP only, and
    draws other dropout masks, so both runs turn it off). 4 steps of an epoch of 5: the
    layouts, not the data or an evaluation, are the point."""
    data = write_mnist_idx(tmp_path, train=640, test=8)
    reference = tmp_path / "dp"
    no_chunks = ("--data-dir", str(data), *COMMON, "trainer.stop_at_step=4", "trainer.invariant_chunks=null")
    assert single(8, "--run-dir", str(reference), *no_chunks).returncode == 0
    out = launch(
        tmp_path,
        2,
        4,
        *("--run-dir", str(tmp_path / "run"), *no_chunks, "mesh.fsdp=4", "mesh.tensor=2"),
    )
    assert out.returncode == 0, out.stderr
    assert "mesh: data=1 fsdp=4 tensor=2 -> parameters and optimizer state split over fsdp" in out.stdout
    got, ref = losses(tmp_path / "run"), losses(reference)
    np.testing.assert_allclose([v for _, v in got], [v for _, v in ref], rtol=1e-5)
    # restored from the 2-process FSDP x TP checkpoint onto 1 process's pure DP
    # (measured: 9e-8 relative L2 at most after these 4 AdamW steps)
    assert_same(params_at(tmp_path / "run", 4, strategy8), params_at(reference, 4, strategy8), 1e-5)


def test_killed_process_ends_the_job_with_a_clear_message(tmp_path):
    data = write_mnist_idx(tmp_path, train=512, test=8)  # quicker to load than the embedded CSV
    cmd = [*XLAFIT, "launch", "--processes", "2", "--devices-per-process", "4", "--log-dir", str(tmp_path / "logs")]
    cmd += ["--", *XLAFIT, "train", "mnist", "--data-dir", str(data), "--run-dir", str(tmp_path / "run")]
    cmd += ["trainer.epochs=50", *COMMON]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    pid = None
    for line in job.stderr:
        m = re.match(r"xlafit launch: process 1 \(pid (\d+)\)", line)
        if m:
            pid = int(m.group(1))
            break
    assert pid is not None
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # training is under way
        assert time.monotonic() < deadline and job.poll() is None, "the job did not start training"
        time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    rest = job.stderr.read()
    job.wait(timeout=120)
    elapsed = time.monotonic() - killed_at
    assert elapsed < 60, f"the job took {elapsed:.0f}s to end"
    assert "process 1 was killed by SIGKILL; stopping the other 1 process(es)" in rest
    assert job.returncode == 128 + signal.SIGKILL


def test_exit_codes_propagate(tmp_path):
    script = "import os, sys; sys.exit(3 if os.environ['XLAFIT_PROCESS_ID'] == '1' else 0)"
    cmd = [*XLAFIT, "launch", "--processes", "2", "--log-dir", str(tmp_path), "--", sys.executable, "-c", script]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=60)
    assert out.returncode == 3
    assert "process 1 exited with code 3" in out.stderr


def test_missing_peer_times_out_with_a_clear_error():
    env = {
        **_env(),
        "XLAFIT_COORDINATOR": f"127.0.0.1:{free_port()}",
        "XLAFIT_NUM_PROCESSES": "2",
        "XLAFIT_PROCESS_ID": "1",
        "XLAFIT_INIT_TIMEOUT_S": "5",
    }
    out = subprocess.run([*XLAFIT, "devices", "--simulate", "4"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert "process 1 of 2 could not join the job at 127.0.0.1:" in out.stderr
    assert "within 5s: process 0 cannot be reached" in out.stderr and "Traceback" not in out.stderr


def test_asking_to_join_where_jax_detects_no_job_names_the_variable_and_the_fixes():
    """XLAFIT_DISTRIBUTED=1 copied from the pod-slice instructions onto one host said "process
    None of None could not join the job ... within 300s" after 2 s: which setting asked for a
    job, that none was found, and what to do instead are the message."""
    env = {k: v for k, v in _env().items() if not k.startswith(("XLAFIT_", "SLURM_", "TPU_"))}
    env.update({"XLAFIT_DISTRIBUTED": "1", "JAX_PLATFORMS": "cpu"})
    out = subprocess.run([*XLAFIT, "devices"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    said = out.stderr.strip().splitlines()[-1]
    assert said.startswith("xlafit: error: XLAFIT_DISTRIBUTED=1 asks to join a multi-process job, and JAX found none")
    assert "On one host, run without XLAFIT_DISTRIBUTED" in said and "xlafit launch" in said
    assert "None of None" not in out.stderr and "Traceback" not in out.stderr


def test_process_zero_names_the_processes_that_did_not_arrive():
    # Processes 0 and 2 of 3 start; process 1 never does.
    address = f"127.0.0.1:{free_port()}"
    env = {**_env(), "XLAFIT_COORDINATOR": address, "XLAFIT_NUM_PROCESSES": "3", "XLAFIT_INIT_TIMEOUT_S": "8"}
    cmd = [*XLAFIT, "devices", "--simulate", "2"]
    procs = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "XLAFIT_PROCESS_ID": i}
        )
        for i in ("0", "2")
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert f"process(es) 1 of 3 did not join the job at {address} within 8s" in errs[0]
    assert "process 2 of 3 could not join" in errs[1]


def test_a_worker_told_another_process_count_is_warned():
    """The twenty-sixth walk: process 1 started with XLAFIT_NUM_PROCESSES=3 joined process 0's
    job of 2 without a word (JAX's service takes process 0's count)."""
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [*XLAFIT, "devices", "--simulate", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**_env(), "XLAFIT_COORDINATOR": address, "XLAFIT_NUM_PROCESSES": count, "XLAFIT_PROCESS_ID": str(i)},
        )  # fmt: skip
        for i, count in enumerate(("2", "3"))
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    said = "warning: process 1 was started with XLAFIT_NUM_PROCESSES=3, and the job it joined has 2 processes"
    assert said in errs[1]
    assert "warning" not in errs[0]


def test_job_flags_without_the_launcher():
    """Two processes started by hand with --coordinator/--num-processes/--process-id."""
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                *XLAFIT,
                "devices",
                "--simulate",
                "4",
                "--coordinator",
                address,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    for i, out in enumerate(outs):
        assert f"process {i} of 2" in out
        assert "mesh: data=8 fsdp=1 tensor=1" in out


def _by_hand(tmp_path, per_process):
    """Two processes of one job started by hand, as a pod slice's workers are: each with the
    arguments and environment ``per_process(i)`` gives it; their (exit code, stderr)."""
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(2):
        args, env = per_process(i)
        job = {"XLAFIT_COORDINATOR": address, "XLAFIT_NUM_PROCESSES": "2", "XLAFIT_PROCESS_ID": str(i)}
        cmd = [*XLAFIT, "train", "mnist", "--simulate", "4", "trainer.stop_at_step=1", *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**_env(), **job, **env}, cwd=tmp_path))  # fmt: skip
    errs = [p.communicate(timeout=300)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


def test_processes_given_other_settings_are_refused_naming_each_difference(tmp_path):
    """The twenty-sixth walk: workers started with another seed, or another global batch,
    trained a blend of two runs to the end (the gradients' shapes agree, so no collective
    failed). Every process now says which settings differ, and where, before anything trains."""
    per_process = lambda i: ([f"--run-dir={tmp_path / 'run'}", f"data.global_batch={128 // (i + 1)}",  # noqa: E731
                              f"trainer.seed={i}"], {})  # fmt: skip
    ran = _by_hand(tmp_path, per_process)
    said = (
        "the job's processes were given other settings: data.global_batch is 128 in process 0, 64 in process 1; "
        "trainer.seed is 0 in process 0, 1 in process 1. Start every process with the same command and settings"
    )
    for code, err in ran:
        assert code == 2 and said in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_run_directory_each_process_keeps_on_its_own_disk_is_refused(tmp_path):
    """The twenty-sixth walk: a run directory on each host's own disk (the same path, other
    files) left process 0's first checkpoint waiting for the others' until JAX's service
    aborted the job. Here each process has its own HOME and the run directory is ~/runs/a."""
    homes = [tmp_path / "host0", tmp_path / "host1"]
    for home in homes:
        home.mkdir()
    ran = _by_hand(tmp_path, lambda i: (["--run-dir=~/runs/a"], {"HOME": str(homes[i])}))
    for code, err in ran:
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert "is not shared by the job's processes: process(es) 1 do not see the file process 0 wrote there" in err
    assert not (homes[1] / "runs" / "a" / "checkpoints").exists()


def test_logs_go_to_the_cache_not_the_working_directory(tmp_path, monkeypatch, capsys):
    """Issue 21: `xlafit launch` wrote launch-logs/ into the working directory (a clone's tree)."""
    from xlafit.cli import main

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    script = "import os; print('I am', os.environ['XLAFIT_PROCESS_ID'])"
    assert main(["launch", "--processes", "2", "--devices-per-process", "1", "--", sys.executable, "-c", script]) == 0
    said = capsys.readouterr().err  # the walk: how to start the workers by hand was in the docs alone
    assert "xlafit launch: each process runs " in said and "XLAFIT_NUM_PROCESSES=2 XLAFIT_PROCESS_ID=<0..1>" in said
    assert list(work.iterdir()) == []
    (log_dir,) = (tmp_path / "cache" / "launch").iterdir()
    assert (log_dir / "process-1.log").read_text() == "I am 1\n"
    assert f"the output of process 1 goes to {log_dir} (--log-dir)" in said


@pytest.mark.parametrize(
    ("flags", "command", "said"),
    [
        (["--processes", "999", "--devices-per-process", "1"], ["xlafit", "devices"], "--processes 999 is more than"),
        (
            ["--processes", "2", "--devices-per-process", "2"],
            ["xlafit", "train", "mnist", "--simulate", "8"],
            "--simulate 8",
        ),
        (["--processes", "2", "--devices-per-process", "2"], ["xlafit", "devices", "--simulate=8"], "--simulate=8"),
        (["--log-dir", "a-file"], ["xlafit", "devices"], "--log-dir a-file is a file, not a folder"),
    ],
)
def test_a_launch_that_cannot_be_what_was_asked_starts_nothing(flags, command, said, tmp_path, monkeypatch, capsys):
    """999 processes on 2 cores forked them all; --simulate in the command silently replaced
    --devices-per-process (16 devices for 2 x 2); a --log-dir that is a file gave a traceback."""
    from xlafit.cli import main
    from xlafit.parallel import launch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    started = []
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: started.append(a))
    assert main(["launch", *flags, "--", *command]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err
    assert started == []


@pytest.mark.parametrize("taken", [0, 1])
def test_process_0_names_its_port_in_use_at_once(taken):
    """A port in use: the coordinator's made process 0 wait out the timeout and blame process 1;
    the rendezvous port (the coordinator's + 1) gave a bare OSError."""
    import socket

    from xlafit.errors import DeviceError
    from xlafit.parallel.cluster import Cluster, _rendezvous

    port = free_port()
    with socket.create_server(("127.0.0.1", port + taken)):
        start = time.monotonic()
        with pytest.raises(DeviceError) as e:
            _rendezvous(Cluster(f"127.0.0.1:{port}", 2, 0, timeout_s=10))
    assert time.monotonic() - start < 5
    assert f"port {port + taken} (" in str(e.value) and "Address already in use" in str(e.value)
    assert "choose another XLAFIT_COORDINATOR port (--coordinator HOST:PORT)" in str(e.value)


def test_a_job_setting_left_out_names_its_flag(monkeypatch):
    from xlafit.errors import DeviceError
    from xlafit.parallel.cluster import Cluster

    monkeypatch.delenv("XLAFIT_COORDINATOR", raising=False)
    monkeypatch.delenv("XLAFIT_PROCESS_ID", raising=False)
    monkeypatch.setenv("XLAFIT_NUM_PROCESSES", "2")
    with pytest.raises(
        DeviceError, match=r"XLAFIT_COORDINATOR \(--coordinator\), XLAFIT_PROCESS_ID \(--process-id\) are"
    ):
        Cluster.from_env()
