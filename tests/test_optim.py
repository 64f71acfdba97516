import numpy as np
import pytest

from xlafit.config import OptimizerConfig
from xlafit.train.optim import make_optimizer, scaled_lr


@pytest.mark.parametrize(("rule", "expected"), [("linear", 0.8), ("sqrt", 0.2 * 2), ("none", 0.2)])
def test_lr_scaling_rules(rule, expected):
    # 1024 = 4 x the reference batch of 256: linear x4, sqrt x2.
    assert scaled_lr(0.2, 1024, 256, rule) == pytest.approx(expected)


def test_warmup_then_cosine_to_final_fraction():
    cfg = OptimizerConfig(
        learning_rate=0.1, reference_batch=64, scaling="linear", warmup_steps=10, decay="cosine", final_lr_fraction=0.1
    )
    plan = make_optimizer(cfg, global_batch=128, total_steps=110)
    assert plan.peak_lr == pytest.approx(0.2)
    lrs = np.array([float(plan.schedule(s)) for s in range(111)])
    assert lrs[0] == 0.0
    assert lrs[5] == pytest.approx(0.1)  # halfway through warmup
    assert lrs.max() == pytest.approx(0.2)
    assert lrs[10] == pytest.approx(0.2)
    assert lrs[110] == pytest.approx(0.02)  # final fraction of the peak
    assert np.all(np.diff(lrs[10:]) <= 1e-9)  # decays monotonically after warmup


def test_linear_decay_and_clipping():
    cfg = OptimizerConfig(learning_rate=1.0, reference_batch=8, scaling="none", decay="linear", grad_clip_norm=1.0)
    plan = make_optimizer(cfg, global_batch=8, total_steps=100)
    assert float(plan.schedule(50)) == pytest.approx(0.5)
    assert float(plan.schedule(100)) == pytest.approx(0.0)
