"""`xlafit bench`: the table's columns exist, add up, and the peers and profile work."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers import long_form
from xlafit.bench import model_flops, summarize, whiskers
from xlafit.cli import main
from xlafit.models.cnn import train_flops_per_example
from xlafit.platform.hardware import table_bandwidth, table_peak


def bench(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-m", "xlafit", "bench", "mnist", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("kind", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-40GB", 312),
        ("TPU v2", 22.5),
        ("TPU v4", 275),
        ("TPU v5 lite", 197),
        ("TPU v5", 459),
        ("TPU v6 lite", 918),
    ],
)
def test_peak_table(kind, tflops):
    assert table_peak(kind)[0] == tflops * 1e12


@pytest.mark.parametrize(
    ("kind", "gbps"),
    [
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA H200", 4800),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100-SXM4-40GB", 1555),
        ("TPU v3", 450),  # a chip's two cores are two devices
        ("TPU v4", 1200),  # megacore: one device
        ("TPU v5 lite", 819),
        ("TPU v5", 2765),
    ],
)
def test_bandwidth_table(kind, gbps):
    assert table_bandwidth(kind)[0] == gbps * 1e9
    assert table_bandwidth("cpu") is None


def test_the_cpu_peak_is_measured_once_a_process():
    """Every run on a CPU reports MFU against the measured peak: six 2048^3 products, about a
    second of CPU, were measured again at each run of a process (a notebook's every cell)."""
    from xlafit.platform.hardware import measured_cpu_peak, peak_flops

    peak = measured_cpu_peak()
    assert 1e8 < peak < 1e15
    assert peak_flops(jax.devices("cpu")[:1])[0] == peak == measured_cpu_peak()  # not measured again


def test_the_cpu_peak_is_measured_once_a_machine(tmp_path, monkeypatch):
    """Each training process on a CPU measured the peak again (a CPU-second of matrix
    products at every start): it is kept in the user cache, and a new process reads it."""
    from xlafit.platform.hardware import measured_cpu_peak

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path))
    measured_cpu_peak.cache_clear()  # as in a new process
    try:
        first = measured_cpu_peak(256, 2)
        (stored,) = json.loads((tmp_path / "cpu-peak.json").read_text()).values()
        measured_cpu_peak.cache_clear()
        assert measured_cpu_peak(256, 2) == first == stored  # read, not measured again (no two timings agree)
    finally:
        measured_cpu_peak.cache_clear()


def test_mfu_flops_prefer_xla_unless_it_disagrees():
    assert model_flops(9.3e9, 9.16e9) == (9.3e9, "XLA cost analysis")
    assert model_flops(1.14e9, 9.16e9)[0] == 9.16e9  # cuDNN convolutions counted as 0 on GPUs
    assert model_flops(None, 9.16e9)[0] == 9.16e9


def test_analytic_cnn_flops():
    # conv1 26*26*32*9*2 + conv2 24*24*64*288*2 + dense (9216*128 + 1280)*2, times 3, less conv1's input gradient
    assert train_flops_per_example() == 3 * (389_376 + 21_233_664 + 2_361_856) - 389_376


def test_whiskers_are_never_negative():
    """Issue 21: with one run of 20 steps in 2.5401 s at batch 128, the median's
    batch / (wall / steps) is 1 ulp above the run's batch * steps / wall: a whisker of -1 ulp
    made matplotlib refuse the chart."""
    wall, steps, batch = 2.5401, 20, 128
    assert batch / (wall / steps) > batch * steps / wall  # the values that trigger it
    row = {"examples_per_s": batch / (wall / steps), "examples_per_s_runs": [batch * steps / wall]}
    lo, hi = whiskers([row, {"examples_per_s": 5.0, "examples_per_s_runs": [4.0, 5.0, 7.5]}])
    assert 0 <= lo[0] < 1e-9 and hi[0] == 0.0  # was -1 ulp
    assert lo[1] == 1.0 and hi[1] == 2.5
    run = {
        **{"call_s": [wall / steps] * steps, "call_steps": [1] * steps, "wall_s": wall, "steps": steps},
        **{"wait_s": 0.0, "compile_s": 1.0, "compiles": 1, "flops_per_step": 1e6, "flops_per_step_analytic": 1e6},
        **{"devices": 1, "device_kind": "cpu"},
    }
    one = summarize("xlafit 1 device", [run], 469, batch, 1e12)
    assert [x.tolist() for x in whiskers([one])] == [[0.0], [0.0]]  # one run: no whisker at all
    assert one["page_faults_per_step"] is None and one["peak_rss_bytes"] is None  # not recorded: not invented
    grew = summarize("xlafit 1 device", [{**run, "page_faults": 600, "peak_rss_bytes": 2**30}] * 2, 469, batch, 1e12)
    assert grew["page_faults_per_step"] == 600 / steps and grew["peak_rss_bytes"] == 2**30


