"""Every path a gs:// URL, against a real GCS API server on 127.0.0.1 (fake-gcs-server, the
``gcs`` fixture of conftest.py): MNIST and the MLM pipeline with their run directories,
data and checkpoints in a bucket, killed and resumed; ``--restart`` moving runs aside; and
the errors of a missing bucket, a read-only bucket and a server that goes away.

Nothing here leaves 127.0.0.1: the GCS clients are pointed at the local server and the
metadata-server probes at a closed local port (``FakeGCS.env``).
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from xlafit.checkpoint import Checkpointer, fingerprint
from xlafit.cli import main
from xlafit.data import mnist
from xlafit.data.mnist import load_idx_dir
from xlafit.errors import CheckpointError, ConfigError, DataError
from xlafit.hf import bert as bert_hf
from xlafit.io.paths import as_path, filesystem, upload
from xlafit.recipes import load_config
from xlafit.rundir import local_log, start_run_dir

XLAFIT = [sys.executable, "-m", "xlafit"]
STRESS = os.environ.get("XLAFIT_STRESS") == "1"  # longer variants: more kills, more steps


def env(gcs, tmp_path):
    """A subprocess's environment: the server's settings, the split cache in ``tmp_path`` and
    the user's JAX compilation cache (programs other runs compiled load instead)."""
    from xlafit.io.cache import cache_dir

    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return (
        base
        | gcs.env
        | {
            "PYTHONUNBUFFERED": "1",
            "XLAFIT_CACHE": str(tmp_path / "cache"),
            "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", str(cache_dir() / "jax")),
        }
    )


def write_idx_dir(directory, n_train=128, n_test=64):
    """The first digits of the embedded set as IDX files, under a local path or a URL."""
    raw = mnist.load_embedded()
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images = np.round((raw[split]["image"][:n, :, :, 0] * mnist.STD + mnist.MEAN) * 255).astype(np.uint8)
        mnist.write_idx(f"{directory}/{prefix}-images-idx3-ubyte", images)
        mnist.write_idx(f"{directory}/{prefix}-labels-idx1-ubyte", raw[split]["label"][:n].astype(np.uint8))


def mnist_cmd(run_dir, data_dir, *extra):
    return [
        *XLAFIT,
        *("train", "mnist", "--simulate", "1", "--data-dir", str(data_dir), "--run-dir", str(run_dir)),
        *("data.global_batch=64", "data.eval_global_batch=64", "trainer.invariant_chunks=null"),
        *("trainer.epochs=2", "trainer.log_every_steps=1", "trainer.checkpoint_every_steps=1"),
        *extra,
    ]


