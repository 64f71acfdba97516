"""The decoder families beside Llama (Qwen3, Mistral, Gemma 2, Gemma 3): Hugging Face
checkpoints of random tiny configs load with logits equal to transformers' (float32, 1e-4),
export back to what transformers reads, fine-tune with LoRA into a PEFT adapter, and generate
with sliding windows as recomputing the prefix does."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import recomputed
from xlafit.hf import llama as llama_hf
from xlafit.models.generation import generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)  # fmt: skip


def _configs():
    four = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return {
        "qwen3": transformers.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=24, tie_word_embeddings=False),
        "mistral": transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=6),
        "gemma2": transformers.Gemma2Config(
            **COMMON, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
            attn_logit_softcapping=5.0, final_logit_softcapping=3.0, layer_types=four,
        ),
        "gemma3_text": transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
            rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, layer_types=four,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
    }  # fmt: skip


@pytest.fixture(scope="module", params=["qwen3", "mistral", "gemma2", "gemma3_text"])
def checkpoint(request, tmp_path_factory):
    """A transformers model of the family with random weights (norms too), saved as safetensors."""
    config = _configs()[request.param]
    config._attn_implementation = "eager"  # Gemma's soft-cap: the reference computation
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return request.param, model, folder


def _theirs(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


IDS = np.random.default_rng(0).integers(0, 97, (2, 16)).tolist()


def test_a_checkpoint_loads_with_transformers_logits(checkpoint):
    family, theirs, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    assert ours.cfg.family == family
    np.testing.assert_allclose(np.asarray(ours(jnp.array(IDS))), _theirs(theirs, IDS), atol=1e-4, rtol=1e-4)


def test_an_export_loads_back_in_transformers(checkpoint, tmp_path):
    family, theirs, folder = checkpoint
    llama_hf.save_hf(llama_hf.from_hf(folder), tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    assert type(back).__name__ == type(theirs).__name__
    np.testing.assert_allclose(_theirs(back, IDS), _theirs(theirs, IDS), atol=1e-5, rtol=1e-5)


def test_packed_sequences_see_only_their_own_segment(checkpoint):
    """Two sequences packed in one row compute what each does alone (windows by position)."""
    _, _, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    a, b = IDS[0][:9], IDS[1][:7]
    row = jnp.array([a + b])
    segments = jnp.array([[1] * 9 + [2] * 7])
    positions = jnp.array([list(range(9)) + list(range(7))])
    packed = np.asarray(ours(row, segments, positions))[0]
    np.testing.assert_allclose(packed[:9], np.asarray(ours(jnp.array([a])))[0], atol=1e-5)
    np.testing.assert_allclose(packed[9:], np.asarray(ours(jnp.array([b])))[0], atol=1e-5)


def test_generation_with_the_cache_equals_recomputing(checkpoint):
    """Past the sliding window (6) the cache's masks must drop the old keys as the full pass does."""
    _, _, folder = checkpoint
    ours = llama_hf.from_hf(folder)
    prompts = [IDS[0][:5], IDS[1][:3]]
    got = generate(ours, prompts, 9)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == recomputed(ours, prompt, 9)


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing (not our code)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_exports_a_peft_adapter_transformers_applies(checkpoint, tmp_path):
    peft = pytest.importorskip("peft")
    from xlafit.hf.peft import save_peft_adapter
    from xlafit.models.lora import apply_lora, merge_lora

    _, _, folder = checkpoint
    ours = apply_lora(llama_hf.from_hf(folder), ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8, rngs=nnx.Rngs(1))
    for path, value in nnx.state(ours, nnx.LoRAParam).flat_state():  # non-zero B: the adapter changes the logits
        if path[-1] == "lora_b":
            value.set_value(jnp.full(value.shape, 0.05, value.dtype))
    save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(folder))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
    tuned = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = merge_lora(ours)
    np.testing.assert_allclose(np.asarray(merged(jnp.array(IDS))), _theirs(tuned, IDS), atol=1e-4, rtol=1e-4)
