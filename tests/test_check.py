"""`xlafit check`: each rule at the right line, clean files pass, the recipes' reports."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from xlafit.check import assumed_settings, check_command, check_file, check_recipe
from xlafit.cli import build_parser
from xlafit.cli.entry import _parse
from xlafit.errors import ConfigError
from xlafit.recipes import load_config

CASES = Path(__file__).parent / "check_cases"


@pytest.mark.parametrize(
    ("name", "rule", "line"),
    [("rule1_if", 1, 11), ("rule2_mask", 2, 11), ("rule2_unique", 2, 11), ("rule3_lengths", 3, None)],
)
def test_each_violation_gets_its_rule_and_line(name, rule, line):
    report = check_file(CASES / f"{name}.py")
    assert [f.rule for f in report.findings] == [rule]
    finding = report.findings[0]
    assert finding.line == line
    if line is not None:
        assert Path(finding.file).name == f"{name}.py" and f"line {line}" in finding.code
    assert finding.fix and ("jnp.where" in finding.fix or "mask" in finding.fix or "pad_batch" in finding.fix)


def test_clean_file_passes_with_memory_and_flops():
    report = check_file(CASES / "clean.py", per_device_batch=64)
    assert report.ok and report.traced and report.ran and not report.notes
    assert report.memory["arguments"] > 0 and report.flops_per_step > 0
    assert report.batch["per_device"] == 64


def test_a_scalar_loss_passes_with_a_note_that_evaluation_needs_one_per_example(tmp_path):
    """A loss_fn returning a mean trains, but fit(eval=...) refuses it at the start of a run;
    check said nothing about it."""
    path = tmp_path / "mean.py"
    path.write_text((CASES / "clean.py").read_text().replace("return losses * batch", "return jnp.mean(losses * batch"))
    path.write_text(path.read_text().replace("* positive\n", "* positive)\n"))
    report = check_file(path)
    assert report.ok and report.ran
    (note,) = report.notes
    assert note.startswith("loss_fn returns loss as a scalar") and "one value per example" in note
    assert note in report.format() and report.to_json()["notes"] == [note]
    # a scalar metric beside per-example losses: evaluation refuses it the same way
    metric = (CASES / "clean.py").read_text().replace("* positive\n", '* positive, {"acc": jnp.mean(losses)}\n')
    path.write_text(metric)
    (note,) = check_file(path).notes
    assert note.startswith("loss_fn returns acc as a scalar")


REGRESSION = """
import numpy as np
from flax import nnx

model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
rng = np.random.default_rng(0)
batch = {"x": rng.normal(size=(16, 4)).astype("float32"), "y": rng.normal(size=(16,)).astype("float32")}