def test_bench_table_json_plot_and_profile(tmp_path):
    # 7 steps an epoch: the k=2 row's calls are 2, 2, then 1 and 1 where the epoch ends (two
    # programs; k=3 over 8 steps compiled three, 3, 2 and 1, for the same uneven calls).
    out = bench(
        *("--simulate", "2", "--devices", "all", "--steps", "6", "--warmup", "2", "--repeats", "2"),
        *("--steps-per-call", "1,2", "--data", "synthetic", "--examples", "224", "--batch", "32"),
        *("--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")),
        *("--profile", "2", "--profile-dir", str(tmp_path / "prof")),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for column in ("compile s", "step ms", "p10-p90 ms", "epoch s", "examples/s", "wait %", "MFU %", "speedup"):
        assert column in out.stdout
    result = json.loads((tmp_path / "b.json").read_text())
    names = [row["configuration"] for row in result["rows"]]
    assert names == ["xlafit 2 cpu (simulated)", "xlafit 2 cpu (simulated) k=2"]
    s = result["settings"]
    assert s["steps_per_epoch"] == 224 // 32 and s["batch"] == 32
    for row in result["rows"]:
        runs = result["runs"][row["configuration"]]
        assert len(runs) == 2
        for run in runs:
            assert run["steps"] == 6 == sum(run["call_steps"])
            assert run["call_steps"] == ([1] * 6 if row["configuration"].endswith(")") else [2, 2, 1, 1])
            # wall time = the first call's dispatch + step time + input wait, every second accounted for
            assert run["dispatch_s"] + sum(run["call_s"]) + run["wait_s"] == pytest.approx(run["wall_s"], rel=1e-9)
            # each call's own time: the dispatch after the warm-up's sync is none of them (it was the
            # first "call", a few ms, with the next one holding two calls' work)
            assert min(run["call_s"]) > 0 and run["dispatch_s"] < max(run["call_s"])
            assert run["compiles"] >= 1 and run["compile_s"] > 0
            assert run["page_faults"] >= 0 and run["peak_rss_bytes"] > 100 * 2**20  # a JAX process
        per_step = np.median([r["wall_s"] / r["steps"] for r in runs])
        assert row["epoch_s"] == pytest.approx(s["steps_per_epoch"] * per_step, rel=1e-9)
        assert row["examples_per_s"] == pytest.approx(s["batch"] / per_step, rel=1e-9)
        assert row["step_ms_p10"] <= row["step_ms_median"] <= row["step_ms_p90"]
        assert 0 <= row["input_wait_frac"] < 0.25
        assert 0 < row["mfu"] < 1
        # XLA's cost analysis (per device, times the devices) against the analytic count
        assert row["flops_per_step_xla"] == pytest.approx(row["flops_per_step_analytic"], rel=0.05)
    assert result["rows"][0]["speedup"] == 1.0
    assert "host memory xlafit 2 cpu (simulated): peak" in out.stdout
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    traces = list((tmp_path / "prof").rglob("*.xplane.pb"))
    assert len(traces) == 2, traces  # one per xlafit configuration


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed (make bench installs it)")
@long_form(
    42,
    "test_bench_table_json_plot_and_profile (the bench's rows, JSON and plot) and tests/test_torch.py (a PyTorch "
    "module trained through xlafit)",
)
def test_bench_compares_with_pytorch_eager(tmp_path):
    out = bench(
        *("--devices", "1", "--compare", "torch,xlafit-torch", "--steps", "4", "--warmup", "2", "--repeats", "1"),
        *("--data", "synthetic", "--examples", "128", "--batch", "32", "--json", str(tmp_path / "b.json")),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    names = ["xlafit 1 cpu", "PyTorch eager", "the PyTorch module through xlafit, 1 device(s)"]
    assert [r["configuration"] for r in rows] == names
    assert rows[2]["examples_per_s"] > 0 and rows[2]["compiles"] == 1  # PyTorch's Net, compiled once by XLA
    torch_row = rows[1]
    assert torch_row["compile_s"] is None and torch_row["examples_per_s"] > 0
    assert torch_row["page_faults_per_step"] >= 0 and torch_row["peak_rss_bytes"] > 100 * 2**20
    assert torch_row["speedup"] == pytest.approx(torch_row["examples_per_s"] / rows[0]["examples_per_s"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--devices", "0"], "--devices 0"),
        (["--compare", "jax"], "known peers are torch, torch-compile, xlafit-torch"),
        (["--steps-per-call", "two"], "expected whole numbers"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--batch", "100000", "--data", "synthetic", "--examples", "1000"], "larger than the 1000 training"),
        (["--devices", "abc"], "--devices abc: expected device counts or 'all'"),
        (["--devices", "3", "--batch", "8"], "--batch 8 does not divide over 3 devices"),
        (["--profile", "-1"], "--profile must be 0"),
        (["--epochs", "-1"], "--epochs must be more than 0"),
        (["--simulate", "-2"], "--simulate must be at least 1"),
        (["--data", "synthetic", "--examples", "-5"], "--examples must be at least 1"),
        (["--json", "/nonexistent-xlafit-dir/b.json"], "--json /nonexistent-xlafit-dir/b.json: the folder"),
    ],
)
def test_bench_bad_input(args, message, capsys):
    # In this process (each refusal comes before any work): the subprocess runs above go
    # through the same `xlafit` entry point.
    assert main(["bench", "mnist", *args, "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed (make bench installs it)")
def test_pytorch_peer_gets_the_xlafit_rows_cpu_allocator():
    """On a CPU the xlafit rows keep freed memory for reuse (xlafit.connect()); the peer must
    too, or its ResNet activations are page-faulted in afresh every step and the comparison
    times glibc, not PyTorch."""
    from xlafit.bench import run_worker
    from xlafit.bench.worker import Spec

    env_tunables = "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
    # The allocator is set before any recipe runs: MNIST's rows, the cheapest, show it.
    common = {"recipe": "mnist", "data": "synthetic", "batch": 8, "examples": 16}
    for framework in ("xlafit", "torch"):
        result = run_worker(Spec(framework, warmup=0, steps=1, **common))
        assert result["cpu_keep_memory"] is not env_tunables, framework  # GLIBC_TUNABLES: the user's choice


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed (make bench installs it)")
def test_pytorch_peer_normalises_pixels_as_the_xlafit_rows():
    """Both ResNet rows are fed the same uint8 pixels; the peer must turn them into the
    network's input exactly as the recipe's ImageClassifier does."""
    import torch

    from xlafit.bench.torch_peers import normalise_pixels
    from xlafit.recipes.resnet import NORMALISATION, ImageClassifier

    pixels = np.random.default_rng(0).integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    ours = ImageClassifier(lambda x: x, *NORMALISATION["imagenet"])(pixels)  # type: ignore[arg-type]
    peer = normalise_pixels(torch.from_numpy(pixels.transpose(0, 3, 1, 2)), *NORMALISATION["imagenet"])
    np.testing.assert_allclose(peer.numpy().transpose(0, 2, 3, 1), np.asarray(ours), rtol=1e-6, atol=1e-6)
    assert float(np.abs(np.asarray(ours)).max()) > 1.5  # normalised, not merely scaled to [0, 1]


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_a_json_or_plot_path_that_is_a_folder_is_refused_before_the_benchmark(flag, tmp_path, monkeypatch):
    """--json <a folder> ran the whole benchmark, then raised IsADirectoryError."""
    from xlafit import bench
    from xlafit.cli.entry import build_parser
    from xlafit.errors import ConfigError

    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the benchmark ran"))
    args = build_parser().parse_args(["bench", "mnist", "--steps", "1", flag, str(tmp_path)])
    with pytest.raises(ConfigError, match=f"{flag} {tmp_path} is a folder; give a file in it"):
        args.run(args)
