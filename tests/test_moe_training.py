"""Training a mixture of experts: the llm recipe's loss adds the router's load-balancing loss
and reports the tokens routed to each expert; expert parallelism (mesh.expert) trains what
one device trains."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from helpers import packed_rows
from xlafit.config import TrainerConfig
from xlafit.errors import ConfigError
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.models.moe import load_balancing_loss
from xlafit.recipes import llm as recipe

CFG = LlamaConfig.preset("tiny-moe", vocab_size=64, num_layers=2, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=16, num_heads=4, num_kv_heads=2, max_position_embeddings=32)  # fmt: skip
STEPS, BATCH, T = 20, 16, 16


def test_the_loss_adds_the_aux_loss_and_counts_the_routed_tokens():
    batch = {k: jnp.asarray(v) for k, v in packed_rows(4, T, 64).items()}
    loss_fn = nnx.jit(recipe.loss_fn)
    model = LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))
    loss, metrics = loss_fn(model, batch)
    plain = LlamaForCausalLM(dataclasses.replace(CFG, router_aux_loss_coef=0.0), rngs=nnx.Rngs(0))
    cross_entropy, _ = loss_fn(plain, batch)
    _, stats = model.decode_routed(batch["input_ids"], batch["segment_ids"], batch["positions"])
    aux = float(load_balancing_loss(stats))
    assert aux > 0 and float(metrics["moe_aux_loss"][0]) == pytest.approx(aux)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(cross_entropy) + 0.001 * aux, rtol=1e-6)
    # The fifth walk: the perplexity was the exponential of the loss with the router's term in it.
    np.testing.assert_allclose(np.asarray(metrics["nll_loss"]), np.asarray(cross_entropy), rtol=1e-6)
    routed = [float(metrics[f"expert_tokens/{e}"][0]) for e in range(8)]
    real = int((np.asarray(batch["segment_ids"]) > 0).sum())
    assert sum(routed) == 2 * real  # k=2 experts for each real token, per layer; padding counts none
    assert "router_z_loss" not in metrics
    z = dataclasses.replace(CFG, router_z_loss_coef=0.01)
    _, with_z = loss_fn(LlamaForCausalLM(z, rngs=nnx.Rngs(0)), batch)
    assert float(with_z["router_z_loss"][0]) > 0


def _trainer(mesh, strategy=None):
    return xlafit.Trainer(
        lambda: LlamaForCausalLM(CFG, rngs=nnx.Rngs(0)),
        recipe.loss_fn,
        optax.sgd(0.05, momentum=0.9),
        strategy=strategy or xlafit.connect(mesh=mesh),
        global_batch=BATCH,
        config=TrainerConfig(epochs=1, log_every_steps=STEPS),
    )


def test_expert_parallelism_trains_what_one_device_trains(strategy1, capsys):
    """mesh.expert=4 x fsdp=2 on 8 devices: the experts split 4 ways (2 of 8 each), the batch
    8 ways; 20 SGD steps land within 1e-5 (relative L2, each parameter) of one device's.
    Pure data parallelism over 8 lands 2.9e-7 away, expert parallelism 2.8e-7; a learning
    rate ten times larger makes both drift 1e-3 (a top-k choice that flips with the rounding
    moves a token to another expert), so it is kept small."""
    from xlafit.data.dataset import ArrayDataset

    data = ArrayDataset(packed_rows(BATCH * STEPS, T, 64))
    one = _trainer(None, strategy1).fit(data)
    trainer = _trainer((1, 2, 1, 4))
    split = trainer.fit(data)
    out = capsys.readouterr().out
    assert "mesh: data=1 fsdp=2 expert=4 tensor=1 -> " in out and "experts split over expert" in out
    gate = split.state.params["layers"][0]["mlp"]["experts"]["gate_proj"][...]
    assert gate.sharding.spec[0] == "expert" and gate.sharding.shard_shape(gate.shape)[0] == 8 // 4
    ours = dict(nnx.to_flat_state(split.state.params))
    for path, theirs in nnx.to_flat_state(one.state.params):
        a, b = np.asarray(ours[path][...]), np.asarray(theirs[...])
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5, path
    np.testing.assert_allclose(split.history[-1]["loss"], one.history[-1]["loss"], rtol=1e-5)
    assert jax.device_count() == 8


def test_the_final_report_gives_the_perplexity_of_the_next_token_loss_and_no_expert_counts():
    """The fifth walk: a MoE run's `perplexity:` was exp(loss + coef x aux), and its `test:` line
    printed the experts' token counts the logs leave out."""
    from xlafit.run import final_report

    metrics = {"expert_tokens/0": 33.0, "loss": 6.9381, "moe_aux_loss": 2.3799, "nll_loss": 5.7481,
               "token_accuracy": 0.1, "count": 2}  # fmt: skip
    test, perplexity = final_report(metrics, unit="rows").splitlines()
    assert "expert_tokens" not in test and "nll_loss=5.7481" in test
    assert perplexity == "perplexity: 313.59"  # exp(5.7481), not exp(6.9381) = 1,030.8