def inspect_json(target):
    """``xlafit inspect TARGET --json``, in this process (the test's environment has the server)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["inspect", str(target), "--json"])
    return code, json.loads(out.getvalue())


def metrics(run_dir):
    return [json.loads(line) for line in as_path(f"{run_dir}/metrics.jsonl").read_text().splitlines()]


class Segment:
    """A training command whose output is watched, to kill it while it trains."""

    def __init__(self, cmd, env):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.reached = threading.Event()
        self.at = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.at is not None and line.startswith(f"[train] step {self.at} "):
                self.reached.set()
        self.reached.set()  # the process ended

    def kill_at(self, step, timeout=240):
        self.at = step
        assert self.reached.wait(timeout), "no progress"
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        return "".join(self.lines)


def test_mnist_on_gcs_killed_resumes_bit_exact_and_logs_every_step_once(gcs, tmp_path):
    """Data, run directory and checkpoints in the bucket; kill -9 at step 3, resumed to the
    end (2 epochs of 2 steps): the parameters of an uninterrupted local run, bit for bit, and
    every step once in the bucket's metrics.jsonl."""
    data = f"{gcs.bucket}/mnist"
    write_idx_dir(data)
    run = f"{gcs.bucket}/runs/a"
    environment = env(gcs, tmp_path)
    killed = Segment(mnist_cmd(run, data), environment).kill_at(3)
    assert f"run directory: {run}" in killed  # not gs:/...
    resumed = subprocess.run(mnist_cmd(run, data), capture_output=True, text=True, env=environment)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint" in resumed.stdout
    local = subprocess.run(mnist_cmd(tmp_path / "local", data), capture_output=True, text=True, env=environment)
    assert local.returncode == 0, local.stderr[-3000:]

    code, report = inspect_json(run)
    assert code == 0 and report["fingerprint"]["step"] == 4
    assert report["fingerprint"] == inspect_json(tmp_path / "local")[1]["fingerprint"]
    records = metrics(run)
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 5))
    assert [r["step"] for r in records if r["split"] == "eval"] == [2, 4]
    fs, root = filesystem(run)
    events = fs.find(f"{root}/tensorboard")
    assert events and all(fs.size(e) > 0 for e in events)
    assert "recipe: mnist" in as_path(f"{run}/config.yaml").read_text()

    # --restart moves the whole run aside, in the bucket; its checkpoints stay readable
    cfg = load_config("mnist", [f"run.run_dir={run}", "run.resume=false"])
    start_run_dir(as_path(run), cfg)
    fs.invalidate_cache()
    siblings = [p for p in fs.ls(f"{root.rsplit('/', 1)[0]}") if "a-before-restart-" in p]
    assert len(siblings) == 1
    moved = f"gs://{siblings[0]}"
    assert inspect_json(moved)[1]["fingerprint"] == report["fingerprint"]
    assert len(metrics(moved)) == len(records)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root)) == ["config.yaml"]  # the new run's only


@pytest.mark.skipif(not STRESS, reason="about 40 s: XLAFIT_STRESS=1 runs it (the suite's 25-minute budget)")
def test_mlm_pipeline_on_gcs_tokenizer_shards_train_kill_resume_export(gcs, tmp_path):
    """Text in the bucket -> tokenizer -> shards -> a tiny BERT trained from and into the
    bucket, kill -9, resume -> export to the bucket; the exported weights are the checkpoint's."""
    from flax import nnx

    from xlafit.data.mlm import prepare
    from xlafit.data.text import expand_inputs, korean_demo_files
    from xlafit.data.tokenizer import train_tokenizer
    from xlafit.export import export_hf
    from xlafit.io.paths import download_dir

    b = gcs.bucket
    t0 = time.monotonic()
    for f in korean_demo_files()[:4]:
        as_path(f"{b}/corpus/{os.path.basename(f)}").write_bytes(open(f, "rb").read())
    files = expand_inputs([f"{b}/corpus/*.txt"])
    assert len(files) == 4 and all(f.startswith(f"{b}/corpus/") for f in files)
    train_tokenizer(files, 800, f"{b}/tok", show_progress=False)
    manifest = prepare(f"{b}/tok", files, f"{b}/mlm", seq_len=32, eval_fraction=0.2, show_progress=False)
    assert manifest["splits"]["train"]["sequences"] >= 64
    print(f"tokenizer and shards: {time.monotonic() - t0:.1f}s")

    run = f"{b}/runs/bert"
    cmd = [
        *XLAFIT,
        *("train", "bert", "--simulate", "1", "--data-dir", f"{b}/mlm", "--run-dir", run),
        *("data.global_batch=16", "trainer.log_every_steps=1", "trainer.checkpoint_every_steps=2"),
        *("trainer.stop_at_step=6", "trainer.steps_per_call=1"),
    ]
    environment = env(gcs, tmp_path)
    t0 = time.monotonic()
    Segment(cmd, environment).kill_at(5)
    t1 = time.monotonic()
    intact = [c["step"] for c in inspect_json(run)[1]["checkpoints"] if c["status"] == "intact"]
    resumed = subprocess.run(cmd, capture_output=True, text=True, env=environment)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from checkpoint {intact[-1]}" in resumed.stdout
    print(f"killed after {t1 - t0:.1f}s, resumed in {time.monotonic() - t1:.1f}s")
    assert [r["step"] for r in metrics(run) if r["split"] == "train"] == list(range(1, 7))

    t0 = time.monotonic()
    out, step, *_ = export_hf(run, f"{b}/hf")
    assert step == 6
    local = download_dir(f"{b}/hf", tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "xlafit-config.yaml"} <= {
        p.name for p in local.iterdir()
    }
    exported = fingerprint(nnx.state(bert_hf.from_hf(local), nnx.Param))
    assert exported == inspect_json(run)[1]["fingerprint"]["sha256"]
    print(f"export: {time.monotonic() - t0:.1f}s")


