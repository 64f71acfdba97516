"""Qwen3-MoE (qwen3_moe): a checkpoint of a random tiny config, built and saved with
transformers, loads with transformers' logits (float32, 1e-4) whichever way the experts are
computed, keeps packed segments apart, generates what transformers.generate does, gives
transformers' load-balancing loss on the same router logits, exports back to what
transformers reads, and exports a LoRA fine-tune as a PEFT adapter with the same logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import hf_greedy
from xlafit.hf import llama as llama_hf
from xlafit.models.generation import generate
from xlafit.models.moe import load_balancing_loss

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Layer 1 keeps the dense MLP (mlp_only_layers): the decoder mixes both kinds.
CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
              decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True, max_position_embeddings=128,
              tie_word_embeddings=False)  # fmt: skip
IDS = np.random.default_rng(0).integers(0, 97, (2, 16)).tolist()


def _save(model, folder):
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _random(**changes):
    config = transformers.Qwen3MoeConfig(**{**CONFIG, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # norms and the router away from their initial values too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = _random()
    return model, _save(model, tmp_path_factory.mktemp("qwen3_moe"))


@nnx.jit
def _ours(model, *args):
    """The model's logits, compiled (op by op, the sort and gathers of the grouped products are slow)."""
    return model(*args)


def _theirs(model, ids, **kwargs):
    with torch.no_grad():
        return model(torch.tensor(ids), **kwargs).logits.numpy()


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_a_checkpoint_loads_with_transformers_logits(checkpoint, impl):
    theirs, folder = checkpoint
    ours = llama_hf.from_hf(folder, moe_impl=impl)
    assert ours.cfg.family == "qwen3_moe" and ours.cfg.moe_layers == (True, False, True)
    np.testing.assert_allclose(np.asarray(_ours(ours, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_fused_expert_tensors_load_too(checkpoint, tmp_path):
    """transformers' in-memory layout (gate_up_proj [E, 2f, h], down_proj [E, h, f]) in the file."""
    from safetensors.numpy import save_file

    theirs, folder = checkpoint
    state = {k: v.numpy() for k, v in theirs.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers 5 keeps them fused in memory
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ours = llama_hf.from_hf(tmp_path)
    np.testing.assert_allclose(np.asarray(_ours(ours, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_every_layer_sparse_scans_to_the_same_logits(tmp_path):
    theirs = _random(mlp_only_layers=[], num_hidden_layers=2)
    folder = _save(theirs, tmp_path)
    scanned = llama_hf.from_hf(folder, scan_layers=True)
    np.testing.assert_allclose(np.asarray(_ours(scanned, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_sparse_and_dense_layers_scan_as_a_block(checkpoint):
    """Layers (sparse, dense, sparse): the (sparse, dense) block scanned, the last layer after
    it unscanned; transformers' logits, the same router statistics as unscanned, the same
    generated tokens."""
    theirs, folder = checkpoint
    ours, scanned = llama_hf.from_hf(folder), llama_hf.from_hf(folder, scan_layers=True)
    assert scanned.cfg.scan_period == 2 and len(scanned.tail) == 1
    np.testing.assert_allclose(np.asarray(_ours(scanned, jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)
    segments = jnp.array([[1] * 16, [1] * 11 + [0] * 5])
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    routed = nnx.jit(lambda m: m.decode_routed(jnp.array(IDS), segments, positions)[1])
    want, got = routed(ours), routed(scanned)
    assert float(got.layers) == 2
    for name in ("counts", "probs", "rows", "z"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), rtol=1e-5)
    prompts = [IDS[0][:5], IDS[1][:3]]
    assert generate(scanned, prompts, 6) == generate(ours, prompts, 6)


def test_packed_sequences_see_only_their_own_segment(checkpoint):
    _, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    a, b = IDS[0][:9], IDS[1][:7]
    packed = np.asarray(
        _ours(ours, jnp.array([a + b]), jnp.array([[1] * 9 + [2] * 7]), jnp.array([list(range(9)) + list(range(7))]))
    )[0]
    np.testing.assert_allclose(packed[:9], np.asarray(_ours(ours, jnp.array([a])))[0], atol=1e-5)
    np.testing.assert_allclose(packed[9:], np.asarray(_ours(ours, jnp.array([b])))[0], atol=1e-5)


def test_cached_greedy_generation_equals_transformers_generate(checkpoint):
    theirs, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    prompts = [IDS[0][:5], IDS[1][:3]]
    got = generate(ours, prompts, 8)
    assert got == hf_greedy(theirs, prompts, 8, eos_token_id=None)


def test_the_aux_loss_equals_transformers_on_the_same_router_logits(checkpoint):
    """Padding (segment 0 here, attention_mask 0 there) is left out of both."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    theirs, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    segments = np.ones((2, 16), np.int32)
    segments[1, 11:] = 0  # right padding
    with torch.no_grad():
        out = theirs(torch.tensor(IDS), attention_mask=torch.tensor(segments), output_router_logits=True)
    expected = load_balancing_loss_func(out.router_logits, 8, 2, torch.tensor(segments)).item()
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    _, stats = ours.decode_routed(jnp.array(IDS), jnp.array(segments), positions)
    assert stats is not None and float(stats.layers) == 2
    np.testing.assert_allclose(float(load_balancing_loss(stats)), expected, rtol=1e-5)
    assert float(jnp.sum(stats.expert_load())) == 2 * 27  # k x real tokens, per layer


def test_an_export_loads_back_in_transformers(checkpoint, tmp_path):
    theirs, folder = checkpoint
    llama_hf.save_hf(llama_hf.from_hf(folder), tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    np.testing.assert_allclose(_theirs(back, IDS), _theirs(theirs, IDS), atol=1e-5, rtol=1e-5)


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_on_attention_exports_a_peft_adapter_transformers_applies(checkpoint, tmp_path):
    peft = pytest.importorskip("peft")
    from xlafit.hf.peft import save_peft_adapter
    from xlafit.models.lora import apply_lora, merge_lora

    _, folder = checkpoint
    # and the router (`gate`), a module of its own in transformers: a target parameter for PEFT
    targets = ["q_proj", "v_proj", "o_proj", "gate"]
    ours = apply_lora(llama_hf.from_hf(folder), targets, rank=4, alpha=8, rngs=nnx.Rngs(1))
    for path, value in nnx.state(ours, nnx.LoRAParam).flat_state():  # non-zero B: the adapter changes the logits
        if path[-1] == "lora_b":
            value.set_value(jnp.full(value.shape, 0.05, value.dtype))
    save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(folder))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
    tuned = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = merge_lora(ours)
    np.testing.assert_allclose(np.asarray(_ours(merged, jnp.array(IDS))), _theirs(tuned, IDS), atol=1e-4, rtol=1e-4)
