"""Preference objectives (xlafit.train.preference): DPO, SimPO and ORPO against TRL's own loss
code on identical inputs, and the reference model of a LoRA run (the adapters off)."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlafit.errors import ConfigError
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.models.lora import adapters_off, apply_lora
from xlafit.train import preference

torch = pytest.importorskip("torch")
trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
trl_cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
trl_orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

TOL = 1e-5  # float32, the same per-token log-probabilities
PAIRS, T, V = 6, 14, 23


@pytest.fixture(scope="module")
def pairs():
    """Random logits over 6 pairs of rows (chosen, rejected) of prompts and completions of
    different lengths, padded at the end; as xlafit's pairs and as TRL's batches."""
    rng = np.random.default_rng(0)
    ids = rng.integers(3, V, size=(PAIRS, 2, T)).astype(np.int32)
    segments = np.zeros((PAIRS, 2, T), np.int32)
    mask = np.zeros((PAIRS, 2, T), np.int8)
    for i in range(PAIRS):
        prompt = rng.integers(2, 6)
        for j in range(2):
            end = prompt + rng.integers(2, T - prompt + 1)
            segments[i, j, :end] = 1
            mask[i, j, prompt:end] = 1
            ids[i, j, end:] = 0
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), ids.shape).copy()
    logits = (rng.standard_normal((PAIRS, 2, T, V)) * 3).astype(np.float32)
    ref = (rng.standard_normal((PAIRS, 2)) * 4 - 20).astype(np.float32)
    batch = {"input_ids": ids, "segment_ids": segments, "positions": positions, "loss_mask": mask}
    return batch, logits, ref


def torch_rows(x):
    """``[B, 2, ...]`` as TRL's concatenated batch ``[2B, ...]``: every chosen row, then every rejected one."""
    return torch.from_numpy(np.concatenate([x[:, 0], x[:, 1]]).copy())


def trl_labels(batch):
    ids = torch_rows(batch["input_ids"]).long()
    return ids.masked_fill(torch_rows(batch["loss_mask"]) == 0, -100)


def ours(batch, logits):
    """xlafit's summed completion log-probabilities and token counts, ``[B, 2]``."""
    rows = {k: jnp.asarray(v.reshape(-1, T)) for k, v in batch.items()}
    sums, counts = preference.completion_logps(jnp.asarray(logits.reshape(-1, T, V)), rows)
    return np.asarray(sums).reshape(-1, 2), np.asarray(counts).reshape(-1, 2)


def test_completion_logps_equal_trl_get_batch_logps(pairs):
    batch, logits, _ = pairs
    sums, counts = ours(batch, logits)
    expected = trl_orpo.ORPOTrainer.get_batch_logps(torch_rows(logits), trl_labels(batch)).numpy()
    average = trl_orpo.ORPOTrainer.get_batch_logps(torch_rows(logits), trl_labels(batch), average_log_prob=True)
    np.testing.assert_allclose(np.concatenate([sums[:, 0], sums[:, 1]]), expected, rtol=0, atol=TOL * 10)
    np.testing.assert_allclose(
        np.concatenate([(sums / counts)[:, 0], (sums / counts)[:, 1]]), average.numpy(), rtol=0, atol=TOL
    )


