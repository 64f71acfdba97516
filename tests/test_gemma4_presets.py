"""``model.preset=gemma-4-*``: each preset is what xlafit reads from the released model's
``config.json`` (its ``text_config``), and builds a model with as many parameters as
transformers' model of that config (built on the meta device: no weights; two blocks of
layers, the last of them sharing keys and values where the release shares them)."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

from xlafit.errors import HFFormatError
from xlafit.hf import config_json
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GLOBAL_EVERY_6 = (["sliding_attention"] * 5 + ["full_attention"]) * 10
ROPE = {
    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
    "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
}
# The keys of each release's text_config (google/gemma-4-26B-A4B, 31B, E2B and E4B; the keys
# left out equal in all four: vocabulary 262,144, heads of 256 and 512 on global layers,
# final logit softcap 30, tied embeddings, the rotary parameters above).
SHARED = {
    "model_type": "gemma4_text", "vocab_size": 262144, "vocab_size_per_layer_input": 262144, "head_dim": 256,
    "global_head_dim": 512, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_parameters": ROPE, "attention_bias": False,
}  # fmt: skip
RELEASED = {
    "gemma-4-26b-a4b": {
        "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30, "num_attention_heads": 16,
        "num_key_value_heads": 8, "num_global_key_value_heads": 2, "attention_k_eq_v": True, "sliding_window": 1024,
        "layer_types": GLOBAL_EVERY_6[:30], "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False, "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
        "moe_intermediate_size": 704, "max_position_embeddings": 262144, "use_bidirectional_attention": "vision",
    },
    "gemma-4-31b": {
        "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60, "num_attention_heads": 32,
        "num_key_value_heads": 16, "num_global_key_value_heads": 4, "attention_k_eq_v": True, "sliding_window": 1024,
        "layer_types": GLOBAL_EVERY_6, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False, "enable_moe_block": False, "max_position_embeddings": 262144,
        "use_bidirectional_attention": "vision",
    },
    "gemma-4-e2b": {
        "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35, "num_attention_heads": 8,
        "num_key_value_heads": 1, "num_global_key_value_heads": None, "attention_k_eq_v": False, "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7, "hidden_size_per_layer_input": 256,
        "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "enable_moe_block": False,
        "max_position_embeddings": 131072, "use_bidirectional_attention": None,
    },
    "gemma-4-e4b": {
        "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42, "num_attention_heads": 8,
        "num_key_value_heads": 2, "num_global_key_value_heads": None, "attention_k_eq_v": False, "sliding_window": 512,
        "layer_types": GLOBAL_EVERY_6[:42], "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 18,
        "use_double_wide_mlp": False, "enable_moe_block": False, "max_position_embeddings": 131072,
        "use_bidirectional_attention": None,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_the_preset_is_the_released_config_with_transformers_parameter_count(name):
    released = {**SHARED, **RELEASED[name]}
    preset = LlamaConfig.preset(name)
    read = config_json.config_from_hf(released)
    differ = {f.name: (getattr(preset, f.name), getattr(read, f.name)) for f in dataclasses.fields(preset)}
    assert {k: v for k, v in differ.items() if v[0] != v[1]} == {}
    period = released["layer_types"].index("full_attention") + 1
    short = {"num_hidden_layers": 2 * period, "layer_types": released["layer_types"][: 2 * period]}
    short["num_kv_shared_layers"] = period if released["num_kv_shared_layers"] else 0
    with torch.device("meta"):
        theirs = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**{**released, **short}))
    mine = dataclasses.replace(
        preset,
        num_layers=2 * period,
        layer_types=preset.layer_types[: 2 * period],
        num_kv_shared_layers=short["num_kv_shared_layers"],
    )
    ours = nnx.eval_shape(lambda: LlamaForCausalLM(mine, rngs=nnx.Rngs(0)))
    count = sum(v.size for _, v in nnx.to_flat_state(nnx.state(ours, nnx.Param)))
    assert count == sum(p.numel() for p in theirs.parameters())


def test_vision_bidirectional_attention_reads_as_causal_text_and_all_is_refused():
    """The 26B-A4B and 31B releases say ``use_bidirectional_attention: "vision"`` (an image's
    tokens see each other; text stays causal): their text model reads. ``"all"`` (an
    encoder's attention) is refused, naming it."""
    released = {**SHARED, **RELEASED["gemma-4-31b"]}
    assert config_json.config_from_hf(released).family == "gemma4_text"
    with pytest.raises(HFFormatError, match="use_bidirectional_attention='all'.*causal attention"):
        config_json.config_from_hf({**released, "use_bidirectional_attention": "all"})
