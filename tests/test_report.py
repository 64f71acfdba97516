"""What a run shows while it trains (train/report.py) and says at start-up (train/progress.py)."""

import sys

from tqdm import tqdm

from xlafit.train import report as report_module
from xlafit.train.report import RunReport

RECORDS = [
    {"step": 2, "epoch": 0.5, "loss": 0.5, "grad_norm": 1.25, "learning_rate": 0.01},
    {"step": 4, "epoch": 1, "loss": 0.25, "grad_norm": 0.75, "learning_rate": 0.005},
]


def shown(report: RunReport) -> None:
    for record in RECORDS:
        report.record(dict(record))
    report.record({"step": 4, "epoch": 1, "loss": 0.3, "count": 8}, prefix="eval")
    report.close()


def train_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("[train]")]


def test_on_a_terminal_every_logged_step_prints_its_line_through_the_bar(monkeypatch, capsys):
    """The bar's postfix keeps loss, accuracy and throughput; grad_norm, the learning rate and
    DPO's and GRPO's rewards were on no screen while the bar replaced the lines."""
    monkeypatch.setattr(report_module, "in_notebook", lambda: False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    shown(RunReport(None, total_steps=4))
    out, err = capsys.readouterr()
    assert train_lines(out) == [
        "[train] step 2 epoch 0.5  loss=0.5000  grad_norm=1.2500  learning_rate=0.01",
        "[train] step 4 epoch 1  loss=0.2500  grad_norm=0.7500  learning_rate=0.005",
    ], out
    assert "[eval] step 4 epoch 1  loss=0.3000  count=8" in out
    assert err.count("4/4") == 1, err  # the bar, closed once at 100 %


def test_in_a_notebook_with_ipywidgets_the_lines_print_beside_the_widget_bar(monkeypatch, capsys):
    """The first notebook walk: in a kernel the run drew the bar and never printed its
    ``[train]`` lines. The text bar stands in for the widget one here (the suite has no
    ipywidgets): what matters is that the lines print through it."""
    monkeypatch.setattr(report_module, "in_notebook", lambda: True)
    monkeypatch.setattr(report_module, "notebook_tqdm", lambda: tqdm)
    report = RunReport(None, total_steps=4)
    assert report._bar is not None
    shown(report)
    out, _ = capsys.readouterr()
    assert [line.split("  ")[0] for line in train_lines(out)] == ["[train] step 2 epoch 0.5", "[train] step 4 epoch 1"]
    assert "grad_norm=1.2500" in out


def test_in_a_notebook_without_ipywidgets_no_text_bar_is_drawn(monkeypatch, capsys):
    """The text bar cannot redraw in place in a notebook (stderr and stdout are separate
    outputs there): each line printed through it left another copy of the bar, ~50 over a
    100-epoch cell. Without ipywidgets the run prints its lines alone."""
    monkeypatch.setattr(report_module, "in_notebook", lambda: True)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # find_spec: not installed
    assert report_module.notebook_tqdm() is None
    report = RunReport(None, total_steps=4)
    assert report._bar is None
    shown(report)
    out, err = capsys.readouterr()
    assert len(train_lines(out)) == 2 and err == "", err


def test_the_host_memory_line_names_the_setting_in_python_too_and_is_said_once(strategy8, monkeypatch):
    """The line named ``cpu.keep_memory=false``, an override a ``Trainer`` in a notebook has
    no place for (``xlafit.connect(cpu=...)`` is its way), and came with every ``fit``."""
    import numpy as np

    from xlafit.config import TrainerConfig
    from xlafit.data.dataset import as_dataset
    from xlafit.data.loader import TrainOrder
    from xlafit.train import progress

    monkeypatch.setattr(progress, "keeping_freed_memory", lambda: True)
    monkeypatch.setitem(progress._said, "host memory", False)
    lines: list[str] = []

    class Printed:
        def print(self, message: str) -> None:
            lines.append(message)

    train = as_dataset({"x": np.zeros((16, 2), np.float32)})
    order = TrainOrder(num_examples=16, global_batch=8, seed=0)
    for _ in range(2):  # two fits in one process
        progress.announce(
            Printed(), strategy8, TrainerConfig(epochs=1), None, restored=None, order=order, train=train,
            total=2, global_batch=8, learning_rate=None, flops_per_example=None, peak=None,
        )  # fmt: skip
    said = [line for line in lines if line.startswith("host memory:")]
    assert said == [
        "host memory: freed blocks are kept for the next step (no page faults; the process holds more memory); "
        "cpu.keep_memory=false returns them, in Python "
        "xlafit.connect(cpu=xlafit.platform.cpu.CpuConfig(keep_memory=False)) before JAX starts"
    ], lines