def loss_fn(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean(-1)
"""


def test_an_output_of_one_column_against_labels_of_one_axis_is_named_at_its_line(tmp_path):
    """(B, 1) - (B,) broadcasts to (B, B): every prediction against every label, and the
    mean over the last axis gives the loss its right shape back, so training went on toward
    the labels' mean without a word. check names the line; a loss on out[:, 0] passes, as
    does a bias added to every row (a promotion of another kind)."""
    import jax

    path = tmp_path / "regression.py"
    path.write_text(REGRESSION)
    with jax.numpy_rank_promotion("allow"):  # JAX's default, which a user has (the suite raises)
        report = check_file(path)
        (finding,) = report.findings
        assert finding.kind == "rows against every label" and finding.line == 11 and "mean(-1)" in finding.code
        assert "subtract of shapes (16, 1) and (16,) broadcasts to (16, 16)" in finding.message
        assert "drop the output's last axis (out[..., 0])" in finding.message and not report.ok
        path.write_text(REGRESSION.replace('model(batch["x"])', 'model(batch["x"])[:, 0]'))
        assert check_file(path).ok
        path.write_text(REGRESSION.replace('model(batch["x"])', '(model(batch["x"]) + np.ones(1, "float32"))[:, 0]'))
        assert check_file(path).ok


def test_violations_written_other_ways(tmp_path):
    header = "import jax, jax.numpy as jnp, numpy as np, optax\nfrom flax import nnx\n"
    header += "model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))\nbatch = {'x': np.ones((8, 4), np.float32)}\n"
    bodies = {
        # a while loop on a value, inside a helper the loss calls
        "while_loop": (
            1,
            "def helper(v):\n    while v.sum() > 0:\n        v = v - 1\n    return v\n"
            "def loss_fn(model, batch):\n    return helper(model(batch['x'])).sum(-1)\n",
            6,
        ),
        # nonzero without a size
        "nonzero": (
            2,
            "def loss_fn(model, batch):\n    y = model(batch['x'])\n"
            "    idx = jnp.nonzero(y > 0)[0]\n    return y.sum(-1) + idx.shape[0]\n",
            7,
        ),
        # a conditional expression
        "ifexp": (
            1,
            "def loss_fn(model, batch):\n    y = model(batch['x'])\n"
            "    return y.sum(-1) if y.max() > 1 else y.mean(-1)\n",
            7,
        ),
        # np.where with one argument on a mask
        "where1": (
            2,
            "def loss_fn(model, batch):\n    y = model(batch['x'])\n"
            "    keep = jnp.where(y[:, 0] > 0)[0]\n    return y[keep].sum(-1)\n",
            7,
        ),
    }
    for name, (rule, body, line) in bodies.items():
        path = tmp_path / f"{name}.py"
        path.write_text(header + body)
        report = check_file(path)
        assert [(f.rule, f.line) for f in report.findings] == [(rule, line)], (name, report.format())


def test_cli_exit_codes_and_json(tmp_path, capsys):
    from xlafit.cli import main

    env = {**os.environ}
    env.pop("XLA_FLAGS", None)

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "xlafit", "check", *args], capture_output=True, text=True, env=env, timeout=300
        )

    out = run(str(CASES / "rule1_if.py"))
    assert out.returncode == 1 and "rule 1: data-dependent control flow at" in out.stdout and "jnp.where" in out.stdout
    out = run(str(CASES / "clean.py"), "--json", "--global-batch", "12", "--devices", "8")
    report = json.loads(out.stdout)
    assert out.returncode == 1 and report["findings"][0]["kind"] == "batch" and "multiple of 8" in out.stdout
    # In this process (the refusal comes before any work; the runs above and below go
    # through the same entry point as a process).
    assert main(["check", str(CASES / "missing.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # A file that prints (the static-shapes guide's example does): its lines went into the JSON.
    printing = tmp_path / "printing.py"
    printing.write_text((CASES / "clean.py").read_text() + "\nprint(batch['x'].shape)\n")
    out = run(str(printing), "--json")
    assert json.loads(out.stdout)["ok"] and "(8, 4)" in out.stderr, out.stdout


def test_the_static_shapes_guides_example_breaks_only_rule_3_as_the_guide_says(tmp_path):
    """The guide's file was introduced as following the rules, yet `check` exited 1 on it:
    its lengths vary on purpose. The guide now says rule 3 and shows the report's line."""
    guide = (Path(__file__).parents[1] / "docs" / "guides" / "static-shapes.md").read_text()
    example = tmp_path / "example.py"
    example.write_text(guide.split("```python\n", 1)[1].split("```", 1)[0])
    report = check_file(example)
    assert [f.rule for f in report.findings] == [3] and report.traced and report.ran
    assert "break rule 3" in guide and "follows the rules" not in guide
    assert f"the data holds {report.shapes['distinct']} different lengths" in guide
    # padded to the recommended boundaries, as bucket_batches feeds them, the file passes
    padded = "lengths = np.array(BOUNDS)[np.searchsorted(BOUNDS, lengths)]\n".replace(
        "BOUNDS", str([32, 63, 101, 131, 177, 217, 259, 299])
    )
    example.write_text(example.read_text().replace("\n\n\ndef loss_fn", "\n" + padded + "\n\ndef loss_fn"))
    assert "Recommended: planned, 8 shapes, boundaries [32, 63, 101, 131, 177, 217, 259, 299]" in guide
    assert check_file(example).ok


def test_planner_on_the_korean_corpus_beats_multiples(tmp_path, monkeypatch):
    """The judged comparison: on the tokenized Korean demo corpus (one line per example),
    the planned buckets waste no more than a multiple of 32 or 64 with as many shapes."""
    from xlafit.data.shapes import compare_plans
    from xlafit.recipes import bert, load_config

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path))
    lengths = bert.sequence_lengths(load_config("bert", []))
    assert len(lengths) > 1000 and len(set(lengths.tolist())) > 30
    plans = {p.name: p for p in compare_plans(lengths)}
    for k in (32, 64):
        multiple = plans[f"multiple of {k}"]
        planned = plans[f"planned, {multiple.shapes} shapes"]
        assert planned.padded_tokens <= multiple.padded_tokens, (planned, multiple)