def test_router_loss_weights_given_to_an_objective_that_trains_without_them_are_named(caplog):
    """The fifth walk: model.moe.router_aux_loss_coef=0.5 on a DPO run changed nothing, without a word."""
    import logging

    from xlafit.recipes import get_recipe

    dpo = ["model.preset=tiny-moe", "lora.rank=4", "model.objective=dpo", "data.demo=preference",
           "model.moe.router_aux_loss_coef=0.5"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        get_recipe("llm").validate(xlafit.load_config("llm", dpo))
    assert [r.getMessage() for r in caplog.records] == [
        "warning: model.moe.router_aux_loss_coef=0.5 set, but model.objective=dpo trains without the router's "
        "losses (only next-token runs add them; TRL's trainers add the load-balancing one to every objective): "
        "ignored"
    ]


def test_expert_settings_for_a_model_without_experts_are_named_and_a_moe_presets_weight_is_overridden(caplog):
    """The sixth walk: model.moe.router_aux_loss_coef and mesh.expert on a dense model were taken
    without a word; and model.moe.router_aux_loss_coef on a MoE preset (tiny-moe, qwen3-30b-a3b)
    ended in a TypeError (the preset's own weight given twice)."""
    import logging

    from xlafit.recipes import get_recipe

    with caplog.at_level(logging.WARNING, logger="xlafit"):
        get_recipe("llm").validate(xlafit.load_config("llm", ["model.moe.router_aux_loss_coef=0.5", "mesh.expert=2"]))
    assert [r.getMessage() for r in caplog.records] == [
        "warning: model.moe.router_aux_loss_coef=0.5 set, but model.preset=tiny has no experts: ignored",
        "warning: mesh.expert=2 set, but model.preset=tiny has no experts to split: that axis only splits the batch, "
        "as mesh.data does",
    ]
    caplog.clear()
    moe = xlafit.load_config("llm", ["model.preset=tiny-moe", "model.moe.router_aux_loss_coef=0.5", "mesh.expert=2"])
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        get_recipe("llm").validate(moe)
    assert caplog.records == []
    assert recipe.llama_config(moe, 64).router_aux_loss_coef == 0.5


def test_preference_settings_the_objective_does_not_read_are_named(caplog):
    """The sixth walk: model.preference.gamma / sft_weight / label_smoothing on ORPO (and gamma on
    DPO, sft_weight on SimPO) changed nothing, without a word."""
    import logging

    from xlafit.recipes import get_recipe

    orpo = ["lora.rank=4", "model.objective=orpo", "data.demo=preference", "model.preference.gamma=3",
            "model.preference.sft_weight=2", "model.preference.beta=0.2"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        get_recipe("llm").validate(xlafit.load_config("llm", orpo))
    assert [r.getMessage() for r in caplog.records] == [
        "warning: model.preference.gamma=3.0, model.preference.sft_weight=2.0 set, but model.objective=orpo does not "
        "read them (it reads model.preference.beta): ignored"
    ]
    caplog.clear()  # the seventh walk: data.loss_on=all on DPO/ORPO changed nothing, without a word
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        get_recipe("llm").validate(xlafit.load_config("llm", [*orpo[:3], "data.loss_on=all"]))
    assert [r.getMessage() for r in caplog.records] == [
        "warning: data.loss_on=all set, but model.objective=orpo compares the completions' tokens alone (ORPO's SFT "
        "term too): ignored"
    ]
    caplog.clear()  # the fifteenth walk: data.text_column on DPO, the same
    with caplog.at_level(logging.WARNING, logger="xlafit"):
        get_recipe("llm").validate(xlafit.load_config("llm", [*orpo[:3], "data.text_column=chosen"]))
    assert [r.getMessage() for r in caplog.records] == [
        "warning: data.text_column=chosen set, but model.objective=orpo reads each record's prompt, chosen and "
        "rejected fields: ignored"
    ]
    with pytest.raises(ConfigError, match=r"^data.format=bogus: give one of auto, text, chat, prompt_completion, pref"):
        xlafit.load_config("llm", [*orpo[:3], "data.format=bogus"])  # was "is another kind of data"


def test_an_evaluation_counts_the_routed_tokens_of_its_examples_alone(strategy8):
    """An evaluation pads its last batch with copies of example 0, each weighing 0: the
    router's statistics, one value for the whole batch, counted their tokens too (a walk's 3
    rows at an eval batch of 8 reported the tokens of 8). Those rows are padding throughout."""
    data = packed_rows(3, T, 64)
    result = _trainer(None, strategy8).evaluate(data)
    routed = sum(result[f"expert_tokens/{e}"] for e in range(8))
    real = int((data["segment_ids"] > 0).sum())
    assert result["count"] == 3 and routed == pytest.approx(2 * real)  # k=2 experts a real token, per layer