def trl_dpo_trainer(beta, loss_types=("sigmoid",), loss_weights=(1.0,)):
    """TRL's DPOTrainer with what its ``_compute_loss`` reads and nothing else: a sigmoid
    loss with precomputed reference log-probabilities, on one process."""
    trainer = object.__new__(trl_dpo.DPOTrainer)
    one = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)
    fields = {
        "accelerator": one,
        "model": types.SimpleNamespace(training=True),
        "aux_loss_enabled": False,
        "precompute_ref_logps": True,
        "ld_alpha": None,
        "f_divergence_type": "reverse_kl",
        "loss_types": list(loss_types),
        "loss_weights": list(loss_weights),
        "beta": beta,
        "label_smoothing": 0.0,
        "use_weighting": False,
        "_metrics": {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
        "_total_train_tokens": 0,
        "_tp_size": 1,
    }
    for k, v in fields.items():
        object.__setattr__(trainer, k, v)
    return trainer


def trl_dpo_loss(batch, logits, ref, beta, **losses):
    """DPOTrainer._compute_loss on pairs, fed the same per-token log-probabilities as its
    model's: ``(loss, {metric: value})``."""
    labels = trl_labels(batch)
    token_logps = trl_utils.selective_log_softmax(torch_rows(logits)[:, :-1], labels[:, 1:].clamp(min=0))
    token_logps = token_logps * (labels[:, 1:] != -100)
    rows = 2 * len(ref)
    outputs = types.SimpleNamespace(
        log_probs=token_logps,
        entropy=torch.zeros(rows, T - 1),
        mean_logits=torch.zeros(rows, T - 1),
        is_top1=torch.zeros(rows, T - 1, dtype=torch.bool),
    )
    inputs = {
        "input_ids": torch_rows(batch["input_ids"]).long(),
        "attention_mask": torch_rows(batch["segment_ids"]).long(),
        "completion_mask": torch_rows(batch["loss_mask"]).long(),
        "ref_chosen_logps": torch.from_numpy(ref[:, 0].copy()),
        "ref_rejected_logps": torch.from_numpy(ref[:, 1].copy()),
    }
    trainer = trl_dpo_trainer(beta, **losses)
    loss = trainer._compute_loss(lambda **kwargs: outputs, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def test_dpo_equals_trl_dpo_trainer(pairs):
    """The loss and TRL's logged rewards, margins, accuracies and log-probabilities of
    DPOTrainer._compute_loss."""
    batch, logits, ref = pairs
    beta = 0.3
    loss, logged = trl_dpo_loss(batch, logits, ref, beta)

    sums, _ = ours(batch, logits)
    losses, chosen, rejected = preference.dpo(
        jnp.asarray(sums[:, 0]), jnp.asarray(sums[:, 1]), jnp.asarray(ref[:, 0]), jnp.asarray(ref[:, 1]), beta=beta
    )
    assert abs(float(losses.mean()) - loss.item()) < TOL
    assert abs(float(chosen.mean()) - logged["rewards/chosen"]) < TOL
    assert abs(float(rejected.mean()) - logged["rewards/rejected"]) < TOL
    assert abs(float((chosen - rejected).mean()) - logged["rewards/margins"]) < TOL
    assert float((chosen > rejected).mean()) == logged["rewards/accuracies"]
    assert abs(float(sums[:, 0].mean()) - logged["logps/chosen"]) < TOL * 10
    assert abs(float(sums[:, 1].mean()) - logged["logps/rejected"]) < TOL * 10
    assert 0 < logged["rewards/accuracies"] < 1  # the pairs tell right from wrong: the check can fail


def trl_cpo_trainer(loss_type, beta, label_smoothing, gamma=0.5):
    trainer = object.__new__(trl_cpo.CPOTrainer)
    fields = {
        "accelerator": types.SimpleNamespace(device=torch.device("cpu")),
        "alpha": 0.0,
        "loss_type": loss_type,
        "beta": beta,
        "label_smoothing": label_smoothing,
        "simpo_gamma": gamma,
    }
    for k, v in fields.items():
        object.__setattr__(trainer, k, v)
    return trainer


def test_conservative_dpo_equals_trl_sigmoid_with_label_smoothing(pairs):
    """DPO's label smoothing (conservative DPO) is TRL's sigmoid loss with label_smoothing
    (CPOTrainer keeps it; its logits are DPO's difference of log-ratios)."""
    batch, logits, ref = pairs
    sums, _ = ours(batch, logits)
    beta, smoothing = 0.2, 0.15
    ratios = torch.from_numpy(sums - ref)
    expected, _, _ = trl_cpo_trainer("sigmoid", beta, smoothing).cpo_loss(ratios[:, 0], ratios[:, 1])
    losses, _, _ = preference.dpo(
        jnp.asarray(sums[:, 0]),
        jnp.asarray(sums[:, 1]),
        jnp.asarray(ref[:, 0]),
        jnp.asarray(ref[:, 1]),
        beta=beta,
        label_smoothing=smoothing,
    )
    np.testing.assert_allclose(np.asarray(losses), expected.numpy(), rtol=0, atol=TOL)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_equals_trl_cpo_trainer_simpo(pairs, smoothing):
    batch, logits, _ = pairs
    sums, counts = ours(batch, logits)
    avg = sums / counts
    beta, gamma = 2.0, 0.7
    expected = trl_cpo_trainer("simpo", beta, smoothing, gamma).cpo_loss(
        torch.from_numpy(avg[:, 0].copy()), torch.from_numpy(avg[:, 1].copy())
    )
    got = preference.simpo(
        jnp.asarray(avg[:, 0]), jnp.asarray(avg[:, 1]), beta=beta, gamma=gamma, label_smoothing=smoothing
    )
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(mine), theirs.numpy(), rtol=0, atol=TOL)


def test_orpo_equals_trl_orpo_trainer(pairs):
    """ORPO's odds-ratio term, rewards and logged ratios are ORPOTrainer.odds_ratio_loss's; its
    SFT term is TRL's cross-entropy over the chosen completion's tokens."""
    batch, logits, _ = pairs
    sums, counts = ours(batch, logits)
    avg = sums / counts
    beta = 0.25
    trainer = object.__new__(trl_orpo.ORPOTrainer)
    object.__setattr__(trainer, "beta", beta)
    object.__setattr__(trainer, "accelerator", types.SimpleNamespace(device=torch.device("cpu")))
    ratio_losses, chosen_r, rejected_r, log_odds_ratio, log_odds_chosen = trainer.odds_ratio_loss(
        torch.from_numpy(avg[:, 0].copy()), torch.from_numpy(avg[:, 1].copy())
    )
    losses, chosen, rejected, extras = preference.orpo(jnp.asarray(avg[:, 0]), jnp.asarray(avg[:, 1]), beta=beta)
    np.testing.assert_allclose(np.asarray(chosen), chosen_r.numpy(), rtol=0, atol=TOL)
    np.testing.assert_allclose(np.asarray(rejected), rejected_r.numpy(), rtol=0, atol=TOL)
    assert abs(float(extras["log_odds_ratio"].mean()) - log_odds_ratio.item()) < TOL
    assert abs(float(extras["log_odds_chosen"].mean()) - log_odds_chosen.item()) < TOL
    # One pair at a time: TRL's SFT term is a mean over the batch's tokens, each pair's here.
    labels = trl_labels(batch)
    for i in range(PAIRS):
        nll = torch.nn.functional.cross_entropy(torch_rows(logits)[i, :-1], labels[i, 1:], ignore_index=-100)
        expected = nll - ratio_losses[i]
        assert abs(float(losses[i]) - expected.item()) < TOL


def tiny_lora_llama(vocab=V):
    model = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=vocab), rngs=nnx.Rngs(0))
    model = apply_lora(model, ("q_proj", "v_proj"), rank=4, alpha=8, rngs=nnx.Rngs(1))
    for _, var in nnx.state(model, nnx.LoRAParam).flat_state():  # trained adapters: the policy moved off its base
        var[...] = jax.random.normal(jax.random.key(2), var[...].shape) * 0.3
    return model