def test_restart_moves_a_local_run_aside_and_inspect_reads_it(tmp_path, capsys):
    run = tmp_path / "run"
    ckpt = Checkpointer(run / "checkpoints", async_save=False)
    ckpt.save(5, {"params": {"w": np.arange(4, dtype=np.float32)}})
    ckpt.wait()
    ckpt.close()
    (run / "metrics.jsonl").write_text('{"split": "train", "step": 5}\n')
    cfg = load_config("mnist", [f"run.run_dir={run}", "run.resume=false"])
    start_run_dir(as_path(run), cfg)
    said = capsys.readouterr().out
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run-before-restart-")]
    assert len(moved) == 1 and str(moved[0]) in said and "nothing was deleted" in said
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]
    assert (moved[0] / "metrics.jsonl").read_text() == '{"split": "train", "step": 5}\n'
    code, report = inspect_json(moved[0])
    expected = fingerprint({"w": np.arange(4, dtype=np.float32)})
    assert code == 0 and report["fingerprint"] == {"step": 5, "sha256": expected}


def test_a_process_log_in_a_bucket_keeps_an_earlier_attempts_lines(gcs):
    """The twenty-sixth walk: after a preemption and a resume, a bucket's process-1.log held
    the second attempt's lines alone (the upload replaced the object; a local log appends)."""
    target = as_path(f"{gcs.bucket}/run/process-1.log")
    target.write_text("22:46 the first attempt, up to its SIGTERM\n")
    local = local_log(target)
    with local.open("a") as f:
        f.write("22:47 resumed\n")
    upload(local, target)
    assert target.read_text() == "22:46 the first attempt, up to its SIGTERM\n22:47 resumed\n"
    assert not local_log(as_path(f"{gcs.bucket}/run/process-2.log")).exists()  # none before: a new file


def test_missing_bucket_is_named_and_never_created(gcs):
    missing = "gs://xlafit-no-such-bucket"
    cfg = load_config("mnist", [f"run.run_dir={missing}/run"])
    with pytest.raises(ConfigError, match=f"--run-dir {missing}/run: the bucket {missing} does not exist"):
        start_run_dir(as_path(f"{missing}/run"), cfg)
    with pytest.raises(CheckpointError, match=f"{missing}/ckpt: the bucket {missing} does not exist"):
        Checkpointer(f"{missing}/ckpt")
    assert main(["inspect", f"{missing}/run"]) == 2
    with pytest.raises(DataError, match=f"--data-dir {missing}/mnist: the bucket {missing} does not exist"):
        load_idx_dir(f"{missing}/mnist")  # the walk: "is not a directory"
    fs, _ = filesystem(missing)
    fs.invalidate_cache()
    assert not fs.exists("xlafit-no-such-bucket")  # gcsfs's mkdir would have made it


def test_an_export_into_a_bucket_folder_of_other_files_is_refused_before_any_work(gcs, tmp_path, capsys):
    """The export's files would have gone up beside them (a README, another model's weights)."""
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer.json").write_text("{}")
    (run / "config.yaml").write_text(yaml.safe_dump(load_config("llm", []).to_dict() | {"recipe": "llm"}))
    as_path(f"{gcs.bucket}/notes/README.md").write_text("mine")
    assert main(["export", "hf", str(run), "--out", f"{gcs.bucket}/notes"]) == 2
    assert f"--out {gcs.bucket}/notes holds files that are not an xlafit export" in capsys.readouterr().err
    assert as_path(f"{gcs.bucket}/notes/README.md").read_text() == "mine"


