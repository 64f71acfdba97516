"""`xlafit check --tpu`'s verdict for a run: every program it compiles must fit (the train
step and the eval step), and a named model's shapes need no corpus.

The model is Meta's 1B preset cut to one narrow layer: its vocabulary (128,256 tokens) is the
preset's, and its logits are kept whole (``model.logits_chunk=0``; ``auto`` computes them in
blocks), so the eval step's logits are what fills the core; each compile takes seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SMALL_LLM
from xlafit.check import check_recipe, to_json
from xlafit.check.program import EvalFit, TargetReport
from xlafit.check.tpu_report import _probe_line, format_report

ROOT = Path(__file__).resolve().parents[1]
SMALL = SMALL_LLM


@pytest.fixture(scope="module")
def eval_over_and_its_progress():
    """A run whose train step fits one v5e core and whose eval batch (4,096 rows of 64
    tokens: float32 logits of 32 MiB a row) does not; and the progress lines it printed."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        report = check_recipe("llm", [*SMALL, "data.eval_global_batch=4096"], tpu="v5e-1")
    return report, err.getvalue().splitlines()


@pytest.fixture(scope="module")
def eval_over(eval_over_and_its_progress):
    return eval_over_and_its_progress[0]


def test_a_run_whose_eval_step_does_not_fit_does_not_fit(eval_over):
    """The report said "eval step: does not fit" above "fits 1 of 1 TPU target(s)", exit 0,
    and named no fix: the run died at its first evaluation."""
    (t,) = eval_over.tpu
    assert t.train_fits and t.eval is not None and not t.eval.fits
    assert t.fits is False and t.unfit == ["eval step"] and not eval_over.ok  # the CLI's exit 1
    text = eval_over.format()
    assert "fits 0 of 1 TPU target(s)" in text and "fits 1 of 1" not in text
    assert "✗ eval step (batch 4096 per core) does not fit" in text
    assert "✗ the run does not fit: its eval step does not" in text
    out = json.loads(to_json(eval_over))
    assert out["ok"] is False and out["tpu"][0]["fits"] is False and out["tpu"][0]["unfit"] == ["eval step"]


def test_the_eval_step_that_does_not_fit_names_the_largest_eval_batch_that_does(eval_over):
    (t,) = eval_over.tpu
    e = t.eval
    assert e.largest and 0 < e.largest < 4096 and e.fix == f"data.eval_global_batch={e.largest}"
    fitted = {p.per_device_batch: p.fits for p in e.probes}
    assert fitted[e.largest] is True  # compiled: the fix is a batch the compiler placed
    assert not any(ok for batch, ok in fitted.items() if batch > e.largest)
    assert f"fix: {e.fix} ({e.largest} per core, the largest that compiles" in format_report(t)


def test_the_eval_batch_search_comes_after_the_train_steps_verdict_and_says_why_it_runs(eval_over_and_its_progress):
    """A 9B check on Colab probed eval batches for 8 minutes before the train step's verdict,
    in lines that named --max-batch, which was not given."""
    _, err = eval_over_and_its_progress
    said = err.index("v5e-1: the train step fits")
    assert err[said + 1] == (
        "v5e-1 eval step: the run's eval batch, 4096 per core (data.eval_global_batch=4096), does not fit: searching "
        "for the largest that compiles, one compile a probe; set data.eval_global_batch=N to skip the search."
    )
    probes = err[said + 2 :]
    assert probes and all(line.startswith("v5e-1 eval step: eval batch probe ") for line in probes)
    assert not any("--max-batch" in line for line in err)


def test_a_run_that_sets_no_eval_batch_evaluates_at_its_train_batch():
    """data.per_device_batch=1 with data.global_batch=null (the docs' largest-model commands)
    compiled the eval step at the preset's 64 rows a core, then searched for one that fit; a
    run's eval batch is its global batch unless data.eval_global_batch says otherwise."""
    (t,) = check_recipe("llm", SMALL, tpu="v5e-1").tpu
    assert t.per_device_batch == 1 and t.eval is not None
    assert t.eval.fits and t.eval.per_device_batch == 1 and not t.eval.probes


def test_an_eval_step_the_compiler_placed_is_reported_at_its_peak_not_the_sum_of_its_buffers():
    """A Qwen3 1.7B eval step was printed "fits, 18.97 GiB" under a limit of 15.75 GiB: the
    sum of its buffers (temporaries never live together each counted), beside a compiler's
    peak within the limit."""
    gib = 2**30
    r = TargetReport("v5e-8", "TPU v5 lite", 8, 8, 1, train_fits=True, capacity=15.75 * gib)
    r.memory = {"state": gib, "total": 4 * gib}
    r.eval = EvalFit(True, 8, total=int(19.36 * gib), peak=int(14.71 * gib), compile_s=51.7)
    text = format_report(r)
    assert "✓ eval step (batch 8 per core) fits: the compiler's peak 14.71 GiB of 15.75 GiB per core" in text
    assert "its buffers add up to 19.36 GiB" in text and r.fits


def test_max_batch_says_it_searches_the_train_steps_batch():
    r = TargetReport("v5e-1", "TPU v5 lite", 1, 1, 8, train_fits=True, capacity=16 * 2**30, max_batch=8)
    r.eval = EvalFit(True, 8, total=2**30)
    r.max_batch_limit = 64
    text = _probe_line(r)
    assert "largest per-core batch that fits: 8" in text
    assert "(the train step's; the eval step is checked at its own batch, data.eval_global_batch, above)" in text


def test_a_presets_fit_check_needs_no_corpus(tmp_path):
    """`xlafit check llm --tpu colab model.preset=...` from a wheel install failed: "the Korean
    demo corpus comes from the konlpy wheel". A preset's shapes come from the config (its
    vocabulary, data.seq_len): here konlpy is shadowed by a package with no corpus, and the
    user cache holds no demo tokenizer."""
    hide = tmp_path / "hide" / "konlpy"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update(PYTHONPATH=f"{hide.parent}{os.pathsep}{ROOT / 'src'}", XLAFIT_CACHE=str(tmp_path / "cache"))
    code = (
        "import sys; from xlafit.data.text import korean_demo_files\n"
        "try:\n    korean_demo_files()\nexcept Exception as e:\n    print('no corpus:', e)\n"
        "from xlafit.cli import main\n"
        f"code = main(['check', 'llm', '--tpu', 'v5e-1', *{SMALL!r}, 'data.eval_global_batch=8', '--json'])\n"
        "from xlafit.check import recipe_program\n"
        f"print('examples', recipe_program('llm', {SMALL!r})[2])\n"
        "sys.exit(code)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert "no corpus: no corpus files under" in out.stdout  # the data lookup fails, as without konlpy
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout[out.stdout.index("{") : out.stdout.rindex("}") + 1])
    (t,) = report["tpu"]
    assert t["fits"] and t["eval"]["fits"] and "examples None" in out.stdout
    assert "demo" not in out.stderr.lower()  # no corpus read, no tokenizer trained
