"""The per-token log-probabilities of the preference objectives and GRPO in blocks of the logits
(``model.logits_chunk``), as the next-token loss computes its cross-entropy: equal to the whole
logits' in float32, their gradients too, and with the real TPU compiler a step that holds far
less than the whole logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlafit.check import check_recipe
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.models.lora import ADAPTER, apply_lora
from xlafit.recipes import llm as recipe
from xlafit.train import grpo, preference, rollout
from xlafit.train.losses import blockwise_token_logps, token_logps_of

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, max_position_embeddings=64)
T = 32  # 31 predicted positions: a chunk of 5 does not divide them


@pytest.mark.parametrize("softcap, temperature", [(None, 1.0), (2.0, 0.7)])
def test_blockwise_token_logps_are_the_whole_logits_and_their_gradients(softcap, temperature):
    """Chunks of 5 of 13 positions, tiles of 128 of 300 columns (the last overlapping the one
    before): each position's log-probability and the gradients of a weighted sum of them with
    respect to the hidden states and the kernel, as the whole float32 logits give them."""
    kh, kk, ky, kw = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(kh, (2, 13, 16))
    kernel = jax.random.normal(kk, (16, 300)) * 0.5
    labels = jax.random.randint(ky, (2, 13), 0, 300)
    weights = jax.random.normal(kw, (2, 13))

    def whole(h, k):
        z = jnp.einsum("bth,hv->btv", h, k)
        if softcap:
            z = jnp.tanh(z / softcap) * softcap
        return token_logps_of(z, labels, temperature)

    def blocks(h, k):
        return blockwise_token_logps(h, k, labels, chunk=5, tile=128, softcap=softcap, temperature=temperature)

    np.testing.assert_allclose(jax.jit(blocks)(hidden, kernel), whole(hidden, kernel), rtol=1e-6, atol=1e-6)
    grads = [  # compiled: op by op, the blocks' backward pass takes seconds
        jax.jit(jax.grad(lambda h, k, f=f: (f(h, k) * weights).sum(), argnums=(0, 1)))(hidden, kernel)
        for f in (blocks, whole)
    ]
    for got, expected in zip(*grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def _model(logits_chunk, softcap=None):
    cfg = LlamaConfig(**SIZES, logits_chunk=logits_chunk, final_logit_softcap=softcap)
    model = apply_lora(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), ("q_proj", "v_proj"), rank=4, alpha=8, rngs=nnx.Rngs(1))
    nnx.update(model, jax.tree.map(lambda x: x + 0.1, nnx.state(model, ADAPTER)))  # B starts at 0: policy != base
    return model


def _rows(rng, n):
    segments = np.repeat([[1] * 20 + [2] * 8 + [0] * 4], n, axis=0)  # two pieces, then padding
    return {
        "input_ids": jnp.asarray(rng.integers(1, 97, (n, T)), jnp.int32),
        "segment_ids": jnp.asarray(segments, jnp.int32),
        "positions": jnp.asarray(np.repeat([list(range(20)) + list(range(8)) + [0] * 4], n, axis=0), jnp.int32),
        "loss_mask": jnp.asarray(np.repeat([[0] * 9 + [1] * 11 + [0] * 2 + [1] * 6 + [0] * 4], n, axis=0), jnp.int8),
    }


def _value_and_grads(loss, model, batch):
    def scalar(m):
        losses, metrics = loss(m, batch)
        return losses.mean(), metrics

    # compiled: op by op, the chunked scan's backward pass takes most of the test's time
    (value, metrics), grads = nnx.jit(nnx.value_and_grad(scalar, has_aux=True))(model)
    return value, metrics, jax.tree.leaves(nnx.state(grads))


def _assert_same(chunked, whole):
    """Equal within 1e-6: the loss, the gradients, the metrics; those made of completions' summed
    log-probabilities (DPO's rewards: differences of sums near -80, whose float32 spacing is
    8e-6) within 1e-6 of those sums, and the gradients, which the loss scales by a function of
    those differences, within 1e-6 of that relative to each (on one x86 CPU an element of 0.0685
    differed by 1.1e-6, 1.6e-5 of it)."""
    (v1, m1, g1), (v0, m0, g0) = chunked, whole
    np.testing.assert_allclose(v1, v0, rtol=1e-6, atol=1e-6)
    sums = [np.abs(m0[k]).max() for k in ("logps/chosen", "logps/rejected") if k in m0]
    scale = max([1.0, *sums])
    for name in m0:
        np.testing.assert_allclose(m1[name], m0[name], rtol=1e-6, atol=1e-6 * scale, err_msg=name)
    assert len(g1) == len(g0) > 0
    for x, y in zip(g1, g0, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6 * scale, atol=1e-6)


@pytest.mark.parametrize("loss", ["dpo", "orpo"])
def test_the_preference_losses_in_blocks_are_the_whole_logits_losses_and_gradients(loss):
    """DPO with its reference in the step (the base, adapters off) and ORPO, the recipe's
    log-probabilities in chunks of 5 positions against the whole logits (``logits_chunk=0``)."""
    rng = np.random.default_rng(0)
    rows = _rows(rng, 6)
    batch = {k: v.reshape(3, 2, T) for k, v in rows.items()}
    objective = preference.Objective(loss, beta=0.5, sft_weight=0.3 if loss == "dpo" else 0.0)
    results = [_value_and_grads(preference.loss_fn(objective, recipe.token_logps), _model(c), batch) for c in (5, 0)]
    _assert_same(*results)
    reference = [
        preference.reference_logps(_model(c), {k: np.asarray(v) for k, v in batch.items()}, 2, recipe.token_logps)
        for c in (5, 0)
    ]
    np.testing.assert_allclose(*reference, rtol=1e-6, atol=1e-6)


def test_the_grpo_loss_and_the_rollouts_log_probabilities_in_blocks_are_the_whole_logits():
    """GRPO at a temperature of 0.7 with a KL term and a policy that has moved since generation
    (the ratio not 1), on Gemma 2's soft-capped logits: the loss, its metrics and gradients, and
    the rollout's log-probability pass (policy and reference), chunks of 5 against the whole."""
    rng = np.random.default_rng(1)
    rows = _rows(rng, 4)
    objective = grpo.GrpoObjective(beta=0.04, temperature=0.7, num_generations=2)
    whole = _model(0, softcap=2.0)
    logps = recipe.token_logps(whole, rows, 0.7)
    batch = {
        **rows,
        "advantages": jnp.asarray([1.0, -1.0, 0.5, -0.5]),
        "weights": jnp.full((4,), 1 / 17),
        "old_logps": logps + jnp.asarray(rng.normal(0, 0.3, logps.shape), jnp.float32),
        "ref_logps": logps + jnp.asarray(rng.normal(0, 0.3, logps.shape), jnp.float32),
    }
    loss = grpo.loss_fn(objective, recipe.token_logps)
    _assert_same(_value_and_grads(loss, _model(5, softcap=2.0), batch), _value_and_grads(loss, whole, batch))
    for reference in (False, True):
        got = [rollout._logps(*nnx.split(_model(c, 2.0)), rows, 0.7, reference, recipe.token_logps) for c in (5, 0)]
        np.testing.assert_allclose(*got, rtol=1e-6, atol=1e-6)