def test_a_machine_without_credentials_is_told_how_to_get_them(gcs, capsys, monkeypatch):
    """GCS answers a caller with no credentials 401 ("Anonymous caller does not have ...");
    that is not a missing role but missing credentials, and the fix differs."""
    front = Front(gcs.url, lambda method, path: "401")
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", front.url)
        gcs.forget_clients()
        assert main(["inspect", f"{gcs.bucket}/run"]) == 2
    finally:
        front.close()
        gcs.forget_clients()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("xlafit:")]
    assert len(lines) == 1 and f"{gcs.bucket}/run refused this machine: it has no Google credentials" in lines[0], err
    assert "gcloud auth application-default login" in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize(
    "command, named",
    [
        (
            ["train", "mnist", "--run-dir", "{bucket}/run", "trainer.epochs=1"],
            "cannot take the run directory's lock: the storage service for {bucket}/run",
        ),
        (["generate", "{bucket}/run", "--prompt", "hi"], "cannot read {bucket}/run"),
        (["export", "hf", "{bucket}/run", "--out", "{tmp}/out"], "cannot read {bucket}/run"),
        (["inspect", "{bucket}/run"], "cannot read {bucket}/run"),
        (["train", "mnist", "--data-dir", "{bucket}/mnist"], "cannot read --data-dir {bucket}/mnist"),
    ],
    ids=["train", "generate", "export", "inspect", "mnist-data"],
)
def test_a_bucket_whose_server_is_gone_is_one_line(gcs, capsys, monkeypatch, tmp_path, command, named):
    """The run directory's server unreachable: each command's first access to it (is there a
    run to resume, is it a run) is one line naming it; train and generate printed the HTTP
    client's traceback."""
    import gcsfs.retry

    monkeypatch.setattr(gcsfs.retry, "is_retriable", lambda e: False)  # else 30 s of retries
    gcs.stop()
    try:
        gcs.forget_clients()
        code = main([part.format(bucket=gcs.bucket, tmp=tmp_path) for part in command])
    finally:
        gcs.start()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("xlafit:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert named.format(bucket=gcs.bucket) in lines[0] and "cannot be reached" in lines[0], lines


def test_mnist_data_dir_that_is_not_in_the_bucket_is_named(gcs):
    from xlafit.data import mnist

    with pytest.raises(DataError, match=f"--data-dir {gcs.bucket}/nothing-here is not a directory"):
        mnist.load_idx_dir(f"{gcs.bucket}/nothing-here")


def test_server_gone_at_a_save_names_the_url_and_the_last_checkpoint_survives(gcs, monkeypatch):
    """The server goes away after checkpoint 1 and before checkpoint 2 is written.

    gcsfs retries a refused connection for about 30 s (1 + 2 + 4 + 8 + 16 s of backoff); the
    test makes it give up at once, so that the error arrives in a second. A server that dies
    while TensorStore is writing the arrays is retried by TensorStore itself, for minutes
    (its default), before the same error: too long for this suite."""
    import gcsfs.retry

    monkeypatch.setattr(gcsfs.retry, "is_retriable", lambda e: False)
    directory = f"{gcs.bucket}/ckpt"
    ckpt = Checkpointer(directory, keep=5)
    state = {"params": {"w": np.arange(200_000, dtype=np.float32)}}
    ckpt.save(1, state)
    ckpt.wait()
    gcs.stop()
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, {"params": {"w": state["params"]["w"] + 1}})
        ckpt.wait()
    with contextlib.suppress(Exception):  # stops Orbax's threads of the failed save
        ckpt.close()
    message = str(err.value)
    assert f"writing checkpoint 2 in {directory} failed" in message and "cannot be reached" in message, message
    assert "Run again to resume" in message
    gcs.start()
    after = Checkpointer(directory, keep=5)
    assert [i.step for i in after.list() if i.status == "intact"] == [1]
    restored, step = after.restore({"params": {"w": np.zeros(200_000, np.float32)}})
    assert step == 1 and restored["params"]["w"].tolist() == state["params"]["w"].tolist()
    after.close()


