"""The command line, run as a user runs it: in a fresh process."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import write_mnist_idx
from helpers import xlafit_cli as run  # the CLI in a fresh process, which makes its own devices
from xlafit.errors import ConfigError


def test_devices_simulate():
    out = run("devices", "--simulate", "8")
    assert out.returncode == 0, out.stderr
    assert "platform: cpu" in out.stdout
    assert out.stdout.count("\n   ") >= 8  # one row per device
    assert "mesh: data=8 fsdp=1 tensor=1 -> parameters replicated on 8 devices" in out.stdout
    out = run("devices", "--simulate", "8", "--mesh", "2,-1,2")
    assert "mesh: data=2 fsdp=2 tensor=2 -> parameters and optimizer state split over fsdp" in out.stdout
    # The ninth walk: a mesh that does not cover the devices was told in a run's keys (mesh.data=-1
    # mesh.fsdp=2 ...), which `devices` refuses as arguments: in its own --mesh.
    out = run("devices", "--simulate", "8", "--mesh", "1,3,2")
    assert out.returncode == 2 and "For example --mesh -1,2,2 (sizes that divide 8" in out.stderr, out.stderr
    assert "mesh.fsdp" not in out.stderr


def test_devices_simulate_from_environment():
    out = run("devices", env={"XLAFIT_SIMULATE_DEVICES": "4"})
    assert out.returncode == 0, out.stderr
    assert "mesh: data=4 fsdp=1 tensor=1" in out.stdout


def test_the_simulate_variable_holds_however_jax_is_first_started():
    """XLAFIT_SIMULATE_DEVICES=8 and a model built before xlafit.connect() (the fine-tuning
    notebook's test mode): JAX started with 1 device, and connect() said to set the variable
    that was set. ``import xlafit`` makes the devices; a run's own CPU settings still replace
    the defaults it applied (mnist: cpu.fast_paths=false, no YNNPACK flag); JAX started before
    the import is told to import xlafit first."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLAFIT_SIMULATE_DEVICES"] = "8"
    code = (
        "import os, jax; from flax import nnx; import xlafit; nnx.Rngs(0); "
        "print(jax.device_count(), xlafit.connect().num_replicas)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["8", "8"], out.stderr[-2000:]
    code = (
        "import os, xlafit; from xlafit.parallel.cluster import configure; from xlafit.platform.cpu import CpuConfig; "
        "before = os.environ['XLA_FLAGS']; configure(cpu=CpuConfig(fast_paths=False)); "
        "print(repr(before), repr(os.environ['XLA_FLAGS']))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["'--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce'", "''"], out.stderr
    code = "import jax; jax.devices(); import xlafit; xlafit.connect()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "8 simulated devices cannot be made in this process; import xlafit before anything else runs JAX" in (
        out.stderr
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trainer.epoch=3"], "unknown config key trainer.epoch. Valid keys here: trainer.epochs"),
        (["optimizer.learning_rate=-1"], "must be positive"),
        (["data.global_batch=100"], "does not divide evenly over 8 devices"),
        (["--data-dir", "/nonexistent"], "is not a directory"),
        (
            ["--data-dir", "mlm", "data.data_dir=/nonexistent"],
            "--data-dir mlm (data.data_dir=mlm) and the override data.data_dir=/nonexistent set data.data_dir to "
            "different values; keep one of them.",
        ),
        (["run.simulate_devices=4"], "--simulate 8 (run.simulate_devices=8) and the override run.simulate_devices=4"),
        (["--restart", "run.resume=true"], "--restart (run.resume=false) and the override run.resume=true set"),
        (["cpu.ynn_fusion=dot,bogus"], "unknown YNNPACK fusion type 'bogus' (cpu.ynn_fusion)"),
        (
            ["mesh.fsdp=3", "trainer.invariant_chunks=null"],
            "the mesh data=-1 x fsdp=3 x tensor=1 cannot cover 8 devices: 3 does not divide 8",
        ),
        (
            ["mesh.data=2", "mesh.tensor=4", "mesh.rules=classes=tensor", "trainer.invariant_chunks=null"],
            "parameter params/fc2/bias (10,): dimension 0 ('classes', 10) does not divide over mesh.tensor=4",
        ),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path):
    out = run("train", "mnist", "--simulate", "8", "--run-dir", str(tmp_path), *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_cpu_library_flags_follow_the_recipe_and_yield_to_the_user():
    code = (
        "import os, xlafit; from xlafit.platform.cpu import CpuConfig as C; xlafit.connect({}); "
        "print(os.environ.get('XLA_FLAGS', ''))"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    flags = lambda call, **extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code.format(call)], env={**env, **extra}, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert flags("") == "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce"
    assert flags("cpu=C(ynn_fusion='dot')") == "--xla_cpu_experimental_ynn_fusion_type=dot"
    assert flags("cpu=C(fast_paths=False)") == ""
    mine = "--xla_cpu_experimental_ynn_fusion_type=eltwise"
    assert flags("cpu=C(ynn_fusion='dot')", XLA_FLAGS=mine) == mine
    # Not on an accelerator: its jaxlib may be another XLA build, which rejects unknown flags.
    on_tpu = "import os; from xlafit.parallel import cluster; cluster.configure(); print(os.getenv('XLA_FLAGS', ''))"
    out = subprocess.run(
        [sys.executable, "-c", on_tpu], env={**env, "JAX_PLATFORMS": "tpu"}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""
    from xlafit.recipes import load_config

    assert load_config("bert").cpu.ynn_fusion == "dot"
    assert load_config("mnist").cpu.ynn_fusion == "dot,eltwise,reduce"


def test_a_flag_and_an_override_naming_one_place_agree():
    """`--run-dir runs/a run.run_dir=runs/a/` was refused as a conflict: paths are compared as
    places, not as strings; two places still conflict."""
    from xlafit.cli import build_parser
    from xlafit.cli.entry import _parse
    from xlafit.cli.train import overrides_of
    from xlafit.recipes import load_config

    def parse(*argv):
        return overrides_of(_parse(build_parser(), ["train", "mnist", *argv]))

    assert parse("--run-dir", "runs/a", "run.run_dir=runs/a/")[-1] == "run.run_dir=runs/a"
    assert parse("--run-dir", "./runs/a", "run.run_dir=runs/a")
    assert parse("--data-dir", "gs://b/d/", "data.data_dir=gs://b/d")
    with pytest.raises(ConfigError, match="set run.run_dir to different values"):
        parse("--run-dir", "runs/a", "run.run_dir=runs/b")
    with pytest.raises(ConfigError, match="set data.data_dir to different values"):
        parse("--data-dir", "gs://b/d", "data.data_dir=gs://b/e")
    # --simulate 0 is given, and refused by the config's rule (it was dropped as if not given)
    with pytest.raises(ConfigError, match=r"run.simulate_devices=0 must be a positive number"):
        load_config("mnist", parse("--simulate", "0"))


def test_config_prints_resolved_yaml(tmp_path):
    out = run("config", "mnist", "trainer.epochs=2")
    assert out.returncode == 0, out.stderr
    assert "epochs: 2" in out.stdout and "global_batch: 128" in out.stdout
    # the file `train --config` would take, shown as that train would use it
    mine = tmp_path / "my.yaml"
    mine.write_text(out.stdout.replace("global_batch: 128", "global_batch: 64"))
    out = run("config", "mnist", "--config", str(mine), "trainer.epochs=3")
    assert out.returncode == 0, out.stderr
    assert "epochs: 3" in out.stdout and "global_batch: 64" in out.stdout


def test_train_pulse_and_resume(tmp_path):
    """Two steps, then two more from the checkpoint: the whole CLI path, twice. The second
    process loads the train step from JAX's persistent compilation cache."""
    run_dir = tmp_path / "run"  # beside the cache: a run directory holds a run's files only
    data = write_mnist_idx(tmp_path, train=640)  # 5 steps an epoch: no evaluation; quicker to load
    common = ["train", "mnist", "--simulate", "8", "--data-dir", str(data), "--run-dir", str(run_dir)]
    common += ["trainer.log_every_steps=1"]
    cache = {"XLAFIT_CACHE": str(tmp_path / "cache")}
    first = run(*common, "trainer.stop_at_step=2", env=cache)
    assert first.returncode == 0, first.stderr
    assert "per-device batch: 16   global batch: 128" in first.stdout
    assert "peak 0.002 at global batch 128" in first.stdout
    assert "train step compiled 1 time(s)" in first.stdout
    assert "host memory: freed blocks are kept for the next step" in first.stdout  # cpu.keep_memory
    second = run(*common, "trainer.stop_at_step=4", "cpu.keep_memory=false", env=cache)
    assert second.returncode == 0, second.stderr
    assert "host memory:" not in second.stdout
    assert "resumed from checkpoint 2 " in second.stdout
    compiling = [float(re.search(r"([0-9.]+)s compiling", out.stdout).group(1)) for out in (first, second)]
    assert any((tmp_path / "cache" / "jax").iterdir())
    assert compiling[1] < 0.5 * compiling[0], compiling  # loaded, not compiled again
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (run_dir / "config.yaml").exists()


def test_inspect_fails_when_the_newest_checkpoint_is_corrupt(tmp_path, capsys):
    """Issue 21: `inspect` exited 0 with a corrupt newest checkpoint, and its time column
    showed when the damage happened rather than when the checkpoint was written."""
    import datetime

    import numpy as np

    from xlafit.checkpoint import Checkpointer
    from xlafit.cli import main

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5, async_save=False)
    for step in (1, 2):
        ckpt.save(step, {"params": {"w": np.full(3, step, np.float32)}})
    ckpt.wait()
    ckpt.close()
    written = datetime.datetime.now(datetime.UTC)
    assert main(["inspect", str(tmp_path)]) == 0
    assert "has not finished" not in capsys.readouterr().out
    # A save a kill left half written is listed too (the tenth walk: it was not, under a help that
    # says the checkpoints are listed intact or not).
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").mkdir()
    assert main(["inspect", str(tmp_path)]) == 0
    assert "step 3: a save that has not finished (being written, or its process stopped" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unfinished"] == [3]
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").rmdir()
    later = datetime.datetime(2031, 5, 6, tzinfo=datetime.UTC).timestamp()
    files = [p for p in (tmp_path / "checkpoints" / "2").rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(b"\0" + biggest.read_bytes()[1:])  # and its modification time moves on:
    os.utime(biggest, (later, later))

    assert main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:3]]
    assert [row[0] for row in rows] == ["1", "2"] and rows[1][5] == "corrupt:"
    times = [datetime.datetime.fromisoformat(f"{row[1]}T{row[2]}+00:00") for row in rows]
    assert all(abs((t - written).total_seconds()) < 60 for t in times)  # not 2031
    assert "parameters at step 1: sha256 " in out
    assert "checkpoint 2, the newest, is corrupt: resuming sets it aside and continues from checkpoint 1" in out
    assert main(["inspect", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["fingerprint"]["step"] == 1 and report["checkpoints"][1]["time_source"] == "commit"


def test_inspect_names_a_checkpoint_that_cannot_be_read_as_export_does(tmp_path, capsys):
    """Tester's report: `inspect --step 2` on a corrupt checkpoint printed some 950 lines of
    Orbax tracebacks and exited 1. It says what `export --step` says (the file that fails
    its checksum, the intact checkpoints) and exits 2; without --step, a newest checkpoint
    that is unsealed and unreadable is named, and the parameters are the previous one's."""
    import numpy as np

    from xlafit.checkpoint import SEAL, Checkpointer
    from xlafit.cli import main

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5)
    for step in (1, 2):
        ckpt.save(step, {"params": {"w": np.arange(4096, dtype=np.float32) * step}})
    ckpt.wait()
    ckpt.close()
    data = (tmp_path / "checkpoints" / "2" / "default").rglob("*")
    biggest = max((p for p in data if p.is_file()), key=os.path.getsize)
    os.truncate(biggest, 100)
    name = biggest.relative_to(tmp_path / "checkpoints" / "2")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path), "--step", "2"]) == 2
    assert capsys.readouterr().err == (
        f"xlafit: error: checkpoint 2 in {tmp_path / 'checkpoints'} is corrupt: {name} does not match its checksum; "
        "intact: [1].\n"
    )
    (tmp_path / "checkpoints" / "2" / SEAL).unlink()  # unsealed: only reading it tells
    assert main(["inspect", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "parameters at step 1: sha256 " in out and err == ""
    assert "checkpoint 2 is unreadable (ValueError: " in out
    assert "checkpoint 2, the newest, cannot be read: resuming sets it aside and continues from checkpoint 1" in out


def test_inspect_exits_1_when_no_checkpoint_can_be_read(tmp_path, capsys):
    """Issue 63's walk: with every checkpoint unsealed and unreadable (or set aside), `inspect`
    exited 2, which the exit-code table (xlafit.errors) and the preemption guide give to a
    usage mistake; "none is intact" is 1. The table is printed, with why none reads."""
    import numpy as np

    from xlafit.checkpoint import SEAL, Checkpointer
    from xlafit.cli import main

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5)
    for step in (1, 2):
        ckpt.save(step, {"params": {"w": np.arange(4096, dtype=np.float32) * step}})
    ckpt.wait()
    ckpt.close()
    for step in (1, 2):  # killed before their seals, then damaged: only reading them tells
        (tmp_path / "checkpoints" / str(step) / SEAL).unlink()
        data = (tmp_path / "checkpoints" / str(step) / "default").rglob("*")
        os.truncate(max((p for p in data if p.is_file()), key=os.path.getsize), 100)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert err == "" and "no intact checkpoint" in out
    assert f"no checkpoint in {tmp_path / 'checkpoints'} can be read (checkpoint 2 is unreadable (" in out
    assert main(["inspect", str(tmp_path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fingerprint"] == {"step": None, "sha256": None}


def test_inspect_says_a_path_does_not_exist_and_takes_one_checkpoints_folder(tmp_path, capsys):
    """Tester's report: a path that does not exist was "neither a run directory nor a checkpoint
    directory", and one checkpoint's folder (which `--help` calls a checkpoint directory)
    "held no checkpoint". That folder is that checkpoint, as --step."""
    import numpy as np

    from xlafit.checkpoint import Checkpointer
    from xlafit.cli import main

    ckpt = Checkpointer(tmp_path / "checkpoints", keep=5)
    for step in (1, 2):
        ckpt.save(step, {"params": {"w": np.full(3, step, np.float32)}})
    ckpt.wait()
    ckpt.close()
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == (
        f"xlafit: error: {tmp_path / 'nowhere'} does not exist: give a run directory (what `xlafit train --run-dir` "
        "writes) or its checkpoints/ folder.\n"
    )
    folder = tmp_path / "checkpoints" / "1"
    assert main(["inspect", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fingerprint"]["step"] == 1
    assert main(["inspect", str(folder), "--step", "2"]) == 2
    assert capsys.readouterr().err == (
        f"xlafit: error: {folder} is checkpoint 1's folder, and --step 2 asks for another: give "
        f"{tmp_path / 'checkpoints'} (or the run directory) with --step 2.\n"
    )
    for step in (1, 2):  # every checkpoint set aside as corrupt: said so, not "holds no checkpoint: give a run"
        (tmp_path / "checkpoints" / str(step)).rename(tmp_path / "checkpoints" / f"corrupt-{step}-20260101T000000")
    assert main(["inspect", str(tmp_path / "checkpoints")]) == 1  # none is intact (xlafit.errors.DAMAGED)
    assert capsys.readouterr().err == (
        f"xlafit: error: {tmp_path / 'checkpoints'} holds no checkpoint, only ones a resume set aside as corrupt "
        "(corrupt-1-20260101T000000, corrupt-2-20260101T000000); nothing there can be read.\n"
    )


def test_gcsfs_tracebacks_of_errors_it_raises_again_are_dropped_unless_verbose(caplog):
    """gcsfs logged 'out of retries' with a whole traceback before xlafit named the same error."""
    from xlafit.cli import configure_logging

    gcsfs = logging.getLogger("gcsfs")
    for verbose in (False, True):
        configure_logging(verbose=verbose)
        caplog.clear()
        try:
            raise OSError("Cannot connect to host 127.0.0.1:9")
        except OSError as e:
            gcsfs.exception(f"_request out of retries on exception: {e}")
        gcsfs.warning("a warning of its own")
        # Logged twice (two clients) before xlafit's own line on a machine without credentials.
        fallback = "Could not determine bucket type for bucket name b: 401, falling back to GCSFileSystem"
        gcsfs.warning(fallback)
        messages = [r.getMessage() for r in caplog.records if r.name == "gcsfs"]
        assert ("_request out of retries on exception: Cannot connect to host 127.0.0.1:9" in messages) == verbose
        assert (fallback in messages) == verbose
        assert "a warning of its own" in messages
    configure_logging(verbose=False)


def test_help_loads_no_jax():
    """The commands import the library when they run: `xlafit --help` answers without JAX
    (a twentieth of a second instead of a second)."""
    code = (
        "import sys, contextlib, io\n"
        "from xlafit.cli import build_parser\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    build_parser().parse_args(['train', '--help'])\n"
        "print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'xlafit.train') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["train", "check", "plan", "config"])
def test_help_names_every_recipe(command):
    import contextlib
    import io

    from xlafit.cli import build_parser
    from xlafit.recipes import RECIPES

    out = io.StringIO()
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):
        build_parser().parse_args([command, "--help"])
    assert ", ".join(RECIPES) in " ".join(out.getvalue().split())


def test_every_commands_help_formats():
    """argparse formats help with %: a lone "%" in a help text makes --help a traceback."""
    import argparse

    from xlafit.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert len(commands) > 5
    for name, command in commands.items():
        assert command.format_help(), name


def test_every_benchmark_scripts_help_formats():
    """The scripts under benchmarks/ import JAX (seconds each): their help texts are read, not run."""
    import ast

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    scripts = sorted(p for p in root.rglob("*.py") if "results" not in p.relative_to(root).parts)
    checked = 0
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for keyword in node.keywords:
                    if keyword.arg == "help" and isinstance(keyword.value, ast.Constant):
                        text = keyword.value.value
                        checked += 1
                        assert re.sub(r"%%|%\(\w+\)[sd]", "", text).count("%") == 0, (script.name, text)
    assert checked > 20


def test_inspect_of_a_folder_that_is_no_run_is_one_line(tmp_path):
    out = run("inspect", str(tmp_path))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (
        f"xlafit: error: {tmp_path} holds no checkpoint: give a run directory (what `xlafit train --run-dir` "
        "writes) or its checkpoints/ folder."
    )


def test_max_batch_is_a_flag_that_overrides_may_follow():
    """`--max-batch data.source=synthetic`: the override stays an override, not the search's limit."""
    from xlafit.cli import build_parser
    from xlafit.cli.entry import _parse

    args = _parse(build_parser(), ["check", "bert", "--tpu", "v5e-8", "--max-batch", "data.source=synthetic"])
    assert args.max_batch is True and args.max_batch_limit is None and args.overrides == ["data.source=synthetic"]
    out = run("check", "mnist", "--max-batch-limit", "64")
    assert out.returncode == 2
    assert "--max-batch-limit 64: give a positive per-core batch, with --max-batch" in out.stderr


def test_a_misplaced_flag_names_the_command_that_takes_it(capsys):
    from xlafit.cli import build_parser
    from xlafit.cli.entry import _parse

    for argv, hint in (
        (["plan", "model.py", "--max-batch"], "(--max-batch is a flag of xlafit check, not of xlafit plan)"),
        (["train", "mnist", "--trainer.epochs=1"], "(config overrides take no dashes: trainer.epochs=1)"),
        # issue 63's walk: the data of a check is the key --data-dir stands for in train
        (["check", "llm", "--data-dir", "chat.jsonl", "lora.rank=8"],
         "(--data-dir is a flag of xlafit train, not of xlafit check: give the key it stands for, "
         "data.data_dir=chat.jsonl)"),
        (["inspect", "runs/a", "--data-dir", "x"], "(--data-dir is a flag of xlafit train, not of xlafit inspect)\n"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            _parse(build_parser(), argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"xlafit {argv[0]}: error: unrecognized arguments" in err and hint in err


def test_lora_on_a_new_model_exports_and_generates(tmp_path):
    """A LoRA run on a new model (no model.init_from_hf), each command in its own process as a
    user runs them: export and generate re-initialise the base with the run's CPU settings, so
    its fingerprint is the one the adapters were trained on. A failed export leaves no --out.
    Issue 63's walk: such an export wrote its base through a copy that shared the model's
    variables, so zeroing the copy's adapters zeroed the model's (adapter/ held zeros, the
    merged model was the base): the export is the base plus the trained adapters."""
    import jax.numpy as jnp
    import numpy as np

    from xlafit.errors import CheckpointError
    from xlafit.export import export_hf
    from xlafit.hf import llama as llama_hf
    from xlafit.hf.peft import load_peft_adapter

    run_dir, out = tmp_path / "run", tmp_path / "hf"
    train = run(
        "train", "llm", "lora.rank=4", "data.demo=arithmetic", "trainer.epochs=1", "trainer.stop_at_step=2",
        "data.seq_len=32", "--run-dir", str(run_dir), env={"XLAFIT_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert train.returncode == 0, train.stderr
    exported = run("export", "hf", str(run_dir), "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert {"model.safetensors", "adapter", "base"} <= {p.name for p in out.iterdir()}
    ids = jnp.asarray([[0, 5, 17, 42, 99, 7, 20, 12]])
    base = np.asarray(llama_hf.from_hf(out / "base")(ids))
    adapted = np.asarray(load_peft_adapter(llama_hf.from_hf(out / "base"), out / "adapter")(ids))
    assert np.abs(adapted - base).max() > 1e-3  # the adapters written are the trained ones, not zeros
    np.testing.assert_allclose(np.asarray(llama_hf.from_hf(out)(ids)), adapted, atol=1e-5, rtol=1e-5)
    # the base, PEFT's base_model_name_or_path, stops where the merged model does
    generation = (out / "generation_config.json").read_text()
    assert (out / "base" / "generation_config.json").read_text() == generation and "eos_token_id" in generation
    answered = run("generate", str(run_dir), "--prompt", "1 plus 2", "--max-new-tokens", "4")
    assert answered.returncode == 0, answered.stderr
    # The twenty-third walk: the adapter directory was neither asked nor a clear refusal to train from.
    # It answers as the merged model does (its base's weights, the adapter merged into them) ...
    from xlafit.generator import Generator

    # (its base_model_name_or_path named the export's temporary folder, gone once the export was in place)
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((out / "base").absolute())
    assert (out / "adapter" / "tokenizer.json").exists()  # as TRL saves an adapter: AutoTokenizer reads it there
    merged, on_base = Generator.load(str(out)), Generator.load(str(out / "adapter"))
    assert on_base(["1 plus 2"], 6, use_chat=False) == merged(["1 plus 2"], 6, use_chat=False)
    # ... and a run starting from it is told to start from the merged model
    from xlafit.errors import ConfigError
    from xlafit.recipes import load_config
    from xlafit.recipes.llm import check_checkpoint

    with pytest.raises(ConfigError, match=r"adapter is a PEFT adapter on .*base \(adapter_config.json\), not a model"):
        check_checkpoint(load_config("llm", [f"model.init_from_hf={out / 'adapter'}"]), out / "adapter")
    # another seed re-initialises another base: refused, and the --out it made is gone again
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["trainer"]["seed"] = 1
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(CheckpointError, match="is not the one its adapters were trained on"):
        export_hf(run_dir, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_a_checkpoint_that_cannot_be_written_ends_the_command_with_one_line(tmp_path):
    """A checkpoint directory that cannot be created (no permission: root ignores chmod, so
    the refusal is injected at os.makedirs) left Orbax's writer threads waiting 300 s for its
    signal, and the process hung after printing its error, under a traceback per thread."""
    code = (
        "import os, sys\n"
        "makedirs = os.makedirs\n"
        "def refuse(path, *args, **kwargs):\n"
        "    if str(path).endswith('orbax-checkpoint-tmp'):\n"
        "        raise PermissionError(13, 'Permission denied', str(path))\n"
        "    return makedirs(path, *args, **kwargs)\n"
        "os.makedirs = refuse\n"
        f"sys.argv = ['xlafit', 'train', 'mnist', '--run-dir', {str(tmp_path / 'run')!r}, 'trainer.stop_at_step=1',\n"
        f"            '--data-dir', {str(write_mnist_idx(tmp_path))!r}]\n"
        "from xlafit.cli import main\n"
        "sys.exit(main())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 74, out.stderr  # STORAGE: the same command resumes once it can write
    assert "Traceback" not in out.stderr
    assert "xlafit: error: writing checkpoint 1 in" in out.stderr and "Permission denied" in out.stderr


def test_a_key_given_twice_on_the_command_line_is_named_with_the_value_used(capsys):
    """The fifth walk: `xlafit config llm lora.rank=8 lora.rank=4` took the last without a word."""
    from xlafit.cli import main

    assert main(["config", "llm", "lora.rank=8", "lora.rank=4", "trainer.epochs=2"]) == 0
    out, err = capsys.readouterr()
    assert "warning: lora.rank given 2 times (8, 4): the last, lora.rank=4, is used" in err
    assert "epochs" not in err and "rank: 4" in out


def test_xlafits_warnings_print_as_written_and_others_name_their_logger():
    """The eighth walk: `WARNING xlafit: warning: data.loss_on=all set, ...`: the logger's
    prefix before xlafit's own "warning:". xlafit's messages that say what they are print as
    written; another library's keep its level and name."""
    code = (
        "import logging\n"
        "from xlafit.cli.entry import configure_logging\n"
        "configure_logging(verbose=False)\n"
        "logging.getLogger('xlafit').warning('warning: %s set, but ignored', 'data.loss_on=all')\n"
        "logging.getLogger('xlafit.data').warning('note: a note')\n"
        "logging.getLogger('xlafit').warning('cannot cache it')\n"
        "logging.getLogger('orbax').warning('its own words')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.splitlines() == [
        "warning: data.loss_on=all set, but ignored",
        "note: a note",
        "WARNING xlafit: cannot cache it",
        "WARNING orbax: its own words",
    ]


def test_a_commands_option_before_the_command_is_named_with_where_it_goes(capsys):
    """The eleventh walk: `xlafit --simulate 8 train mnist` said `invalid choice: '8'`, naming
    neither the option nor where it goes; and `xlafit --version` said a command is required."""
    from xlafit.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--simulate", "8", "train", "mnist"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("xlafit: error: --simulate is an option of a command (") and "train" in err
    assert err.endswith("give it after the command, as in `xlafit train mnist --simulate 8`.")
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("xlafit ")
