import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from xlafit.config import OptimizerConfig
from xlafit.errors import ConfigError
from xlafit.train.loop import lr_at
from xlafit.train.optim import highest_rate, make_optimizer, make_schedule, matrices, scaled_lr, warmup_steps


@pytest.mark.parametrize(("rule", "expected"), [("linear", 0.8), ("sqrt", 0.2 * 2), ("none", 0.2)])
def test_lr_scaling_rules(rule, expected):
    # 1024 = 4 x the reference batch of 256: linear x4, sqrt x2.
    assert scaled_lr(0.2, 1024, 256, rule) == pytest.approx(expected)


def test_a_schedule_is_read_as_one_compiled_program(caplog):
    """The start-up's learning-rate lines and every logged step read the schedule: op by op,
    each of its dozen or so jnp operations compiled alone for every new shape (about two
    CPU-seconds of a training command's start)."""
    schedule = make_schedule(OptimizerConfig(warmup_steps=5, decay="cosine"), 1e-3, 37)
    with jax.log_compiles(), caplog.at_level(logging.WARNING, logger="jax._src.dispatch"):
        highest, at_3 = highest_rate(schedule, 37), lr_at(schedule, 3)
    compiles = [r for r in caplog.records if r.getMessage().startswith("Finished XLA compilation")]
    assert len(compiles) <= 2, [r.getMessage() for r in compiles]  # steps [37] and one step
    assert highest == pytest.approx(1e-3, rel=1e-6) and at_3 == pytest.approx(3 / 5 * 1e-3, rel=1e-6)


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