class Front:
    """An HTTP front of the local server that passes every request, except that
    ``verdict(method, path)`` may answer ``"403"`` (GCS's refusal of a write), ``"401"`` (its
    answer to a caller with no credentials, on a bucket that is not public) or ``"dead"``
    (the connection closed unanswered, as a server that went away). fake-gcs-server has no IAM
    and cannot be made to die on cue; the clients still talk real HTTP to the real server."""

    def __init__(self, upstream, verdict):
        import http.server
        import urllib.parse
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                answer = verdict(self.command, urllib.parse.unquote(self.path))
                if answer == "dead":
                    self.close_connection = True
                    return
                if answer in ("401", "403"):
                    message = {
                        "401": "Anonymous caller does not have storage.objects.list access to the Google Cloud "
                        "Storage bucket. Permission 'storage.objects.list' denied on resource (or it may not exist).",
                        "403": "caller does not have storage.objects.create access",
                    }[answer]
                    data = json.dumps({"error": {"code": int(answer), "message": message}}).encode()
                    self.send_response(int(answer))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return
                skip = {"host", "content-length", "connection", "accept-encoding"}
                sent = {k: v for k, v in self.headers.items() if k.lower() not in skip}  # Range, Content-Type...
                request = urllib.request.Request(upstream + self.path, data=body, headers=sent, method=self.command)
                try:
                    response = opener.open(request, timeout=30)
                    status, headers, data = response.status, response.headers, response.read()
                except urllib.error.HTTPError as e:
                    status, headers, data = e.code, e.headers, e.read()
                self.send_response(status)
                for key, value in headers.items():
                    if key.lower() not in ("content-length", "connection", "transfer-encoding", "date", "server"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that hung up on an answer: its business
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def read_only(method, path):
    """A service account with roles/storage.objectViewer only: every write refused."""
    return None if method in ("GET", "HEAD") else "403"


def test_server_gone_in_the_middle_of_a_save_names_the_url_and_the_last_checkpoint_survives(gcs, monkeypatch):
    """The server goes away while TensorStore writes checkpoint 2's arrays (after its first
    write under ``ckpt/2``). TensorStore retries for minutes by default (32 tries, up to 32 s
    apart); its ``gcs_request_retries`` context resource, set in Orbax's default contexts, makes
    it give up in a second here. The error names the URL, and checkpoint 1 restores."""
    import gcsfs.retry
    from orbax.checkpoint._src.serialization import tensorstore_utils

    retries = {"max_retries": 2, "initial_delay": "10ms", "max_delay": "50ms"}
    for context in (tensorstore_utils._BASE_TS_CONTEXT, tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
        monkeypatch.setitem(context, "gcs_request_retries", retries)
    monkeypatch.setattr(gcsfs.retry, "is_retriable", lambda e: False)
    writes_of_2 = []

    def dies_during_save_2(method, path):
        # Orbax's own metadata files go first (gcsfs); the array data are TensorStore's OCDBT
        # files under d/: the server dies at the first of those.
        if method not in ("GET", "HEAD") and "ckpt/2" in path:
            writes_of_2.append(path)
        return "dead" if any("/d/" in w for w in writes_of_2) else None

    front = Front(gcs.url, dies_during_save_2)
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", front.url)
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", front.url)
        gcs.forget_clients()
        directory = f"{gcs.bucket}/ckpt"
        ckpt = Checkpointer(directory, keep=5)
        state = {"params": {"w": np.arange(200_000, dtype=np.float32)}}
        ckpt.save(1, state)
        ckpt.wait()
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as err:
            ckpt.save(2, {"params": {"w": state["params"]["w"] + 1}})
            ckpt.wait()
        with contextlib.suppress(Exception):
            ckpt.close()
        print(f"the failed save ended {time.monotonic() - t0:.1f}s after it began; writes under ckpt/2: {writes_of_2}")
        assert any("/d/" in w for w in writes_of_2), f"no array data of checkpoint 2 written: {writes_of_2}"
        message = str(err.value)
        assert f"writing checkpoint 2 in {directory} failed: the storage service" in message, message
        assert "cannot be reached" in message and "Run again to resume" in message, message
        assert "tensorstore_spec" not in message, message
    finally:
        front.close()
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", gcs.url)
        gcs.forget_clients()
    after = Checkpointer(directory, keep=5)  # the server itself never stopped: straight to it
    assert [i.step for i in after.list() if i.status == "intact"] == [1]
    restored, step = after.restore({"params": {"w": np.zeros(200_000, np.float32)}})
    assert step == 1 and restored["params"]["w"].tolist() == state["params"]["w"].tolist()
    after.close()


def test_read_only_bucket_is_named_and_the_checkpoints_stay_readable(gcs, monkeypatch, korean_tokenizer):
    directory = f"{gcs.bucket}/run/checkpoints"
    ckpt = Checkpointer(directory)
    ckpt.save(3, {"params": {"w": np.arange(8, dtype=np.float32)}})
    ckpt.wait()
    ckpt.close()
    front = Front(gcs.url, read_only)
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", front.url)
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", front.url)
        gcs.forget_clients()
        run = f"{gcs.bucket}/run"
        cfg = load_config("mnist", [f"run.run_dir={run}"])
        with pytest.raises(ConfigError, match=f"permission denied .*{run}/config.yaml.*roles/storage.objectAdmin"):
            start_run_dir(as_path(run), cfg)
        ckpt = Checkpointer(directory)
        with pytest.raises(CheckpointError, match=f"writing checkpoint 4 in {directory} failed: permission denied"):
            ckpt.save(4, {"params": {"w": np.zeros(8, np.float32)}})
            ckpt.wait()
        with contextlib.suppress(Exception):
            ckpt.close()
        ckpt = Checkpointer(directory)
        restored, step = ckpt.restore({"params": {"w": np.zeros(8, np.float32)}})
        assert step == 3 and restored["params"]["w"].tolist() == list(range(8))
        assert inspect_json(run)[1]["fingerprint"]["step"] == 3
        # `xlafit data mlm --out` into the same bucket: the 403 named with the fix, no traceback
        from xlafit.data.mlm import prepare
        from xlafit.data.text import korean_demo_files
        from xlafit.errors import DataError

        with pytest.raises(DataError, match=f"writing the MLM shards failed: permission denied .*{gcs.bucket}/mlm"):
            prepare(korean_tokenizer, korean_demo_files()[:1], f"{gcs.bucket}/mlm", seq_len=32, show_progress=False)
    finally:
        front.close()
        gcs.forget_clients()


def test_image_shards_in_a_bucket_are_not_replaced_without_overwrite(gcs, tmp_path, monkeypatch):
    from tests.test_images import write_folder
    from xlafit.data.images import load_split, prepare
    from xlafit.errors import DataError
    from xlafit.io.paths import filesystem

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    out = f"{gcs.bucket}/images"
    prepare(write_folder(tmp_path / "in"), out, shard_size=4, workers=1)  # 18 images: 5 shards
    small = write_folder(tmp_path / "small", classes=("x", "y"), per_class=2)
    with pytest.raises(DataError, match=r"already holds prepared images \(manifest.json, train-00000.parquet"):
        prepare(small, out, workers=1)
    prepare(small, out, workers=1, overwrite=True)
    fs, root = filesystem(out)
    fs.invalidate_cache()
    names = " ".join(sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)))
    assert re.fullmatch(r"manifest.json train-00000\.\w{8}\.parquet", names)  # the earlier's name + a tag
    assert len(load_split(out, "train")[0]) == 4


