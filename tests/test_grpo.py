"""GRPO's objective (xlafit.train.grpo) against TRL's GRPOTrainer on identical inputs: the
advantages that TRL's ``_generate_and_score_completions`` computes from the same rewards,
and the loss, its gradient and its logged metrics that TRL's ``_compute_loss`` computes from
the same per-token log-probabilities, for each loss variant. TRL's own methods run, called
on a stub that holds the settings they read."""

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xlafit.errors import ConfigError
from xlafit.train import grpo

torch = pytest.importorskip("torch")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
GRPOTrainer = trl_grpo.GRPOTrainer

TOL = 1e-5  # float32, the same per-token log-probabilities
G, PROMPTS, C = 4, 3, 7  # group size, prompts, max completion length
B = G * PROMPTS


class Stub:
    """What TRL's methods read of a GRPOTrainer; anything else they ask for fails the test by name."""

    def __init__(self, **settings):
        self.__dict__.update(settings)

    def __getattr__(self, name):
        raise AttributeError(f"the TRL stub lacks {name!r}: TRL's code reads it (add it to the stub)")


class Accelerator:
    device = torch.device("cpu")
    process_index, num_processes, is_main_process = 0, 1, True

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def args(**kw):
    defaults = dict(
        use_bias_correction_kl=False, delta=None, steps_per_generation=1, gradient_accumulation_steps=1,
        per_device_train_batch_size=B, gradient_checkpointing_kwargs=None, report_to=[],
    )  # fmt: skip
    return Stub(**(defaults | kw))


def model_stub():
    return Stub(training=True, is_gradient_checkpointing=False)