def test_a_recipe_that_packs_its_rows_passes_rule_3_and_shows_the_lengths_as_information(tmp_path, monkeypatch):
    """`xlafit check bert` exited 1 on rule 3 (the corpus's line lengths) although the recipe
    packs its lines into rows of data.seq_len tokens: one shape, one compile."""
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path))
    report = check_recipe("bert", ["model.preset=custom", "model.num_layers=1", "model.hidden_size=32",
                                   "model.num_heads=2", "model.intermediate_size=64"])  # fmt: skip
    assert report.ok and not [f for f in report.findings if f.rule == 3], report.format()
    assert report.shapes["one_shape"] and report.shapes["distinct"] > 30 and report.plans
    assert "input shapes: one (the examples are packed or padded to rows of one length)" in report.format()


NEIGHBOUR = """from flax import nnx


class Tiny(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(x)
"""


def test_console_script_imports_the_files_neighbours_and_the_working_directory(tmp_path):
    """Issue 21: `xlafit check clean.py` (the console script, whose sys.path[0] is the venv's
    bin/) failed with "No module named 'common'" where `python clean.py` works."""
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "common.py").write_text(NEIGHBOUR)
    (tmp_path / "settings_here.py").write_text("ROWS = 8\n")  # in the working directory
    (tmp_path / "project" / "clean.py").write_text(
        "import numpy as np, optax\nfrom common import Tiny\nfrom settings_here import ROWS\n"
        "model = Tiny()\nbatch = {'x': np.ones((ROWS, 4), np.float32), 'y': np.arange(ROWS) % 3}\n"
        "def loss_fn(model, batch):\n"
        "    return optax.softmax_cross_entropy_with_integer_labels(model(batch['x']), batch['y'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    out = subprocess.run(
        [str(Path(sys.executable).parent / "xlafit"), "check", "project/clean.py"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "no rule violated" in out.stdout


def test_a_data_file_named_bare_in_the_working_directory_is_refused_as_a_file(tmp_path, monkeypatch, capsys):
    """`xlafit check d.jsonl` in the file's folder was taken for a recipe's name ("unknown
    recipe"); a file there is a file, unless it has a recipe's name."""
    from xlafit.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"messages": []}\n')
    assert main(["check", "d.jsonl"]) == 2
    assert "d.jsonl is not a Python file (.py)" in capsys.readouterr().err


def test_load_errors_name_the_line_and_leave_sys_path_as_it_was(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import numpy as np\nmodel = (\nbatch = {}\n")
    before = list(sys.path)
    with pytest.raises(ConfigError, match=r"broken.py, line 2: SyntaxError: '\(' was never closed in `model = \(`"):
        check_file(path)
    path.write_text("import numpy as np\n\nraise ValueError('no data here')\n")
    with pytest.raises(ConfigError, match=r"broken.py failed while being loaded, at line 3: ValueError: no data"):
        check_file(path)
    assert sys.path == before
    # A data file is no model file (the eleventh walk: JSON lines ran as Python, then "must define
    # model"); nothing in it runs.
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": []}\n')
    with pytest.raises(ConfigError, match=r"chat.jsonl is not a Python file \(.py\): .* xlafit data show "):
        check_file(data)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (xlafit[tpu])")
def test_cpu_check_keeps_libtpus_start_up_errors_off_stderr():
    """libtpu, installed for --tpu, logs five lines of errors when JAX starts its backends
    on a host with no TPU; `xlafit check RECIPE` starts them as xlafit.connect() does."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user runs it: JAX tries libtpu
    out = subprocess.run([sys.executable, "-m", "xlafit", "check", "mnist"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "could not determine TPU" not in out.stderr and "InitGoogle" not in out.stderr, out.stderr


def test_a_file_whose_model_is_of_no_known_kind_names_every_kind_it_takes(tmp_path):
    path = tmp_path / "odd.py"
    path.write_text("model = 3\nloss_fn = None\nbatch = {'x': [1.0]}\n")
    with pytest.raises(ConfigError, match=r"is a int, not an nnx.Module, a torch.nn.Module or a Keras 3 model"):
        check_file(path)
    path.write_text("model = 3\n")
    with pytest.raises(ConfigError, match=r"an nnx.Module, a torch.nn.Module or a compiled Keras 3 model.*missing"):
        check_file(path)
    path.write_text(  # check --tpu said it fits
        "from flax import nnx\nclass M(nnx.Module):\n    def __init__(self, rngs):\n        pass\n"
        "model = M(nnx.Rngs(0))\nloss_fn = lambda m, b: b['x']\nbatch = {'x': [1.0], 'note': ['a']}\n"
    )
    with pytest.raises(ConfigError, match=r"batch\['note'\] holds text \(<U1\): a step takes numbers only"):
        check_file(path)
    # the class itself, or a function that builds it: told to build it in the file
    for model in ("M", "lambda: M(nnx.Rngs(0))"):
        path.write_text(
            "from flax import nnx\nclass M(nnx.Module):\n    def __init__(self, rngs):\n        pass\n"
            f"model = {model}\nloss_fn = lambda m, b: b['x']\nbatch = {{'x': [1.0]}}\n"
        )
        with pytest.raises(ConfigError, match=r"; build it in the file: model = MyModel\(nnx.Rngs\(0\)\) \(nnx.eval"):
            check_file(path)


def test_a_recipes_check_command_carries_every_override_and_names_the_checkpoint_not_the_preset():
    """The command printed under the answer checks the same run when pasted: each override
    given (the data, the adapters' alpha and targets) and each assumed setting, each key once;
    with model.init_from_hf the sizes are the checkpoint's, so "for:" names it, not a preset."""
    given = [
        "model.init_from_hf=runs/base-hf",
        "data.data_dir=chat.jsonl",
        "lora.rank=16",
        "lora.alpha=32",
        "lora.targets=q_proj,v_proj",
        "mesh.data=1",
        "mesh.fsdp=-1",
    ]
    cfg = load_config("llm", given)
    assumed = assumed_settings(cfg, SimpleNamespace(per_device_batch=None, global_batch=32), given)
    assert "model.init_from_hf=runs/base-hf" in assumed and not any(a.startswith("model.preset=") for a in assumed)
    command = check_command("llm", "colab", given, assumed)
    args = _parse(build_parser(), shlex.split(command)[1:])
    assert args.target == "llm" and args.tpu == "colab"
    assert set(given) | set(assumed) == set(args.overrides)
    assert len({o.partition("=")[0] for o in args.overrides}) == len(args.overrides)
    assert "--config plan.yaml" in check_command("llm", "colab", given, assumed, "plan.yaml")
    # The third walk: the objective and quantized embeddings shape the program and were left out;
    # a GRPO row is a prompt and its completion, so data.seq_len is none of its shape.
    assert not any(a.startswith(("model.objective=", "lora.quantize_embeddings=")) for a in assumed)
    grpo = [*given, "model.objective=grpo", "lora.base_dtype=nf4", "lora.quantize_embeddings=true"]
    assumed = assumed_settings(load_config("llm", grpo), SimpleNamespace(per_device_batch=None, global_batch=32), grpo)
    assert {"model.objective=grpo", "lora.quantize_embeddings=true"} <= set(assumed)
    assert not any(a.startswith("data.seq_len=") for a in assumed)
    # A walk's Gemma 3 4B, the 12B preset with the 4B's sizes: "for:" named the 12B alone.
    sized = ["model.preset=gemma-3-12b", "model.num_layers=34", "model.hidden_size=2560", "lora.rank=16"]
    assumed = assumed_settings(load_config("llm", sized), SimpleNamespace(per_device_batch=1), sized)
    assert {"model.preset=gemma-3-12b", "model.num_layers=34", "model.hidden_size=2560"} <= set(assumed)


def test_a_recipes_plain_check_reports_the_runs_own_batch():
    """mnist trains at a global batch of 128: the plain check estimates memory and FLOPs at
    it (as --tpu does), not at the few rows it runs here."""
    report = check_recipe("mnist", devices=1)
    assert report.ok and report.batch == {"per_device": 128, "devices": 1, "global": 128}
    assert "per device at batch 128 (1 device(s), global 128)" in report.format()


def test_the_cpu_check_of_a_lora_preference_run_traces_with_its_adapters():
    """Issue 63's second walk: `xlafit check llm model.objective=dpo lora.rank=16 ...` without
    --tpu said the model had no adapters and told the user to set the lora.rank they had set:
    the CPU check built the model without them."""
    from xlafit.check.recipes import check_recipe

    report = check_recipe(
        "llm", ["model.objective=dpo", "lora.rank=4", "data.demo=preference", "data.seq_len=48", "data.global_batch=8"]
    )
    assert report.traced and report.ran and not report.findings, report.findings


def test_progress_lines_of_compiles_in_two_threads_stay_whole(monkeypatch):
    """Issue 63's second walk: `check --tpu kaggle` printed "compiling the eval step ...kaggle =
    v5e-8: compiling the train step ..." on one line (the eval step compiles in another thread,
    and print writes a line's text and its end apart)."""
    import threading
    import time

    from xlafit.check.program import progress

    class SlowStderr:  # a write that yields to the other thread, as a busy terminal or pipe can
        def __init__(self):
            self.parts = []

        def write(self, text):
            self.parts.append(text)
            time.sleep(0.001)

        def flush(self):
            pass

    stderr = SlowStderr()
    monkeypatch.setattr("sys.stderr", stderr)
    threads = [threading.Thread(target=lambda n=n: [progress(f"step {n} ...") for _ in range(20)]) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(set("".join(stderr.parts).splitlines())) == ["step 0 ...", "step 1 ..."]


def test_check_tpu_compiles_no_eval_step_for_data_that_holds_no_evaluation(tmp_path):
    """The fifth walk: `check --tpu colab` on 24 chat records that held none out (the start-up
    line says so) compiled and reported an eval step the run would never run."""
    import json

    from xlafit.check.recipes import recipe_program
    from xlafit.data import chat_demo

    data = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "It is 7."}]
    data.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(24)))
    common = [f"data.data_dir={data}", f"data.tokenizer={chat_demo.demo_files()[2]}", "data.seq_len=32"]
    without, _, _ = recipe_program("llm", [*common, "data.eval_fraction=0"])
    assert without.eval_global_batch is None
    held_out, _, _ = recipe_program("llm", [*common, "data.eval_fraction=0.5"])
    assert held_out.eval_global_batch is not None


def test_a_large_models_check_on_the_host_says_it_builds_it_first(monkeypatch, capsys):
    """The sixteenth walk: `xlafit check llm model.preset=qwen3.5-9b lora.rank=16
    lora.base_dtype=nf4` printed nothing for minutes after its data line while it built and
    quantized a 9B base in host memory. (The bar lowered here so that a tiny model crosses it.)"""
    from xlafit.check import recipes

    monkeypatch.setattr(recipes, "LARGE_BUILD", 1000)
    tiny = ["model.preset=custom", "model.num_layers=1", "model.hidden_size=64", "model.num_heads=1",
            "model.intermediate_size=128", "data.seq_len=32", "data.demo=arithmetic", "lora.rank=4",
            "lora.base_dtype=nf4"]  # fmt: skip
    recipes.check_recipe("llm", tiny)
    err = capsys.readouterr().err
    assert "building the 0.0B-parameter model in this host's memory, its base quantized to nf4, to run a step" in err