def test_lora_reference_is_the_base_with_adapters_off(pairs):
    """DPO's reference under LoRA: the log-probabilities of the merged-out base (the model
    before its adapters), without a gradient; the policy's differ."""
    batch, _, _ = pairs
    model = tiny_lora_llama()
    rows = {k: jnp.asarray(v.reshape(-1, T)) for k, v in batch.items()}
    reference = preference._base_logps(model, rows)
    base = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=V), rngs=nnx.Rngs(0))
    expected, _ = preference._pair_logps(base, rows)
    np.testing.assert_allclose(np.asarray(reference), np.asarray(expected), rtol=0, atol=1e-5)
    policy, _ = preference._pair_logps(model, rows)
    assert np.abs(np.asarray(policy) - np.asarray(reference)).max() > 1e-2
    with adapters_off():  # traced inside: jit keeps the base's path
        off = nnx.jit(lambda m: preference._pair_logps(m, rows)[0])(model)
    np.testing.assert_allclose(np.asarray(off), np.asarray(expected), rtol=0, atol=1e-5)


def test_dpo_loss_fn_gradient_reaches_the_adapters_only_through_the_policy(pairs):
    batch, _, _ = pairs
    model = tiny_lora_llama()
    step_loss = preference.loss_fn(preference.Objective("dpo", beta=0.1))
    jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
    losses, metrics = step_loss(model, jbatch)
    assert losses.shape == (PAIRS,)
    assert set(metrics) >= {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"}
    np.testing.assert_allclose(
        np.asarray(metrics["rewards/margins"]),
        np.asarray(metrics["rewards/chosen"] - metrics["rewards/rejected"]),
        rtol=0,
        atol=1e-6,
    )
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    grads = jax.grad(lambda a: step_loss(nnx.merge(graphdef, a, rest), jbatch)[0].mean())(adapters)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads) if g.ndim == 2 and g.shape[0] == 4)


def test_dpo_without_adapters_or_reference_names_the_options(pairs):
    batch, _, _ = pairs
    model = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=V), rngs=nnx.Rngs(0))
    step_loss = preference.loss_fn(preference.Objective("dpo"))
    with pytest.raises(ConfigError, match=r"lora\.rank=16.*model\.preference\.reference=precomputed"):
        step_loss(model, {k: jnp.asarray(v) for k, v in batch.items()})


def test_precomputed_reference_equals_the_base(pairs):
    batch, _, _ = pairs
    base = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=V), rngs=nnx.Rngs(0))
    got = preference.reference_logps(base, batch, batch_pairs=4)  # 6 pairs: the last batch filled up
    rows = {k: jnp.asarray(v.reshape(-1, T)) for k, v in batch.items()}
    expected, _ = preference._pair_logps(base, rows)
    np.testing.assert_allclose(got, np.asarray(expected), rtol=0, atol=1e-5)


def test_dpo_with_the_sft_term_equals_trl_sigmoid_plus_sft(pairs):
    """sft_weight: TRL's loss_type=["sigmoid", "sft"], loss_weights=[1, w], a pair at a time
    (TRL's SFT term averages over the batch's chosen tokens, xlafit's over each pair's)."""
    batch, logits, ref = pairs
    beta, weight = 0.3, 0.7
    rows = {k: jnp.asarray(v) for k, v in batch.items()}
    given_logits = jnp.asarray(logits.reshape(-1, T, V))
    model = lambda ids, segments, positions: given_logits  # noqa: E731  (the logits as the model's)
    losses, metrics = preference.loss_fn(
        preference.Objective("dpo", beta=beta, reference="precomputed", sft_weight=weight)
    )(model, {**rows, "ref_logps": ref})
    for i in range(PAIRS):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        expected, logged = trl_dpo_loss(
            one, logits[i : i + 1], ref[i : i + 1], beta, loss_types=("sigmoid", "sft"), loss_weights=(1.0, weight)
        )
        assert abs(float(losses[i]) - expected.item()) < TOL
        assert abs(float(metrics["rewards/chosen"][i]) - logged["rewards/chosen"]) < TOL