@pytest.fixture(scope="module")
def batch():
    """Per-token log-probabilities of B completions of different lengths (right-padded),
    the policy's at generation and the reference's, and advantages of both signs."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, C + 1, size=B)
    lengths[0] = C
    mask = (np.arange(C)[None, :] < lengths[:, None]).astype(np.float32)
    logps = rng.uniform(-4.0, -0.05, size=(B, C)).astype(np.float32)
    old = (logps + rng.normal(0, 0.3, size=(B, C))).astype(np.float32)  # ratios far enough from 1 to clip
    ref = (logps + rng.normal(0, 0.2, size=(B, C))).astype(np.float32)
    adv = rng.normal(0, 1, size=B).astype(np.float32)
    return {"logps": logps, "old": old, "ref": ref, "mask": mask, "adv": adv, "lengths": lengths}


def trl_loss(batch, loss_type, beta, epsilon, epsilon_high):
    """TRL's loss, its gradient with respect to the per-token log-probabilities, and its metrics."""
    logps = torch.tensor(batch["logps"], requires_grad=True)
    metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    stub = Stub(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=args(), loss_type=loss_type, epsilon_low=epsilon, epsilon_high=epsilon_high, use_vllm=False,
        model=model_stub(), current_gradient_accumulation_steps=1, max_completion_length=C,
        accelerator=Accelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=metrics,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )  # fmt: skip
    mask = torch.tensor(batch["mask"], dtype=torch.long)
    inputs = {
        "prompt_ids": torch.ones((B, 2), dtype=torch.long),
        "prompt_mask": torch.ones((B, 2), dtype=torch.long),
        "completion_ids": torch.ones((B, C), dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.tensor(batch["adv"]),
        "old_per_token_logps": torch.tensor(batch["old"]),
        "ref_per_token_logps": torch.tensor(batch["ref"]),
        "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return float(loss.detach()), logps.grad.numpy(), {k: v[-1] for k, v in metrics["train"].items()}


def xlafit_loss(batch, objective):
    weights = grpo.row_weights(batch["lengths"], objective.loss_type, C, int(batch["mask"].sum()))

    def loss(logps):
        losses, metrics = grpo.policy_loss(
            logps, jnp.asarray(batch["old"]), jnp.asarray(batch["ref"]), jnp.asarray(batch["mask"]),
            jnp.asarray(batch["adv"]), jnp.asarray(weights), objective,
        )  # fmt: skip
        return losses.mean(), metrics  # the trainer's mean over the rows

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(batch["logps"]))
    return float(value), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
@pytest.mark.parametrize(("beta", "epsilon_high"), [(0.0, None), (0.04, 0.28)], ids=["no-kl", "kl-clip-higher"])
def test_loss_gradient_and_metrics_equal_trls(batch, loss_type, beta, epsilon_high):
    objective = grpo.GrpoObjective(loss_type, beta=beta, epsilon_high=epsilon_high, num_generations=G,
                                   max_completion_length=C)  # fmt: skip
    low, high = objective.clip
    theirs, their_grad, their_metrics = trl_loss(batch, loss_type, beta, 1 - low, high - 1)
    ours, our_grad, our_metrics = xlafit_loss(batch, objective)
    assert abs(ours - theirs) < TOL, (ours, theirs)
    np.testing.assert_allclose(our_grad, their_grad, atol=TOL, rtol=0)
    assert their_metrics["clip_ratio/region_mean"] > 0  # the clip is exercised
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"] + (["kl"] if beta else [])
    for name in names:
        assert abs(our_metrics[name] - their_metrics[name]) < TOL, name
    assert ("kl" in our_metrics) == bool(beta)


def test_the_first_step_of_a_generation_batch_has_ratio_one(batch):
    """Without old log-probabilities (num_iterations=1) the ratio is 1: TRL's detached copy."""
    objective = grpo.GrpoObjective("grpo", num_generations=G, max_completion_length=C)
    logps = jnp.asarray(batch["logps"])
    weights = jnp.asarray(grpo.row_weights(batch["lengths"], "grpo", C, 0))
    losses, metrics = grpo.policy_loss(
        logps, jax.lax.stop_gradient(logps), None, jnp.asarray(batch["mask"]), jnp.asarray(batch["adv"]), weights,
        objective,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(losses), -batch["adv"], rtol=1e-6)  # -A per token, averaged per row
    assert float(metrics["clip_ratio/region_mean"]) == 0.0


def reward_a(prompts, completions, **kwargs):
    return [float(len(c)) % 3 for c in completions]


def reward_b(prompts, completions, answer, **kwargs):
    return [1.0 if c.endswith(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def trl_advantages(completions, answers, weights, scale):
    """TRL's _generate_and_score_completions (its _calculate_rewards calling the reward
    functions) on completions given instead of generated."""
    metrics = collections.defaultdict(lambda: collections.defaultdict(list))
    ids = [[7] * len(c) for c in completions]
    inputs = [{"prompt": f"q{i // G}", "answer": a} for i, a in enumerate(answers)]
    generated = ([[1, 2]] * B, ids, None, completions, None, {}, None, None)
    stub = Stub(
        accelerator=Accelerator(), model=model_stub(), environment_factories=None, tools=None, environments=None,
        _generate=lambda prompts: generated, _tokenizer=Stub(pad_token_id=0), pad_to_multiple_of=None,
        mask_truncated_completions=False, args=args(), _is_vlm=False, num_iterations=1, use_vllm=False,
        beta=0.0, reward_funcs=[reward_a, reward_b], reward_processing_classes=[None, None],
        reward_func_names=["reward_a", "reward_b"], state=Stub(global_step=0), num_generations=G,
        multi_objective_aggregation="sum_then_normalize", scale_rewards=scale,
        reward_weights=torch.tensor(weights, dtype=torch.float32), _metrics=metrics,
        _logs={"prompt": [], "completion": [], "rewards": collections.defaultdict(list), "advantages": [],
               "extra": collections.defaultdict(list)},
        _pending_extra_logs=collections.defaultdict(list), _pending_metrics=collections.defaultdict(list),
        log_multimodal=False,
    )  # fmt: skip
    stub._calculate_rewards = lambda *a: GRPOTrainer._calculate_rewards(stub, *a)
    stub._log_completion_extra = lambda *a: GRPOTrainer._log_completion_extra(stub, *a)
    stub._log_metric = lambda *a: GRPOTrainer._log_metric(stub, *a)
    with contextlib.redirect_stdout(None):
        out = GRPOTrainer._generate_and_score_completions(stub, inputs)
    return out["advantages"].numpy(), {k: v[-1] for k, v in metrics["train"].items()}


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale):
    rng = np.random.default_rng(1)
    answers = [str(rng.integers(0, 3)) for _ in range(B)]
    completions = ["x" * int(rng.integers(1, 6)) + str(rng.integers(0, 3)) for _ in range(B)]
    completions[G : 2 * G] = ["same1"] * G  # a group whose rewards are all equal: advantage 0, zero std
    weights = [0.5, 2.0]
    theirs, their_metrics = trl_advantages(completions, answers, weights, scale)
    kwargs = {"prompts": [f"q{i // G}" for i in range(B)], "completions": completions, "answer": answers}
    values = np.array([reward_a(**kwargs), reward_b(**kwargs)], np.float32).T
    ours, stats = grpo.advantages(values, np.array(weights), G, scale)
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)
    assert abs(float(stats["reward"].mean()) - their_metrics["reward"]) < TOL
    assert abs(float(stats["zero_std"].mean()) - their_metrics["frac_reward_zero_std"]) < TOL


def test_row_weights_make_each_variant_from_the_rows_mean():
    lengths = np.array([2, 5, 3, 6])
    assert grpo.row_weights(lengths, "grpo", 8, 16).tolist() == pytest.approx([1 / 2, 1 / 5, 1 / 3, 1 / 6])
    assert grpo.row_weights(lengths, "dr_grpo", 8, 16).tolist() == pytest.approx([1 / 8] * 4)
    assert grpo.row_weights(lengths, "dapo", 8, 16).tolist() == pytest.approx([4 / 16] * 4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"loss_type": "ppo"}, "one of grpo, dr_grpo, dapo"),
        ({"num_generations": 1}, "a group needs 2 completions"),
        ({"beta": -1.0}, "beta=-1 must be 0"),
        ({"temperature": 0.0}, "temperature above 0"),
    ],
)
def test_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        grpo.GrpoObjective(**settings)
