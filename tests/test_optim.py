import jax.numpy as jnp
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


def test_optimizers_lamb_and_polynomial_decay():
    cfg = OptimizerConfig(
        name="lamb",
        learning_rate=1e-3,
        reference_batch=64,
        warmup_steps=10,
        decay="polynomial",
        decay_power=2.0,
        weight_decay=0.01,
        weight_decay_on="matrices",
    )
    plan = make_optimizer(cfg, 64, 110)
    assert float(plan.schedule(10)) == pytest.approx(1e-3)
    assert float(plan.schedule(60)) == pytest.approx(1e-3 * 0.5**2)  # (1 - 50/100) ** 2
    params = {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)}
    state = plan.tx.init(params)
    updates, _ = plan.tx.update({"kernel": jnp.zeros((3, 3)), "bias": jnp.zeros(3)}, state, params)
    # a zero gradient: only weight decay moves anything, and only the matrix (step 0: lr 0 in warmup)
    assert float(jnp.abs(updates["bias"]).max()) == 0.0