def test_sgd_nesterov_with_masked_weight_decay_equals_pytorch():
    """Nesterov SGD with weight decay on the kernel only, five steps: PyTorch's torch.optim.SGD
    (decay added to the gradient before the momentum) within float32 rounding."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    params = {
        "conv": {"kernel": rng.standard_normal((3, 3, 2, 4)).astype(np.float32)},
        "norm": {"scale": rng.standard_normal(4).astype(np.float32), "bias": rng.standard_normal(4).astype(np.float32)},
    }
    grads = [jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params) for _ in range(5)]
    cfg = OptimizerConfig(
        name="sgd",
        learning_rate=0.1,
        reference_batch=256,
        scaling="linear",
        decay="constant",
        momentum=0.9,
        nesterov=True,
        weight_decay=1e-2,
        weight_decay_on="matrices",
    )
    plan = make_optimizer(cfg, global_batch=512, total_steps=5)  # lr 0.1 x 512 / 256
    ours = jax.tree.map(jnp.asarray, params)
    state = plan.tx.init(ours)
    for g in grads:
        updates, state = plan.tx.update(jax.tree.map(jnp.asarray, g), state, ours)
        ours = optax.apply_updates(ours, updates)

    theirs = {k: torch.tensor(v) for k, v in (("kernel", params["conv"]["kernel"]), ("scale", params["norm"]["scale"]))}
    theirs["bias"] = torch.tensor(params["norm"]["bias"])
    for t in theirs.values():
        t.requires_grad_(True)
    opt = torch.optim.SGD(
        [{"params": [theirs["kernel"]], "weight_decay": 1e-2}, {"params": [theirs["scale"], theirs["bias"]]}],
        lr=0.2,
        momentum=0.9,
        nesterov=True,
    )
    for g in grads:
        theirs["kernel"].grad = torch.tensor(g["conv"]["kernel"])
        theirs["scale"].grad = torch.tensor(g["norm"]["scale"])
        theirs["bias"].grad = torch.tensor(g["norm"]["bias"])
        opt.step()
    np.testing.assert_allclose(ours["conv"]["kernel"], theirs["kernel"].detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(ours["norm"]["scale"], theirs["scale"].detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(ours["norm"]["bias"], theirs["bias"].detach().numpy(), atol=1e-5)


def test_lars_trust_ratio_and_masks_by_hand():
    """One LARS step: the kernel's update is lr x eta x |w| / |g + wd w| x (g + wd w); the
    rank-1 parameters (biases, batch-norm scales) get neither decay nor trust ratio."""
    rng = np.random.default_rng(1)
    w, b = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    gw, gb = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    cfg = OptimizerConfig(
        name="lars",
        learning_rate=2.0,
        scaling="none",
        decay="constant",
        weight_decay=1e-3,
        weight_decay_on="matrices",
        trust_coefficient=0.01,
    )
    plan = make_optimizer(cfg, global_batch=32768, total_steps=10)
    params = {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)}
    updates, state = plan.tx.update({"kernel": jnp.asarray(gw), "bias": jnp.asarray(gb)}, plan.tx.init(params), params)
    u = gw.astype(np.float64) + 1e-3 * w
    trust = 0.01 * np.linalg.norm(w) / np.linalg.norm(u)
    np.testing.assert_allclose(updates["kernel"], -2.0 * trust * u, rtol=1e-5)
    np.testing.assert_allclose(updates["bias"], -2.0 * gb, rtol=1e-6)
    # "all": the bias gets the decay and its own trust ratio too
    every = make_optimizer(
        OptimizerConfig(**{**cfg.__dict__, "weight_decay_on": "all", "trust_ratio_on": "all"}), 32768, 10
    )
    updates, _ = every.tx.update({"kernel": jnp.asarray(gw), "bias": jnp.asarray(gb)}, every.tx.init(params), params)
    ub = gb.astype(np.float64) + 1e-3 * b
    np.testing.assert_allclose(updates["bias"], -2.0 * 0.01 * np.linalg.norm(b) / np.linalg.norm(ub) * ub, rtol=1e-5)


def test_mlperf_lars_schedule_warmup_epochs_then_polynomial_power_2():
    cfg = OptimizerConfig(
        name="lars",
        learning_rate=10.0,
        scaling="none",
        warmup_epochs=2,
        decay="polynomial",
        decay_power=2.0,
        final_lr_fraction=1e-5,
    )
    plan = make_optimizer(cfg, global_batch=32768, total_steps=100, steps_per_epoch=10)
    assert float(plan.schedule(10)) == pytest.approx(5.0)  # halfway through 2 epochs of warmup
    assert float(plan.schedule(20)) == pytest.approx(10.0)
    end = 10.0 * 1e-5
    for t in (40, 60, 100):
        assert float(plan.schedule(t)) == pytest.approx((10.0 - end) * (1 - (t - 20) / 80) ** 2 + end, rel=1e-5)
    assert warmup_steps(cfg, 1251) == 2502
    with pytest.raises(ValueError, match="needs steps_per_epoch"):
        make_optimizer(cfg, 32768, total_steps=100)


def test_resnet_masks_leave_out_biases_and_batch_norm():
    from flax import nnx

    from xlafit.models.resnet import ResNet

    params = nnx.state(nnx.eval_shape(lambda: ResNet(18, 10, width=4, rngs=nnx.Rngs(0))), nnx.Param)
    flat = {jax.tree_util.keystr(p): m for p, m in jax.tree.leaves_with_path(matrices(params))}
    decayed = sorted(k for k, m in flat.items() if m)
    assert all("kernel" in k for k in decayed) and len(decayed) == 1 + 16 + 3 + 1  # stem, 16 convs, 3 shortcuts, head
    assert not any(m for k, m in flat.items() if "norm" in k or "bias" in k)


def test_a_run_records_warmup_epochs_as_steps(strategy1):
    from xlafit.errors import ConfigError
    from xlafit.recipes import load_config
    from xlafit.run import resolve

    cfg = load_config("mnist", ["optimizer.warmup_epochs=2.5", "data.global_batch=64"])
    resolved, _ = resolve(cfg, strategy1, num_examples=640)  # 10 steps per epoch
    assert resolved.optimizer.warmup_steps == 25 and resolved.optimizer.warmup_epochs == 2.5
    with pytest.raises(ConfigError, match="warmup_epochs=-1.0 must be zero or more"):
        load_config("mnist", ["optimizer.warmup_epochs=-1"])
    with pytest.raises(ConfigError, match="optimizer.name='rmsprop' is not allowed"):
        load_config("mnist", ["optimizer.name=rmsprop"])


def test_bf16_first_moment_halves_it_and_is_refused_where_optax_has_none():
    tx = make_optimizer(OptimizerConfig(moment_dtype="bfloat16"), 128, total_steps=10).tx
    state = tx.init({"w": jnp.zeros((4, 4))})
    adam = next(s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu"))
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.float32
    with pytest.raises(ConfigError, match="moment_dtype=bfloat16 applies to adam and adamw"):
        OptimizerConfig(name="sgd", moment_dtype="bfloat16")