# A tiny LoRA model with 4 x Gemma's 262,144-token vocabulary: the step's memory is its logits'.
# (The TPU compiler's time grows with the rows a core, not the vocabulary: 4 rows over this
# vocabulary compile faster than 16 over Gemma's.)
WIDE_VOCAB = [
    "model.preset=custom", "model.num_layers=1", "model.hidden_size=64", "model.num_heads=4",
    "model.intermediate_size=128", "model.max_position_embeddings=128", "lora.rank=4",
    "model.vocab_size=1048576", "data.seq_len=128",
]  # fmt: skip


def test_a_dpo_step_and_its_eval_hold_far_less_than_the_whole_logits_by_default():
    """2 pairs (4 rows of 128 tokens) a v5e core: the whole float32 logits are 2.1 GB (4.3 with
    their gradient, over 1/8 of the core's 16 GiB), so ``auto`` takes blocks, for the policy's
    pass, the reference's and the eval step's alike; each then needs under a third of what the
    whole logits (``model.logits_chunk=0``) take."""
    dpo = [
        *WIDE_VOCAB,
        "model.objective=dpo",
        "data.demo=preference",
        "data.global_batch=2",
        "data.eval_global_batch=2",
    ]
    (auto,) = check_recipe("llm", dpo, tpu="v5e-1").tpu
    (whole,) = check_recipe("llm", [*dpo, "model.logits_chunk=0"], tpu="v5e-1").tpu
    assert auto.error is None and whole.error is None, (auto.message, whole.message)
    logits = 4 * 127 * 1048576 * 4
    assert whole.memory["total"] > logits and whole.eval.total > logits
    assert auto.memory["total"] < whole.memory["total"] / 3, (auto.memory, whole.memory)
    assert auto.eval.total < whole.eval.total / 3, (auto.eval.total, whole.eval.total)