def test_mlm_shards_in_a_bucket_are_not_replaced_without_overwrite(gcs, tmp_path, monkeypatch, korean_tokenizer):
    from xlafit.data.mlm import load_split, prepare
    from xlafit.data.text import korean_demo_files
    from xlafit.errors import DataError
    from xlafit.io.paths import filesystem

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    out, files = f"{gcs.bucket}/mlm", korean_demo_files()
    prepare(korean_tokenizer, files, out, seq_len=64, shard_size=50, show_progress=False)  # several shards
    with pytest.raises(DataError, match=r"already holds prepared MLM data \(eval-00000.parquet, .*--overwrite"):
        prepare(korean_tokenizer, files, out, seq_len=64, show_progress=False)
    manifest = prepare(korean_tokenizer, files, out, seq_len=64, show_progress=False, overwrite=True)
    fs, root = filesystem(out)
    fs.invalidate_cache()
    names = " ".join(sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)))
    assert re.fullmatch(r"eval-00000\.(\w{8})\.parquet manifest.json tokenizer train-00000\.\1\.parquet", names)
    assert len(load_split(out, "train")[0]["input_ids"]) == manifest["splits"]["train"]["sequences"]


@pytest.mark.parametrize("verdict", ["403", "dead"])
def test_image_shards_that_cannot_be_read_are_named_with_the_fix(gcs, tmp_path, monkeypatch, verdict):
    """No permission to read (a machine with no credentials for the bucket) or a server that is
    gone: ``xlafit train resnet data.data_dir=gs://...`` printed the client's traceback."""
    import gcsfs.retry

    from tests.test_images import write_folder
    from xlafit.data.images import load_split, prepare
    from xlafit.errors import DataError

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gcsfs.retry, "is_retriable", lambda e: False)  # else minutes of retries
    out = f"{gcs.bucket}/images"
    prepare(write_folder(tmp_path / "in", per_class=2), out, workers=1)
    reads = []

    def refuse(method, path):  # the manifest once read, then the shards too (the second case)
        reads.append(path)
        return verdict if len(reads) > blocked_after else None

    front = Front(gcs.url, refuse)
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", front.url)
        for blocked_after in (0, 2):  # the manifest itself; a shard
            reads.clear()
            gcs.forget_clients()
            with pytest.raises(DataError, match="reading the prepared image data failed: ") as err:
                load_split(out, "train")
            reason = "permission denied" if verdict == "403" else "cannot be reached"
            assert reason in str(err.value) and gcs.bucket in str(err.value), (blocked_after, str(err.value))
    finally:
        front.close()
        gcs.forget_clients()


