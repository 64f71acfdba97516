"""A quantized base's mixture of experts (``lora.base_dtype=nf4|int4|int8`` on Qwen3-MoE,
Qwen3.5-MoE, Gemma 4 26B-A4B): each expert's stacked weights are quantized in blocks along
its own input features, exactly as each expert's kernel alone; the experts compute with their
dequantized weights; LoRA on them trains the adapters alone; a merge writes bfloat16 experts;
and a Hugging Face checkpoint read into a quantized base quantizes each expert as it arrives,
to the same codes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xlafit.config import LoraConfig
from xlafit.hf import llama as llama_hf
from xlafit.hf.quantized import from_hf_quantized
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.models.lora import ADAPTER, merge_lora
from xlafit.models.moe import EXPERT_WEIGHTS, Experts
from xlafit.models.quantized import QuantizedExperts, dequantize_linears, param_bytes, quantize_base, quantize_kernel
from xlafit.run import with_lora

IDS = jnp.array(np.random.default_rng(0).integers(0, 64, (2, 10)))


def _tiny_moe() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig.preset("tiny-moe", vocab_size=64, num_layers=1), rngs=nnx.Rngs(0))


def _experts(model) -> list:
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, Experts | QuantizedExperts)]


@nnx.jit
def _logits(model, ids):
    return model(ids)


@pytest.mark.parametrize("qtype", ["nf4", "int8"])
def test_each_expert_is_quantized_as_its_own_kernel_and_computes_dequantized(qtype):
    model = _tiny_moe()
    plain = _experts(model)[0]
    quantized = quantize_base(nnx.clone(model), qtype, block=32)
    (first, *_) = _experts(quantized)
    assert isinstance(first, QuantizedExperts) and first.shape == plain.shape
    for weight in EXPERT_WEIGHTS:  # stacked codes = each expert's kernel quantized alone
        stacked = getattr(first, weight)
        for e in range(plain.shape[0]):
            codes, scales = quantize_kernel(np.asarray(getattr(plain, weight)[...][e]), qtype, 32)
            np.testing.assert_array_equal(np.asarray(stacked.qvalue[...][e]), np.asarray(codes))
            np.testing.assert_array_equal(np.asarray(stacked.scale[...][e]), np.asarray(scales))
    # stored at half a byte a weight (NF4) or a byte (int8), and a float32 scale a block of 32
    weights = sum(3 * int(np.prod(m.shape)) for m in _experts(model))
    stored = sum(param_bytes(m) for m in _experts(quantized))
    assert stored == weights * ((0.5 if qtype == "nf4" else 1.0) + 4 / 32)
    # the quantized model computes what its dequantized weights do
    want = _logits(dequantize_linears(nnx.clone(quantized), jnp.float32), IDS)
    np.testing.assert_allclose(np.asarray(_logits(quantized, IDS)), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_lora_on_quantized_experts_trains_the_adapters_alone_and_merges_to_bfloat16():
    """Through the experts alone (the model around them is any model's): the adapters get
    gradients, the quantized weights are no parameter the trainer trains, and a merge writes
    bfloat16 experts equal to the dequantized weights plus the update."""
    lora = LoraConfig(rank=2, alpha=4, targets="q_proj,experts", base_dtype="nf4", base_block=32)
    model = with_lora(_tiny_moe(), lora, seed=0)
    (path, wrapped), *_ = [(p, m) for p, m in nnx.iter_modules(model) if type(m).__name__ == "ExpertLoRA"]
    assert isinstance(wrapped.base_module, QuantizedExperts)
    wrapped.gate_up_b[...] = jnp.full(wrapped.gate_up_b.shape, 0.05)  # B off zero: the update shows
    wrapped.down_b[...] = jnp.full(wrapped.down_b.shape, 0.05)
    tokens = jnp.asarray(np.random.default_rng(1).normal(size=(6, 64)), jnp.float32)
    weights, experts = jnp.full((6, 2), 0.5), jnp.array([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7], [3, 4]])
    graph, adapters, rest = nnx.split(wrapped, ADAPTER, ...)
    grads = jax.grad(lambda a: jnp.sum(nnx.merge(graph, a, rest)(tokens, weights, experts) ** 2))(adapters)
    flat = dict(nnx.to_flat_state(grads))
    assert sorted(k[-1] for k in flat) == ["down_a", "down_b", "gate_up_a", "gate_up_b"]
    assert all(float(jnp.abs(g[...]).max()) > 0 for g in flat.values())
    want = [np.asarray(w) for w in wrapped.merged_weights()]
    merged = merge_lora(model)
    experts_module = merged
    for key in path:
        experts_module = experts_module[key] if isinstance(key, int) else getattr(experts_module, key)
    assert type(experts_module) is Experts
    for got, expected in zip(experts_module.weights(jnp.float32), want, strict=True):
        assert got.dtype == jnp.float32 and np.asarray(got).shape == expected.shape
        np.testing.assert_allclose(np.asarray(got), expected, atol=1e-2, rtol=1e-2)  # bfloat16's rounding
    assert experts_module.gate_proj[...].dtype == jnp.bfloat16


def test_a_checkpoint_read_into_a_quantized_base_quantizes_each_expert_as_it_arrives(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    for scan in (False, True):
        read = from_hf_quantized(tmp_path, "nf4", 32, scan_layers=scan)
        made = quantize_base(llama_hf.from_hf(tmp_path, scan_layers=scan), "nf4", 32)
        got, want = _experts(read), _experts(made)
        assert len(got) == len(want) and all(isinstance(m, QuantizedExperts) for m in got)
        for a, b in zip(got, want, strict=True):
            for weight in EXPERT_WEIGHTS:
                np.testing.assert_array_equal(
                    np.asarray(getattr(a, weight).qvalue[...]), np.asarray(getattr(b, weight).qvalue[...])
                )
                np.testing.assert_array_equal(
                    np.asarray(getattr(a, weight).scale[...]), np.asarray(getattr(b, weight).scale[...])
                )