def test_chat_jsonl_and_prompt_completion_parquet_read_from_a_bucket(gcs, tmp_path):
    """Chat records as JSON lines and prompt/completion records as Parquet, both in a bucket:
    each format detected, and each record packed exactly as the same file read locally."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from xlafit.data import clm, rendering

    conversation = [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4."}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": conversation}) for _ in range(12)))
    pq.write_table(pa.table({"prompt": ["Say hi."] * 12, "completion": ["Hi."] * 12}), tmp_path / "pc.parquet")
    (tmp_path / "corpus.txt").write_text("What is 2 plus 2? 4. Say hi. Hi.\n" * 20)
    tok = clm.train_bpe([str(tmp_path / "corpus.txt")], 300, tmp_path / "tok")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    template = rendering.ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        {"eos_token": "<|im_end|>"},
    )
    fs, _ = filesystem(gcs.bucket)
    for name in ("chat.jsonl", "pc.parquet"):
        fs.put(str(tmp_path / name), f"{gcs.bucket}/data/{name}")
        fs.invalidate_cache()
        remote = clm.load_packed([f"{gcs.bucket}/data/{name}"], tok, seq_len=64, eval_fraction=0.0, template=template)
        local = clm.load_packed([str(tmp_path / name)], tok, seq_len=64, eval_fraction=0.0, template=template)
        assert remote[0].source.format == ("chat" if name.endswith(".jsonl") else "prompt_completion")
        for key in ("input_ids", "loss_mask"):
            np.testing.assert_array_equal(remote[0].arrays[key], local[0].arrays[key])
        assert remote[0].documents == 12 and 0 < remote[0].source.answer_share < 0.5


def test_data_in_a_bucket_that_cannot_be_reached_is_one_line(gcs, monkeypatch):
    """The storage service gone (gcsfs told to give up at once, not after its 30 s of
    retries): the data's URL and "cannot be reached", not the HTTP client's traceback."""
    import gcsfs.retry

    from xlafit.data import clm

    monkeypatch.setattr(gcsfs.retry, "is_retriable", lambda e: False)
    gcs.stop()
    try:
        filesystem(gcs.bucket)[0].invalidate_cache()
        with pytest.raises(DataError, match=rf"cannot read {gcs.bucket}/data/chat.jsonl: .*cannot be reached"):
            clm.data_files([f"{gcs.bucket}/data/chat.jsonl"])
    finally:
        gcs.start()


def test_a_storage_host_whose_name_does_not_resolve_fails_at_once(tmp_path):
    """No network (no DNS): one line naming the host within seconds, where gcsfs would probe
    for credentials and retry for about a minute first."""
    env = {
        **os.environ,
        "STORAGE_EMULATOR_HOST": "http://storage.no-such-host.invalid:4443",
        "XLAFIT_CACHE": str(tmp_path),
    }
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(proxy, None)
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "xlafit", "inspect", "gs://some-bucket/run"], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - t0 < 30
    lines = [line for line in done.stderr.splitlines() if line.startswith("xlafit:")]
    assert len(lines) == 1 and "gs://some-bucket/run cannot be reached (storage.no-such-host.invalid" in lines[0], lines
    assert "Check STORAGE_EMULATOR_HOST" in lines[0] and "Traceback" not in done.stderr


def test_the_guides_local_bucket_sets_what_the_tests_set(gcs_server):
    """The cloud-storage guide's block for a bucket on one's own machine exports the variables
    the tests' server needs, every one of them; a variable added here and not there would
    leave a reader's clients talking to Google."""
    guide = (Path(__file__).parents[1] / "docs" / "guides" / "cloud-storage.md").read_text()
    block = guide.split("## A bucket on your machine", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    exported = set(re.findall(r"\b([A-Z_a-z]+)=", block.split("export ", 1)[1].split("\ncurl", 1)[0]))
    assert exported == set(gcs_server.env)


def test_a_tokenizer_out_in_a_missing_bucket_is_refused_before_training(gcs, tmp_path, monkeypatch):
    """It trained first, then failed to upload (with no network: after 52 s, a page of
    aiohttp traceback): the work lost."""
    from xlafit.data import tokenizer

    monkeypatch.setattr(tokenizer, "_continuation_tokens", lambda *a: pytest.fail("trained before the check"))
    (tmp_path / "a.txt").write_text("the cat sat on the mat\n" * 20)
    with pytest.raises(DataError, match=r"--out gs://xlafit-no-such-bucket/tok: the bucket gs://xlafit-no-such"):
        tokenizer.train_tokenizer([str(tmp_path / "a.txt")], 100, "gs://xlafit-no-such-bucket/tok")


def test_a_new_models_adapter_exported_to_a_bucket_names_its_base_in_the_bucket(gcs, tmp_path):
    """A LoRA run on a new model exports its base beside the adapter; exported to a bucket, the
    adapter's base_model_name_or_path is the base's URL there, not a local path made of it."""
    import xlafit
    from xlafit.export import export_hf

    run_dir = tmp_path / "run"
    settings = ["lora.rank=4", "data.demo=arithmetic", "trainer.epochs=1", "trainer.stop_at_step=1",
                "data.seq_len=32", f"run.run_dir={run_dir}"]  # fmt: skip
    xlafit.train_and_evaluate(load_config("llm", settings))
    export_hf(run_dir, f"{gcs.bucket}/exported")
    config = json.loads(as_path(f"{gcs.bucket}/exported/adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == f"{gcs.bucket}/exported/base"
    assert as_path(f"{gcs.bucket}/exported/base/config.json").exists()
